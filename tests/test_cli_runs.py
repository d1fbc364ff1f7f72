"""The command line as a user drives it: own corpora, pretrained weights, what a run shows.

Each test runs the `purejax.train` (and `sample`, `convert`) command line on a tiny
model and a corpus the test writes itself: in-process (`run_cli`, and `refusal` for
what it must refuse), or as `python -m purejax.train` where the story needs a
process of its own (a terminal, a SIGKILL, modules hidden from the interpreter).
"""

import json
import os
import pickle
import pty
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers.cli import SHORT_FLAGS, TINY_FLAGS, final, refusal, run_cli
from helpers.data import REPO_ROOT, need
from purejax import checkpoint
from purejax.cli import convert
from purejax.cli import sample
from purejax.cli import train
from purejax.training.effects import monitor

pytestmark = pytest.mark.slow



def test_a_text_file_trains_and_its_tokens_are_cached(tmp_path, text_file):
  cache, own_text = tmp_path / "cache", tmp_path / "plays.txt"
  own_text.write_text(text_file.read_text())  # this test changes it
  args = [*TINY_FLAGS, *SHORT_FLAGS, f"--dataset={own_text}", f"--cache_dir={cache}"]
  metrics = final(run_cli(train, *args, f"--out_dir={tmp_path / 'a'}"))
  assert metrics["step"] == 20 and metrics["val_loss"] < 4.0
  assert len(list(cache.glob("*.tokens"))) == 1
  own_text.write_text(own_text.read_text() + "\nA changed line.\n")
  final(run_cli(train, *args, f"--out_dir={tmp_path / 'b'}"))
  assert len(list(cache.glob("*.tokens"))) == 2  # the changed file was tokenized again


def test_a_nanogpt_bin_folder_trains_unchanged(tmp_path, capsys):
  chars = sorted(set("hello world, said the nanoGPT folder.\n"))
  stoi = {c: i for i, c in enumerate(chars)}
  text = "hello world, said the nanoGPT folder.\n" * 400
  ids = np.array([stoi[c] for c in text], np.uint16)
  folder = tmp_path / "shakespeare_char"
  folder.mkdir()
  ids[:14000].tofile(folder / "train.bin")
  ids[14000:].tofile(folder / "val.bin")
  with open(folder / "meta.pkl", "wb") as f:
    pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
  final(run_cli(train, *TINY_FLAGS, *SHORT_FLAGS, f"--dataset={folder}",
                f"--out_dir={tmp_path / 'run'}", "--learning_rate=1e-2"))
  evals = [r["val_loss"] for r in monitor.read_metrics(tmp_path / "run") if r["kind"] == "eval"]
  assert evals[-1] < evals[0] - 0.5, evals  # it learned from the .bin ids
  bad = ids.copy()
  bad[5] = 999
  bad.tofile(folder / "val.bin")
  assert "999" in refusal(capsys, train, *TINY_FLAGS, *SHORT_FLAGS, f"--dataset={folder}",
                         f"--out_dir={tmp_path / 'bad'}")
  assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").iterdir())


def test_hugging_face_weights_fine_tune_evaluate_and_export(tmp_path, text_file, capsys):
  torch = need("torch")
  transformers = need("transformers")
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=2))
  hf = tmp_path / "tiny-gpt2"
  model.save_pretrained(hf)
  # No tokenizer is recorded with these weights: the user names one.
  assert "--tokenizer=char" in refusal(capsys, train, f"--init_from={hf}",
                                       f"--dataset={text_file}", f"--out_dir={tmp_path / 'x'}")
  assert "--n_layer has no effect on weights" in refusal(
      capsys, train, f"--init_from={hf}", "--n_layer=3", f"--out_dir={tmp_path / 'x'}")
  args = ["--tokenizer=char", f"--dataset={text_file}", "--batch_size=8", "--eval_iters=4",
          "--sample_tokens=20", "--learning_rate=1e-2", "--warmup_iters=5", *SHORT_FLAGS]
  before = final(run_cli(train, f"--init_from={hf}", "--eval_only", *args,
                         f"--out_dir={tmp_path / 'eval'}"))
  tuned = final(run_cli(train, f"--init_from={hf}", *args, f"--out_dir={tmp_path / 'tuned'}"))
  assert tuned["val_loss"] < before["val_loss"] - 0.5, (before, tuned)
  after = final(run_cli(train, "--eval_only", *args, f"--out_dir={tmp_path / 'tuned'}"))
  np.testing.assert_allclose(after["val_loss"], tuned["val_loss"], rtol=1e-5)
  exported = tmp_path / "exported"
  converted = run_cli(convert, f"--from=purejax:{tmp_path / 'tuned'}", f"--to=hf:{exported}")
  assert converted.returncode == 0, converted.stderr[-2000:]
  transformers.GPT2LMHeadModel.from_pretrained(exported)
  sampled = run_cli(sample, f"--out_dir={tmp_path / 'tuned'}", "--start=ROMEO:", "--show_prompt",
                    "--max_new_tokens=10")
  assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr[-2000:]


