"""Data parallel, FSDP and gradient accumulation give the one-device result.

JAX fixes its number of CPU devices at start-up, so the multi-device runs
happen in subprocesses (`tests/parallel_worker.py`) with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`; each trains 20 steps
of a small GPT or MLP on synthetic data and reports its losses, params, how
many param bytes each device holds, and the collectives in its compiled HLO.
"""

import functools
import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.sharding import PartitionSpec as P

from bench import hlo
from helpers.data import REPO_ROOT
from helpers.runs import host_devices
from purejax import mlp
from purejax.training.pure import parallel


WORKER = REPO_ROOT / "tests" / "parallel_worker.py"
RTOL = 1e-5  # fp32, relative: the bar for "the same losses"


@functools.lru_cache(maxsize=None)
def _run_worker(options_json: str) -> dict:
  env = dict(os.environ, **host_devices(4), PYTHONPATH=str(REPO_ROOT), TF_CPP_MIN_LOG_LEVEL="2")
  process = subprocess.run([sys.executable, str(WORKER), options_json], env=env,
                           capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
  assert process.returncode == 0, process.stderr[-3000:]
  return json.loads(process.stdout.strip().splitlines()[-1])


def run_worker(**options) -> dict:
  return _run_worker(json.dumps(options, sort_keys=True))


# Each of these trains in subprocesses with 4 CPU devices.
slow = pytest.mark.slow


def assert_same_training(result, reference, rtol=RTOL):
  np.testing.assert_allclose(result["losses"], reference["losses"], rtol=rtol)
  assert result["params"].keys() == reference["params"].keys()
  for name, values in reference["params"].items():
    # Some gradients are zero up to rounding (the key bias: softmax ignores a
    # shift of every score), and Adam rescales that rounding to steps of up to
    # the learning rate (1e-3); hence an absolute tolerance of 2% of it.
    np.testing.assert_allclose(result["params"][name], values, rtol=1e-4, atol=2e-5,
                               err_msg=name)


@slow
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_data_parallel_matches_one_device(model):
  one = run_worker(model=model, num_devices=1)
  four = run_worker(model=model, num_devices=4)
  assert_same_training(four, one)
  # Replicated params: one all-reduce of the gradients per step, no gathers.
  assert set(four["collective_bytes_per_step"]) == {"all-reduce"}
  assert four["param_bytes_per_device"] == [four["param_bytes"]] * 4


@slow
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_fsdp_matches_one_device_and_splits_the_params(model):
  one = run_worker(model=model, num_devices=1)
  fsdp = run_worker(model=model, num_devices=4, fsdp=True)
  assert_same_training(fsdp, one)
  quarter = fsdp["param_bytes"] / 4
  if model == "gpt":
    # Every GPT leaf has a dimension divisible by 4: exactly a quarter each.
    assert fsdp["param_bytes_per_device"] == [quarter] * 4
  else:
    # The MLP's [10] output bias (40 bytes) cannot split 4 ways: replicated.
    assert fsdp["param_bytes_per_device"] == [(fsdp["param_bytes"] - 40) / 4 + 40] * 4


@slow
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_four_microbatches_equal_one_four_times_larger_batch(model):
  whole = run_worker(model=model, num_devices=1, batch_size=16)
  accumulated = run_worker(model=model, num_devices=1, batch_size=16, grad_accum_steps=4)
  assert_same_training(accumulated, whole)


@slow
@pytest.mark.parametrize("fsdp", [False, True])
def test_accumulation_on_four_devices_matches_one_device(fsdp):
  one = run_worker(model="gpt", num_devices=1)
  four = run_worker(model="gpt", num_devices=4, fsdp=fsdp, grad_accum_steps=4)
  assert_same_training(four, one)


@slow
@pytest.mark.parametrize("fsdp", [False, True])
def test_gradients_cross_devices_once_per_step(fsdp):
  # Each device sums its microbatches' gradients locally (shard_map) and the
  # sum is all-reduced once: one copy of the params, not four. FSDP adds one
  # all-gather of the params, and never gathers activations. (The other <10%:
  # loss terms reduced across devices.)
  for accum in (1, 4):
    result = run_worker(model="gpt", num_devices=4, fsdp=fsdp, grad_accum_steps=accum)
    volume, param_bytes = result["collective_bytes_per_step"], result["param_bytes"]
    assert param_bytes <= volume["all-reduce"] < 1.1 * param_bytes, accum
    if fsdp:
      assert param_bytes <= volume["all-gather"] < 1.1 * param_bytes, accum
    assert set(volume) == ({"all-reduce", "all-gather"} if fsdp else {"all-reduce"})


@pytest.mark.budget(30)
@slow
def test_dropout_is_the_same_on_four_devices_as_on_one():
  # JAX's partitionable threefry draws the same bits however the batch is split.
  one = run_worker(model="gpt", num_devices=1, dropout=0.1)
  four = run_worker(model="gpt", num_devices=4, dropout=0.1)
  no_dropout = run_worker(model="gpt", num_devices=1)
  assert_same_training(four, one)
  assert not np.allclose(one["losses"][1:], no_dropout["losses"][1:], rtol=1e-4)


# ----------------------------------------------------------------------------
# In-process pieces (one device)


class FsdpSpecTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("largest_divisible_dim", (65, 128), 4, P(None, "data")),
      ("ties_go_to_the_later_dim", (128, 128), 4, P(None, "data")),
      ("stacked_layers_split_inside_a_layer", (4, 128, 384), 4, P(None, None, "data")),
      ("skips_indivisible_dims", (784, 10), 4, P("data")),
      ("nothing_divisible_is_replicated", (10,), 4, P()),
      ("scalar_is_replicated", (), 4, P()),
      ("one_device_is_replicated", (128, 128), 1, P()),
  )
  def test_fsdp_spec(self, shape, num_shards, expected):
    self.assertEqual(parallel.fsdp_spec(shape, num_shards), expected)


class AccumulateGradientsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_microbatches_average_to_the_whole_batch(self):
    params = mlp.init_network_params([8, 16, 3], jax.random.PRNGKey(0), scale=0.5)
    x = jax.random.normal(jax.random.PRNGKey(1), (12, 8))
    y = jax.random.randint(jax.random.PRNGKey(2), (12,), 0, 3)
    loss_fn = lambda p, xy, _: mlp.loss(p, *xy)

    @self.variant
    def accumulated(params, x, y):
      return parallel.accumulate_gradients(loss_fn, params, (x, y), 3)

    value, grads = accumulated(params, x, y)
    expected_value, expected_grads = jax.value_and_grad(mlp.loss)(params, x, y)
    chex.assert_trees_all_close(value, expected_value, rtol=1e-6)
    chex.assert_trees_all_close(grads, expected_grads, rtol=1e-5, atol=1e-7)

  def test_microbatch_j_holds_the_jth_block_of_rows_and_index_j(self):
    def loss_fn(p, x, index):
      # Records (first row, index) of each microbatch through the loss value.
      return p * (100.0 * x[0] + index)
    # Rows 0..7 in 4 microbatches: microbatch j = rows (2j, 2j + 1), index j.
    value, grad = parallel.accumulate_gradients(loss_fn, jnp.float32(1.0),
                                                jnp.arange(8.0), 4)
    expected = np.mean([100.0 * 2 * j + j for j in range(4)])
    self.assertAlmostEqual(float(value), expected, places=4)
    self.assertAlmostEqual(float(grad), expected, places=4)

  def test_indivisible_batch_is_refused(self):
    with self.assertRaisesRegex(ValueError, "does not split into 3 equal microbatches"):
      parallel.accumulate_gradients(lambda p, x, i: p * jnp.sum(x), 1.0, jnp.ones(8), 3)


def test_batch_size_must_divide_by_devices_times_microbatches():
  mesh = parallel.make_mesh(1)
  parallel.check_batch_size(12, mesh, 4)
  with pytest.raises(ValueError, match=r"`batch_size=10` must be a multiple of .* = 4"):
    parallel.check_batch_size(10, mesh, 4)
  with pytest.raises(ValueError, match="`grad_accum_steps` must be >= 1"):
    parallel.check_batch_size(8, mesh, 0)


def test_make_mesh_refuses_more_devices_than_exist():
  with pytest.raises(ValueError, match=r"`num_devices=2` must be in \[1, 1\]"):
    parallel.make_mesh(2)


_HLO = """\
HloModule step

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %r = f32[] add(f32[] %a, f32[] %b)
}

%layer_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %ag = f32[16,8]{1,0} all-gather(f32[4,8]{1,0} %x), dimensions={0}
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %x)
}

%layer_cond (p: (s32[], f32[4,8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[4,8]) -> f32[100] {
  %w = (s32[], f32[4,8]) while(%init), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"6"}}
  %ar = f32[100]{0} all-reduce(f32[100]{0} %g), to_apply=%add
  ROOT %out = f32[100]{0} copy(%ar)
}
"""


def test_collective_bytes_counts_loop_bodies_per_trip():
  assert hlo.collective_bytes(_HLO) == {
      "all-gather": 6 * 16 * 8 * 4,  # inside a 6-trip loop
      "all-reduce": 100 * 4,
  }
