"""`python -m purejax.serve` as its users meet it: a live server on the real SmolLM2-135M-Instruct,
called by OpenAI's own Python client, by many clients at once, by clients that vanish or
send garbage, and through its chat page in a headless browser; and stopped by SIGTERM.

Every server here listens on 127.0.0.1 only, is started by the test and stopped by it
(and by the kernel if the test's process dies first), and every request is bounded in
time. The server of the real model is one per test process (a module fixture).
"""

import concurrent.futures
import json
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from real_model import IN_CI, smollm2_folder  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
httpx = pytest.importorskip("httpx")
QUESTION = "What is the capital of France?"
TIMEOUT = 120  # seconds any one request may take


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# `python -m purejax.serve` that gets SIGTERM if the test's process dies (PR_SET_PDEATHSIG),
# set in the child itself: no Python runs between fork and exec.
LAUNCH = ("import ctypes, runpy, signal, sys; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM); "
          "sys.argv = ['purejax.serve'] + sys.argv[1:]; "
          "runpy.run_module('purejax.serve', run_name='__main__')")


class Server:
  """`python -m purejax.serve` in a process of its own, on 127.0.0.1."""

  def __init__(self, log: pathlib.Path, *flags: str):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.log = log
    self.process = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, f"--port={self.port}", *flags],
        stdout=open(log, "w"), stderr=subprocess.STDOUT)

  def wait_ready(self, seconds: float = 300) -> None:
    start = time.time()
    while time.time() - start < seconds:
      assert self.process.poll() is None, self.log.read_text()[-3000:]
      try:
        if httpx.get(self.url + "/health", timeout=2).status_code == 200:
          return
      except httpx.HTTPError:
        pass
      time.sleep(0.5)
    raise AssertionError(f"not ready after {seconds} s:\n{self.log.read_text()[-3000:]}")

  def stop(self) -> int:
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
      try:
        self.process.wait(60)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    return self.process.returncode

  def load(self):
    return httpx.get(self.url + "/health", timeout=5).json()


@pytest.fixture(scope="module")
def live(smollm2_folder, tmp_path_factory):  # noqa: F811
  server = Server(tmp_path_factory.mktemp("serve") / "server.log",
                  f"--init_from={smollm2_folder}", "--served_model_name=smollm2", "--rows=16",
                  "--max_context=1024", "--max_queue=24", "--max_tokens=256")
  try:
    server.wait_ready()
    yield server
  finally:
    code = server.stop()
    log = server.log.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-5000:]


def openai_client(server):
  openai = pytest.importorskip("openai")
  return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT,
                       max_retries=0)


@pytest.mark.budget(40)
def test_the_openai_client_chats_streams_and_completes(live):
  client = openai_client(live)
  ask = dict(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
             temperature=0, max_tokens=40)
  whole = client.chat.completions.create(**ask)
  answer = whole.choices[0].message.content
  assert "Paris" in answer and whole.choices[0].finish_reason == "stop"
  assert "<|im_end|>" not in answer
  assert whole.usage.completion_tokens <= 40 and whole.usage.prompt_tokens > 10
  pieces, usage = [], None
  for chunk in client.chat.completions.create(**ask, stream=True,
                                              stream_options={"include_usage": True}):
    if chunk.choices:
      pieces.append(chunk.choices[0].delta.content or "")
    if chunk.usage is not None:
      usage = chunk.usage
  assert "".join(pieces) == answer  # a stream's deltas are the whole answer
  assert usage.completion_tokens == whole.usage.completion_tokens
  assert usage.prompt_tokens == whole.usage.prompt_tokens
  cut = client.chat.completions.create(**ask, stop=["Paris"])
  assert cut.choices[0].message.content == answer[:answer.index("Paris")]
  assert cut.choices[0].finish_reason == "stop"
  sampled = {**ask, "temperature": 0.9, "max_tokens": 24}
  two = client.chat.completions.create(**sampled, n=2, seed=3)
  assert [c.index for c in two.choices] == [0, 1]
  again = client.chat.completions.create(**sampled, n=2, seed=3)
  assert [c.message.content for c in two.choices] == [c.message.content for c in again.choices]
  text = client.completions.create(model="smollm2", prompt="The capital of France is",
                                   temperature=0, max_tokens=4)
  assert "Paris" in text.choices[0].text and text.usage.completion_tokens == 4
  assert [m.id for m in client.models.list()] == ["smollm2"]


