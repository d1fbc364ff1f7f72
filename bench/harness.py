"""The benches' one harness: arms run alternately, their summaries, results files, tables.

    times = harness.alternate({"purejax": ours, "twin": theirs}, rounds=7)
    rows = harness.summarise(times, "purejax", "s/iter")
    path = harness.unused_results_path(harness.RESULTS_DIR, "2026-11-24-ac")
    harness.write_results(path, {"meta": meta, "results": {"a": {"rows": rows}}})

An arm is a function of no arguments that runs its thing once and returns
seconds (per step, token or epoch: the unit is the caller's). Arms run
A B A B ... in one process, so that slow drifts of a shared machine hit every
arm alike, and each arm is compared with its reference by the median of the
per-round ratio arm/reference. The train arms build the GPT train step of
purejax and of its PyTorch twin (`bench/torch_gpt.py`) the same way for
every bench; a purejax arm records what its compiled program holds
(`program_stats`: cuDNN attention calls, peak memory).

`bench.run` (CPU cases a-g) and `bench.gpu` (GPU cases h-j) share it. It
defines no command-line flags, so both can be imported in one process.
"""

import functools
import json
import math
import os
import pathlib
import re
import time
import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from purejax import cache_rows
from purejax import engine
from purejax import gpt
from purejax import kv_cache
from purejax.data import batches
from purejax.ops import attention
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.pure import parallel
from purejax.training.pure import state as state_lib
from purejax.training.pure import steps as steps_lib
from purejax.training.pure.state import TrainState

RESULTS_DIR = pathlib.Path(__file__).parent / "results"
# The real model's float32 folder, where the tests' fixture makes it (tests/real_model.py).
REAL_MODEL_FOLDER = (pathlib.Path(os.environ.get("PUREJAX_MODEL_CACHE") or
                                  pathlib.Path.home() / ".cache" / "purejax-test-models")
                     / "SmolLM2-135M-Instruct-f32")
DATA_TOKENS = 200_000  # random token ids a train arm draws its batches from

Arm = Callable[[], float]


# ----------------------------------------------------------------------------
# Alternating arms, and their summary


def alternate(arms: Mapping[str, Arm], rounds: int, *, min_rounds: int = 0,
              out_of_time: Optional[Callable[[], bool]] = None,
              on_error: Optional[Callable[[str, Exception], None]] = None,
              after_round: Optional[Callable[[Dict[str, List[float]]], None]] = None
              ) -> Dict[str, List[float]]:
  """Runs `arms` round-robin, A B A B ..., for `rounds` rounds.

  Args:
    arms: `{name: fn() -> seconds}`.
    rounds: rounds to run.
    min_rounds: rounds run even once `out_of_time()` says True.
    out_of_time: once it returns True (checked before each round), no more
      rounds start.
    on_error: `on_error(name, exception)` for an arm that raises, which is
      then left out of later rounds; without it the exception propagates.
    after_round: gets the times after every round (to save partial results).

  Returns:
    `{name: [seconds of each round it ran]}`.
  """
  times = {name: [] for name in arms}
  failed = set()
  for r in range(rounds):
    if out_of_time is not None and r >= min_rounds and out_of_time():
      break
    for name, fn in arms.items():
      if name in failed:
        continue
      try:
        times[name].append(fn())
      except Exception as e:  # pylint: disable=broad-except
        if on_error is None:
          raise
        failed.add(name)
        on_error(name, e)
    if after_round is not None:
      after_round(times)
  return times


def recipe_step_times(arms: Mapping[str, Tuple[gpt.GPTConfig, optim.OptimizerConfig]],
                      schedule_end: int, rounds: int, steps_per_call: int,
                      batch_size: int = 12) -> Dict[str, List[float]]:
  """Seconds per step of each arm `{name: (model, optimizer)}` on random tokens, the
  arms' jitted `steps.train_steps` calls alternated in this process (`alternate`),
  after two warm-up calls each."""
  data = batches.DeviceTokens(jax.random.randint(jax.random.PRNGKey(0), (100_000,), 0, 65))
  state = {}
  for name, (config, opt_config) in arms.items():
    optimizer = optim.make_optimizer(optim.with_schedule_end(opt_config, schedule_end))
    params = gpt.init_params(config, jax.random.PRNGKey(0))
    state[name] = [config, optimizer, state_lib.TrainState(params, optimizer.init(params),
                                                 {"train": jax.random.PRNGKey(1)}), 0]

  def call(name: str) -> float:
    config, optimizer, train_state, step = state[name]
    start = time.perf_counter()
    train_state, metrics = steps_lib.train_steps(
        train_state, data, step, config=config, optimizer=optimizer, batch_size=batch_size,
        num_steps=steps_per_call, forms=kernels.select())
    jax.block_until_ready(metrics)
    state[name][2:] = [train_state, step + steps_per_call]
    return (time.perf_counter() - start) / steps_per_call

  for name in arms:  # compile and warm up
    call(name)
    call(name)
  return alternate({name: functools.partial(call, name) for name in arms}, rounds)


