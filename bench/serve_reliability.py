r"""The server under abuse: hundreds of requests, good and bad, at once; nothing may break.

    python -m bench.serve_reliability --folder=SmolLM2-f32 --requests=320 --out=results.json

Starts `python -m purejax.serve` on 127.0.0.1 (`--max_queue` small, so that bursts
overflow it), asks each good request once alone for its greedy answer, then sends
`--requests` requests from `--clients` threads at once, shuffled:

* good chat requests, greedy: each must get exactly its answer alone;
* malformed JSON, fields of the wrong type, values out of range, unsupported fields,
  a body of about 1.2 MB, prompts longer than the context: each must get a 4xx with
  OpenAI's JSON error body;
* streams that their client drops after a chunk: their rows must be freed;
* bursts of good requests, more than the queue holds: 200 or 429 with `Retry-After`.

A good request told 429 waits its `Retry-After` and asks again, as OpenAI's client
does (for up to `--retry_seconds`); it must end with its answer. A burst's requests
do not retry.

Then: no 5xx, no connection error, no traceback in the server's log, the server
still answers, every row free, and its resident memory before and after the storm
(after a first round of each kind, so that every program is compiled and every
allocation made once) is reported. The server stops by SIGTERM at the end.
"""

import collections
import concurrent.futures
import json
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time

from absl import app
from absl import flags

flags.DEFINE_string("folder", None, "The model (a Hugging Face folder).")
flags.DEFINE_integer("requests", 320, "Requests in the storm.")
flags.DEFINE_integer("clients", 48, "Threads sending at once.")
flags.DEFINE_integer("max_queue", 12, "The server's --max_queue.")
flags.DEFINE_integer("seed", 0, "Seed of the mix.")
flags.DEFINE_float("retry_seconds", 300.0, "How long a good request told 429 keeps asking.")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS

QUESTIONS = ["What is the capital of France?", "Name a red fruit.", "What is 2 + 2?",
             "Say hello in Spanish.", "What color is the sky?", "Name a planet.",
             "What do bees make?", "Who wrote Hamlet?"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def rss_mib(pid: int) -> float:
  for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) / 1024
  return float("nan")


def good(question: str) -> bytes:
  return json.dumps({"messages": [{"role": "user", "content": question}], "temperature": 0,
                     "max_tokens": 24}).encode()


def bad_bodies():
  one = [{"role": "user", "content": "hi"}]
  return {
      "malformed json": b'{"messages": [{"role": "user", "content": "hi"}',
      "not an object": b"[1, 2, 3]",
      "wrong type max_tokens": json.dumps({"messages": one, "max_tokens": "12"}).encode(),
      "wrong type messages": json.dumps({"messages": "hi"}).encode(),
      "wrong type stream": json.dumps({"messages": one, "stream": "yes"}).encode(),
      "out of range temperature": json.dumps({"messages": one, "temperature": 9}).encode(),
      "out of range top_p": json.dumps({"messages": one, "top_p": 0}).encode(),
      "out of range n": json.dumps({"messages": one, "n": 64}).encode(),
      "out of range max_tokens": json.dumps({"messages": one, "max_tokens": 10 ** 9}).encode(),
      "unsupported tools": json.dumps({"messages": one, "tools": [
          {"type": "function", "function": {"name": "f"}}]}).encode(),
      "unsupported response_format": json.dumps({"messages": one, "response_format": {
          "type": "json_object"}}).encode(),
      "unknown role": json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(),
      "over the context": json.dumps({"messages": [
          {"role": "user", "content": "word " * 3000}]}).encode(),
      "1 MB body": json.dumps({"messages": [{"role": "user", "content": "x" * 1_200_000}]}
                              ).encode(),
  }


