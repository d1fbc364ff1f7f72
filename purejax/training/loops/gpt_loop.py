"""The GPT's training loop, as a library function that reads no flags.

    metrics = train_gpt(model_config, text, GPTTrainConfig(max_iters=2000),
                        recipes.GPT_OPTIMIZER, RunConfig(out_dir="out-gpt"))

`python -m purejax.train` only turns its flags into these configs and calls
`train_gpt` (or `mlp_loop.train_mlp`); a Python user can call them the same
way. `train_gpt` reads as nanoGPT's loop: the run starts (`gpt_run.start_run`:
data, model, optimizer, resumed state), its step is compiled once, then one
loop trains, evaluates, logs and saves on schedule, and the run ends with its
plot and a sample. A sweep has its own loop (`sweep_loop`).
"""

import contextlib
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from purejax import engine
from purejax import gpt
from purejax import lora
from purejax.data import corpus as corpus_lib
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.effects import folder_lock
from purejax.training.effects import plots
from purejax.training.effects import progress as progress_lib
from purejax.training.effects import runs
from purejax.training.effects.runs import RunConfig
from purejax.training.effects.session import Recorded, Session
from purejax.training.loops import gpt_metrics
from purejax.training.loops import gpt_run
from purejax.training.loops.gpt_run import GPTTrainConfig  # (a name of this module's API)
from purejax.training.pure import flops
from purejax.training.pure import parallel
from purejax.training.pure import preference
from purejax.training.pure import state as state_lib
from purejax.training.pure.parallel import ParallelConfig
from purejax.training.pure.state import TrainState

class RunReport:
  """What a run shows of its calls and evaluations: the progress bar (loss, tokens/s), a log
  line and a metrics record at the log interval (loss, rate, gradient norm, ms/iter,
  tokens/s, MFU), and each evaluation's line."""

  def __init__(self, config: gpt.GPTConfig, train: GPTTrainConfig, schedule, n_params: int,
               num_devices: int, rows_per_example: int = 1):
    self._schedule = schedule
    # (a preference pair is two rows through the model)
    self._tokens_per_step = train.batch_size * config.block_size * rows_per_example
    self._flops_per_token = flops.transformer_flops_per_token(
        n_params, config.n_layer, config.n_head, config.head_dim, config.block_size)
    peak = train.peak_flops or flops.device_peak_flops(jax.devices()[0], config.compute_dtype)
    self._peak = peak * num_devices if peak else None
    self._since_log: List[float] = []

  def trained(self, session: Session, step: int, seconds_per_step: float, loss: float,
              grad_norm: float, log_due: bool) -> None:
    """After every call of the step: `loss` and `grad_norm` of its last step, `step` after it."""
    self._since_log.append(seconds_per_step)
    session.progress.update_to(step, loss=loss, tok_s=self._tokens_per_step / seconds_per_step)
    if not log_due:
      return
    ms = 1000 * float(np.median(self._since_log))
    self._since_log = []
    tokens_per_s = self._tokens_per_step / ms * 1000
    record = session.record.monitor.log_train(
        step, loss=loss, lr=float(self._schedule(step - 1)), grad_norm=grad_norm,
        ms_per_iter=ms, tokens_per_s=tokens_per_s,
        mfu=flops.mfu(self._flops_per_token, tokens_per_s, self._peak))
    mfu = f" | MFU {100 * record['mfu']:.1f}%" if record.get("mfu") else ""
    session.log(f"step {step:5d} | loss {loss:.4f} | lr {record['lr']:.2e} | "
                f"grad norm {record['grad_norm']:.3f} | {ms:6.2f} ms/iter | "
                f"{tokens_per_s:8.0f} tokens/s{mfu}")

  def evaluated(self, session: Session, step: int, values: Dict[str, float],
                state: TrainState) -> None:
    """After every evaluation: its line, and its record (a best checkpoint of `state`)."""
    bpb = f" | val bpb {values['val_bpb']:.4f}" if "val_bpb" in values else ""
    if "val_accuracy" in values:  # a preference run's
      bpb += (f" | val accuracy {values['val_accuracy']:.3f} | val margin "
              f"{values['val_margin']:.3f} | val chosen nll {values['val_chosen_nll']:.4f}")
    session.log(f"step {step:5d} | train loss {values['train_loss']:.4f} | "
                f"val loss {values['val_loss']:.4f}{bpb}")
    session.record.add_eval(step, state, {"step": step, **values}, **values)


