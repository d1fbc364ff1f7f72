"""The command lines refuse bad input with one clear line and exit code 1, not a traceback.

Each command line's `run(argv)` parses fresh flags and returns the exit code,
so these tests run it in-process; a few run `python -m purejax.<cmd>` in a
subprocess, as a user does, to keep the real entry points covered.
"""

import dataclasses
import importlib
import typing

import jax
import jax.numpy as jnp
import pytest

import purejax
from helpers.cli import one_line_error, refusal, run_module
from purejax import gpt
from purejax import weights
from purejax.cli import convert
from purejax.cli import errors
from purejax.cli import replay
from purejax.cli import sample
from purejax.cli import train
from purejax.optimizers import optim


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
  """A refused command line must stop before any training: reaching it fails the test."""
  def reached(*args, **kwargs):
    raise AssertionError("the command line trained instead of refusing its flags")
  for module, name in ((train.gpt_loop, "train_gpt"), (train.sweep_loop, "train_gpt_sweep"),
                       (train.mlp_loop, "train_mlp"), (train.gpt_loop, "evaluate_gpt")):
    monkeypatch.setattr(module, name, reached)


@pytest.mark.parametrize("args, message", [
    (["--learning_rate=-1"], "--learning_rate must be > 0, got -1.0."),
    (["--learning_rate=0"], "--learning_rate must be > 0, got 0.0."),
    (["--peak_flops=-1"], "--peak_flops must be one device's peak FLOP/s, a positive number "
     "(e.g. 989e12), or None for the device's known peak; got -1.0."),
    (["--batch_size=0"], "--batch_size must be a positive integer, got 0."),
    (["--max_iters=-5"], "--max_iters must be a positive integer, got -5."),
    (["--n_embd=30", "--n_head=4"], "n_embd=30 is not divisible by n_head=4; choose n_head "
     "among the divisors of n_embd (e.g. n_head=2), or set head_size."),
    (["--arch=llama", "--n_kv_head=3", "--n_head=2"], "n_kv_head=3 does not divide n_head=2; "
     "each key/value head serves a whole group of query heads."),
    (["--dropout=1.0"], "dropout must be in [0, 1), got 1.0."),
    (["--block_size=0"], "--block_size must be a positive integer, got 0."),
    (["--keep_checkpoints=0"], "--keep_checkpoints must be a positive integer, got 0."),
    (["--model=mlp", "--epochs=0"], "--epochs must be a positive integer, got 0."),
    (["--model=mlp", "--layer_sizes=784,a,10"],
     "--layer_sizes must be integers, got ['784', 'a', '10']."),
    (["--model=mlp", "--optimizer=sgd", "--min_lr=1"],
     "--min_lr must be in [0, --learning_rate=0.003], got 1.0."),
    (["--attention=cudnn"], "--attention=cudnn needs an NVIDIA GPU; this run is on cpu. "
     "Choose --attention=auto."),
    (["--sweep=batch_size=4,8"], "'batch_size' cannot be swept in one program; choose among "
     "('learning_rate', 'min_lr', 'momentum', 'beta1', 'beta2', 'weight_decay', "
     "'muon_learning_rate', 'muon_momentum', 'muon_weight_decay', 'lion_beta1', 'lion_beta2', "
     "'lion_weight_decay', 'dropout') (and seeds)."),
])
def test_bad_flag_values(capsys, tmp_path, args, message):
  assert refusal(capsys, train, *args, f"--out_dir={tmp_path}") == "error: " + message


