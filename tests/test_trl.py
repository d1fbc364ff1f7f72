"""DPO's and GRPO's losses and gradients equal TRL's trainers' on the same weights and batch.

DPO: the batch is TRL's own: its collator tokenizes and pads the pairs, and
`DPOTrainer` computes the loss (`_compute_loss`) and, by torch's autograd, the
policy's gradient; purejax reads the same ids and completion masks as rows and
weights, the same weights through its Hugging Face loader, and the reference's
log-probabilities as a run computes them before training (`preference.pair_logps`).

GRPO: prompts, completions, advantages, old and reference log-probabilities given
to `GRPOTrainer._compute_loss` (TRL's default "dapo" loss: token-level over the
batch) and to purejax's policy loss (`rl_steps.token_logps`, `preference.policy_loss`).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.data import need
from purejax.data import batches
from purejax.ops import kernels
from purejax.training.pure import preference
from purejax.training.pure import rl_steps
from purejax.weights import llama
from real_model import smollm2_folder  # noqa: F401  (the fixture)

FORMS = kernels.select("cpu")


def word_tokenizer(vocab_size):
  """A word-level tokenizer of `t0 .. t{vocab - 1}` (pad t0, EOS t1)."""
  tokenizers = need("tokenizers")
  transformers = need("transformers")
  model = tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t2")
  tk = tokenizers.Tokenizer(model)
  tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1",
                                              pad_token="t0")


def random_pairs(n, vocab_size, seed=0):
  rnd = np.random.default_rng(seed)
  words = lambda k: " ".join(f"t{i}" for i in rnd.integers(3, vocab_size, k))
  return [{"prompt": words(rnd.integers(2, 6)), "chosen": " " + words(rnd.integers(1, 6)),
           "rejected": " " + words(rnd.integers(1, 6))} for _ in range(n)]


def trl_loss_and_grads(policy, ref, tokenizer, pairs, tmp_path, **dpo_args):
  """TRL's DPO loss of `pairs` (one batch), its policy gradients, and the batch."""
  datasets = need("datasets")
  trl = need("trl")
  args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(pairs),
                       report_to=[], use_cpu=True, bf16=False, **dpo_args)
  trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args,
                           train_dataset=datasets.Dataset.from_list(pairs),
                           processing_class=tokenizer)
  batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])
  policy.train()
  loss = trainer._compute_loss(policy, batch, return_outputs=False)
  loss.backward()
  grads = {name: p.grad.numpy() for name, p in policy.named_parameters()}
  return float(loss), grads, batch


def purejax_loss_and_grads(policy, ref, batch, dpo):
  """purejax's DPO loss and gradients of TRL's batch, in Hugging Face's names' layout."""
  ids = batch["input_ids"].numpy()
  mask = batch["completion_mask"].numpy().astype(np.float32)
  config = llama.config_from_hf(policy.config.to_dict())
  config = dataclasses.replace(config, block_size=ids.shape[1] - 1)
  state = lambda model: {k: v.detach().numpy() for k, v in model.state_dict().items()}
  params, ref_params = (jax.tree.map(jnp.asarray, llama.params_from_state(
      state(m), config, source="test")) for m in (policy, ref))
  n = ids.shape[0] // 2  # TRL's batch: the chosen rows, then the rejected ones
  rows = np.stack([ids[:n], ids[n:]], axis=1)  # [pairs, 2, time]
  weights = np.stack([mask[:n, 1:], mask[n:, 1:]], axis=1)  # target t is token t + 1
  reference, _ = preference.pair_logps(ref_params, rows, weights, config, forms=FORMS,
                                       batch_size=n)
  pairs = batches.PairBatch(jnp.asarray(rows), jnp.asarray(weights), jnp.asarray(reference))
  loss, grads = jax.value_and_grad(lambda p: dpo(p, pairs, config, forms=FORMS))(params)
  return float(loss), grads, config


def assert_same(trl_grads, loss, grads, want_loss, config):
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  # TRL's gradients through the same loader (linear: transposes, stacking, fusing).
  want = llama.params_from_state(trl_grads, config, source="TRL's gradients")
  for (path, got), ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
    error = np.max(np.abs(np.asarray(got) - ref)) / np.max(np.abs(ref))
    assert error <= 1e-4, (jax.tree_util.keystr(path), error)