QUESTIONS = ["What is the capital of France?", "Name a red fruit.", "What is 2 + 2?",
             "Say hello in Spanish.", "What color is the sky?", "Name a planet.",
             "What do bees make?", "Who wrote Hamlet?", "Name an ocean.",
             "What is ice made of?", "How many legs does a spider have?",
             "What is the opposite of hot?", "Name a musical instrument.",
             "What language is spoken in Brazil?", "Name a vegetable.",
             "What animal says moo?"]


@pytest.mark.budget(120)
def test_sixteen_concurrent_greedy_streams_equal_their_solo_completions(live):
  # Each answer's tokens and their log-probabilities, bit for bit, decoded alone and then
  # with fifteen others in the same decoding steps.
  def ask(question):
    tokens, logprobs, text = [], [], ""
    with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": question}], "temperature": 0,
        "max_tokens": 32, "stream": True, "logprobs": True}) as response:
      assert response.status_code == 200
      for line in response.iter_lines():
        if line.startswith("data: {"):
          for choice in json.loads(line[6:])["choices"]:
            text += choice["delta"].get("content", "")
            for entry in (choice.get("logprobs") or {}).get("content", []):
              tokens.append(entry["token"])
              logprobs.append(entry["logprob"])
    return text, tokens, logprobs

  alone = [ask(q) for q in QUESTIONS]
  with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
    together = list(pool.map(ask, QUESTIONS))
  for question, solo, crowd in zip(QUESTIONS, alone, together):
    assert solo[0], question
    assert crowd == solo, question
  assert live.load()["rows_in_use"] == 0


@pytest.mark.budget(30)
def test_a_client_that_vanishes_mid_stream_frees_its_row(live):
  with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=TIMEOUT, json={
      "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
      "temperature": 0, "max_tokens": 200, "stream": True}) as response:
    lines = response.iter_lines()
    seen = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in seen)
    assert live.load()["rows_in_use"] == 1
  # The client closed the connection after a few chunks: its row is free within a chunk.
  start = time.time()
  while live.load()["rows_in_use"] and time.time() - start < 20:
    time.sleep(0.1)
  assert live.load()["rows_in_use"] == 0
  time.sleep(0.5)
  assert "status=499" in live.log.read_text()


def _mixed_requests():
  """(kind, body bytes, what it must get): good and bad requests, shuffled together."""
  good = lambda q, n: ("good", json.dumps({"messages": [{"role": "user", "content": q}],
                                           "temperature": 0, "max_tokens": n}).encode(), 200)
  bad = [
      b"{this is not json", json.dumps({"messages": "hello"}).encode(),
      json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}).encode(),
      json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(),
      json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 1000}).encode(),
      json.dumps({"messages": [{"role": "user", "content": "x"}],
                  "tools": [{"type": "function", "function": {"name": "f"}}]}).encode(),
      json.dumps({"messages": [{"role": "user", "content": "x " * 1500}]}).encode(),
      json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}).encode(),
      b"[" + b"1," * 600000 + b"1]",  # over the 1 MB body limit
  ]
  out = [good(q, 8) for q in QUESTIONS[:8]]
  out += [("bad", body, 400) for body in bad]
  return out