@pytest.mark.parametrize("args, message", [
    # absl's own parsing: one line too, not its usage text
    (["--batch_size=abc"], "--batch_size=abc: invalid literal for int() with base 10: 'abc'"),
    (["--model=resnet"], "--model=resnet: value should be one of <gpt|mlp>"),
    (["--dtype=float64"], "--dtype=float64: value should be one of <float32|bfloat16>"),
    (["--optimizer=adafactor"], "--optimizer=adafactor: value should be one of "
     "<sgd|momentum|adam|adamw|muon|lion>"),
    (["--cpu_devices=0"], "--cpu_devices=0: 0 is not a positive integer"),
    (["--sweep_seeds=0"], "--sweep_seeds=0: 0 is not a positive integer"),
    (["--attn_block=0"], "--attn_block=0: must be 'auto' or a positive integer, got '0'"),
    (["--loss_chunk_rows=many"],
     "--loss_chunk_rows=many: must be 'auto' or a non-negative integer, got 'many'"),
    (["--sweep_batch=-2"],
     "--sweep_batch=-2: must be 'auto' or a non-negative integer, got '-2'"),
    (["--attention=flash"], "--attention=flash: must be 'auto' or one of plain, blocked, xla, "
     "cudnn, got 'flash'"),
    (["--scan_layers=maybe"], "--scan_layers=maybe: must be 'auto' or 'true' or 'false', "
     "got 'maybe'"),
    (["--lerning_rate=1e-3"], "Unknown command line flag 'lerning_rate'. Did you mean: "
     "learning_rate ?"),
])
def test_flags_absl_cannot_parse_are_one_line(capsys, args, message):
  assert refusal(capsys, train, *args) == f"error: {message} (--help lists the flags)."


def test_a_positional_argument_is_refused(capsys):
  assert refusal(capsys, train, "learning_rate=1e-3") == (
      "error: unexpected arguments ['learning_rate=1e-3']; flags are written --name=value "
      "(--help lists them).")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("name, default", [
    ("learning_rate", 1e-3), ("min_lr", 1e-4), ("weight_decay", 0.1), ("beta2", 0.99),
    ("grad_clip", 1.0), ("dropout", 0.0)])
def test_non_finite_numbers_are_refused_at_start_up(capsys, name, default, value):
  assert refusal(capsys, train, f"--{name}={value}") == (
      f"error: --{name}={float(value)} is not a finite number; pass a finite value such as "
      f"its default, {default:g}.")


def test_non_finite_numbers_without_a_default_and_in_other_command_lines(capsys):
  assert refusal(capsys, train, "--peak_flops=inf") == (
      "error: --peak_flops=inf is not a finite number; pass a finite value.")
  assert refusal(capsys, sample, "--temperature=nan") == (
      "error: --temperature=nan is not a finite number; pass a finite value such as its "
      "default, 0.8.")