def main(argv):
  del argv
  import httpx  # pylint: disable=import-outside-toplevel
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  log = pathlib.Path(FLAGS.out or "serve_reliability.json").with_suffix(".log")
  server = subprocess.Popen(
      [sys.executable, "-m", "purejax.serve", f"--init_from={FLAGS.folder}", f"--port={port}",
       "--served_model_name=m", "--rows=16", "--max_context=1024",
       f"--max_queue={FLAGS.max_queue}"], stdout=open(log, "w"), stderr=subprocess.STDOUT)
  try:
    start = time.time()
    while True:
      assert server.poll() is None, log.read_text()[-3000:]
      try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
          break
      except httpx.HTTPError:
        pass
      assert time.time() - start < 600, "not ready"
      time.sleep(0.5)
    chat = url + "/v1/chat/completions"
    post = lambda body: httpx.post(chat, content=body, timeout=300,
                                   headers={"Content-Type": "application/json"})
    answers = {q: post(good(q)).json()["choices"][0]["message"]["content"] for q in QUESTIONS}
    bad = bad_bodies()
    for body in bad.values():  # every refusal path once before the memory is read
      post(body)

    def vanish():
      with httpx.stream("POST", chat, timeout=300, json={
          "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
          "max_tokens": 200}) as response:
        next(response.iter_lines())

    vanish()
    time.sleep(1)
    before = rss_mib(server.pid)
    rng = random.Random(FLAGS.seed)
    kinds = ["good"] * 3 + ["bad"] * 4 + ["vanish"] + ["burst"] * 2
    work = []
    while len(work) < FLAGS.requests:
      kind = rng.choice(kinds)
      if kind == "burst":
        work += [("burst", q) for q in rng.sample(QUESTIONS, 8)]
      elif kind == "good":
        work.append(("good", rng.choice(QUESTIONS)))
      elif kind == "bad":
        work.append(("bad", rng.choice(list(bad))))
      else:
        work.append(("vanish", None))
    work = work[:FLAGS.requests]

    def send(item):
      kind, what = item
      try:
        if kind == "vanish":
          vanish()
          return kind, what, 0, ""
        response = post(good(what) if kind in ("good", "burst") else bad[what])
        give_up = time.time() + FLAGS.retry_seconds
        while kind == "good" and response.status_code == 429 and time.time() < give_up:
          retried[0] += 1
          time.sleep(float(response.headers["Retry-After"]))
          response = post(good(what))
        return kind, what, response.status_code, response.text
      except httpx.HTTPError as e:
        return kind, what, -1, repr(e)

    retried = [0]  # good requests' retries after a 429
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(FLAGS.clients) as pool:
      results = list(pool.map(send, work))
    seconds = time.time() - started
    problems = []
    counts = collections.Counter()
    for kind, what, status, text in results:
      counts[f"{kind} {status}"] += 1
      if status == -1 or status >= 500:
        problems.append((kind, what, status, text[:200]))
      elif kind == "bad":
        if not (400 <= status < 500 and json.loads(text)["error"]["message"]):
          problems.append((kind, what, status, text[:200]))
      elif kind in ("good", "burst") and status == 200:
        if json.loads(text)["choices"][0]["message"]["content"] != answers[what]:
          problems.append((kind, what, status, "a different answer than alone"))
      elif kind == "good" or (kind == "burst" and status != 429):
        problems.append((kind, what, status, text[:200]))
    time.sleep(2)
    health = httpx.get(url + "/health", timeout=10).json()
    still = post(good(QUESTIONS[0])).json()["choices"][0]["message"]["content"]
    after = rss_mib(server.pid)
  finally:
    server.send_signal(signal.SIGTERM)
    code = server.wait(120)
  text = log.read_text()
  result = {"requests": len(results), "seconds": seconds, "counts": dict(counts),
            "good_retries_after_429": retried[0],
            "problems": problems, "rss_mib_before": before, "rss_mib_after": after,
            "health_after": health, "answers_after": still == answers[QUESTIONS[0]],
            "tracebacks_in_log": text.count("Traceback"), "exit_code": code,
            "date": time.strftime("%Y-%m-%d")}
  print(json.dumps(result, indent=1))
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  flags.mark_flag_as_required("folder")
  app.run(main)