def train_gpt(
    config: gpt.GPTConfig,
    text: corpus_lib.Corpus,
    train: GPTTrainConfig,
    opt_config: optim.OptimizerConfig,
    run: RunConfig,
    devices: ParallelConfig = ParallelConfig(),
    *,
    init_params: Optional[gpt.Params] = None,
    init_from: Optional[str] = None,
    forms: Union[kernels.Forms, Mapping[str, Any], None] = None,
    lora_config: Optional[lora.LoraConfig] = None,
    data: Optional[str] = None,
    sinks: Union[Sequence[Any], Callable[[Dict[str, Any]], Sequence[Any]]] = (),
    metrics: Sequence[gpt_metrics.Metric] = (),
    dpo: Optional[preference.DPO] = None,
) -> Dict[str, Any]:
  """Trains a GPT on a token corpus, conversations or preference pairs; returns the
  final evaluation and timing.

  What a run writes to `run.out_dir`: checkpoints (`ckpt_<step>.npz`, and
  `ckpt_best.npz` with `always_save_checkpoint=False`), `metrics.jsonl` and
  TensorBoard events with every log and eval point (`purejax.training.effects.monitor`), and
  `loss.png` at the end when matplotlib is installed.

  Args:
    config: the model; its `vocab_size` must cover the corpus's tokenizer.
    text: the corpus (`corpus.load_corpus`); small ones are put on every
      device, larger ones are read by the host one call ahead. Or
      conversations (`conversations.load_conversations`): whole padded rows
      on every device, the loss over the assistant's tokens only. Or
      preference pairs (`preferences.load_preferences`): DPO from `init_params`,
      which are also the reference (with LoRA, the base).
    train: steps, evaluation, logging, checkpoints.
    opt_config: the optimizer; `decay_iters=None` ends the schedule at
      `max_iters` in a new run and keeps the saved run's end on resume.
    run: out_dir, resuming, checkpoints kept, non-finite handling.
    devices: how the step is spread over devices and hosts.
    init_params: start from these params (fine-tuning) instead of a random init.
    init_from: where `init_params` came from, recorded in the checkpoints.
    forms: how the model runs: a `kernels.Forms`, or `kernels.select`'s
      overrides for the devices' platform (e.g. `{"attention": "xla"}`);
      None: that platform's forms. Not part of the run's identity: a run may
      resume with other forms.
    lora_config: train LoRA adapters of the params (`lora`) instead of the
      params; checkpoints hold base and adapters, and loading them as
      weights (`weights.from_purejax`) merges them.
    data: the `--dataset` the corpus came from, recorded for `purejax.replay`.
    sinks: further metric sinks (`monitor.Monitor`'s), e.g. W&B's; or a function of the
      run's checkpoint metadata that makes them, called once the run holds its folder
      (a W&B run starts only then, with the run's settings as its config).
    metrics: further evaluation metrics, logged after the losses and bits per
      byte: plain functions of the run's model (`gpt_metrics.Metric`), e.g.
      benchmarks (`purejax.evaluation.task_metric`).
    dpo: the DPO settings of a run on preference pairs (None: `preference.DPO()`'s);
      each evaluation also logs their rewards, margin, accuracy and the chosen answers'
      NLL on train and held-out pairs (`preference.pair_metrics`).

  Returns:
    `{"step", "train_loss", "val_loss", "ms_per_iter"}` of the last evaluation.
  """
  with folder_lock.hold(run.out_dir, log=runs.print_line):  # one writer per run folder
    context, started = gpt_run.start_run(
        config, text, train, devices, run, opt_config, init_params=init_params,
        init_from=init_from, forms=forms, lora_config=lora_config, data=data, dpo=dpo)
    metrics = gpt_metrics.objective_metrics(context) + list(metrics)
    sinks = sinks(started.meta) if callable(sinks) else sinks
    runs.print_line(f"optimizer: {optim.describe(started.opt_config)}")
    for warning in optim.schedule_warnings(started.opt_config, train.max_iters):
      runs.print_line(f"warning: {warning}")
    # One jit with the state's shardings; each call length compiles once.
    state, train_step = gpt_run.run_program(started.state, started.opt_config, config, context)
    byte_lengths = gpt_metrics.device_byte_lengths(text, context.plan)
    report = RunReport(config, train, optim.make_schedule(started.opt_config),
                       started.n_params, context.plan.num_devices,
                       rows_per_example=2 if isinstance(context.objective, preference.DPO) else 1)
    profiler = progress_lib.Profiler(train.profile_steps, run.out_dir)

    def evaluate(step: int, state: TrainState) -> None:
      values = gpt_metrics.evaluate_run(state.params, state.keys["eval"], config, context,
                                        byte_lengths, metrics)
      report.evaluated(session, step, values, state)

    with contextlib.closing(context.feed), Session(
        [Recorded(run, started.meta, started.saved, sinks)], total=train.max_iters,
        start=started.step, bar=train.progress,
        keep_best=not train.always_save_checkpoint) as session:
      step, times = started.step, []
      while step < train.max_iters:
        # The untrained model, and a resumed run's first evaluation unless it has it.
        if step % train.eval_interval == 0 and not session.record.evaluated_at(step):
          evaluate(step, state)
        num_steps = context.call_length(step)  # never across an eval, log or save
        profiler.before(step)
        began = time.perf_counter()
        state, step_metrics = train_step(state, context.feed.train(step, num_steps), step,
                                         num_steps=num_steps)
        losses = np.asarray(step_metrics.loss)  # [num_steps]; waits for the steps to end
        seconds = (time.perf_counter() - began) / num_steps
        profiler.after(step + num_steps, session.log)
        session.record.check_finite(losses, step)  # a NaN stops here; the checkpoint stays
        step += num_steps
        times.append(seconds)
        report.trained(session, step, seconds, float(losses[-1]),
                       float(np.asarray(step_metrics.grad_norm)[-1]),
                       log_due=runs.every(train.log_interval, step, train.max_iters))
        if runs.every(train.eval_interval, step, train.max_iters):
          evaluate(step, state)
        # Also on SIGINT/SIGTERM, which then stop the run (`signals.Interrupted`).
        session.save_if(runs.every(train.checkpoint_interval, step, train.max_iters), step,
                        state)
    return _finish(session.record.history, step, times, state, text, started.keys, context)


