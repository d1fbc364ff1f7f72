r"""Serving under load: purejax's server against `transformers serve` and llama.cpp's, one model.

    python -m bench.serve_load --folder=SmolLM2-f32 --gguf=SmolLM2.Q4_1.gguf \
        --hf_venv=/path/venv-hf --llama_venv=/path/venv-llama --out=results.json

Each arm is a server started here on 127.0.0.1 (purejax's `python -m purejax.serve`;
`transformers serve` with continuous batching; llama-cpp-python's server on the GGUF
file), then loaded by N concurrent clients at each of `--levels`: streamed chat
requests, greedy, whose prompts are passages of Tiny Shakespeare of mixed lengths
(about 40 to 700 tokens) and whose `max_tokens` is drawn from 64 to 256, the same
list for every arm. Per level it reports:

* total tokens/s: completion tokens (the answers' text counted with the model's own
  tokenizer, the same count for every server) over the level's wall time;
* time to first token (the first non-empty content), p50 and p95;
* inter-token latency: each gap between content chunks, divided among the chunk's
  tokens (one value per token), p50 and p95; and TPOT, a request's (last - first) /
  (tokens - 1), p50.

Arms run one after another (never two servers at once), in `--rounds` alternated
rounds; medians over rounds. Every server is stopped before the next starts.
"""

import asyncio
import json
import os
import pathlib
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from absl import app
from absl import flags

flags.DEFINE_string("folder", None, "The model's Hugging Face folder (float32).")
flags.DEFINE_string("gguf", None, "The same model's GGUF file (llama.cpp's arm).")
flags.DEFINE_string("hf_venv", None, "A virtual environment with `transformers serve` "
                    "(transformers[serving]); none: no transformers arm.")
flags.DEFINE_string("llama_venv", None, "A virtual environment with llama-cpp-python[server]; "
                    "none: no llama.cpp arm.")
flags.DEFINE_list("arms", ["purejax", "transformers", "llama.cpp"], "Arms to run.")
flags.DEFINE_list("levels", ["1", "4", "16"], "Concurrent clients.")
flags.DEFINE_list("requests", ["4", "12", "32"], "Requests at each level.")
flags.DEFINE_integer("rounds", 1, "Alternated rounds of every arm.")
flags.DEFINE_integer("seed", 0, "Seed of the prompt list.")
flags.DEFINE_string("purejax_flags", "", "Extra flags for `python -m purejax.serve`.")
flags.DEFINE_integer("cb_blocks", 64, "transformers serve's --cb-num-blocks (of 256 tokens).")
flags.DEFINE_float("timeout", 600.0, "Seconds a request may take at most.")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS

SHAKESPEARE = (pathlib.Path(__file__).resolve().parents[1] / "purejax" / "data" / "_datasets"
               / "tinyshakespeare" / "input.txt")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def prompts(n: int, seed: int) -> List[Dict[str, Any]]:
  """`n` chat requests: passages of mixed lengths, each with its own max_tokens."""
  lines = SHAKESPEARE.read_text(encoding="utf-8").splitlines()
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    length = rng.choice([3, 6, 12, 24, 48])
    start = rng.randrange(0, len(lines) - length)
    passage = "\n".join(lines[start:start + length])
    out.append({"messages": [{"role": "user", "content":
                              "Continue this scene in the same style, at length:\n\n" + passage}],
                "max_tokens": rng.randint(64, 256), "temperature": 0, "stream": True})
  return out


class Arm:
  """A server to start, how to ask it, and how to stop it."""

  def __init__(self, name: str, command: List[str], ready_path: str, model: Optional[str],
               env: Optional[Dict[str, str]] = None):
    self.name, self.command, self.ready_path, self.model = name, command, ready_path, model
    self.env = {**os.environ, **(env or {})}
    self.process: Optional[subprocess.Popen] = None
    self.port = 0

  def start(self, log: pathlib.Path) -> float:
    import httpx  # pylint: disable=import-outside-toplevel
    self.port = free_port()
    command = [c.replace("{port}", str(self.port)) for c in self.command]
    start = time.perf_counter()
    self.process = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                    env=self.env, start_new_session=True)
    while time.perf_counter() - start < 600:
      if self.process.poll() is not None:
        raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {log}")
      try:
        if httpx.get(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=2).status_code == 200:
          return time.perf_counter() - start
      except httpx.HTTPError:
        pass
      time.sleep(1)
    raise RuntimeError(f"{self.name} was not ready after 600 s; see {log}")

  def stop(self) -> None:
    if self.process is not None and self.process.poll() is None:
      os.killpg(self.process.pid, signal.SIGTERM)
      try:
        self.process.wait(60)
      except subprocess.TimeoutExpired:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


