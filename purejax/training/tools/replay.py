"""Replaying a training step from a checkpoint or the run's start, to see what made its loss.

    state = replay_to(state, train_ids, start=400, stop=449, config=config, ...)
    report = inspect_step(state, train_ids, 449, config=config, ...)
    report.loss                 # what metrics.jsonl logged at step 450, bit for bit
    report.token_losses         # [batch, block]: which tokens it came from
    report.grad_norms           # {"blocks.attn.qkv.w": [n_layer], ..., "blocks": [n_layer]}

Step `s` of a run is a function of its state before the step and of
`fold_in(train key, s)` (its batch and dropout), or, when the host reads the
batches, of `(seed, s)` (`batches.sample_windows`). So the state of a
checkpoint, or the run's initial state (a function of its config and seed,
`state.start_state`), and the same steps replay the run exactly:
`replay_to` runs `steps.train_steps` from the checkpoint's step (or 0), in
the jitted scan training ran, and `inspect_step` runs the step once more and
also returns its batch, each token's loss and each layer's gradient norm.
Exact for runs trained alone on one device: several devices add a step's
gradients in another order, and a step trained inside a sweep
(`sweep.train_steps`) equals its replay to float rounding only.

Numbering: the loop logs the loss of update `s` (0-based) at step `s + 1`,
the step count after it; `inspect_step(..., s)` returns that loss.
"""

import pathlib
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from purejax import _files
from purejax import checkpoint
from purejax import gpt
from purejax import lora
from purejax import rng
from purejax.data import batches
from purejax.data import conversations
from purejax.data import corpus as corpus_lib
from purejax.data import tokenizers
from purejax.data.tokenizer_spec import TokenizerSpec
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.effects import monitor
from purejax.training.pure import parallel
from purejax.training.pure import state as state_lib
from purejax.training.pure import steps
from purejax.training.pure.state import TrainState


class StepReport(NamedTuple):
  """What one replayed step computed.

  Attributes:
    update: 0-based index of the update (logged as step `update + 1`).
    loss: the step's mean loss, as the training step computed it.
    tokens: `[batch, block + 1]` the batch's windows; inputs are `[:, :-1]`,
      targets `[:, 1:]`.
    token_losses: `[batch, block]` each target's loss, under the step's
      dropout; their mean equals `loss` to float rounding.
    grad_norm: the global norm of the step's gradient (as logged).
    grad_norms: `{dotted param path: norm}`; stacked block params give one
      norm per layer, `[n_layer]`, and `"blocks"` is each layer's total.
  """
  update: int
  loss: float
  tokens: np.ndarray
  token_losses: np.ndarray
  grad_norm: float
  grad_norms: Dict[str, np.ndarray]


def step_windows(train_ids, key: chex.PRNGKey, update: int, *, config: gpt.GPTConfig,
                 batch_size: int, host_seed: Optional[int] = None) -> np.ndarray:
  """The `[batch, block + 1]` windows update `update` trained on.

  Args:
    train_ids: the run's `[num_tokens]` training ids (an array or memmap).
    key: the run's training key (`state.keys["train"]`).
    update: the update's 0-based index.
    config, batch_size: the run's.
    host_seed: the run's seed when the host read its batches
      (`batches.host_feed`); None when they were drawn on the device.
  """
  if host_seed is not None:
    return batches.sample_windows(train_ids, config.block_size, batch_size,
                                  batches.train_windows_seed(host_seed), update)
  batch_key, _ = jax.random.split(rng.fold_in_step(key, update))
  x, y = batches.sample_batch(batch_key, jnp.asarray(train_ids), config.block_size,
                              batch_size)
  return np.concatenate([np.asarray(x), np.asarray(y[:, -1:])], axis=1)


def tokens_for(train_ids, start, num_steps, config, batch_size, host_seed) -> batches.Tokens:
  """What `steps.train_steps` is given for updates `start ..`, as the loop gave it."""
  if host_seed is None:
    return batches.DeviceTokens(jnp.asarray(train_ids))
  return batches.HostWindows(jnp.asarray(np.stack([
      batches.sample_windows(train_ids, config.block_size, batch_size,
                             batches.train_windows_seed(host_seed), s)
      for s in range(start, start + num_steps)])))