CASES = {
    "sigmoid": (dict(beta=0.1), preference.DPO(beta=0.1)),
    "ipo": (dict(beta=0.3, loss_type=["ipo"]), preference.DPO(beta=0.3, loss_type="ipo")),
    "sigmoid+sft": (dict(beta=0.1, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
                    preference.DPO(beta=0.1, sft_weight=0.5)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_random_llama_has_trls_loss_and_gradients(tmp_path, case):
  torch = need("torch")
  transformers = need("transformers")
  vocab = 64
  config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False)
  torch.manual_seed(0)
  policy, ref = (transformers.LlamaForCausalLM(config).float() for _ in range(2))
  trl_args, dpo = CASES[case]
  want_loss, trl_grads, batch = trl_loss_and_grads(
      policy, ref, word_tokenizer(vocab), random_pairs(4, vocab), tmp_path, **trl_args)
  assert batch["completion_mask"].sum() > 0
  loss, grads, config = purejax_loss_and_grads(policy, ref, batch, dpo)
  assert_same(trl_grads, loss, grads, want_loss, config)


@pytest.mark.slow
@pytest.mark.budget(25)
def test_the_real_smollm2_has_trls_loss_and_gradients(tmp_path, smollm2_folder):
  torch = need("torch")
  transformers = need("transformers")
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_folder),
                                                          dtype=torch.float32)
  policy = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_folder),
                                                             dtype=torch.float32)
  torch.manual_seed(0)
  with torch.no_grad():  # a policy a few steps away from its reference
    for p in policy.parameters():
      p.add_(1e-3 * torch.randn_like(p))
  # torch's nn.Embedding gives its padding_idx row no gradient from lookups; SmolLM2's pad
  # id is its <|im_end|>, which the answers hold, so that row's gradient would lack their
  # share. The loss is the same either way; the gradient compared is the loss's whole.
  assert policy.model.embed_tokens.padding_idx == 2
  policy.model.embed_tokens.padding_idx = None
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_folder))
  pairs = [
      {"prompt": [{"role": "user", "content": "What is 12 + 30?"}],
       "chosen": [{"role": "assistant", "content": "42."}],
       "rejected": [{"role": "assistant", "content": "It is 52, I think."}]},
      {"prompt": [{"role": "user", "content": "Name a primary colour."}],
       "chosen": [{"role": "assistant", "content": "Blue."}],
       "rejected": [{"role": "assistant", "content": "Green is one."}]},
  ]
  want_loss, trl_grads, batch = trl_loss_and_grads(policy, ref, tokenizer, pairs, tmp_path,
                                                   beta=0.1)
  loss, grads, config = purejax_loss_and_grads(policy, ref, batch, preference.DPO(beta=0.1))
  assert abs(loss - np.log(2)) > 1e-3  # the policy differs from its reference
  assert_same(trl_grads, loss, grads, want_loss, config)


# ----------------------------------------------------------------------------
# GRPO


def grpo_batch(vocab, n=4, prompt_len=3, completion_len=6, seed=0):
  """Prompts, completions (two ended early) and advantages, as TRL's tensors."""
  torch = need("torch")
  rnd = np.random.default_rng(seed)
  prompt_ids = torch.tensor(rnd.integers(3, vocab, (n, prompt_len)))
  completion_ids = torch.tensor(rnd.integers(3, vocab, (n, completion_len)))
  completion_mask = torch.ones(n, completion_len, dtype=torch.long)
  completion_mask[1, 4:] = 0
  completion_mask[3, 2:] = 0
  advantages = torch.tensor(rnd.normal(size=n), dtype=torch.float32)
  return prompt_ids, completion_ids, completion_mask, advantages


def completion_logps(model, ids, prompt_len):
  torch = need("torch")
  with torch.no_grad():
    logits = model(ids).logits[:, prompt_len - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_len:, None])[..., 0]


def trl_grpo(folder, tokenizer, tmp_path, batch, *, off_policy, noise=0.02, **grpo_args):
  """TRL's GRPO loss of `batch` and the policy's gradients; the policy is `folder`'s
  model moved by `noise`, the reference `folder`'s."""
  torch = need("torch")
  datasets = need("datasets")
  trl = need("trl")
  args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                        num_generations=4, report_to=[], use_cpu=True, bf16=False,
                        max_completion_length=8, temperature=1.0, **grpo_args)
  zero = lambda completions, **_: [0.0] * len(completions)
  trainer = trl.GRPOTrainer(model=str(folder), reward_funcs=zero, args=args,
                            processing_class=tokenizer,
                            train_dataset=datasets.Dataset.from_list([{"prompt": "t5"}] * 8))
  policy = trainer.model
  if getattr(policy.model.embed_tokens, "padding_idx", None) is not None:
    policy.model.embed_tokens.padding_idx = None  # (the whole gradient: see above)
  torch.manual_seed(1)
  with torch.no_grad():
    for p in policy.parameters():
      p.add_(noise * torch.randn_like(p))
  prompt_ids, completion_ids, completion_mask, advantages = batch
  ids = torch.cat([prompt_ids, completion_ids], 1)
  p = prompt_ids.shape[1]
  inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": advantages, "num_items_in_batch": completion_mask.sum()}
  old = None
  if off_policy:  # a policy a little away from the one being trained
    rnd = np.random.default_rng(2)
    old = completion_logps(policy, ids, p) + torch.tensor(
        0.05 * rnd.normal(size=completion_ids.shape), dtype=torch.float32)
    inputs["old_per_token_logps"] = old
  ref = None
  if trainer.beta:
    ref = completion_logps(trainer.ref_model, ids, p)
    inputs["ref_per_token_logps"] = ref
  policy.train()
  trainer.current_gradient_accumulation_steps = 1  # (its training loop sets it)
  loss = trainer._compute_loss(policy, inputs)
  loss.backward()
  grads = {name: q.grad.numpy() for name, q in policy.named_parameters()}
  return float(loss), grads, policy, ids.numpy(), old, ref


