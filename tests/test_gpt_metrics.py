"""Bits per byte: every evaluation's val loss per UTF-8 byte of the text it scored.

Each test scores fixed windows with a small random GPT and compares
`gpt_metrics.bits_per_byte` with the direct computation: every target token's
cross-entropy from the logits, summed, over the bytes of the targets' text
as the tokenizer decodes it.
"""

import jax
import numpy as np

from helpers.data import tiny_ranks, train_tokenizer_json, write_tiktoken_file
from helpers.models import CPU_FORMS
from purejax import gpt
from purejax.data import batches
from purejax.data import tokenizers
from purejax.training.loops import gpt_loop
from purejax.training.loops import gpt_metrics
from purejax.training.pure import steps

TEXT = ("Ça va? Très bien — naïve café, 東京 and 🚀 rockets.\n" * 8
        + "the other thing, the ring in the outer reach\n" * 8)
BATCH, BLOCK, NUM_BATCHES = 3, 12, 2


def windows_of(ids, seed=0):
  """`[NUM_BATCHES, BATCH, BLOCK + 1]` windows of `ids` at fixed random starts."""
  starts = np.random.default_rng(seed).integers(0, len(ids) - BLOCK - 1,
                                                (NUM_BATCHES, BATCH))
  return np.stack([[ids[s:s + BLOCK + 1] for s in row] for row in starts]).astype(np.int32)


def direct_bits_per_byte(params, config, windows, text_bytes):
  """Every target's loss from the logits, summed, over the bytes the targets decode to."""
  nats, num_bytes = 0.0, 0
  forward = jax.jit(lambda p, x: gpt.forward(p, x, config, forms=CPU_FORMS))
  for batch in windows:
    logits = forward(params, batch[:, :-1])
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    targets = batch[:, 1:]
    nats -= float(np.sum(np.take_along_axis(np.asarray(logp), targets[..., None], -1)))
    num_bytes += sum(text_bytes(row) for row in targets)
  return nats / np.log(2) / num_bytes


def library_bits_per_byte(params, config, windows, tokenizer):
  train = gpt_loop.GPTTrainConfig(batch_size=BATCH, eval_iters=NUM_BATCHES)
  tokens = batches.HostWindows(windows)
  loss = float(steps.evaluate(params, tokens, jax.random.PRNGKey(0), config=config,
                              batch_size=BATCH, num_batches=NUM_BATCHES, forms=CPU_FORMS))
  return gpt_metrics.bits_per_byte(loss, tokens, jax.random.PRNGKey(0),
                            tokenizers.byte_lengths(tokenizer), config, train)


def model_for(tokenizer):
  config = gpt.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=1,
                         n_head=2, n_embd=16)
  return gpt.init_params(config, jax.random.PRNGKey(1)), config


def test_a_char_tokenizers_bits_per_byte_counts_each_characters_utf8_bytes():
  tokenizer = tokenizers.CharTokenizer.from_text(TEXT)
  lengths = tokenizers.byte_lengths(tokenizer)
  assert lengths[tokenizer.encode("a")[0]] == 1 and lengths[tokenizer.encode("é")[0]] == 2
  assert lengths[tokenizer.encode("東")[0]] == 3 and lengths[tokenizer.encode("🚀")[0]] == 4
  params, config = model_for(tokenizer)
  windows = windows_of(tokenizer.encode(TEXT))
  direct = direct_bits_per_byte(params, config, windows,
                                lambda row: len(tokenizer.decode(row).encode("utf-8")))
  np.testing.assert_allclose(library_bits_per_byte(params, config, windows, tokenizer),
                             direct, rtol=1e-5)


def test_a_bpe_tokenizers_bits_per_byte_counts_its_tokens_bytes(tmp_path):
  tokenizer = tokenizers.bpe_tokenizer(str(write_tiktoken_file(tmp_path / "tiny.tiktoken",
                                                               tiny_ranks())))
  lengths = tokenizers.byte_lengths(tokenizer)
  assert lengths[tokenizer.eot_id] == 0  # <|endoftext|> stands for no text
  ids = np.concatenate([tokenizer.encode(TEXT[:300]), [tokenizer.eot_id],
                        tokenizer.encode(TEXT[300:])])
  params, config = model_for(tokenizer)
  windows = windows_of(ids, seed=3)
  # A window may cut a character's bytes; the bytes are counted as decoded.
  direct = direct_bits_per_byte(params, config, windows,
                                lambda row: len(tokenizer.encoding.decode_bytes(row.tolist())))
  np.testing.assert_allclose(library_bits_per_byte(params, config, windows, tokenizer),
                             direct, rtol=1e-5)


def test_a_tokenizer_json_counts_byte_level_tokens_as_their_bytes(tmp_path):
  from purejax.data import tokenizer_json
  tokenizer = tokenizer_json.load(str(train_tokenizer_json(tmp_path, TEXT)))
  lengths = tokenizers.byte_lengths(tokenizer)
  ids = tokenizer.encode(TEXT)
  assert int(np.sum(lengths[ids])) == len(TEXT.encode("utf-8"))
  assert lengths[tokenizer.tokenizer.token_to_id("</s>")] == 0


def test_the_device_drawn_val_batches_count_the_bytes_evaluate_scores():
  tokenizer = tokenizers.CharTokenizer.from_text(TEXT)
  ids = jax.numpy.asarray(tokenizer.encode(TEXT))
  key = jax.random.PRNGKey(7)
  counts = steps.target_bytes(batches.DeviceTokens(ids), key,
                              tokenizers.byte_lengths(tokenizer), block_size=BLOCK,
                              batch_size=BATCH, num_batches=NUM_BATCHES)
  # evaluate's batch i is drawn with the i-th of NUM_BATCHES keys split from its key
  expected = [sum(len(tokenizer.decode(row).encode("utf-8")) for row in
                  np.asarray(batches.sample_batch(k, ids, BLOCK, BATCH)[1]))
              for k in jax.random.split(key, NUM_BATCHES)]
  assert np.asarray(counts).tolist() == expected