def summarise(times: Mapping[str, Sequence[float]],
              reference: Union[str, Mapping[str, str]], unit: str) -> Dict[str, dict]:
  """Each arm's median, min-max and round count, and its per-round ratios to its reference.

  Args:
    times: `{arm: [seconds per round]}`.
    reference: the arm every other arm is compared with, or `{arm: its
      reference}` (arms not in it are not compared).
    unit: the unit of the times, e.g. "s/iter".

  Returns:
    `{arm: {"median", "min", "max", "unit", "n"}}`; a compared arm also has
    "vs" (its reference) and the median, min and max of the ratio
    arm/reference over the rounds both ran ("ratio", "ratio_min",
    "ratio_max"). Arms without times are left out.
  """
  references = ({name: reference for name in times if name != reference}
                if isinstance(reference, str) else reference)
  rows = {}
  for name, ts in times.items():
    if not ts:
      continue
    row = {"median": float(np.median(ts)), "min": float(min(ts)), "max": float(max(ts)),
           "unit": unit, "n": len(ts)}
    ref = references.get(name)
    n = min(len(ts), len(times.get(ref, ())))
    if n:
      ratios = np.asarray(ts[:n]) / np.asarray(times[ref][:n])
      row.update(vs=ref, ratio=float(np.median(ratios)), ratio_min=float(ratios.min()),
                 ratio_max=float(ratios.max()))
    rows[name] = row
  return rows


# ----------------------------------------------------------------------------
# Results files and tables


def unused_results_path(out_dir: pathlib.Path, stem: str) -> pathlib.Path:
  """`<out_dir>/<stem>.json`, or `<stem>-2.json`, ...: an earlier run is never overwritten."""
  out, n = pathlib.Path(out_dir) / f"{stem}.json", 1
  while out.exists():
    n += 1
    out = out.with_name(f"{stem}-{n}.json")
  return out


def read_results(path: pathlib.Path) -> dict:
  """A results file's `{"meta": ..., "results": ...}`; empty ones if it is missing or torn."""
  try:
    return json.loads(pathlib.Path(path).read_text())
  except (OSError, ValueError):
    return {"meta": {}, "results": {}}


