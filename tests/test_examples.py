"""The examples run as a user runs them, and learn."""

import os
import re
import subprocess
import sys

import pytest

from helpers.data import REPO_ROOT, require_test_data
from helpers.runs import long_run_env

pytestmark = pytest.mark.slow  # each trains for a minute or two


def run_example(name, *args, env=None):
  process = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / name), *args],
                           capture_output=True, text=True, timeout=900, cwd=REPO_ROOT,
                           env=dict(os.environ, **long_run_env(), **(env or {})))
  assert process.returncode == 0, process.stderr[-3000:]
  return process.stdout


@pytest.mark.budget(40)
def test_shakespeare_gpt_lowers_its_val_loss_and_samples():
  # 200 of its 1000 steps: the 500-step run of tests/test_integration.py is the one that
  # checks how far this model learns.
  out = run_example("shakespeare_gpt.py", "200")
  val = [float(v) for v in re.findall(r"val loss (\d+\.\d+)", out)]
  assert len(val) == 10
  assert val[-1] < val[0] - 0.5 and val[-1] < 2.6  # log(65) = 4.17 at the start
  assert "ROMEO:" in out


@pytest.mark.budget(60)
def test_mnist_mlp_reaches_97_percent_from_the_original_files(tfds_data_dir):
  # TFDS's default data dir is the run's, which has prepared MNIST from the original files
  # once for all tests (tests/test_integration.py checks what it holds): TFDS's own
  # preparation takes ~25 s.
  out = run_example("mnist_mlp.py", str(require_test_data("mnist")),
                    env={"TFDS_DATA_DIR": tfds_data_dir})
  accuracy = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", out)]
  assert len(accuracy) == 5 and accuracy[-1] > 0.97
