"""Reinforcement learning with verifiable rewards, as a library function that reads no flags.

    task = rl_tasks.load_task("arithmetic")
    metrics = train_rl(params, config, tokenizer, fmt, task, rewards.load_reward("numeric"),
                       RLConfig(group_size=8, max_iters=40), optim.named("adamw", ...),
                       RunConfig(out_dir="out-rl"), lora_config=lora.LoraConfig(16))

`python -m purejax.rl` turns its flags into these arguments. Each step, read top to
bottom in `train_rl`:

1. draws `prompts_per_step` prompts of the task (`fold_in(data key, step)`);
2. samples `group_size` completions of each with the step's policy through the engine
   (`engine.Engine`, one for the run; token `i` of completion `j` from
   `fold_in(fold_in(sample key, step), j)`), so a resumed run samples what the run
   sampled;
3. scores each completion with the reward, on the host;
4. turns rewards into advantages within each group (`preference.group_advantages`);
5. updates the policy `updates_per_batch` times on that batch (`rl_steps.policy_update`:
   GRPO's clipped surrogate, token-level normalisation, optional KL to the reference).
   Without a KL term the groups whose completions all scored alike (advantage 0, so
   no gradient) are left out of the passes (`rl_steps.drop_silent_groups`): the same
   update, computed on fewer rows.

Evaluation decodes the held-out prompts greedily and reports pass@1 (a completion
passes where its reward is at least 1, the built-in rewards' score for a right answer).
The reference for the KL term is the starting model: with LoRA its base (no copy),
else a copy of the starting params, kept only where `beta > 0`.
"""

import dataclasses
import time
import math
import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from purejax import decode
from purejax import engine as engine_lib
from purejax import gpt
from purejax import lora
from purejax.data import chat
from purejax.data import rl_tasks
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.effects import folder_lock
from purejax.training.effects import runs
from purejax.training.effects.runs import RunConfig
from purejax.training.effects.session import Recorded, Session
from purejax.training.pure import preference
from purejax.training.pure import rl_steps
from purejax.training.pure import state as state_lib