def replay_to(state: TrainState, train_ids, start: int, stop: int, *, config: gpt.GPTConfig,
              optimizer: optax.GradientTransformation, batch_size: int, forms: kernels.Forms,
              grad_accum_steps: int = 1, host_seed: Optional[int] = None,
              params_view=None, steps_per_call: int = 10) -> TrainState:
  """Runs updates `start .. stop - 1`: the state before update `stop`.

  The updates run as training ran them, in the jitted `lax.scan` of
  `steps.train_steps`: calls of `steps_per_call` updates, and the last
  `< steps_per_call` one per call (the program `inspect_step` runs too), so
  a replay compiles at most the two programs and costs what training the
  updates cost.

  Args:
    state: the state before update `start` (a checkpoint at step `start`, or
      the run's start, `state.start_state`); donated.
    train_ids: the run's `[num_tokens]` training ids.
    start, stop: the first update to run and the one to stop before.
    config, optimizer, batch_size, forms, grad_accum_steps, params_view: the
      run's (as given to `steps.train_steps`; other forms replay to float
      rounding, not bit for bit).
    host_seed: see `step_windows`.
    steps_per_call: updates per jitted call (the result does not depend on it).

  Returns:
    The state before update `stop`.
  """
  if host_seed is None:
    train_ids = jnp.asarray(train_ids)  # on the device once, not once per call
  step = start
  while step < stop:
    n = steps_per_call if stop - step >= steps_per_call else 1
    state, _ = steps.train_steps(
        state, tokens_for(train_ids, step, n, config, batch_size, host_seed), step,
        config=config, optimizer=optimizer, batch_size=batch_size, num_steps=n, forms=forms,
        grad_accum_steps=grad_accum_steps, params_view=params_view)
    step += n
  return state


def _dotted(path) -> str:
  return ".".join(str(getattr(entry, "key", entry)) for entry in path)


def _per_layer_norms(grads: gpt.Params) -> Dict[str, np.ndarray]:
  """`{path: norm}`, per layer (`[n_layer]`) for the stacked blocks."""
  norms, layer_squares = {}, 0.0
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    name = _dotted(path)
    g = np.asarray(g, np.float64)
    if name.startswith("blocks."):
      squares = (g.reshape(g.shape[0], -1) ** 2).sum(axis=1)
      layer_squares = layer_squares + squares
      norms[name] = np.sqrt(squares)
    else:
      norms[name] = np.sqrt((g ** 2).sum())
  norms["blocks"] = np.sqrt(layer_squares)
  return norms


def inspect_step(state: TrainState, train_ids, update: int, *, config: gpt.GPTConfig,
                 optimizer: optax.GradientTransformation, batch_size: int, forms: kernels.Forms,
                 grad_accum_steps: int = 1, host_seed: Optional[int] = None,
                 params_view=None) -> StepReport:
  """Runs update `update` once more and reports what it computed.

  The loss comes from `steps.train_steps` itself (one step), so it equals
  the logged one bit for bit; the per-token losses and the gradient norms
  of the model's params (for LoRA: of the merged weights) are recomputed
  beside it, with the same batch and dropout keys.

  Args: as `replay_to`, with the state before update `update` (not donated).

  Returns:
    A `StepReport`.
  """
  key = state.keys["train"]
  windows = step_windows(train_ids, key, update, config=config, batch_size=batch_size,
                         host_seed=host_seed)
  _, dropout_key = jax.random.split(rng.fold_in_step(key, update))
  x, y = jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])
  model_params = state.params if params_view is None else params_view(state.params)

  rows = batch_size // grad_accum_steps

  @jax.jit  # one program for both: a replay compiles as little as it can
  def diagnose(params, x, y):
    def microbatch_loss(params, xy, index):  # as steps.train_steps' update
      return gpt.loss(params, *xy, config, key=jax.random.fold_in(dropout_key, index),
                      deterministic=False, forms=forms)

    _, grads = parallel.accumulate_gradients(microbatch_loss, params, (x, y),
                                             grad_accum_steps)
    parts = []
    for j in range(grad_accum_steps):  # microbatch j: rows j * rows .., dropout key j
      logits = gpt.forward(params, x[j * rows:(j + 1) * rows], config, forms=forms,
                           key=jax.random.fold_in(dropout_key, j), deterministic=False)
      parts.append(optax.softmax_cross_entropy_with_integer_labels(
          logits, y[j * rows:(j + 1) * rows]))
    return grads, jnp.concatenate(parts)

  grads, per_token = diagnose(model_params, x, y)
  per_token = np.asarray(per_token)
  copy = jax.tree.map(jnp.array, state)  # train_steps donates its state
  _, metrics = steps.train_steps(
      copy, tokens_for(train_ids, update, 1, config, batch_size, host_seed), update,
      config=config, optimizer=optimizer, batch_size=batch_size, num_steps=1, forms=forms,
      grad_accum_steps=grad_accum_steps, params_view=params_view)
  return StepReport(update, float(metrics.loss[0]), windows, per_token,
                    float(metrics.grad_norm[0]), _per_layer_norms(grads))


# ----------------------------------------------------------------------------
# A run directory's step


