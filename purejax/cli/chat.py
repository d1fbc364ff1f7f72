r"""Chats with an instruct model in the terminal, its answers streamed as they are decoded.

    python -m purejax.chat --init_from=path/to/SmolLM2-135M-Instruct
    python -m purejax.chat --init_from=out-sft --system="Answer in one sentence."
    python -m purejax.chat --init_from=path/to/model --prompt="What is the capital of France?"

Type a message and press Enter; /reset starts the conversation over (the
system prompt stays), /quit or Ctrl-D ends it. The conversation is kept in
the model's KV cache (one row of `purejax.engine`), so each turn feeds only its
own tokens, not the whole history again. With --prompt it answers once and exits (for scripts). The
model is a Hugging Face folder with a chat template, or a purejax run
fine-tuned from one; an answer ends at the model's end-of-turn token.
"""

import sys
import time
from typing import List, Sequence

from absl import flags
import jax

from purejax import checkpoint
from purejax import engine
from purejax.cli import command
from purejax.cli import errors
from purejax.cli import forms_flags
from purejax.cli import models
from purejax.data import chat

COMMANDS = "/reset starts over, /quit or Ctrl-D ends"


def define_flags(args: flags.FlagValues) -> None:
  flags.DEFINE_string("init_from", None, "The model: a Hugging Face folder with a chat "
                      "template, or a purejax run fine-tuned from one.", flag_values=args)
  flags.DEFINE_string("tokenizer_file", None, "Where the model's tokenizer.json is now, if "
                      "it moved.", flag_values=args)
  flags.DEFINE_string("system", None, "A system prompt (default: the template's own, if "
                      "any).", flag_values=args)
  flags.DEFINE_string("prompt", None, "Answer this one message, print the answer and exit.",
                      flag_values=args)
  flags.DEFINE_integer("max_new_tokens", 512, "Most tokens per answer.", lower_bound=1,
                       flag_values=args)
  flags.DEFINE_float("temperature", 0.7, "Softmax temperature (0: greedy).",
                     lower_bound=0.0, flag_values=args)
  flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0: all).", lower_bound=0,
                       flag_values=args)
  flags.DEFINE_float("top_p", 0.9, "Nucleus sampling mass in (0, 1] (1: all).",
                     lower_bound=0.0, upper_bound=1.0, flag_values=args)
  flags.DEFINE_integer("seed", 1337, "Sampling seed.", flag_values=args)
  flags.DEFINE_integer("block_size", None, "Context kept, at most the model's (default: "
                       "the model's).", lower_bound=1, flag_values=args)
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Dtype of the matmuls "
                    "(default: the model's).", flag_values=args)
  models.define_quantize_flag(args)
  flags.DEFINE_bool("stats", False, "After each answer, print to stderr the tokens fed "
                    "and decoded and the time taken.", flag_values=args)
  forms_flags.define_forms_flags(args, sweeps=False)