def purejax_grpo(policy, ids, batch, old, ref, settings: rl_steps.PolicySettings):
  _, _, completion_mask, advantages = batch
  n, p = ids.shape[0], batch[0].shape[1]
  config = dataclasses.replace(llama.config_from_hf(policy.config.to_dict()),
                               block_size=ids.shape[1] - 1)
  state = {k: v.detach().numpy() for k, v in policy.state_dict().items()}
  params = jax.tree.map(jnp.asarray, llama.params_from_state(state, config, source="test"))
  # Completion token c of a row is the target at position p - 1 + c.
  widen = lambda a: np.concatenate([np.zeros((n, p - 1), np.float32),
                                    np.asarray(a, np.float32)], axis=1)
  mask = widen(completion_mask.numpy())
  old = None if old is None else jnp.asarray(widen(old.numpy()))
  ref = None if ref is None else jnp.asarray(widen(ref.numpy()))

  def loss(params):
    logps = rl_steps.token_logps(params, jnp.asarray(ids), config, forms=FORMS)
    return preference.policy_loss(logps, old, jnp.asarray(advantages.numpy()),
                                  jnp.asarray(mask), ref_logps=ref, beta=settings.beta,
                                  clip=settings.clip, clip_high=settings.clip_high,
                                  kl_ratio=settings.kl_ratio)[0]

  value, grads = jax.value_and_grad(loss)(params)
  return float(value), grads, config


GRPO_CASES = {
    # nanochat's: one update per batch, no KL.
    "on-policy": (dict(beta=0.0), False, rl_steps.PolicySettings()),
    # TRL's defaults with a KL term: clip 0.2/0.28, the KL weighed by the ratio.
    "clipped+kl": (dict(beta=0.04, epsilon=0.2, epsilon_high=0.28), True,
                   rl_steps.PolicySettings(beta=0.04, clip=0.2, clip_high=0.28,
                                           kl_ratio=True)),
    "kl without the ratio": (dict(beta=0.1, use_bias_correction_kl=False), True,
                             rl_steps.PolicySettings(beta=0.1, kl_ratio=False)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_a_random_llama_has_trls_grpo_loss_and_gradients(tmp_path, case):
  torch = need("torch")
  transformers = need("transformers")
  vocab = 64
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      tie_word_embeddings=False)).save_pretrained(tmp_path / "model")
  trl_args, off_policy, settings = GRPO_CASES[case]
  batch = grpo_batch(vocab)
  want_loss, trl_grads, policy, ids, old, ref = trl_grpo(
      tmp_path / "model", word_tokenizer(vocab), tmp_path / "trl", batch,
      off_policy=off_policy, **trl_args)
  loss, grads, config = purejax_grpo(policy, ids, batch, old, ref, settings)
  assert_same(trl_grads, loss, grads, want_loss, config)


@pytest.mark.slow
@pytest.mark.budget(20)
def test_the_real_smollm2_has_trls_grpo_loss_and_gradients(tmp_path, smollm2_folder):
  transformers = need("transformers")
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_folder))
  batch = grpo_batch(1000, prompt_len=5, completion_len=8, seed=3)
  want_loss, trl_grads, policy, ids, old, ref = trl_grpo(
      smollm2_folder, tokenizer, tmp_path / "trl", batch, off_policy=True, noise=1e-3,
      beta=0.04, epsilon=0.2, epsilon_high=0.28)
  loss, grads, config = purejax_grpo(policy, ids, batch, old, ref, rl_steps.PolicySettings(
      beta=0.04, clip=0.2, clip_high=0.28, kl_ratio=True))
  assert_same(trl_grads, loss, grads, want_loss, config)
