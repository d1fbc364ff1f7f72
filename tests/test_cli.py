"""The command-line tools refuse bad input with one clear line, not a traceback.

Each test runs the tool in a subprocess; all but one are in the slow tier.
"""

import pytest

from conftest import run_module
from purejax import _cli

slow = pytest.mark.slow


@pytest.mark.parametrize("args, message", [
    (["--learning_rate=-1"], "--learning_rate must be > 0"),
    pytest.param(["--learning_rate=0"], "--learning_rate must be > 0", marks=slow),
    pytest.param(["--peak_flops=-1"], "--peak_flops must be one device's peak FLOP/s",
                 marks=slow),
    pytest.param(["--batch_size=0"], "--batch_size must be a positive integer", marks=slow),
    pytest.param(["--max_iters=-5"], "--max_iters must be a positive integer", marks=slow),
    pytest.param(["--n_embd=30", "--n_head=4"], "n_embd=30 is not divisible by n_head=4",
                 marks=slow),
    pytest.param(["--dropout=1.0"], r"dropout must be in [0, 1)", marks=slow),
    pytest.param(["--block_size=0"], "--block_size must be a positive integer", marks=slow),
    pytest.param(["--model=mlp", "--epochs=0"], "--epochs must be a positive integer", marks=slow),
    pytest.param(["--model=mlp", "--layer_sizes=784,a,10"], "--layer_sizes must be integers",
                 marks=slow),
    pytest.param(["--model=mlp", "--optimizer=sgd", "--min_lr=1"], "--min_lr must be in",
                 marks=slow),
    pytest.param(["--cpu_devices=0"], "--cpu_devices=0: 0 is not a positive integer",
                 marks=slow),
    pytest.param(["--attention=cudnn"], "--attention=cudnn needs an NVIDIA GPU", marks=slow),
    pytest.param(["--attn_block=0"], "--attn_block must be 'auto' or a positive integer",
                 marks=slow),
    pytest.param(["--loss_chunk_rows=many"], "--loss_chunk_rows must be 'auto' or a "
                 "non-negative integer", marks=slow),
    pytest.param(["--sweep_batch=-2"], "--sweep_batch must be 'auto' or a non-negative "
                 "integer", marks=slow),
])
def test_bad_flag_values(args, message):
  process = run_module("purejax.train", *args, timeout=300)
  assert process.returncode == 1
  assert message in process.stderr
  assert "Traceback" not in process.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--model=resnet"], ["--dtype=float64"],
                                  ["--optimizer=lion"]])
def test_unknown_choices_are_rejected_by_flag_parsing(args):
  process = run_module("purejax.train", *args, timeout=300)
  assert process.returncode != 0
  assert "should be one of" in process.stderr
  assert "Traceback" not in process.stderr


@pytest.mark.slow
def test_mnist_offline_without_data_names_the_flag(tmp_path):
  process = run_module("purejax.train", "--model=mlp",
                       f"--tfds_manual_dir={tmp_path / 'missing'}",
                       f"--tfds_data_dir={tmp_path / 'tfds'}", timeout=300)
  assert process.returncode == 1
  assert "--tfds_manual_dir" in process.stderr and "is not a directory" in process.stderr
  assert "Traceback" not in process.stderr


@pytest.mark.slow
def test_sample_without_a_trained_model(tmp_path):
  process = run_module("purejax.sample", f"--out_dir={tmp_path}", timeout=300)
  assert process.returncode == 1
  assert "train first" in process.stderr


@pytest.mark.slow
def test_unwritable_out_dir_fails_before_training(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  process = run_module("purejax.train", f"--out_dir={blocker / 'run'}", timeout=300)
  assert process.returncode == 1
  assert "is not writable" in process.stderr and "Traceback" not in process.stderr


@pytest.mark.slow
def test_keep_checkpoints_must_be_positive(tmp_path):
  process = run_module("purejax.train", "--keep_checkpoints=0", f"--out_dir={tmp_path}",
                       timeout=300)
  assert process.returncode == 1
  assert "--keep_checkpoints must be a positive integer" in process.stderr


@pytest.mark.slow
def test_block_size_longer_than_validation_text(tmp_path, tfds_data_dir):
  process = run_module("purejax.train", "--block_size=200000", "--n_embd=8", "--n_head=1",
                       "--n_layer=1", f"--tfds_data_dir={tfds_data_dir}",
                       f"--out_dir={tmp_path}", timeout=600)
  assert process.returncode == 1
  assert "must be shorter than the validation text" in process.stderr


@pytest.mark.slow
def test_sample_refuses_a_checkpoint_of_another_model(tmp_path):
  import jax
  from purejax import mlp
  from purejax.training import checkpoint
  params = mlp.init_network_params([4, 3], jax.random.PRNGKey(0))
  checkpoint.save(str(tmp_path), 1, {"params": params}, {"model": "mlp"})
  process = run_module("purejax.sample", f"--out_dir={tmp_path}", timeout=300)
  assert process.returncode == 1
  assert "holds a 'mlp' model, not a GPT" in process.stderr
  assert "Traceback" not in process.stderr


def test_library_names_are_shown_as_the_flags_the_command_line_has():
  flags = {"keep_checkpoints", "dataset", "lr_decay_iters", "tfds_manual_dir"}
  message = ("`RunConfig.keep_checkpoints` must be >= 1; `dataset=a.txt` does not exist; "
             "set `decay_iters` or `manual_dir=DIR`; `vocab.bpe` and `beta1` stay")
  assert _cli.in_flags(message, flags) == (
      "--keep_checkpoints must be >= 1; --dataset=a.txt does not exist; set "
      "--lr_decay_iters or --tfds_manual_dir=DIR; `vocab.bpe` and `beta1` stay")