@pytest.mark.parametrize("args, message", [
    (["--sweep=learning_rate=,"], "--sweep lists no values of learning_rate; write "
     "learning_rate=V1,V2,..."),
    (["--sweep=;"], "--sweep=; names no setting; write NAME=V1,V2,... such as "
     "--sweep=learning_rate=3e-4,1e-3."),
    (["--sweep=learning_rate=nan,1e-3"], "--sweep's learning_rate=nan is not a finite "
     "number; sweep finite values."),
    (["--sweep=momentum=0.8,0.9"], "--sweep of momentum has no effect on --optimizer=adamw "
     "with --lr_schedule=cosine, which reads only learning_rate, min_lr, beta1, beta2, "
     "weight_decay; drop momentum from --sweep or choose an optimizer that uses it."),
    (["--optimizer=sgd", "--sweep=beta2=0.9,0.99"], "--sweep of beta2 has no effect on "
     "--optimizer=sgd with --lr_schedule=cosine, which reads only learning_rate, min_lr; "
     "drop beta2 from --sweep or choose an optimizer that uses it."),
    (["--lr_schedule=constant", "--sweep=min_lr=0,1e-5"], "--sweep of min_lr has no effect on "
     "--optimizer=adamw with --lr_schedule=constant, which reads only learning_rate, beta1, "
     "beta2, weight_decay; drop min_lr from --sweep or choose an optimizer that uses it."),
    (["--sweep=learning_rate=1e-3,3e-3", "--eval_only"], "--eval_only evaluates one model, "
     "not a sweep; drop --sweep and --sweep_seeds (evaluate one run with "
     "--out_dir=OUT_DIR/<run>)."),
    (["--sweep_seeds=2", "--eval_only"], "--eval_only evaluates one model, not a sweep; drop "
     "--sweep and --sweep_seeds (evaluate one run with --out_dir=OUT_DIR/<run>)."),
    (["--sweep_batch=2"], "--sweep_batch sets how a --sweep's runs are batched; add --sweep "
     "or drop --sweep_batch."),
    (["--eval_checkpoint=best"], "--eval_checkpoint chooses what --eval_only evaluates; add "
     "--eval_only or drop --eval_checkpoint."),
    (["--lora_alpha=16"], "--lora_alpha has no effect without LoRA; add --lora_rank=R (e.g. "
     "8) or drop --lora_alpha."),
    (["--lora_targets=*attn.qkv.w"], "--lora_targets has no effect without LoRA; add "
     "--lora_rank=R (e.g. 8) or drop --lora_targets."),
    (["--model=mlp", "--optimizer=muon"], "--optimizer=muon orthogonalises the hidden "
     "matrices of a GPT's blocks, which --model=mlp has none of; choose another "
     "--optimizer (e.g. adamw)."),
    (["--muon_learning_rate=0.05"], "--muon_learning_rate has no effect on "
     "--optimizer=adamw; add --optimizer=muon or drop --muon_learning_rate."),
    (["--muon_ns_steps=4"], "--muon_ns_steps has no effect on --optimizer=adamw; add "
     "--optimizer=muon or drop --muon_ns_steps."),
    (["--muon_ns_coeffs=minimax"], "--muon_ns_coeffs has no effect on --optimizer=adamw; add "
     "--optimizer=muon or drop --muon_ns_coeffs."),
    (["--optimizer=muon", "--muon_ns_steps=0"], "--muon_ns_steps must be an integer >= 1, "
     "got 0."),
    (["--optimizer=muon", "--muon_momentum_start=0.8"], "--muon_momentum_start has no effect "
     "without a momentum warmup; add --muon_momentum_warmup_iters=N (e.g. 300) or drop "
     "--muon_momentum_start."),
    (["--optimizer=muon", "--sweep=momentum=0.8,0.9"], "--sweep of momentum has no effect on "
     "--optimizer=muon with --lr_schedule=cosine, which reads only learning_rate, min_lr, "
     "beta1, beta2, weight_decay, muon_learning_rate, muon_momentum, muon_weight_decay; "
     "drop momentum from --sweep or choose an optimizer that uses it."),
])
def test_flags_that_would_have_no_effect_are_refused(capsys, tmp_path, args, message):
  assert refusal(capsys, train, *args, f"--out_dir={tmp_path}") == "error: " + message


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_each_optimizer_reads_exactly_the_settings_it_is_said_to(name):
  # A setting is read when changing it changes the optimizer's first update.
  import jax
  import jax.numpy as jnp
  # Settings away from every value the check tries, so any change shows.
  own = {setting: 0.5 for setting in optim.HYPERPARAMS if setting in optim.settings_names(name)}
  base = optim.from_flat(name=name, warmup_iters=0, decay_iters=10, min_lr=1e-4, **own)
  # a block's matrix (Muon's, under "muon") and an embedding (AdamW's)
  # (16 x 8: enough coordinates that a sign-based update, Lion's, flips some)
  params = {"blocks": {"w": jnp.ones((16, 8))}, "wte": {"embedding": jnp.ones((16, 8))}}

  def updates(**changed):
    optimizer = optim.make_optimizer(base, hyperparams=changed)
    state = optimizer.init(params)
    for i in range(3):  # gradients that change, so moments matter
      grads = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(i), p.shape), params)
      update, state = optimizer.update(grads, state, params)
    return update

  unchanged = updates()
  # Settings another optimizer has are ignored by this one's (the sweep never passes them).
  read = {setting for setting in optim.HYPERPARAMS
          if not all(jax.tree.leaves(jax.tree.map(jnp.allclose, updates(**{setting: 0.9}),
                                                  unchanged)))}
  assert read == set(optim.hyperparams_used(base))
  constant = optim.hyperparams_used(dataclasses.replace(base, schedule="constant"))
  assert set(constant) == read - {"min_lr"}


# Values of each kind of block flag: one a model may take, one it may not.
FLAG_VALUES = {bool: ("true", "false"), int: ("8", "0"), float: ("2.0", "-1.0")}
WORD_VALUES = {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu", "window_pattern": "SL",
               "param_dtype": "bfloat16"}


