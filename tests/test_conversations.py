"""Fine-tuning on conversations: the loss counts the assistant's tokens only.

A character tokenizer and a small ChatML-like template stand in for a real
model here (fast); tests/test_chat_finetune.py does it with SmolLM2.
"""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.models import stacked_sweep_state
from purejax import gpt
from purejax.cli import train as train_cli
from purejax.data import batches, chat, conversations, tokenizers
from purejax.ops import kernels
from purejax.ops.loss import cross_entropy
from purejax.optimizers import optim
from purejax.training.effects import runs
from purejax.training.loops import gpt_loop
from purejax.training.pure import steps
from purejax.training.pure.state import TrainState

TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}|\n{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")
CHARS = "<>|\nasuy" + "abcdefghijklmnopqrstuvwxyz ?.!"
TOKENIZER = tokenizers.CharTokenizer("".join(dict.fromkeys(CHARS)))
FMT = chat.ChatFormat(TEMPLATE, stop_ids=(TOKENIZER.encode("|")[0],))
TALK = [{"role": "system", "content": "be brief."},
        {"role": "user", "content": "hi?"},
        {"role": "assistant", "content": "hello."},
        {"role": "user", "content": "name?"},
        {"role": "assistant", "content": "bob!"}]


def marked(ids, weights):
  return TOKENIZER.decode([i for i, w in zip(ids, weights) if w])


def test_the_assistant_tokens_are_its_answers_through_their_stop_token():
  ids, weights = conversations.assistant_tokens(TOKENIZER, FMT, TALK)
  assert TOKENIZER.decode(ids) == "<s>be brief.|\n<u>hi?|\n<a>hello.|\n<u>name?|\n<a>bob!|\n"
  # The header "<a>" is the prompt; the "\n" after the stop token is never generated.
  assert marked(ids, weights) == "hello.|bob!|"


def test_an_answer_without_a_stop_token_is_marked_to_the_end_of_its_turn():
  fmt = dataclasses.replace(FMT, stop_ids=())
  ids, weights = conversations.assistant_tokens(TOKENIZER, fmt, TALK)
  assert marked(ids, weights) == "hello.|\nbob!|\n"


def write_chats(path, talks):
  path.write_text("".join(json.dumps({"messages": t}) + "\n" for t in talks))
  return str(path)


def test_rows_are_padded_and_weights_align_with_the_targets(tmp_path):
  data = conversations.load_conversations(write_chats(tmp_path / "c.jsonl", [TALK, TALK[1:3]]),
                                          TOKENIZER, FMT, block_size=48)
  rows, weights = data.train
  assert rows.shape == (2, 49) and weights.shape == (2, 48)
  ids, token_weights = conversations.assistant_tokens(TOKENIZER, FMT, TALK[1:3])
  np.testing.assert_array_equal(rows[1, :len(ids)], ids)
  assert not weights[1, len(ids) - 1:].any()  # padding counts for nothing
  assert TOKENIZER.decode(rows[1, 1:][weights[1] > 0]) == "hello.|"
  assert data.val is data.train and "evaluated on the training ones" in data.source


@pytest.mark.parametrize("line, message", [
    ("{not json", "c.jsonl:2 is not JSON"),
    ('{"text": "hi"}', 'c.jsonl:2 needs {"messages"'),
    ('{"messages": [{"role": "assistant", "content": "hi."}]}',
     "conversation 2: the conversation begins with an assistant message"),
])
def test_bad_lines_are_named_in_one_line(tmp_path, line, message):
  path = tmp_path / "c.jsonl"
  path.write_text(json.dumps({"messages": TALK}) + "\n" + line + "\n")
  with pytest.raises(conversations.ConversationError, match=message[:30].replace("{", ".")
                     .replace("[", ".").replace("(", ".")):
    conversations.load_conversations(str(path), TOKENIZER, FMT, block_size=48)


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
def test_a_runs_closing_sample_continues_a_users_turn_until_the_end_of_turn(tmp_path):
  # The first held-out conversation (else the first), up to its first answer.
  data = conversations.load_conversations(write_chats(tmp_path / "c.jsonl", [TALK]),
                                          TOKENIZER, FMT, block_size=48)
  prompt, stops = data.sample_prompt()
  assert TOKENIZER.decode(prompt) == "<s>be brief.|\n<u>hi?|\n<a>" and stops == FMT.stop_ids
  talks = [TALK] * 9 + [TALK[3:4] + TALK[2:3]]  # ten: the last is held out
  data = conversations.load_conversations(write_chats(tmp_path / "d.jsonl", talks),
                                          TOKENIZER, FMT, block_size=48)
  assert TOKENIZER.decode(data.sample_prompt()[0]) == "<u>name?|\n<a>"
  sample = gpt_loop.sample_text(gpt.init_params(CONFIG, jax.random.PRNGKey(0)), TOKENIZER,
                                CONFIG, jax.random.PRNGKey(1), 30, prompt, stop_ids=stops)
  assert sample.startswith("<s>be brief.|\n<u>hi?|\n<a>")
  answer = sample[len("<s>be brief.|\n<u>hi?|\n<a>"):]
  assert "|" not in answer[:-1] and (answer.endswith("|") or len(answer) == 30)


def test_the_command_line_wants_a_model_with_a_chat_template(tmp_path, capsys):
  code = train_cli.run(["train", f"--dataset={write_chats(tmp_path / 'c.jsonl', [TALK])}",
                        f"--out_dir={tmp_path / 'out'}", "--max_iters=1"])
  err = capsys.readouterr().err.strip()
  assert code == 1 and len(err.splitlines()) == 1
  assert "holds conversations" in err and "--init_from" in err


CONFIG = gpt.GPTConfig(vocab_size=TOKENIZER.vocab_size, block_size=48, n_layer=1, n_head=2,
                       n_embd=16, dropout=0.0, bias=False)
FORMS = kernels.select("cpu")


def rows_of(tmp_path):
  data = conversations.load_conversations(
      write_chats(tmp_path / "c.jsonl", [TALK, TALK[1:3], TALK[:1] + TALK[3:]]), TOKENIZER,
      FMT, block_size=CONFIG.block_size)
  return data, batches.DeviceRows(*map(jnp.asarray, data.train))


@pytest.mark.slow
def test_user_tokens_get_no_gradient(tmp_path):
  _, rows = rows_of(tmp_path)
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(0))
  x, y, w = rows.rows[:, :-1], rows.rows[:, 1:], batches.normalized_weights(rows.weights)
  # Whatever the targets of the weight-0 positions are, loss and gradient are the same...
  other = jnp.where(w > 0, y, (y + 7) % CONFIG.vocab_size)
  grad = jax.jit(lambda targets: jax.value_and_grad(gpt.loss)(
      params, x, targets, CONFIG, weights=w, forms=FORMS))
  chex.assert_trees_all_close(grad(y), grad(other), atol=0, rtol=0)
  # ...and each position's logits get gradient exactly where its target is weighted.
  logits = gpt.forward(params, x, CONFIG, forms=FORMS)
  g = jax.grad(cross_entropy)(logits, y, w)
  np.testing.assert_array_equal(np.abs(g).sum(-1) > 0, np.asarray(w) > 0)
  # The weighted loss is the mean over the assistant's targets.
  per_target = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)[..., 0]
  np.testing.assert_allclose(gpt.loss(params, x, y, CONFIG, weights=w, forms=FORMS),
                             per_target[rows.weights > 0].mean(), rtol=1e-5)