class Replayed(NamedTuple):
  """`replay_run`'s result.

  Attributes:
    report: the replayed step (`StepReport`).
    logged: the loss metrics.jsonl holds for the step; None if the step was
      not a log point.
    checkpoint: the checkpoint the replay started from; None when it
      started from the run's seeded initial state.
    tokenizer: the run's tokenizer (to show the tokens).
    path: the `.npz` written, or None.
  """
  report: StepReport
  logged: Optional[float]
  checkpoint: Optional[pathlib.Path]
  tokenizer: Any
  path: Optional[pathlib.Path]


def _kept_checkpoints(out_dir: str) -> List[Tuple[int, pathlib.Path]]:
  """The run's checkpoints, newest first; a folder that is not a run says what it is."""
  folder = pathlib.Path(out_dir)
  kept = checkpoint.list_checkpoints(out_dir)
  if kept:
    return kept
  if not folder.is_dir():
    raise ValueError(f"{out_dir} is not a folder; pass as `out_dir` the folder a GPT run "
                     f"trained into.")
  runs = sorted(p.name for p in folder.iterdir() if p.is_dir() and
                checkpoint.list_checkpoints(p))
  if runs:
    raise ValueError(f"{out_dir} is a sweep's folder, holding the runs {', '.join(runs[:4])}"
                     f"{', ...' if len(runs) > 4 else ''}; pass one run's folder as `out_dir` "
                     f"(e.g. {folder / runs[0]}).")
  what = ("a run with no checkpoint left" if (folder / monitor.METRICS_FILE).is_file()
          else "not a run's folder (no ckpt_*.npz in it)")
  raise ValueError(f"{out_dir} is {what}; pass as `out_dir` the folder a GPT run trained "
                   f"into and saved checkpoints in.")


def _logged_loss(out_dir: str, step: int) -> Optional[float]:
  try:
    records = monitor.read_metrics(out_dir)
  except FileNotFoundError:
    return None
  losses = [r.get("loss") for r in records if r["kind"] == "train" and r["step"] == step]
  return losses[-1] if losses else None


def _lora_config(meta) -> Optional[lora.LoraConfig]:
  spec = meta.get("lora")
  return lora.LoraConfig(spec["rank"], spec["alpha"], tuple(spec["targets"])) if spec else None


def _restore(arrays, path, meta, config, params_key):
  """The checkpoint's `TrainState` and optimizer: the template is the loop's, with or
  without skipping non-finite updates (the state's structure tells which)."""
  lora_config = _lora_config(meta)
  params = jax.eval_shape(lambda: gpt.init_params(config, params_key))
  if lora_config is not None:
    params = jax.eval_shape(lambda p: lora.trainable(p, lora.init(
        p, lora_config.rank, lora_config.targets, params_key)), params)
  opt_config = optim.from_saved(meta["optimizer"])
  key = jax.eval_shape(lambda: params_key)
  error = None
  for skip in (False, True):
    optimizer = optim.RunOptimizer(opt_config, skip, lora_config is not None)()
    template = TrainState(params, jax.eval_shape(optimizer.init, params),
                          {"train": key, "eval": key})
    try:
      tree = checkpoint.extract(arrays, state_lib.as_tree(template), path)
    except checkpoint.CheckpointError as e:
      error = e
      continue
    view = None if lora_config is None else lora.View(lora_config.scale_alpha)
    return jax.tree.map(jnp.asarray, state_lib.from_tree(tree)), optimizer, view
  raise error


def _initial_state(out_dir, step, oldest, meta, config, optimizer):
  """The state a run started from, built as `gpt_loop.train_gpt` built it (its seed's keys)."""
  if meta.get("init_from"):
    raise ValueError(
        f"step {step} is before {out_dir}'s oldest checkpoint (step {oldest}), and the run "
        f"started from the weights of {meta['init_from']}, which replay does not load; "
        f"replay a step after {oldest}.")
  keys = state_lib.run_keys(meta["seed"])
  return state_lib.start_state(gpt.init_params(config, keys["params"]), keys, optimizer,
                               _lora_config(meta))