def write_results(path: pathlib.Path, results: dict) -> None:
  """Writes atomically, so a kill mid-write leaves the previous version."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(results, indent=2, default=str))
  os.replace(tmp, path)


Column = Tuple[str, Callable[[dict], str]]


def markdown(results: Mapping[str, dict], columns: Sequence[Column], *, first: str = "case",
             notes: Callable[[dict], List[str]] = lambda result: []) -> str:
  """A markdown table with a line per arm of each case, then the case's notes.

  Args:
    results: `{case: {"rows": {arm: row}, ...}}`.
    columns: `(title, row -> text)` of the columns after the case and arm.
    first: title of the first column.
    notes: lines of text about a case's result, each on a line of its own
      in the last column.
  """
  line = lambda cells: "| " + " | ".join(cells) + " |"
  lines = [line([first, "arm"] + [title for title, _ in columns]),
           line(["---"] * (len(columns) + 2))]
  for case, result in results.items():
    for arm, row in (result.get("rows") or {}).items():
      lines.append(line([case, arm] + [cell(row) for _, cell in columns]))
    for text in notes(result):
      lines.append(line([case] + [""] * len(columns) + [text]))
  return "\n".join(lines)


def fmt(value, spec: str = ".3g", scale: float = 1.0) -> str:
  """`value * scale` formatted, or "" for None."""
  return "" if value is None else f"{value * scale:{spec}}"


def ratio_text(row: dict, missing: str = "") -> str:
  """"1.23x (1.10-1.30)": the median ratio to the reference and its range."""
  if "ratio" not in row:
    return missing
  return f"{row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"


# ----------------------------------------------------------------------------
# What a compiled program holds

# A cuDNN fused-attention custom call, in StableHLO (`@__cudnn$fmha...(`) or
# in optimised HLO (`custom_call_target="__cudnn$fmha..."`).
_CUDNN_ATTENTION = re.compile(r'(?:@|custom_call_target=")(__cudnn\$fmha\w*)')


def cudnn_attention_calls(program_text: str) -> Dict[str, int]:
  """cuDNN fused-attention custom calls in a program, counted by call target.

  Args:
    program_text: a lowered program's StableHLO (`lowered.as_text()`) or a
      compiled one's HLO (`compiled.as_text()`).

  Returns:
    `{"__cudnn$fmhaSoftmax": 2, "__cudnn$fmhaSoftmaxBackward": 1, ...}`: calls
    written in the program (one in a scanned loop body counts once).
  """
  counts: Dict[str, int] = {}
  for target in _CUDNN_ATTENTION.findall(program_text):
    counts[target] = counts.get(target, 0) + 1
  return counts


def program_stats(compiled) -> dict:
  """What a compiled program holds: cuDNN attention calls and its peak memory.

  Args:
    compiled: `jax.jit(f).lower(...).compile()`.

  Returns:
    "cudnn_attention_calls" (total, by target in "cudnn_attention_targets")
    and "program_peak_bytes", the device memory XLA planned for one call
    (`memory_analysis().peak_memory_in_bytes`; arguments + outputs - aliased
    + temporaries where that is missing), None where the backend tells none.
  """
  targets = cudnn_attention_calls(compiled.as_text())
  try:
    memory = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  # not every backend implements it
    memory = None
  peak = None
  if memory is not None:
    peak = getattr(memory, "peak_memory_in_bytes", 0) or (
        memory.argument_size_in_bytes + memory.output_size_in_bytes
        - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  return {"cudnn_attention_calls": sum(targets.values()), "cudnn_attention_targets": targets,
          "program_peak_bytes": peak}


# One sampled completion through one engine row (`sample_completion`); the shapes of its
# programs (`engine.generate`'s, with no stop strings or log-probabilities asked for).
SAMPLE_ENGINE = dict(rows=1, prefill_rows=1, stop_strings=1, stop_string_bytes=1,
                     top_logprobs=0)


def sample_completion(params, config: gpt.GPTConfig, key, new_tokens: int, top_k: int = 200,
                      forms: Optional[kernels.Forms] = None) -> Tuple[int, ...]:
  """`new_tokens` sampled after a one-token prompt at temperature 1 (nanoGPT's sampling:
  past the context, on from its last half), through one engine row."""
  ((completion,),) = engine.generate(
      params, [[0]], config, key, new_tokens, temperature=1.0, top_k=top_k, slide=True,
      rows=SAMPLE_ENGINE["rows"], prefill_rows=SAMPLE_ENGINE["prefill_rows"], forms=forms)
  return completion.tokens


def sampling_program(params, config: gpt.GPTConfig, forms: kernels.Forms, top_k: int = 200):
  """`sample_completion`'s decoding program (`cache_rows.decode_chunk`), lowered."""
  settings = engine.EngineConfig(**SAMPLE_ENGINE)
  n = settings.rows
  row_settings = cache_rows.Settings(
      keys=jnp.zeros((n, 2), jnp.uint32), temperature=jnp.ones(n),
      top_k=jnp.full(n, top_k, jnp.int32), top_p=jnp.ones(n), limit=jnp.ones(n, jnp.int32),
      stop_ids=jnp.full((n, 1), -1, jnp.int32),
      strings=jnp.full((n, settings.stop_strings, settings.stop_string_bytes), -1, jnp.int32),
      active=jnp.ones(n, bool), logprobs=jnp.zeros(n, bool), top=jnp.zeros(n, bool))
  return cache_rows.decode_chunk.lower(
      kv_cache.prepare(params, config),
      cache_rows.init_rows(config, settings.rows, settings.length, settings.ring_room, 1),
      row_settings, None, jnp.int32(settings.chunk_steps), False, config=config, forms=forms,
      steps=settings.chunk_steps, top=settings.top_logprobs, valid_vocab=None)


# ----------------------------------------------------------------------------
# The GPT train step, purejax and the PyTorch twin


def lr_table(opt_config: optim.OptimizerConfig, num_steps: int) -> List[float]:
  """The learning rate of steps 0 .. num_steps - 1 by the library's own schedule.

  The twins train with these, so both frameworks follow one schedule
  (nanoGPT's warmup and cosine, `optim.make_schedule`), written once.
  """
  schedule = jax.jit(jax.vmap(optim.make_schedule(opt_config)))
  return [float(lr) for lr in np.asarray(schedule(jnp.arange(num_steps)))]