@pytest.mark.slow
def test_chunked_loss_weighs_as_the_plain_one(tmp_path):
  _, rows = rows_of(tmp_path)
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(1))
  x, y, w = rows.rows[:, :-1], rows.rows[:, 1:], batches.normalized_weights(rows.weights)
  chunked = dataclasses.replace(FORMS, loss_chunk_rows=16, loss_chunk_min_logits=1)
  value = lambda forms: jax.jit(jax.value_and_grad(gpt.loss), static_argnums=3,
                                static_argnames="forms")(params, x, y, CONFIG, weights=w,
                                                         forms=forms)
  chex.assert_trees_all_close(value(chunked), value(FORMS), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_microbatches_average_to_the_whole_batch_mean(tmp_path):
  _, rows = rows_of(tmp_path)
  optimizer = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-2, warmup_iters=0, schedule="constant"))
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(0))

  def run(accum):
    state = TrainState(params, optimizer.init(params), {"train": jax.random.PRNGKey(3)})
    state = jax.tree.map(jnp.copy, state)  # (donated)
    return steps.train_steps(state, rows, 0, config=CONFIG, optimizer=optimizer,
                             batch_size=4, num_steps=3, forms=FORMS, grad_accum_steps=accum)

  (one, m1), (two, m2) = run(1), run(2)
  chex.assert_trees_all_close(m1, m2, rtol=2e-5)
  chex.assert_trees_all_close(one.params, two.params, rtol=1e-4, atol=1e-5)  # (Adam scales rounding up)


@pytest.mark.slow
def test_a_conversation_run_resumes_exactly(tmp_path):
  data, _ = rows_of(tmp_path)
  train = lambda steps_: gpt_loop.GPTTrainConfig(batch_size=4, max_iters=steps_, eval_interval=2,
                                             eval_iters=1, log_interval=2, steps_per_call=2,
                                             sample_tokens=0)
  opt = optim.OptimizerConfig(learning_rate=1e-2, warmup_iters=0, decay_iters=4)
  whole = gpt_loop.train_gpt(CONFIG, data, train(4), opt, runs.RunConfig(str(tmp_path / "a")))
  gpt_loop.train_gpt(CONFIG, data, train(2), opt, runs.RunConfig(str(tmp_path / "b")))
  resumed = gpt_loop.train_gpt(CONFIG, data, train(4), opt,
                           runs.RunConfig(str(tmp_path / "b"), resume=True))
  assert resumed == {**whole, "ms_per_iter": resumed["ms_per_iter"]}
  assert whole["train_loss"] < 3.5  # it learns (ln(vocab) is 3.6)


@pytest.mark.slow
def test_a_sweep_trains_on_conversations_as_each_run_alone(tmp_path):
  from purejax.training.pure import sweep
  _, rows = rows_of(tmp_path)
  base = optim.OptimizerConfig(learning_rate=1e-2, warmup_iters=0, schedule="constant")
  specs = sweep.expand(base, seed=0, grid={"learning_rate": (1e-2, 3e-2)})
  make = optim.RunOptimizer(base)
  state = stacked_sweep_state(CONFIG, specs, make)
  _, metrics = sweep.train_steps(state, rows, 0, sweep.hyperparams(specs), config=CONFIG,
                                 make_optimizer=make, batch_size=4, num_steps=3,
                                 forms=FORMS, sweep_batch=0)
  for i, spec in enumerate(specs):
    optimizer = optim.make_optimizer(spec.opt_config)
    params_key, train_key = jax.random.split(jax.random.PRNGKey(spec.seed))  # as the sweep's
    own = gpt.init_params(CONFIG, params_key)  # (the sweep's state was donated)
    alone = TrainState(own, optimizer.init(own), {"train": train_key})
    _, solo = steps.train_steps(alone, rows, 0, config=CONFIG, optimizer=optimizer,
                                batch_size=4, num_steps=3, forms=FORMS)
    np.testing.assert_allclose(metrics.loss[i], solo.loss, rtol=1e-4)