def _finish(history, step: int, times, state: TrainState, text, keys,
            context: gpt_run.RunContext) -> Dict[str, Any]:
  """The run's final metrics; then its loss plot and a sample, as nanoGPT ends."""
  metrics = dict(history[-1]) if history else {"step": step}
  ms = progress_lib.median_ms(times)
  if ms is not None:
    metrics["ms_per_iter"] = ms
    runs.print_line(f"median {ms:.2f} ms/iter after compilation")
  if parallel.is_main_process():
    plots.save_loss_plot(context.run.out_dir)
  if context.train.sample_tokens > 0:
    view = context.view
    params = state.params if view is None else jax.jit(view)(state.params)
    prompt, stops = text.sample_prompt()  # a chat run's: a user's turn through its template
    sample = sample_text(params, text.tokenizer, context.config, keys["sample"],
                         context.train.sample_tokens, prompt, stop_ids=stops,
                         forms=context.forms)
    runs.print_line("---- sample ----\n" + sample)
  return metrics


def evaluate_gpt(params, config: gpt.GPTConfig, text: corpus_lib.Corpus,
                 train: GPTTrainConfig, devices: ParallelConfig = ParallelConfig(),
                 *, forms: Union[kernels.Forms, Mapping[str, Any], None] = None
                 ) -> Dict[str, float]:
  """Train and val loss (and val bits per byte) of `params` on `train.eval_iters` batches of
  each split, as a run's evaluation measures them (no training). `forms` as in `train_gpt`."""
  gpt_run.check_fits(config, text, train.batch_size)
  gpt.check_params(params, config)
  keys = state_lib.run_keys(train.seed)
  plan = parallel.make_plan(devices, train.batch_size)
  feed = gpt_run.make_feed(text, config, train, plan, start_step=0,
                           steps_per_call=lambda _: 1, end_step=0)
  context = gpt_run.RunContext(config, train, None, plan, gpt_run.forms_of(plan, forms), None,
                               None, devices.grad_accum_steps, feed, None)
  with contextlib.closing(feed):
    return gpt_metrics.evaluate_run(parallel.put(params, plan.replicated), keys["eval"],
                                    config, context,
                                    gpt_metrics.device_byte_lengths(text, plan))


def sample_text(params, tokenizer, config: gpt.GPTConfig, key, num_tokens: int,
                prompt="\n", *, stop_ids=None, forms: Optional[kernels.Forms] = None) -> str:
  """`engine.sample_text` of a run's (possibly sharded) params, on process 0; '' elsewhere."""
  # Whole params on one local device: sampling is one sequence, not worth a mesh.
  params = jax.device_put(parallel.fetch(params), jax.local_devices()[0])
  if not parallel.is_main_process():
    return ""
  return engine.sample_text(params, tokenizer, config, key, num_tokens, prompt,
                            stop_ids=stop_ids, forms=forms)