def purejax_train_arm(config: gpt.GPTConfig, opt_config: optim.OptimizerConfig,
                      batch_size: int, steps: int, *, data: Optional[jax.Array] = None,
                      windows: Optional[Callable[[], np.ndarray]] = None,
                      num_devices: int = 1, forms: Optional[kernels.Forms] = None,
                      info: Optional[dict] = None,
                      compiler_options: Optional[Dict[str, Any]] = None) -> Arm:
  """`steps.train_steps`, `steps` steps per jitted call; returns fn() -> seconds per step.

  Args:
    config: the model.
    opt_config: its optimizer.
    batch_size: sequences per step.
    steps: steps per call (one jitted `lax.scan`).
    data: token ids whose random windows each step draws on the device
      (default: `DATA_TOKENS` random ids).
    windows: instead of `data`, a function returning the next call's
      `[steps, batch_size, block_size + 1]` windows read by the host (e.g.
      from a `batches.BatchPrefetcher`); they are waited for and put on the
      device inside the timing, as `gpt_loop.train_gpt` feeds a corpus too large
      for the device.
    num_devices: > 1 runs the step data parallel as `purejax.train` does.
    forms: how the step runs (default: the forms of the params' platform).
    info: receives the attention form and remat policy, `program_stats` of
      the compiled step, the device's peak memory after the first call
      (`device_memory`) and the last call's loss.
    compiler_options: XLA options (`--xla_...` flags by name, without the
      dashes) this arm's program alone is compiled with.

  Returns:
    The arm. Its first call, which compiles, runs here.
  """
  info = {} if info is None else info
  key = jax.random.PRNGKey(0)
  if data is None and windows is None:
    data = jax.random.randint(key, (DATA_TOKENS,), 0, config.vocab_size)
  params = gpt.init_params(config, key)
  optimizer = optim.make_optimizer(opt_config)
  state = {"train": TrainState(params, optimizer.init(params), {"train": key}), "step": 0}
  forms = forms or kernels.select(kernels.platform_of(params))
  static = dict(config=config, optimizer=optimizer, batch_size=batch_size, num_steps=steps,
                forms=forms)
  if num_devices == 1:
    train_steps, kwargs = steps_lib.train_steps, static
  else:
    plan = parallel.ShardingPlan(parallel.make_mesh(num_devices))
    state["train"], shardings = state_lib.shard(state["train"], plan)
    train_steps, kwargs = parallel.jit_train_step(steps_lib.train_steps_fn, plan, shardings,
                                                  **static), {}
    if data is not None:
      data = parallel.put(data, plan.replicated)
  next_tokens = ((lambda: batches.DeviceTokens(data)) if windows is None else
                 (lambda: batches.HostWindows(jax.device_put(windows()))))
  info["forms"] = {"attention": attention_form(config, forms), "remat": forms.remat,
                   "scan_layers": forms.scan_layers}

  def run(tokens=None):
    start = time.perf_counter()
    tokens = next_tokens() if tokens is None else tokens
    state["train"], metrics = step_fn(state["train"], tokens, state["step"])
    losses = np.asarray(metrics.loss)  # waits for the steps
    seconds = time.perf_counter() - start
    state["step"] += steps
    info["last_loss"] = float(losses[-1])
    if not np.isfinite(losses).all():
      raise FloatingPointError(f"non-finite loss {losses} by step {state['step']}")
    return seconds / steps

  first = next_tokens()
  # Compiled here, then found in jit's cache by the first call (or, with options,
  # called as compiled: jit's cache holds programs compiled without them).
  compiled = train_steps.lower(state["train"], first, 0, **kwargs).compile(compiler_options)
  info.update(program_stats(compiled))
  step_fn = compiled if compiler_options else functools.partial(train_steps, **kwargs)
  run(first)
  info.update(device_memory())
  return lambda: run()


def device_memory() -> dict:
  """JAX's peak and limit on device 0 in this process ({} where the backend keeps none).

  JAX's peak cannot be reset: it covers everything the process ran so far.
  """
  stats = jax.devices()[0].memory_stats() or {}
  return {k: stats[s] for k, s in (("peak_bytes", "peak_bytes_in_use"),
                                   ("limit_bytes", "bytes_limit")) if s in stats}


def attention_form(config: gpt.GPTConfig, forms: Optional[kernels.Forms] = None) -> str:
  """The attention form a training step of `config` runs under `forms` (default: the
  default backend's): cuDNN's falls back to XLA's where cuDNN cannot run it."""
  forms = forms or kernels.select()
  if forms.attention == "cudnn" and attention.cudnn_unsupported(
      (1, config.block_size, config.n_head, config.head_dim),
      config.matmul_dtype or jnp.float32, config.dropout > 0):
    return "xla"
  return forms.attention


