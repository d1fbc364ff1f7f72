"""Learning-rate schedules: pure functions of the step (`schedules.SCHEDULES`, `optim.make_schedule`)."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers.cli import refusal
from purejax.cli import train
from purejax.optimizers import optim
from purejax.optimizers import schedules

BASE = optim.OptimizerConfig(learning_rate=1.0, warmup_iters=4, decay_iters=100, min_lr=0.1)


def test_cosine_warms_up_linearly_then_falls_to_min_lr_and_holds_it():
  schedule = optim.make_schedule(BASE)
  np.testing.assert_allclose([schedule(s) for s in (0, 3)], [1 / 5, 4 / 5], rtol=1e-6)
  np.testing.assert_allclose(schedule(4), 1.0, rtol=1e-6)
  np.testing.assert_allclose(schedule(52), 0.55, rtol=1e-6)  # half way: the mean of the ends
  np.testing.assert_allclose([schedule(100), schedule(500)], [0.1, 0.1], rtol=1e-6)


def test_warmdown_holds_the_peak_then_falls_linearly_over_its_last_fraction():
  schedule = optim.make_schedule(dataclasses.replace(BASE, schedule="warmdown",
                                                     warmdown_frac=0.2))
  # The same warmup as the cosine's.
  np.testing.assert_allclose([schedule(s) for s in (0, 3)], [1 / 5, 4 / 5], rtol=1e-6)
  np.testing.assert_allclose([schedule(s) for s in (4, 50, 80)], [1.0] * 3, rtol=1e-6)
  np.testing.assert_allclose([schedule(s) for s in (85, 90, 95)], [0.775, 0.55, 0.325],
                             rtol=1e-6)
  np.testing.assert_allclose([schedule(100), schedule(500)], [0.1, 0.1], rtol=1e-6)


def test_warmdown_takes_a_traced_rate_as_a_sweep_does():
  rates = jax.numpy.array([1.0, 2.0])
  at_90 = jax.vmap(lambda lr: schedules.warmup_warmdown_schedule(lr, 4, 100, 0.1, 0.2)(90))(rates)
  np.testing.assert_allclose(at_90, [0.55, 1.05], rtol=1e-6)


@pytest.mark.parametrize("frac", [0.0, -0.1, 1.5])
def test_a_warmdown_fraction_outside_0_1_is_refused(frac):
  with pytest.raises(ValueError, match=r"`warmdown_frac` must be in \(0, 1\]"):
    dataclasses.replace(BASE, schedule="warmdown", warmdown_frac=frac)


def test_the_command_line_refuses_a_warmdown_fraction_its_schedule_ignores(capsys, tmp_path):
  assert refusal(capsys, train, "--warmdown_frac=0.3", f"--out_dir={tmp_path}") == (
      "error: --warmdown_frac has no effect on --lr_schedule=cosine; add "
      "--lr_schedule=warmdown or drop --warmdown_frac.")
  assert optim.describe(dataclasses.replace(BASE, schedule="warmdown")).startswith(
      "adamw, lr 1 (warmup 4, held, warmdown: linear to 0.1 over the last 20% of 100 steps)")