class Session:
  """One conversation with one model: messages, and an engine row whose cache holds them."""

  def __init__(self, args, params, config, tokenizer, fmt: chat.ChatFormat, stops, forms):
    self.args, self.config, self.tokenizer, self.fmt = args, config, tokenizer, fmt
    self.stops = stops
    # One row; a turn reuses what the row's cache holds of the conversation so far.
    self.engine = engine.Engine(params, config, engine.EngineConfig(
        rows=1, prefill_rows=1, chunk_steps=8, reuse_prefix=True), forms=forms,
        valid_vocab=tokenizer.vocab_size, decode_text=tokenizer.decode)
    self.system = ([{"role": "system", "content": args.system}]
                   if args.system is not None else [])
    self.messages: List[dict] = list(self.system)
    self.turns = 0

  def reset(self) -> None:
    """Starts over; the cache keeps what the next conversation shares (the system prompt)."""
    self.messages = list(self.system)

  def _prompt_ids(self) -> List[int]:
    """The conversation so far with the assistant's header, earliest turns dropped
    while it leaves no room for an answer in the model's context."""
    room = self.config.block_size - min(self.args.max_new_tokens, self.config.block_size // 2)
    while True:
      ids = chat.encode(self.tokenizer, self.fmt, self.messages, add_generation_prompt=True)
      turns = [i for i, m in enumerate(self.messages) if m["role"] != "system"]
      if len(ids) <= room or len(turns) <= 1:
        break
      del self.messages[turns[0]:turns[1] if len(turns) > 1 else None]  # the oldest turn
      while len(self.messages) > len(self.system) and self.messages[
          len(self.system)]["role"] != "user":  # a conversation starts with the user
        del self.messages[len(self.system)]
    if len(ids) > room:
      raise ValueError(f"this message is {len(ids)} tokens with the conversation's start, "
                       f"more than the model's context leaves room for "
                       f"(block_size={self.config.block_size}); send a shorter one.")
    return ids

  def answer(self, text: str, out) -> str:
    """Streams the answer to `text` into `out`; returns it (without the end token)."""
    self.messages.append({"role": "user", "content": text})
    try:
      ids = self._prompt_ids()
    except ValueError:
      self.messages.pop()
      raise
    start = time.perf_counter()
    key = jax.random.fold_in(jax.random.PRNGKey(self.args.seed), self.turns)
    self.turns += 1
    ended: List[engine.Event] = []

    def shown(event: engine.Event) -> None:
      if event.text:
        out.write(event.text)
        out.flush()
      if event.completion is not None:
        ended.append(event)

    self.engine.submit(engine.Request(
        ids, min(self.args.max_new_tokens, self.config.block_size - len(ids)), [key],
        self.args.temperature, self.args.top_k,
        self.args.top_p if self.args.top_p is not None else 1.0, self.stops), shown)
    while self.engine.step():
      pass
    (last,) = ended
    answer = [t for t in last.completion.tokens if t not in self.stops]
    reply = self.tokenizer.decode(answer)
    out.write("\n")
    out.flush()
    self.messages.append({"role": "assistant", "content": reply})
    if self.args.stats:
      seconds = time.perf_counter() - start
      decoded = len(last.completion.tokens)
      print(f"[fed {last.prompt_fed} tokens, decoded {decoded}, {seconds:.2f} s, "
            f"{decoded / seconds:.1f} tokens/s, context {len(ids) + decoded}]",
            file=sys.stderr)
    return reply


def load(args):
  """The model the flags name, its chat format, stop ids and forms."""
  if not args.init_from:
    raise ValueError("--init_from is required: a Hugging Face model folder with a chat "
                     "template, or a purejax run fine-tuned from one.")
  if args.top_p is not None and not 0 < args.top_p <= 1:
    raise ValueError(f"--top_p must be in (0, 1], got {args.top_p}.")
  forms_flags.check_platform(args)  # before loading weights
  params, config, tokenizer = models.load_model("", args.init_from,
                                                tokenizer_file=args.tokenizer_file,
                                                quantize=args.quantize)
  fmt = models.chat_format(args.init_from, tokenizer)
  stops = models.stop_ids(tokenizer, fmt)
  if not stops:
    raise ValueError(f"{args.init_from}: no end-of-turn token is known (no "
                     f"generation_config.json eos_token_id, no eos_token); answers would "
                     f"never end.")
  params, config = models.adjust(params, config, args.block_size, args.dtype,
                                 args.quantize)
  return params, config, tokenizer, fmt, stops, forms_flags.forms_from_flags(args)


def converse(args: flags.FlagValues, stdin=None, stdout=None) -> int:
  """Runs the chat the parsed flags ask for, reading `stdin`, writing `stdout`."""
  stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
  try:
    session = Session(args, *load(args))
    if args.prompt is not None:
      session.answer(args.prompt, stdout)
      return 0
  except (ValueError, OSError, checkpoint.CheckpointError) as e:
    errors.fail(e, args)
  interactive = stdin.isatty()
  if interactive:
    print(f"Chatting with {args.init_from} ({COMMANDS}).", file=sys.stderr)
  try:
    return _loop(session, args, stdin, stdout, interactive)
  except KeyboardInterrupt:  # Ctrl-C: end the chat without a traceback
    stdout.write("\n")
    return 130


def _loop(session: Session, args, stdin, stdout, interactive: bool) -> int:
  """Reads messages and commands until /quit or the end of input."""
  while True:
    if interactive and stdin is sys.stdin and stdout is sys.stdout:
      try:
        line = input("> ") + "\n"  # the terminal's line editing
      except EOFError:
        line = ""
    else:
      if interactive:
        stdout.write("> ")
        stdout.flush()
      line = stdin.readline()
    if not line:  # Ctrl-D, or the end of piped input
      return 0
    text = line.rstrip("\n")
    if text.strip() in ("/quit", "/exit"):
      return 0
    if text.strip() == "/reset":
      session.reset()
      print("(a new conversation)", file=stdout if interactive else sys.stderr)
      continue
    if not text.strip():
      continue
    try:
      session.answer(text, stdout)
    except ValueError as e:
      print(errors.one_line(e, args), file=sys.stderr)


def run(argv: Sequence[str], stdin=None, stdout=None) -> int:
  """`python -m purejax.chat` with `argv` (the program's name first): the exit code."""
  return command.run(argv, define_flags, lambda args: converse(args, stdin, stdout),
                     usage=__doc__)


def main() -> None:
  command.main(run)


if __name__ == "__main__":
  main()
