"""`python -m purejax.chat`: a conversation typed on stdin, answered by a real instruct model.

The slow tests run the command line in-process on SmolLM2-135M-Instruct's
folder, with greedy decoding, reading the lines a user types; the fast ones
check its one-line refusals.
"""

import io
import json
import re

import pytest

from helpers.cli import refusal
from helpers.data import SHAKESPEARE, train_tokenizer_json
from purejax.cli import chat as chat_cli
from purejax.cli import sample
from purejax.data import chat
from purejax.data import tokenizer_json
from real_model import smollm2_folder, smollm2_gguf  # noqa: F401  (the fixtures)

QUESTION = "What is the capital of France?"
STATS = re.compile(r"\[fed (\d+) tokens, decoded (\d+), ")


class Typed(io.StringIO):
  """Lines typed at a terminal: stdin that says it is a tty."""

  def isatty(self):
    return True


def converse(folder, lines, *flags):
  out = io.StringIO()
  code = chat_cli.run(["chat", f"--init_from={folder}", "--temperature=0", "--stats",
                       "--max_new_tokens=40", *flags], stdin=Typed("".join(lines)), stdout=out)
  return code, out.getvalue()


@pytest.mark.budget(30)
@pytest.mark.slow
def test_answers_each_turn_once_feeding_only_its_own_tokens(smollm2_folder, capsys):
  capsys.readouterr()
  follow_up = "And of Italy?"
  code, out = converse(smollm2_folder, [QUESTION + "\n", follow_up + "\n", "/reset\n",
                                        QUESTION + "\n"])
  err = capsys.readouterr().err
  assert code == 0, err[-2000:]
  # Each turn: a "> " prompt, one answer line; /reset says so; Ctrl-D (end of input) ends.
  turns = out.split("> ")
  assert turns[0] == "" and turns[-1] == ""
  first, second, reset, third = turns[1:-1]
  assert "Paris" in first and first.endswith("\n") and first.count("\n") >= 1
  assert "<|im_end|>" not in out and "<|im_start|>" not in out
  assert "Rome" in second
  assert reset == "(a new conversation)\n"
  assert third == first  # a new conversation, the same greedy answer
  stats = [tuple(map(int, m)) for m in STATS.findall(err)]
  assert len(stats) == 3
  # The answers ended at <|im_end|>, well before --max_new_tokens.
  assert all(decoded < 40 for _, decoded in stats)
  tok = tokenizer_json.load(str(smollm2_folder))
  fmt = chat.load_chat_format(str(smollm2_folder), tok)
  asked = [{"role": "user", "content": QUESTION}]
  first_ids = chat.encode(tok, fmt, asked, add_generation_prompt=True)
  assert stats[0][0] == len(first_ids)
  # The second turn feeds its own tokens only: from the first answer's <|im_end|> on
  # (the answer's last token, drawn and never fed while it was decoded).
  history = asked + [{"role": "assistant", "content": first.rstrip("\n")},
                     {"role": "user", "content": follow_up}]
  second_ids = chat.encode(tok, fmt, history, add_generation_prompt=True)
  assert stats[1][0] == len(second_ids) - (len(first_ids) + stats[0][1] - 1)
  # After /reset the cache still holds the same first question: only its last token
  # is fed again (for its logits).
  assert stats[2][0] == 1


@pytest.mark.slow
def test_a_one_shot_prompt_prints_the_answer_and_exits(smollm2_folder, capsys):
  capsys.readouterr()
  out = io.StringIO()
  code = chat_cli.run(["chat", f"--init_from={smollm2_folder}", f"--prompt={QUESTION}",
                       "--temperature=0", "--system=Answer in one short sentence."],
                      stdin=Typed(""), stdout=out)
  assert code == 0, capsys.readouterr().err[-2000:]
  lines = out.getvalue().splitlines()
  assert len(lines) == 1 and "Paris" in lines[0], out.getvalue()


@pytest.mark.slow
def test_sample_prints_the_continuation_and_stops_at_the_end_token(smollm2_folder, capsys):
  capsys.readouterr()
  code = sample.run(["sample", f"--init_from={smollm2_folder}", "--temperature=0",
                     "--start=<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                     "<|im_start|>assistant\n", "--max_new_tokens=60", "--block_size=256"])
  out = capsys.readouterr().out
  assert code == 0
  answer, rule = out.split("\n---------------\n")[0], out.splitlines()[-1]
  assert "Paris" in answer and "<|im_start|>" not in answer and rule == "-" * 15


def test_refusals_are_one_line(capsys, tmp_path):
  assert refusal(capsys, chat_cli) == (
      "error: --init_from is required: a Hugging Face model folder with a chat template, "
      "or a purejax run fine-tuned from one.")
  assert "--top_p" in refusal(capsys, chat_cli, "--init_from=x", "--top_p=1.5")
  base = tmp_path / "base"
  train_tokenizer_json(base, SHAKESPEARE[:5000])
  (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  with pytest.raises(chat.ChatTemplateError, match="no chat template"):
    chat.load_chat_format(str(base))
  assert refusal(capsys, sample, "--stop_ids=a,b") == (
      "error: --stop_ids=a,b must be token ids (integers) or 'none'.")


def test_the_end_token_of_each_kind_of_model(tmp_path):
  import types
  from purejax.cli import models
  from purejax.data.tokenizer_spec import TokenizerSpec
  gpt2 = TokenizerSpec("bpe", "gpt2", 50257, fingerprint="f", pat_str="p",
                       special_tokens=(("<|endoftext|>", 50256),), encoding_file="encoder.json")
  assert models.stop_ids(types.SimpleNamespace(spec=lambda: gpt2)) == (50256,)
  chars = TokenizerSpec("char", "char", 3, chars="abc")
  assert models.stop_ids(types.SimpleNamespace(spec=lambda: chars)) == ()
  base = tmp_path / "base"  # a folder without a template: its generation_config's EOS
  train_tokenizer_json(base, SHAKESPEARE[:5000])
  (base / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
  assert models.stop_ids(tokenizer_json.load(str(base))) == (1,)


@pytest.mark.slow
def test_a_gguf_file_chats_with_its_own_template_and_end_token(smollm2_gguf, capsys):
  # The GGUF's metadata carries the template, bos/eos and add_bos (no folder beside it).
  capsys.readouterr()
  out = io.StringIO()
  code = chat_cli.run(["chat", f"--init_from={smollm2_gguf}", f"--prompt={QUESTION}",
                       "--temperature=0", "--stats"], stdin=Typed(""), stdout=out)
  err = capsys.readouterr().err
  assert code == 0, err[-2000:]
  lines = out.getvalue().splitlines()
  assert len(lines) == 1 and "Paris" in lines[0], out.getvalue()
  assert "<|im_end|>" not in out.getvalue()
  ((fed, decoded),) = [tuple(map(int, m)) for m in STATS.findall(err)]
  assert fed > 10  # the rendered conversation: system, user and the assistant header
  assert decoded < 40  # ended at <|im_end|>, long before --max_new_tokens (512)