def replay_run(out_dir: str, step: int, *, forms: kernels.Forms, dataset: Optional[str] = None,
               write: bool = True, **corpus_options) -> Replayed:
  """Replays step `step` (as metrics.jsonl numbers it) of the GPT run in `out_dir`.

  Starts from the newest checkpoint before the step, or, for a step before
  every kept checkpoint, from the run's initial state, which its seed makes
  again (not for a fine-tune, whose initial weights replay does not load).

  Args:
    out_dir: the run directory.
    step: the step count after the update to replay (>= 1).
    forms: how the model runs (`kernels.select`; the run's own forms replay
      its losses bit for bit).
    dataset: the run's data; default: the one its checkpoints record.
    write: write `out_dir/replay/step_<step>.npz`.
    **corpus_options: for `corpus.load_corpus` (cache_dir, tokenizer_file, ...).

  Returns:
    A `Replayed`.

  Raises:
    ValueError: `out_dir` is not a run's folder (a sweep's, or none), a
      fine-tune's step before its oldest checkpoint, or a run that is not a GPT's.
    checkpoint.CheckpointError: damaged or unfitting checkpoints.
  """
  if step < 1:
    raise ValueError(f"`step` must be >= 1 (the step count after an update), got {step}.")
  update = step - 1
  kept = _kept_checkpoints(out_dir)
  before = [path for saved, path in kept if saved <= update]
  # the checkpoint to start from; before all of them, the oldest tells the run's settings
  path = before[0] if before else kept[-1][1]
  arrays, manifest = checkpoint.read(path)
  meta = manifest["meta"]
  if meta.get("model") != "gpt":
    raise ValueError(f"{out_dir} holds a {meta.get('model')!r} run; replay works on GPT runs.")
  config = gpt.GPTConfig.from_dict(meta["config"])
  dataset = dataset or meta.get("data")
  if dataset is None:
    raise ValueError(f"{out_dir}'s checkpoints do not record their data; pass `dataset`.")
  if conversations.is_conversations_file(dataset):
    what = "preference pairs" if "dpo" in meta else "conversations"
    raise ValueError(f"{out_dir} was trained on {what} ({dataset}); replay takes runs on "
                     f"text only.")
  state, optimizer, view = _restore(arrays, path, meta, config, jax.random.PRNGKey(0))
  if not before:
    state, view = _initial_state(out_dir, step, kept[-1][0], meta, config, optimizer)
  tok = tokenizers.from_spec(TokenizerSpec.from_dict(meta["tokenizer"]),
                             encoding_file=corpus_options.get("tokenizer_file"))
  text = corpus_lib.load_corpus(dataset, tokenizer=tok, **corpus_options)
  host_seed = None if text.on_device() else meta["seed"]
  train_ids = text.train if host_seed is not None else jnp.asarray(text.train, jnp.int32)
  run = dict(config=config, optimizer=optimizer, batch_size=meta["batch_size"],
             grad_accum_steps=meta.get("grad_accum_steps", 1), host_seed=host_seed,
             params_view=view, forms=forms)
  state = replay_to(state, train_ids, manifest["step"] if before else 0, update, **run)
  report = inspect_step(state, train_ids, update, **run)
  written = None
  if write:
    written = pathlib.Path(out_dir) / "replay" / f"step_{step:09d}.npz"
    written.parent.mkdir(parents=True, exist_ok=True)
    norms = {f"grad_norm/{name}": value for name, value in report.grad_norms.items()}
    _files.atomic_write(written, lambda f: np.savez(
        f, tokens=report.tokens, token_losses=report.token_losses,
        loss=np.float32(report.loss), grad_norm=np.float32(report.grad_norm), **norms))
  return Replayed(report, _logged_loss(out_dir, step), None if not before else path, tok,
                  written)


def describe(replayed: Replayed, *, show_tokens: int = 5) -> List[str]:
  """Lines for a person: the loss against the logged one, the layers' gradient
  norms, and the tokens of highest loss in their context."""
  report, logged = replayed.report, replayed.logged
  step = report.update + 1
  start = replayed.checkpoint or "the run's start (its seed's initial state)"
  lines = [f"replayed step {step} from {start}"]
  if logged is None:
    lines.append(f"loss {report.loss!r} (metrics.jsonl logged no loss at step {step})")
  else:
    same = "bit for bit the logged loss" if report.loss == logged else (
        f"NOT the logged {logged!r}: another device count or data than the run's, or a "
        f"step trained inside a sweep (equal to float rounding only)?")
    lines.append(f"loss {report.loss!r}: {same}")
  lines.append(f"gradient norm {report.grad_norm:.4g}; per layer (blocks): " + ", ".join(
      f"{n:.3g}" for n in report.grad_norms["blocks"]))
  flat = np.argsort(report.token_losses, axis=None)[::-1][:show_tokens]
  for row, col in zip(*np.unravel_index(flat, report.token_losses.shape)):
    context = replayed.tokenizer.decode(report.tokens[row, max(0, col - 20):col + 1].tolist())
    target = replayed.tokenizer.decode([int(report.tokens[row, col + 1])])
    lines.append(f"loss {report.token_losses[row, col]:6.3f} at row {row}, position {col}: "
                 f"{context!r} -> {target!r}")
  if replayed.path is not None:
    lines.append(f"wrote {replayed.path} (tokens, token_losses, loss, grad_norm/<param>)")
  return lines