async def one_request(client, url: str, body: Dict[str, Any], count) -> Dict[str, Any]:
  """Streams one request; returns its timings and token counts."""
  sent = time.perf_counter()
  chunks = []  # (time, tokens)
  text = ""
  async with client.stream("POST", url, json=body) as response:
    if response.status_code != 200:
      return {"error": response.status_code}
    buffer = ""
    async for piece in response.aiter_text():
      buffer += piece
      while "\n\n" in buffer:
        event, buffer = buffer.split("\n\n", 1)
        if not event.startswith("data: ") or event[6:].strip() == "[DONE]":
          continue
        chunk = json.loads(event[6:])
        for choice in chunk.get("choices") or []:
          content = (choice.get("delta") or {}).get("content")
          if content:
            chunks.append((time.perf_counter(), content))
            text += content
  times = [t for t, _ in chunks]
  tokens = count(text)
  # Tokens per chunk: a chunk's own count, scaled so that they sum to the whole's.
  per_chunk = [max(count(c), 1) for _, c in chunks]
  scale = tokens / max(sum(per_chunk), 1)
  gaps = []
  for i in range(1, len(chunks)):
    n = max(1, round(per_chunk[i] * scale))
    gaps += [(times[i] - times[i - 1]) / n] * n
  return {"ttft": times[0] - sent if times else None, "tokens": tokens, "gaps": gaps,
          "tpot": (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and times else None,
          "done": time.perf_counter()}


async def level(url: str, model: Optional[str], bodies: List[Dict[str, Any]], clients: int,
                count) -> Dict[str, Any]:
  import httpx  # pylint: disable=import-outside-toplevel
  queue = list(bodies)
  results = []
  async with httpx.AsyncClient(timeout=FLAGS.timeout) as client:
    async def worker():
      while queue:
        body = dict(queue.pop(0))
        if model is not None:
          body["model"] = model
        results.append(await one_request(client, url, body, count))
    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(clients)])
    wall = time.perf_counter() - start
  ok = [r for r in results if "error" not in r]
  q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] if len(xs) > 1 else (xs or [None])[0]
  ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
  gaps = [g for r in ok for g in r["gaps"]]
  tokens = sum(r["tokens"] for r in ok)
  return {"clients": clients, "requests": len(bodies), "errors": len(results) - len(ok),
          "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
          "ttft_p50": q(ttfts, 50), "ttft_p95": q(ttfts, 95),
          "itl_p50": q(gaps, 50), "itl_p95": q(gaps, 95),
          "tpot_p50": statistics.median([r["tpot"] for r in ok if r["tpot"]]) if ok else None}


def make_arms() -> List[Arm]:
  folder = str(pathlib.Path(FLAGS.folder).resolve())
  arms = []
  for name in FLAGS.arms:
    if name == "purejax":
      arms.append(Arm(name, [sys.executable, "-m", "purejax.serve", f"--init_from={folder}",
                             "--port={port}", *FLAGS.purejax_flags.split()], "/health", None))
    elif name == "transformers" and FLAGS.hf_venv:
      cache = pathlib.Path(FLAGS.hf_venv) / "hf-cache"
      cache.mkdir(exist_ok=True)
      arms.append(Arm(name, [f"{FLAGS.hf_venv}/bin/transformers", "serve", folder,
                             "--continuous-batching", "--cb-num-blocks", str(FLAGS.cb_blocks),
                             "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1",
                             "--port", "{port}"], "/health", None,
                      env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}))
    elif name == "llama.cpp" and FLAGS.llama_venv and FLAGS.gguf:
      arms.append(Arm(name, [f"{FLAGS.llama_venv}/bin/python", "-m", "llama_cpp.server",
                             "--model", str(pathlib.Path(FLAGS.gguf).resolve()),
                             "--model_alias", "model", "--host", "127.0.0.1", "--port", "{port}",
                             "--n_ctx", "2048", "--n_threads", str(os.cpu_count()),
                             "--interrupt_requests", "False"], "/v1/models", "model"))
  return arms


def main(argv):
  del argv
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from purejax.data import tokenizer_json  # pylint: disable=import-outside-toplevel
  tokenizer = tokenizer_json.load(FLAGS.folder)
  count = lambda text: len(tokenizer.encode(text)) if text else 0
  levels = [int(c) for c in FLAGS.levels]
  per_level = [int(n) for n in FLAGS.requests]
  bodies = prompts(max(per_level), FLAGS.seed)
  results: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
  logs = pathlib.Path(FLAGS.out or "serve_load.json").with_suffix("")
  logs.mkdir(parents=True, exist_ok=True)
  for round_ in range(FLAGS.rounds):
    arms = make_arms()
    for arm in arms if round_ % 2 == 0 else arms[::-1]:
      startup = arm.start(logs / f"{arm.name}-{round_}.log")
      print(f"{arm.name}: ready in {startup:.1f} s", flush=True)
      url = f"http://127.0.0.1:{arm.port}/v1/chat/completions"
      try:
        asyncio.run(level(url, arm.model, bodies[:2], 1, count))  # warm up
        for clients, n in zip(levels, per_level):
          got = asyncio.run(level(url, arm.model, bodies[:n], clients, count))
          got["startup_s"] = startup
          results.setdefault(arm.name, {}).setdefault(str(clients), []).append(got)
          print(f"  {clients:2d} clients: {got['tokens_per_s']:6.1f} tok/s, ttft p50 "
                f"{got['ttft_p50']:.3f} s p95 {got['ttft_p95']:.3f} s, itl p50 "
                f"{got['itl_p50'] * 1e3:.1f} ms p95 {got['itl_p95'] * 1e3:.1f} ms, "
                f"errors {got['errors']}", flush=True)
      finally:
        arm.stop()
  summary = {name: {c: {k: statistics.median([r[k] for r in runs if r[k] is not None])
                        for k in ("tokens_per_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95",
                                  "tpot_p50")}
                    for c, runs in by_level.items()}
             for name, by_level in results.items()}
  if "purejax" in summary:
    for peer in summary:
      if peer != "purejax":
        for c in summary[peer]:
          mine, theirs = summary["purejax"][c], summary[peer][c]
          print(f"{c} clients, purejax / {peer}: throughput "
                f"{mine['tokens_per_s'] / theirs['tokens_per_s']:.2f}x, ttft p50 "
                f"{mine['ttft_p50'] / theirs['ttft_p50']:.2f}x of theirs")
  out = {"levels": levels, "requests": per_level, "rounds": FLAGS.rounds, "summary": summary,
         "runs": results, "date": time.strftime("%Y-%m-%d"), "cpu": os.cpu_count()}
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(out, indent=1))
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  flags.mark_flag_as_required("folder")
  app.run(main)