def test_data_errors_are_one_line(tmp_path, text_file, char_gpt_run, capsys):
  out = f"--out_dir={tmp_path / 'run'}"
  assert "does not exist" in refusal(capsys, train, "--dataset=/no/such/file.txt", out)
  assert "has no effect" in refusal(capsys, train, f"--dataset={text_file}",
                                    f"--tfds_manual_dir={tmp_path}", out)
  assert "--tfds_manual_dir" in refusal(capsys, train,
                                        f"--tfds_manual_dir={tmp_path / 'none'}", out)
  assert "--init_from=/no/such/model" in refusal(capsys, train, "--init_from=/no/such/model",
                                                 out)
  # A char model meets text with characters it has never seen.
  other = tmp_path / "other.txt"
  other.write_text("Ünïcödé text the model has never seen. " * 200)
  assert "not in the model's vocabulary" in refusal(
      capsys, train, f"--init_from={char_gpt_run}", f"--dataset={other}", out)
  assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("ckpt_*"))


@pytest.mark.budget(25)
def test_progress_bar_on_a_terminal_and_plain_lines_otherwise(tmp_path, text_file):
  flags = [*TINY_FLAGS, "--max_iters=40", "--eval_interval=20", "--log_interval=10",
           "--steps_per_call=5", f"--dataset={text_file}"]
  piped = run_cli(train, *flags, f"--out_dir={tmp_path / 'piped'}")  # not a terminal
  assert piped.returncode == 0, piped.stderr[-2000:]
  assert "\r" not in piped.stdout + piped.stderr
  assert "step    40 | loss" in piped.stdout
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", COLUMNS="120")
  pid, fd = pty.fork()
  if pid == 0:  # the child runs the training on the terminal
    os.chdir(REPO_ROOT)
    os.execve(sys.executable, [sys.executable, "-m", "purejax.train", *flags,
                               f"--out_dir={tmp_path / 'tty'}"], env)
  output = b""
  while True:
    try:
      chunk = os.read(fd, 4096)
    except OSError:
      break
    if not chunk:
      break
    output += chunk
  _, status = os.waitpid(pid, 0)
  text = output.decode(errors="replace")
  assert os.waitstatus_to_exitcode(status) == 0, text[-2000:]
  assert re.search(r"\r(?!\n)", text) and "40/40" in text  # a bar redrawn in place
  counts = [int(n) for n in re.findall(r"\b(\d+)/40\b", text)]
  assert counts == sorted(counts) and counts[-1] == 40  # it moved forward to the end


@pytest.mark.budget(25)
def test_metrics_survive_a_sigkill_and_resume_without_duplicates(tmp_path, text_file):
  out_dir = tmp_path / "run"
  flags = [*TINY_FLAGS, "--max_iters=200", "--eval_interval=20", "--log_interval=5",
           "--steps_per_call=5", f"--dataset={text_file}", f"--out_dir={out_dir}"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  process = subprocess.Popen([sys.executable, "-m", "purejax.train", *flags], cwd=REPO_ROOT,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 300
  while not checkpoint.list_checkpoints(str(out_dir)) or len(
      monitor.read_metrics(out_dir)) < 12:
    assert process.poll() is None and time.monotonic() < deadline
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.wait()
  lines = (out_dir / "metrics.jsonl").read_text().splitlines()
  complete = lines if (out_dir / "metrics.jsonl").read_text().endswith("\n") else lines[:-1]
  for line in complete:
    json.loads(line)  # every complete line is valid JSON
  resumed = run_cli(train, *flags, "--resume")  # in-process: the kill is the story
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  records = monitor.read_metrics(out_dir)
  for kind in ("train", "eval"):
    steps = [r["step"] for r in records if r["kind"] == kind]
    assert steps == sorted(set(steps)), steps  # strictly increasing
  assert [r["step"] for r in records if r["kind"] == "train"][-1] == 200


def test_trains_on_an_image_with_only_jax(tmp_path):
  # GPU images often carry JAX, optax, chex, absl and numpy only. Hide the
  # rest: the default dataset then comes from the text in the package.
  hidden = ["tensorflow", "tensorflow_datasets", "tiktoken", "safetensors", "tensorboardX",
            "tqdm", "matplotlib", "transformers", "torch"]
  script = (f"import sys, runpy\n"
            f"for name in {hidden!r}:\n"
            f"  sys.modules[name] = None\n"
            f"sys.argv = ['train'] + sys.argv[1:]\n"
            f"runpy.run_module('purejax.train', run_name='__main__')\n")
  process = subprocess.run(
      [sys.executable, "-c", script, *TINY_FLAGS, "--max_iters=10", "--eval_interval=10",
       "--log_interval=5", "--steps_per_call=5", f"--out_dir={tmp_path}"],
      capture_output=True, text=True, cwd=REPO_ROOT, timeout=600,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  metrics = final(process)
  assert metrics["step"] == 10
  assert "tiny_shakespeare (embedded text; TFDS not installed)" in process.stdout
  assert (tmp_path / "metrics.jsonl").exists()
