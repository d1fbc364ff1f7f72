"""DPO's loss and gradients equal TRL's `DPOTrainer`'s on the same weights and batch.

The batch is TRL's own: its collator tokenizes and pads the pairs, and its trainer
computes the loss (`_compute_loss`) and, by torch's autograd, the policy's gradient;
purejax reads the same ids and completion masks as rows and weights, the same weights
through its Hugging Face loader, and the reference's log-probabilities as a run
computes them before training (`preference.pair_logps`).
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