@pytest.mark.budget(60)
def test_garbage_vanishing_clients_and_a_burst_get_4xx_and_the_server_goes_on(live):
  def send(item):
    kind, body, _ = item
    try:
      response = httpx.post(live.url + "/v1/chat/completions", content=body, timeout=TIMEOUT,
                            headers={"Content-Type": "application/json"})
    except httpx.HTTPError as e:
      return kind, -1, str(e)
    return kind, response.status_code, response.text

  def vanish():  # a stream read for a moment, then dropped
    with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": "Tell me a long tale."}], "stream": True,
        "max_tokens": 100}) as response:
      next(response.iter_lines())
    return "vanished", 200, ""

  mixed = _mixed_requests() * 2
  burst = [("burst", json.dumps({"messages": [{"role": "user", "content": q}],
                                 "temperature": 0, "max_tokens": 24}).encode(), None)
           for q in QUESTIONS * 3]  # 48 at once, over the queue's 24 and the 16 rows
  with concurrent.futures.ThreadPoolExecutor(64) as pool:
    futures = [pool.submit(send, item) for item in mixed + burst]
    futures += [pool.submit(vanish) for _ in range(4)]
    results = [f.result(timeout=300) for f in futures]
  statuses = [status for _, status, _ in results]
  assert -1 not in statuses and not [s for s in statuses if s >= 500], results
  for kind, status, text in results:
    if kind == "bad":
      assert 400 <= status < 500 and json.loads(text)["error"]["message"], (status, text)
    elif kind in ("good", "burst") and status == 200:  # well-formed: answered in full
      body = json.loads(text)
      assert body["choices"][0]["message"]["content"] and body["choices"][0]["finish_reason"]
    elif kind in ("good", "burst"):  # or told to come back: the queue was full
      assert status == 429 and json.loads(text)["error"]["type"] == "rate_limit_error", text
  assert 429 in statuses  # the burst went over the queue
  assert sum(1 for kind, s, _ in results if kind in ("good", "burst") and s == 200) >= 24
  # And it still answers, with every row free again.
  answer = send(("good", json.dumps({"messages": [{"role": "user", "content": QUESTION}],
                                     "temperature": 0, "max_tokens": 16}).encode(), 200))
  assert answer[1] == 200 and "Paris" in answer[2]
  start = time.time()
  while live.load()["rows_in_use"] and time.time() - start < 20:
    time.sleep(0.1)
  assert live.load() == {"status": "ok", "model": "smollm2", "waiting": 0, "rows_in_use": 0}


def _browser():
  """Debian's headless Chromium through Selenium, or a skip (a failure under CI) naming
  the fix."""
  webdriver = pytest.importorskip("selenium.webdriver")
  chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
  if not (chromium and driver):
    message = ("the chat page's test needs Debian's chromium and chromium-driver: "
               "apt-get install chromium chromium-driver")
    if IN_CI:
      pytest.fail(message)
    pytest.skip(message)
  options = webdriver.ChromeOptions()
  options.binary_location = chromium
  for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--no-first-run"):
    options.add_argument(flag)
  from selenium.webdriver.chrome.service import Service  # pylint: disable=import-outside-toplevel
  return webdriver.Chrome(options=options, service=Service(driver))


@pytest.mark.budget(40)
def test_the_chat_page_streams_an_answer_in_a_browser(live):
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  from selenium.webdriver.support.ui import WebDriverWait  # pylint: disable=import-outside-toplevel
  browser = _browser()
  try:
    browser.set_page_load_timeout(60)
    browser.get(live.url + "/")
    browser.find_element(By.ID, "temperature").clear()
    browser.find_element(By.ID, "temperature").send_keys("0")
    box = browser.find_element(By.ID, "input")
    box.send_keys(QUESTION)
    browser.find_element(By.ID, "send").click()
    seen = []  # the answer's text as the page shows it, while it streams in
    def finished(driver):
      answers = driver.find_elements(By.CSS_SELECTOR, ".message.assistant")
      if answers:
        seen.append(answers[-1].text)
      return answers and answers[-1].get_attribute("data-done") == "true"
    WebDriverWait(browser, TIMEOUT, poll_frequency=0.05).until(finished)
    answer = browser.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1].text
    assert "Paris" in answer
    assert browser.find_element(By.CSS_SELECTOR, ".message.user").text == QUESTION
    assert any(0 < len(text) < len(answer) for text in seen)  # it grew: streamed
    assert "smollm2" in browser.find_element(By.ID, "model").text
  finally:
    browser.quit()