REWARD_ERRORS = ("fail", "zero")


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """How a reinforcement-learning run samples, scores, updates, evaluates and saves.

  Attributes:
    prompts_per_step: prompts drawn per step (distinct, when the task has enough).
    group_size: completions sampled per prompt (>= 2: a group is its own baseline).
    max_new_tokens: tokens per completion, at most.
    temperature, top_k, top_p: how completions are sampled (`engine.Request`).
    beta: the KL term's weight (0: none, as nanochat; TRL's default too).
    kl_ratio: weigh the KL term by the probability ratio (TRL's
      `use_bias_correction_kl`; `preference.policy_loss`).
    clip, clip_high: PPO's ratio clip, lower and upper margins (`clip_high` None:
      `clip`); they act only with `updates_per_batch > 1`.
    updates_per_batch: optimiser steps on each batch of samples (TRL's
      `num_iterations`); the first is on-policy (ratio 1).
    scale_rewards: divide each group's advantages by its standard deviation.
    max_iters: steps (batches of samples).
    eval_interval: steps between held-out evaluations (and at the first and last).
    eval_examples: held-out prompts each evaluation decodes (its first ones).
    log_interval: steps between log lines.
    checkpoint_every: steps between checkpoints; None: `eval_interval`.
    seed: the run's keys (`state.run_keys`).
    reward_errors: "fail": a reward that raises, or returns no finite number, stops
      the run; "zero": that completion scores 0 (counted as `reward_failed`).
    grad_accum_steps: microbatches per update (must divide the batch's rows).
    progress: draw a progress bar (None: when stderr is a terminal).
  """
  prompts_per_step: int = 4
  group_size: int = 8
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  beta: float = 0.0
  kl_ratio: bool = False
  clip: float = 0.2
  clip_high: Optional[float] = None
  updates_per_batch: int = 1
  scale_rewards: bool = True
  max_iters: int = 40
  eval_interval: int = 10
  eval_examples: int = 100
  log_interval: int = 1
  checkpoint_every: Optional[int] = None
  seed: int = 0
  reward_errors: str = "fail"
  grad_accum_steps: int = 1
  progress: Optional[bool] = None

  def __post_init__(self):
    if self.group_size < 2:
      raise ValueError(f"group_size={self.group_size}: a group needs at least 2 completions "
                       f"of a prompt, since its mean is each one's baseline; use 2 or more "
                       f"(e.g. 8).")
    for name in ("prompts_per_step", "max_new_tokens", "updates_per_batch", "max_iters",
                 "eval_interval", "eval_examples", "log_interval", "grad_accum_steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    if self.temperature <= 0:
      raise ValueError(f"temperature={self.temperature}: sampling a group needs a "
                       f"temperature > 0 (greedy samples would all be one).")
    if self.beta < 0 or self.clip <= 0 or (self.clip_high is not None and self.clip_high <= 0):
      raise ValueError("beta must be >= 0 and the clip margins > 0.")
    if self.reward_errors not in REWARD_ERRORS:
      raise ValueError(f"reward_errors={self.reward_errors!r}: choose one of {REWARD_ERRORS}.")
    if (self.prompts_per_step * self.group_size) % self.grad_accum_steps:
      raise ValueError(f"grad_accum_steps={self.grad_accum_steps} does not divide the "
                       f"{self.prompts_per_step * self.group_size} completions of a step.")

  @property
  def checkpoint_interval(self) -> int:
    return self.checkpoint_every or self.eval_interval

  @property
  def policy(self) -> rl_steps.PolicySettings:
    return rl_steps.PolicySettings(beta=self.beta, clip=self.clip, clip_high=self.clip_high,
                                   temperature=self.temperature,
                                   off_policy=self.updates_per_batch > 1,
                                   kl_ratio=self.kl_ratio)


# What a checkpoint must agree on to continue the run (the rest may change on resume).
EXECUTION_FIELDS = ("eval_interval", "eval_examples", "log_interval", "checkpoint_every",
                    "progress", "max_iters", "reward_errors", "grad_accum_steps")


class RewardFailed(ValueError):
  """A reward that raised, or returned no finite number, on a completion."""


# reward(prompt, completion, example) -> float (`rewards.load_reward`'s).
Reward = Callable[[Any, str, Dict[str, Any]], float]


def score(reward: Reward, prompts: Sequence[Any], completions: Sequence[str],
          examples: Sequence[Dict[str, Any]], *, errors_score_zero: bool = False
          ) -> Tuple[np.ndarray, int]:
  """Each completion's reward, checked: a finite real number.

  Args:
    prompts, completions, examples: one each per completion.
    errors_score_zero: a reward that raises or returns something else than a finite
      number scores that completion 0 (counted in `failed`); else it stops with a
      `RewardFailed`.

  Returns:
    `(rewards [n] float64, failed: how many scored 0 by an error)`.
  """
  out, failed = np.zeros(len(completions), np.float64), 0
  name = getattr(reward, "__name__", repr(reward))
  for i, (prompt, completion, example) in enumerate(zip(prompts, completions, examples)):
    try:
      value = reward(prompt, completion, example)
    except Exception as e:  # the user's function: any failure is the completion's or stops
      if errors_score_zero:
        failed += 1
        continue
      raise RewardFailed(f"the reward {name} raised {type(e).__name__}: {e} on completion "
                         f"{completion[:60]!r}; fix it, or score such completions 0 "
                         f"(`reward_errors=zero`).") from None
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
      if errors_score_zero:
        failed += 1
        continue
      raise RewardFailed(f"the reward {name} returned {value!r}, not a finite number, on "
                         f"completion {completion[:60]!r}; return a float.")
    out[i] = float(value)
  return out, failed


def encode_prompt(example: rl_tasks.Example, tokenizer, fmt: Optional[chat.ChatFormat]
                  ) -> List[int]:
  """A prompt's ids: messages through the chat template, ready for the assistant's
  turn; text as it is (TRL's two prompt formats)."""
  if isinstance(example.prompt, str):
    return [int(i) for i in tokenizer.encode(example.prompt)]
  if fmt is None:
    raise ValueError("the task's prompts are messages, which need the model's chat "
                     "template; start from an instruct model that has one.")
  return chat.encode(tokenizer, fmt, example.prompt, add_generation_prompt=True)


def sample_groups(eng: engine_lib.Engine, prompts: Sequence[Sequence[int]], num: int,
                  key, *, max_new_tokens: int, temperature: float, top_k: int = 0,
                  top_p: float = 1.0, stop_ids: Sequence[int] = ()
                  ) -> List[decode.Completion]:
  """`num` completions of each prompt through `eng`, prompt-major: completion
  `p * num + s` draws with `decode.completion_key(key, p * num + s)`."""
  results: Dict[Tuple[int, int], decode.Completion] = {}

  def on_event(event, prompt):
    if event.completion is not None:
      results[prompt, event.sample] = event.completion

  for p, ids in enumerate(prompts):
    keys = [decode.completion_key(key, p * num + s) for s in range(num)]
    eng.submit(engine_lib.Request(list(ids), max_new_tokens, keys, temperature, top_k, top_p,
                                  tuple(stop_ids)),
               lambda event, p=p: on_event(event, p))
  while eng.step():
    pass
  return [results[p, s] for p in range(len(prompts)) for s in range(num)]


def rollout_rows(prompts: Sequence[Sequence[int]], completions: Sequence[decode.Completion],
                 group_size: int, length: int) -> Tuple[np.ndarray, np.ndarray]:
  """`(tokens [n, length + 1], mask [n, length])`: each completion after its prompt,
  padded; the mask 1 on the completion's targets (its stop token included)."""
  n = len(completions)
  tokens = np.zeros((n, length + 1), np.int32)
  mask = np.zeros((n, length), np.float32)
  for i, completion in enumerate(completions):
    prompt = prompts[i // group_size]
    row = list(prompt) + list(completion.tokens)
    tokens[i, :len(row)] = row
    mask[i, len(prompt) - 1:len(row) - 1] = 1.0  # target t is token t + 1
  return tokens, mask


def completion_text(tokenizer, completion: decode.Completion, stop_ids: Sequence[int]) -> str:
  return tokenizer.decode([t for t in completion.tokens if t not in stop_ids])


def _prompt_length_check(encoded: Sequence[Sequence[int]], examples, rl: RLConfig,
                         config: gpt.GPTConfig) -> int:
  """The rows' length: the longest prompt and `max_new_tokens`; refuses a prompt that
  leaves no room for them in the model's context."""
  longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
  length = len(encoded[longest]) + rl.max_new_tokens
  if length > config.block_size:
    prompt = examples[longest].prompt
    shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    raise ValueError(f"a prompt of {len(encoded[longest])} tokens ({str(shown)[:50]!r}...) "
                     f"and max_new_tokens={rl.max_new_tokens} exceed the model's context of "
                     f"{config.block_size}; shorten the prompt or lower max_new_tokens.")
  return length


def sampled_params(view: Optional[lora.View]):
  """`trained -> params`: the model's params from the trained ones (a LoRA run's
  `{"base", "adapters"}`), as the engine samples them and the old log-probabilities
  read them: each adapted weight a `LowRankWeight`, `x @ W + s (x @ A) @ B` with base
  and adapters apart, as training reads them. Merging them into one matrix a weight
  would hold the model's matrices again, in float32 beside a quantized base (QLoRA),
  for no faster sampling (`bench/rl_memory.py`)."""
  if view is None:
    return lambda params: params
  return lambda tree: lora.low_rank(tree["base"], tree["adapters"], view.alpha)


def evaluate_policy(eng, model_params, prompts, examples, tokenizer, reward,
                    rl: RLConfig, stop_ids) -> Dict[str, float]:
  """Held-out pass@1 and mean reward of greedy completions (`eng` given `model_params`)."""
  eng.update_params(model_params)
  completions = sample_groups(eng, prompts, 1, jax.random.PRNGKey(0),
                              max_new_tokens=rl.max_new_tokens, temperature=0.0,
                              stop_ids=stop_ids)
  texts = [completion_text(tokenizer, c, stop_ids) for c in completions]
  scores, failed = score(reward, [e.prompt for e in examples], texts,
                                     [e.record for e in examples],
                                     errors_score_zero=rl.reward_errors == "zero")
  return {"val_pass_at_1": float(np.mean(scores >= 1.0)), "val_reward": float(np.mean(scores)),
          "val_completion_tokens": float(np.mean([len(c.tokens) for c in completions]))}


def train_rl(
    params: gpt.Params,
    config: gpt.GPTConfig,
    tokenizer,
    fmt: Optional[chat.ChatFormat],
    task: rl_tasks.Task,
    reward: Reward,
    rl: RLConfig,
    opt_config: optim.OptimizerConfig,
    run: RunConfig,
    *,
    lora_config: Optional[lora.LoraConfig] = None,
    init_from: Optional[str] = None,
    reward_name: Optional[str] = None,
    forms: Optional[kernels.Forms] = None,
    sinks: Sequence[Any] = (),
) -> Dict[str, Any]:
  """Trains `params` on `task` by the rewards of their own samples; returns the last
  evaluation and timing.

  What a run writes to `run.out_dir`: checkpoints (`ckpt_<step>.npz`, resumable with
  `run.resume`: the same prompts and samples follow), `metrics.jsonl` and TensorBoard
  events: per step the mean reward, its spread within groups, the fraction of groups
  with no signal (all scored alike), completion length, KL, clipped fraction, loss,
  gradient norm and times; per evaluation the held-out pass@1.

  Args:
    params, config: the starting model (also the reference of the KL term).
    tokenizer, fmt: its tokenizer and chat format (None: prompts must be text).
    task: prompts to learn from and to evaluate on (`rl_tasks.load_task`).
    reward: `reward(prompt, completion, example) -> float` (`rewards.load_reward`).
    rl: sampling, loss, schedule.
    opt_config: the optimizer.
    run: out_dir, resuming, checkpoints kept.
    lora_config: train LoRA adapters of `params` instead of the params; `params` may
      hold its dense matrices quantized (`quant.hold_matrices`: QLoRA), and the run
      samples from them so, the adapters beside them.
    init_from: where `params` came from, recorded in the checkpoints.
    reward_name: how the reward was given (`--reward`), recorded in the checkpoints.
    forms: how the model runs (None: the platform's, `kernels.select`).
    sinks: further metric sinks (`monitor.Monitor`'s).

  Raises:
    ValueError: a prompt longer than the context allows, prompts of messages without
      a chat template.
    RewardFailed: a reward that fails (with `reward_errors="fail"`).
  """
  forms = forms or kernels.select(kernels.platform_of(params))
  stop_ids = tuple(fmt.stop_ids) if fmt is not None else ()
  val = list(task.val[:rl.eval_examples])
  train_prompts = [encode_prompt(e, tokenizer, fmt) for e in task.train]
  val_prompts = [encode_prompt(e, tokenizer, fmt) for e in val]
  length = _prompt_length_check(train_prompts + val_prompts, list(task.train) + val, rl,
                                config)
  rows = rl.prompts_per_step * rl.group_size
  eng = engine_lib.Engine(
      params, config, engine_lib.EngineConfig(rows=max(rows, min(len(val), 32)), length=length,
                                              prefill_chunk=64, short_prefill_chunks=(16, 32)),
      forms=forms, valid_vocab=tokenizer.vocab_size)
  with folder_lock.hold(run.out_dir, log=runs.print_line):
    keys = state_lib.run_keys(rl.seed)
    opt_config = optim.with_schedule_end(opt_config, rl.max_iters)
    optimizer = optim.RunOptimizer(opt_config, run.skip_nonfinite, lora_config is not None)()
    template, view = state_lib.start_state(params, keys, optimizer, lora_config)
    meta = {"model": "gpt", "config": dataclasses.asdict(config),
            "tokenizer": tokenizer.spec().to_dict(), "optimizer": optim.to_saved(opt_config),
            "batch_size": rows, "seed": rl.seed, "init_from": init_from,
            "rl": {k: v for k, v in dataclasses.asdict(rl).items()
                   if k not in EXECUTION_FIELDS},
            "task": task.name, "reward": reward_name}
    if lora_config is not None:
      meta["lora"] = dataclasses.asdict(lora_config)
    start = runs.start_or_resume(
        run, template, meta, identity=("model", "config", "optimizer", "seed", "lora", "rl",
                                       "task", "reward"),
        saved_defaults={"config": runs.dataclass_defaults(gpt.GPTConfig)},
        ignored={"config": gpt.EXECUTION_FIELDS, "optimizer": ("decay_iters",)})
    state, step = jax.device_put(start.state), start.step
    as_model = sampled_params(view)
    schedule = optim.make_schedule(opt_config)
    # The KL term's reference: LoRA's base (in the state, unchanged), else a copy.
    reference = None
    if rl.beta > 0 and view is None:
      reference = jax.tree.map(jnp.array, params)
    data_key, sample_key = jax.random.split(keys["train"])
    runs.print_line(f"task: {task.source}; reward: {reward_name or reward}; "
                    f"{rl.prompts_per_step} prompts x {rl.group_size} completions a step, "
                    f"up to {rl.max_new_tokens} tokens each")
    if lora_config is not None:
      runs.print_line(f"LoRA: {lora.num_params(state.params['adapters']) / 1e6:.3f}M adapter "
                      f"params train, the base is frozen; {lora_config}")
    update = lambda s, batch, num_tokens: rl_steps.policy_update(
        s, batch, config=config, optimizer=optimizer, policy=rl.policy, forms=forms,
        grad_accum_steps=rl.grad_accum_steps, params_view=view, num_tokens=num_tokens)
    # Rows of a batch without its silent groups: whole groups, in microbatches.
    multiple = math.lcm(rl.group_size, rl.grad_accum_steps)
    errors_zero = rl.reward_errors == "zero"

    def evaluate() -> Dict[str, float]:
      return evaluate_policy(eng, as_model(state.params), val_prompts, val, tokenizer, reward,
                             rl, stop_ids)

    def collect(step: int) -> Tuple[List[decode.Completion], np.ndarray, int, List[List[int]],
                                    float]:
      """Step `step`'s prompts, their sampled completions and rewards."""
      began = time.perf_counter()
      n_train = len(task.train)
      picked = np.asarray(jax.random.choice(
          jax.random.fold_in(data_key, step), n_train, (rl.prompts_per_step,),
          replace=n_train < rl.prompts_per_step))
      prompts = [train_prompts[i] for i in picked]
      examples = [task.train[i] for i in picked]
      eng.update_params(as_model(state.params))
      completions = sample_groups(
          eng, prompts, rl.group_size, jax.random.fold_in(sample_key, step),
          max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_k=rl.top_k,
          top_p=rl.top_p, stop_ids=stop_ids)
      texts = [completion_text(tokenizer, c, stop_ids) for c in completions]
      per = lambda xs: [x for x in xs for _ in range(rl.group_size)]
      scores, failed = score(reward, per([e.prompt for e in examples]), texts,
                                         per([e.record for e in examples]),
                                         errors_score_zero=errors_zero)
      return completions, scores, failed, prompts, time.perf_counter() - began

    def log_eval(step: int, values: Dict[str, float]) -> None:
      session.log(f"step {step:5d} | held-out pass@1 {values['val_pass_at_1']:.3f} | "
                  f"reward {values['val_reward']:.3f}")
      session.record.add_eval(step, None, {"step": step, **values}, **values)

    # The first evaluation and samples are scored before anything is written: a reward
    # that fails on them stops the run with the folder as it was.
    first_eval = evaluate() if step % rl.eval_interval == 0 and not any(
        h.get("step") == step for h in start.saved.get("history", [])[-1:]) else None
    pending = collect(step) if step < rl.max_iters else None
    with Session([Recorded(run, meta, start.saved, sinks)], total=rl.max_iters, start=step,
                 bar=rl.progress) as session:
      last = {}
      if first_eval is not None:
        log_eval(step, first_eval)
        last = first_eval
      while step < rl.max_iters:
        if step % rl.eval_interval == 0 and not session.record.evaluated_at(step):
          last = evaluate()
          log_eval(step, last)
        completions, scores, failed, prompts, sample_s = pending or collect(step)
        pending = None
        began = time.perf_counter()
        tokens, mask = rollout_rows(prompts, completions, rl.group_size, length)
        advantages = np.asarray(preference.group_advantages(
            jnp.asarray(scores, jnp.float32), rl.group_size, scale=rl.scale_rewards))
        zeros = np.zeros(mask.shape, np.float32)
        batch = rl_steps.Rollouts(tokens, mask, advantages, zeros, zeros)
        num_tokens = jnp.float32(mask.sum())
        if rl.beta == 0:  # no KL: the groups without signal add nothing; leave them out
          batch = rl_steps.drop_silent_groups(batch, rl.group_size, multiple)
        if batch is None:
          for _ in range(rl.updates_per_batch):
            state = rl_steps.zero_update(state, optimizer=optimizer)
          metrics = rl_steps.UpdateMetrics(*(jnp.zeros(()),) * 4)
        else:
          batch = jax.tree.map(jnp.asarray, batch)
          if rl.updates_per_batch > 1:
            batch = batch._replace(old_logps=rl_steps.batch_token_logps(
                as_model(state.params), batch.tokens, config, forms, rl.temperature))
          if rl.beta > 0:
            ref_params = reference if reference is not None else state.params["base"]
            batch = batch._replace(ref_logps=rl_steps.batch_token_logps(
                ref_params, batch.tokens, config, forms, rl.temperature))
          for _ in range(rl.updates_per_batch):
            state, metrics = update(state, batch, num_tokens)
        loss = float(metrics.loss)
        session.record.check_finite(np.asarray([loss]), step)
        step += 1
        values = {
            **{k: float(v) for k, v in preference.group_stats(jnp.asarray(scores),
                                                              rl.group_size).items()},
            "reward_failed": failed, "loss": loss, "grad_norm": float(metrics.grad_norm),
            "kl": float(metrics.kl), "clipped": float(metrics.clipped),
            "completion_tokens": float(np.mean([len(c.tokens) for c in completions])),
            "stopped": float(np.mean([c.stopped for c in completions])),
            "sample_s": sample_s, "update_s": time.perf_counter() - began,
            "lr": float(schedule(step - 1))}
        session.progress.update_to(step, reward=values["reward"])
        if runs.every(rl.log_interval, step, rl.max_iters):
          session.record.monitor.log_train(step, **values)
          session.log(f"step {step:5d} | reward {values['reward']:.3f} (spread "
                      f"{values['reward_spread']:.3f}, no signal {values['no_signal']:.2f}) | "
                      f"loss {loss:.4f} | kl {values['kl']:.4f} | "
                      f"{values['completion_tokens']:.1f} tokens | sample "
                      f"{values['sample_s']:.1f} s, update {values['update_s']:.1f} s")
        if runs.every(rl.eval_interval, step, rl.max_iters):
          last = evaluate()
          log_eval(step, last)
        session.save_if(runs.every(rl.checkpoint_interval, step, rl.max_iters), step, state)
    return {"step": step, **last}