@pytest.mark.parametrize("arch", sorted(gpt.ARCHITECTURES))
def test_every_block_flag_on_every_arch_gives_a_model_or_a_value_error(arch):
  # A flag's value the model cannot take is a ValueError (one line on the command
  # line), never another exception from inside the config's assembly, the params'
  # initialisation or the loss (traced for shapes only).
  fields = {f.name: f.type for f in dataclasses.fields(gpt.GPTConfig)}
  for name in train.train_flags.block_field_flags():
    kind = typing.get_args(fields[name])[0] if typing.get_args(fields[name]) else fields[name]
    for value in FLAG_VALUES.get(kind) or (WORD_VALUES[name], "bogus"):
      args = train.command.parse(
          ["train", f"--arch={arch}", "--n_layer=3", "--block_size=16", f"--{name}={value}"],
          lambda a: train.train_flags.define_flags(a, "gpt"))
      try:
        config = train.gpt_config(args, vocab_size=40)
        params = jax.eval_shape(lambda c=config: gpt.init_params(c, jax.random.PRNGKey(0)))
        tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
        jax.eval_shape(lambda p, t, c=config: gpt.loss(p, t, t, c), params, tokens)
      except ValueError as e:
        assert str(e), (name, value)


def test_the_same_process_parses_command_lines_again_with_other_flags(capsys, tmp_path):
  out = f"--out_dir={tmp_path}"
  assert "--epochs" in refusal(capsys, train, "--model=mlp", "--epochs=0", out)
  assert "--batch_size" in refusal(capsys, train, "--batch_size=0", out)  # the GPT's flags
  assert "--learning_rate must be > 0" in refusal(capsys, train, "--learning_rate=-2", out)
  assert "--n_embd=30" not in refusal(capsys, train, "--max_iters=-1", out)  # none kept


