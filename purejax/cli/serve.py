r"""Serves a model over HTTP in OpenAI's API, with a chat page, on one generation engine.

    python -m purejax.serve --init_from=path/to/SmolLM2-135M-Instruct   # http://127.0.0.1:8000
    python -m purejax.serve --init_from=model.gguf --port=8080 --api_key=secret
    python -m purejax.serve --init_from=out-sft --rows=8 --max_context=1024

Clients speak OpenAI's API: `POST /v1/chat/completions` and `/v1/completions`
(streamed or not), `GET /v1/models`; `GET /health` answers 200 once the
model is loaded and its programs compiled, `GET /metrics` in Prometheus'
format. The model is a Hugging Face folder, a GGUF file or a purejax run
(a LoRA fine-tune's adapters merged). It listens on 127.0.0.1 unless --host
says otherwise. SIGTERM or Ctrl-C stops taking requests, lets those in
flight finish for up to --drain_seconds, cancels the rest and exits 0.
"""

import logging
import signal
import sys
from typing import Sequence

from absl import flags

from purejax import checkpoint
from purejax import engine
from purejax.cli import command
from purejax.cli import errors
from purejax.cli import forms_flags
from purejax.cli import models
from purejax.data import chat
from purejax.data import tokenizers

LOG = logging.getLogger("purejax.serve")


def define_flags(args: flags.FlagValues) -> None:
  flags.DEFINE_string("init_from", None, "The model: a Hugging Face folder, a .gguf file or "
                      "a purejax run directory.", flag_values=args)
  flags.DEFINE_string("tokenizer_file", None, "Where the model's tokenizer.json is now, if "
                      "it moved.", flag_values=args)
  flags.DEFINE_string("served_model_name", None, "The model's name in the API (default: the "
                      "last part of --init_from).", flag_values=args)
  flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every "
                      "interface; put an --api_key on it).", flag_values=args)
  flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=0, upper_bound=65535,
                       flag_values=args)
  flags.DEFINE_string("api_key", None, "Require `Authorization: Bearer KEY` on /v1/* and "
                      "/metrics.", flag_values=args)
  flags.DEFINE_integer("rows", 16, "Completions decoded side by side (the engine's batch).",
                       lower_bound=1, flag_values=args)
  flags.DEFINE_integer("max_context", 2048, "Cache positions per row: prompt and answer "
                       "together, at most the model's context.", lower_bound=1,
                       flag_values=args)
  flags.DEFINE_integer("prefill_rows", 4, "Prompt chunks fed per prefill call.",
                       lower_bound=1, flag_values=args)
  flags.DEFINE_integer("prefill_chunk", 64, "Tokens per prompt chunk.", lower_bound=2,
                       flag_values=args)
  flags.DEFINE_list("short_prefill_chunks", ["8", "16", "24", "32", "40", "48", "56"],
                    "Smaller chunk sizes for a prompt's last call: what is left after "
                    "whole calls is fed in the smallest that holds it in --prefill_rows "
                    "chunks (a program each; 'none': only --prefill_chunk).",
                    flag_values=args)
  flags.DEFINE_integer("prefill_calls", 2, "Prefill calls at most between decoding chunks "
                       "while rows decode: more feeds new prompts sooner, fewer keeps the "
                       "answers already streaming steadier.", lower_bound=1, flag_values=args)
  flags.DEFINE_integer("chunk_steps", 4, "Decoding steps between the engine's looks at new "
                       "requests and cancellations.", lower_bound=1, flag_values=args)
  flags.DEFINE_integer("max_queue", 64, "Requests waiting for a row at most; more get 429.",
                       lower_bound=1, flag_values=args)
  flags.DEFINE_integer("max_tokens", 1024, "New tokens per completion at most (and the "
                       "default, within the context).", lower_bound=1, flag_values=args)
  flags.DEFINE_integer("max_n", 4, "Completions per request at most.", lower_bound=1,
                       flag_values=args)
  flags.DEFINE_integer("max_messages", 64, "Messages per chat request at most.",
                       lower_bound=1, flag_values=args)
  flags.DEFINE_integer("max_body_bytes", 1 << 20, "Request body size at most.",
                       lower_bound=1024, flag_values=args)
  flags.DEFINE_float("max_temperature", 2.0, "Temperature at most.", lower_bound=0.0,
                     flag_values=args)
  flags.DEFINE_integer("max_top_k", 1000, "top_k at most.", lower_bound=1, flag_values=args)
  flags.DEFINE_float("drain_seconds", 10.0, "On SIGTERM, how long requests in flight may "
                     "finish before they are cancelled.", lower_bound=0.0, flag_values=args)
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Dtype of the matmuls "
                    "(default: the model's).", flag_values=args)
  models.define_quantize_flag(args)
  forms_flags.define_forms_flags(args, sweeps=False)