def torch_train_arm(config: gpt.GPTConfig, opt_config: optim.OptimizerConfig,
                    batch_size: int, steps: int, *, device: str = "cpu",
                    compile_model: bool = False, data=None,
                    lrs: Optional[Sequence[float]] = None, warm_up: bool = True,
                    info: Optional[dict] = None, muon_float32: bool = False) -> Arm:
  """The twin's train step, nanoGPT's way; returns fn() -> seconds per step.

  `torch.compile` if `compile_model`, bf16 autocast when `config.compute_dtype`
  is bfloat16, AdamW (fused on CUDA; for `opt_config.name == "muon"` PyTorch's
  Muon and AdamW, `torch_gpt.MuonAdamW`; its Newton-Schulz products in float32
  with `muon_float32`), gradient clipping; step `i` (counted
  over the calls) trains at `lrs[i]`, or at `opt_config`'s peak rate without
  `lrs`. Batches: random windows of `data` (a tensor on `device`; default
  `DATA_TOKENS` random ids on the CPU, one fixed random batch on a GPU, as
  nanoGPT's bench.py), drawn where `data` lives. No host sync inside a call.
  `info` receives how it ran, the last loss and, on CUDA, the peak memory
  after the first call. With `warm_up`, the first call (which compiles)
  runs here. The arm's `parts` are its `model`,
  `step_model` (compiled or not), `optimizer` and `autocast`.
  """
  import torch  # pylint: disable=g-import-not-at-top
  from bench import torch_gpt  # pylint: disable=g-import-not-at-top
  info = {} if info is None else info
  device = torch.device(device)
  cuda = device.type == "cuda"
  if cuda:
    torch.cuda.reset_peak_memory_stats()
  torch.manual_seed(0)
  with device:
    model = torch_gpt.TorchGPT(config)
  setting = opt_config.setting
  betas = (setting("beta1"), setting("beta2"))
  if opt_config.name == "muon":
    optimizer = torch_gpt.MuonAdamW(model, opt_config.learning_rate,
                                    setting("muon_learning_rate"), setting("weight_decay"),
                                    betas, setting("muon_momentum"), setting("muon_ns_steps"),
                                    float32=muon_float32)
  else:
    optimizer = torch_gpt.make_optimizer(model, opt_config.learning_rate,
                                         setting("weight_decay"), betas, fused=cuda)
  step_model = torch.compile(model) if compile_model else model
  info["torch"] = {"compiled": compile_model, "fused_adamw": cuda,
                   "autocast": config.compute_dtype}
  t = config.block_size
  if data is None and cuda:
    fixed = torch.randint(config.vocab_size, (batch_size, t + 1), device=device)
    fixed_xy = fixed[:, :-1].contiguous(), fixed[:, 1:].contiguous()
    next_batch = lambda: fixed_xy
  else:
    if data is None:
      data = torch.randint(0, config.vocab_size, (DATA_TOKENS,))
    offsets = torch.arange(t, device=data.device)

    def next_batch():
      ix = torch.randint(len(data) - t, (batch_size, 1), device=data.device) + offsets
      return data[ix], data[ix + 1]

  autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16,
                               enabled=config.compute_dtype == "bfloat16")

  step = [0]

  def run():
    sync(torch, device)
    start = time.perf_counter()
    for _ in range(steps):
      if lrs is not None:
        for group in optimizer.param_groups:
          group["lr"] = lrs[step[0]]
      step[0] += 1
      x, y = next_batch()
      with autocast():
        _, loss = step_model(x, y)
      optimizer.zero_grad(set_to_none=True)
      loss.backward()
      if opt_config.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_config.grad_clip)
      optimizer.step()
    sync(torch, device)
    seconds = time.perf_counter() - start
    info["last_loss"] = loss.item()
    if not math.isfinite(info["last_loss"]):
      raise FloatingPointError(f"non-finite loss {info['last_loss']}")
    return seconds / steps

  run.parts = types.SimpleNamespace(model=model, step_model=step_model, optimizer=optimizer,
                                    autocast=autocast)
  if warm_up:
    run()
    if cuda:
      info.update(peak_bytes=torch.cuda.max_memory_allocated(),
                  limit_bytes=torch.cuda.get_device_properties(device).total_memory)
  return run


def sync(torch, device) -> None:
  """Waits for the GPU's queued work (nothing to wait for on the CPU)."""
  if device.type == "cuda":
    torch.cuda.synchronize()