def test_an_unwritable_out_dir_fails_before_training(capsys, tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  assert "is not writable" in refusal(capsys, train, f"--out_dir={blocker / 'run'}")


def test_mnist_offline_without_data_names_the_flag(capsys, tmp_path):
  line = refusal(capsys, train, "--model=mlp", f"--tfds_manual_dir={tmp_path / 'missing'}",
                 f"--tfds_data_dir={tmp_path / 'tfds'}", f"--out_dir={tmp_path / 'run'}")
  assert "--tfds_manual_dir" in line and "is not a directory" in line


def test_sample_without_a_trained_model(capsys, tmp_path):
  assert refusal(capsys, sample, f"--out_dir={tmp_path}") == (
      f"error: no checkpoint in {tmp_path}; train first with `python -m purejax.train "
      f"--out_dir={tmp_path}`, or pass --init_from=gpt2.")
  assert refusal(capsys, sample, "--sweep_batch=1") == (
      "error: Unknown command line flag 'sweep_batch' (--help lists the flags).")


@pytest.mark.parametrize("command_line", ["train", "sample", "chat"])
@pytest.mark.parametrize("missing", ["no/such/run", "nowhere.gguf", "nothing_here"])
def test_a_missing_init_from_says_it_is_missing(capsys, tmp_path, command_line, missing):
  from purejax.cli import chat
  command = {"train": train, "sample": sample, "chat": chat}[command_line]
  path = tmp_path / missing
  out_dir = [] if command_line == "chat" else [f"--out_dir={tmp_path / 'run'}"]
  line = refusal(capsys, command, f"--init_from={path}", *out_dir)
  assert str(path) in line and "missing" in line, line


def test_sample_refuses_a_checkpoint_of_another_model(capsys, tmp_path):
  import jax
  from purejax import mlp
  from purejax import checkpoint
  params = mlp.init_network_params([4, 3], jax.random.PRNGKey(0))
  checkpoint.save(str(tmp_path), 1, {"params": params}, {"model": "mlp"})
  assert "holds a 'mlp' model, not a GPT" in refusal(capsys, sample, f"--out_dir={tmp_path}")


def test_convert_names_the_flag_of_a_bad_location(capsys, tmp_path):
  assert refusal(capsys, convert, "--from=onnx:model", f"--to=hf:{tmp_path}") == (
      "error: --from=onnx:model must be KIND:PATH with KIND one of hf, gguf, nanogpt, purejax.")
  assert refusal(capsys, convert, f"--from=hf:{tmp_path}") == (
      "error: --to is required: KIND:PATH with KIND one of hf, gguf, nanogpt, purejax, peft.")


def test_replay_needs_its_run_and_step(capsys, tmp_path):
  assert refusal(capsys, replay, "--step=3") == (
      "error: --out_dir must be given: the run and the step to replay, e.g. "
      "--out_dir=out-gpt --step=450.")
  assert refusal(capsys, replay, f"--out_dir={tmp_path}", "--step=0") == (
      "error: --step must be >= 1 (the step count after an update), got 0.")


def test_replay_refuses_a_step_past_the_runs_last(capsys, tmp_path):
  (tmp_path / "metrics.jsonl").write_text(
      "".join(f'{{"step": {s}, "time": {s}, "kind": "train", "loss": 2.0}}\n'
              for s in (5, 10)) + '{"step": 10, "time": 11, "kind": "eval", "val_loss": 2.1}\n')
  assert refusal(capsys, replay, f"--out_dir={tmp_path}", "--step=11") == (
      f"error: --step=11 is past the last step {tmp_path} trained, 10; replay a step up "
      f"to 10.")


def test_help_lists_only_the_chosen_models_flags(capsys):
  assert train.run(["train", "--help"]) == 0
  gpt_help = capsys.readouterr().out
  assert train.run(["train", "--model=mlp", "--help"]) == 0
  mlp_help = capsys.readouterr().out
  assert "--n_layer" in gpt_help and "--layer_sizes" not in gpt_help
  assert "--layer_sizes" in mlp_help and "--n_layer" not in mlp_help
  assert "--learning_rate: Peak learning rate.\n    (default: '0.001')" in gpt_help
  assert "(default: '0.003')" in mlp_help


def test_purejax_convert_stays_the_function_beside_the_command_line():
  assert purejax.convert is weights.convert
  with pytest.raises(ImportError, match="purejax.cli.convert"):
    importlib.import_module("purejax.convert")  # the file is `python -m`'s name only
  assert purejax.convert is weights.convert


def test_library_names_are_shown_as_the_flags_the_command_line_has():
  flags = {"keep_checkpoints", "dataset", "lr_decay_iters", "tfds_manual_dir"}
  message = ("`RunConfig.keep_checkpoints` must be >= 1; `dataset=a.txt` does not exist; "
             "set `decay_iters` or `manual_dir=DIR`; `vocab.bpe` and `beta1` stay")
  assert errors.in_flags(message, flags) == (
      "--keep_checkpoints must be >= 1; --dataset=a.txt does not exist; set "
      "--lr_decay_iters or --tfds_manual_dir=DIR; `vocab.bpe` and `beta1` stay")


# ----------------------------------------------------------------------------
# The real entry points, as a user runs them (one bad flag per command line)


def test_python_m_train_refuses_a_flag_absl_cannot_parse_in_one_line():
  one_line_error(run_module("purejax.train", "--batch_size=abc", timeout=300),
                 "--batch_size=abc: invalid literal for int()")


@pytest.mark.slow
def test_python_m_cli_train_is_the_same_program(tmp_path):
  one_line_error(run_module("purejax.cli.train", "--learning_rate=nan", timeout=300),
                 "--learning_rate=nan is not a finite number")


@pytest.mark.slow
@pytest.mark.parametrize("module, args, fragment", [
    ("purejax.sample", ["--top_k=-1"], "--top_k=-1: -1 is not a non-negative integer"),
    ("purejax.convert", ["--from=onnx:model", "--to=hf:x"], "--from=onnx:model must be"),
    ("purejax.replay", ["--step=3"], "--out_dir must be given"),
])
def test_each_command_line_refuses_a_bad_flag_in_one_line(module, args, fragment):
  one_line_error(run_module(module, *args, timeout=300), fragment)


@pytest.mark.slow
def test_help_of_the_program(tmp_path):
  process = run_module("purejax.train", "--help", timeout=300)
  assert process.returncode == 0 and process.stderr == ""
  assert process.stdout.startswith("Trains a purejax model from the command line.")
  assert "--learning_rate: Peak learning rate.\n    (default: '0.001')" in process.stdout


@pytest.mark.slow
def test_block_size_longer_than_validation_text(tmp_path, tfds_data_dir):
  process = run_module("purejax.train", "--block_size=200000", "--n_embd=8", "--n_head=1",
                       "--n_layer=1", f"--tfds_data_dir={tfds_data_dir}",
                       f"--out_dir={tmp_path}", timeout=600)
  one_line_error(process, "must be shorter than the validation text")