def build(args):
  """The `app.Served` the flags name (the model loaded, its engine built, not compiled)."""
  from purejax.serving import app  # pylint: disable=import-outside-toplevel
  if not args.init_from:
    raise ValueError("--init_from is required: a Hugging Face folder, a .gguf file or a "
                     "purejax run directory.")
  forms_flags.check_platform(args)  # before loading weights
  params, config, tokenizer = models.load_model("", args.init_from,
                                                tokenizer_file=args.tokenizer_file,
                                                quantize=args.quantize)
  try:
    fmt = models.chat_format(args.init_from, tokenizer)
  except (chat.ChatTemplateError, OSError):
    fmt = None  # a base model: /v1/completions only
  stops = tuple(models.stop_ids(tokenizer, fmt))
  params, config = models.adjust(params, config, None, args.dtype, args.quantize)
  length = min(args.max_context, config.block_size)
  texts = tokenizers.token_texts(tokenizer)
  settings = engine.EngineConfig(
      rows=args.rows, length=length, prefill_rows=args.prefill_rows,
      prefill_chunk=args.prefill_chunk,
      short_prefill_chunks=short_chunks(args.short_prefill_chunks),
      prefill_calls=args.prefill_calls,
      chunk_steps=args.chunk_steps,
      stop_strings=4,
      stop_string_bytes=32, top_logprobs=20)
  eng = engine.Engine(params, config, settings, forms=forms_flags.forms_from_flags(args),
                      valid_vocab=tokenizer.vocab_size, token_texts=texts,
                      decode_text=tokenizer.decode)
  name = args.served_model_name or args.init_from.rstrip("/").split("/")[-1]
  return app.Served(eng, tokenizer, fmt, stops, name, texts)


def short_chunks(flag) -> tuple:
  """--short_prefill_chunks as sizes; () for 'none'."""
  if [v.lower() for v in flag] in (["none"], []):
    return ()
  try:
    return tuple(int(v) for v in flag)
  except ValueError:
    raise ValueError(f"--short_prefill_chunks={','.join(flag)} must be chunk sizes "
                     f"(integers) or 'none'.") from None


def serve(args: flags.FlagValues) -> int:
  """Runs the server the parsed flags ask for until SIGTERM or Ctrl-C."""
  try:  # the server's own dependencies, an extra of the package
    import uvicorn  # pylint: disable=import-outside-toplevel
    from purejax.serving import app  # pylint: disable=import-outside-toplevel
    from purejax.serving import protocol  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    errors.fail(ValueError(f"python -m purejax.serve needs {e.name}: pip install "
                           f"'purejax[serve]' (starlette, uvicorn, prometheus-client)."))
  logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  LOG.setLevel(logging.INFO)
  try:
    served = build(args)
  except (ValueError, OSError, checkpoint.CheckpointError) as e:
    errors.fail(e, args)
  limits = protocol.Limits(max_body_bytes=args.max_body_bytes, max_messages=args.max_messages,
                           max_tokens=args.max_tokens, max_n=min(args.max_n, args.rows),
                           max_temperature=args.max_temperature, max_top_k=args.max_top_k)
  asgi = app.create_app(served, app.ServerConfig(limits=limits, api_key=args.api_key,
                                                 max_queue=args.max_queue))
  LOG.info("serving %s on http://%s:%d (compiling first: GET /health answers 200 when "
           "ready)", served.model_name, args.host, args.port)
  server = uvicorn.Server(uvicorn.Config(
      asgi, host=args.host, port=args.port, access_log=False, log_level="info",
      timeout_graceful_shutdown=args.drain_seconds, lifespan="on", log_config=None))
  stopped_by = []
  for sig in (signal.SIGTERM, signal.SIGINT):
    # uvicorn catches these to shut down gracefully, then sends each to the handler it
    # found: this one, so that a requested stop exits 0 rather than dying by the signal.
    signal.signal(sig, lambda number, frame: stopped_by.append(number))
  server.run()
  if not server.started:
    return command.EXIT_ERROR  # uvicorn said why (the port is taken, say)
  LOG.info("stopped")
  return 0


def run(argv: Sequence[str]) -> int:
  """`python -m purejax.serve` with `argv` (the program's name first): the exit code."""
  return command.run(argv, define_flags, serve, usage=__doc__)


def main() -> None:
  command.main(run)


if __name__ == "__main__":
  main()