@pytest.mark.budget(60)
def test_sigterm_lets_requests_in_flight_finish_and_exits_0(char_gpt_run, tmp_path):
  server = Server(tmp_path / "server.log", f"--init_from={char_gpt_run}", "--rows=4",
                  "--chunk_steps=1", "--drain_seconds=20")
  try:
    server.wait_ready()
    results, started, opened = [], threading.Event(), threading.Semaphore(0)
    def stream():
      text, finish = "", None
      with httpx.stream("POST", server.url + "/v1/completions", timeout=TIMEOUT, json={
          "prompt": "ROMEO:", "max_tokens": 10, "temperature": 1.0, "seed": 1,
          "stream": True}) as response:
        opened.release()  # the server holds this request (its headers came back)
        for line in response.iter_lines():
          if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            started.set()
      results.append((text, finish))
    threads = [threading.Thread(target=stream) for _ in range(12)]  # 4 rows: some wait
    for t in threads:
      t.start()
    assert started.wait(60), server.log.read_text()[-3000:]
    # Every request received before the signal (one still in the kernel's queue of
    # connections was never the server's to finish); some are still waiting for a row.
    assert all(opened.acquire(timeout=60) for _ in threads), server.log.read_text()[-3000:]
    server.process.send_signal(signal.SIGTERM)
    for t in threads:
      t.join(60)
    assert server.process.wait(60) == 0
  finally:
    server.stop()
  # Every request in flight or waiting ran to its end: 10 characters or a stop.
  assert len(results) == 12 and all(finish in ("length", "stop") for _, finish in results)
  log = server.log.read_text()
  assert "Traceback" not in log and "stopped" in log


@pytest.mark.budget(30)
def test_a_lora_run_is_served_with_its_adapters(char_gpt_run, tmp_path):
  from helpers.cli import final, run_cli  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from purejax import engine  # pylint: disable=import-outside-toplevel
  from purejax import weights  # pylint: disable=import-outside-toplevel
  from purejax.cli import train as train_cli  # pylint: disable=import-outside-toplevel
  from purejax.data import tokenizers  # pylint: disable=import-outside-toplevel
  text = tmp_path / "plays.txt"
  text.write_text("ROMEO: " * 2000)  # a fine-tune that changes what follows "ROMEO:"
  lora_run = tmp_path / "lora"
  final(run_cli(train_cli, f"--init_from={char_gpt_run}", "--lora_rank=2", "--lora_alpha=4",
                "--learning_rate=3e-2", "--max_iters=30", "--batch_size=4", "--eval_iters=1",
                "--eval_interval=30", "--sample_tokens=0", f"--dataset={text}",
                f"--out_dir={lora_run}"))

  def greedy(folder):  # the run's weights as the library loads them (adapters merged)
    params, config, spec = weights.from_pretrained(str(folder))
    ids = list(tokenizers.from_spec(spec).encode("ROMEO:"))
    ((out,),) = engine.generate(params, [ids], config, jax.random.PRNGKey(0), 8)
    return tokenizers.from_spec(spec).decode(list(out.tokens))

  server = Server(tmp_path / "server.log", f"--init_from={lora_run}", "--rows=2")
  try:
    server.wait_ready()
    served = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT, json={
        "prompt": "ROMEO:", "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"]
  finally:
    assert server.stop() == 0
  assert served == greedy(lora_run) != greedy(char_gpt_run)
