"""Bench jobs in processes of their own, under a time budget, saving after every round.

    jobs.define_flags("h,i,j", "Cases or jobs to run.")   # when run as the program
    # The scheduling process (`python -m bench.gpu --cases=h.train,j`):
    jobs.main("bench.gpu", jobs.select(FLAGS.cases, JOBS), JOBS, markdown, ["--quick=1"])
    # Each job's process (`python -m bench.gpu --worker=h.train --results=... ...`):
    jobs.run(jobs.Job("h.train", path, deadline, title="..."), job_h_train)

A job's process holds the device alone, so one job's memory, crash or hang
cannot touch the next, and peak memory is measured from an empty device.
The job writes its entry of the results file (`harness.write_results`)
after every round of its arms, so a killed job keeps what it measured; the
scheduler waits for each job, so one process writes at a time. Once the
deadline passes no round or job starts, and a job still running `grace_s`
later is killed.
"""

import datetime
import gc
from importlib import metadata
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from absl import app
from absl import flags
import jax

from bench import harness
from purejax.training.pure import flops

FLAGS = flags.FLAGS
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def define_flags(default_cases: str, cases_help: str) -> None:
  """The runner's flags; a bench defines them only when it runs as the program."""
  flags.DEFINE_list("cases", default_cases, cases_help)
  flags.DEFINE_bool("quick", False, "Fewer rounds and smaller sizes.")
  flags.DEFINE_float("time_budget_s", 1500.0, "After this, no round or job starts.")
  flags.DEFINE_float("job_grace_s", 300.0, "A job still running this long after the budget "
                     "is killed (what it measured is kept).")
  flags.DEFINE_string("out_dir", str(harness.RESULTS_DIR), "Folder of the results and log.")
  flags.DEFINE_string("out", None, "Results file (overrides the name in --out_dir).")
  # Set by the scheduling process for a job's process.
  flags.DEFINE_string("worker", None, "(internal) Run this one job here.")
  flags.DEFINE_string("results", None, "(internal) Results file of the run.")
  flags.DEFINE_float("deadline", 0.0, "(internal) Unix time the budget ends.")


def select(cases: Sequence[str], names: Sequence[str]) -> List[str]:
  """The jobs of `names` that `cases` name (a job, or a prefix before a dot), in run order."""
  named = lambda job, c: job == c or job.startswith(c + ".")
  unknown = [c for c in cases if not any(named(job, c) for job in names)]
  if unknown:
    raise app.UsageError(f"--cases: unknown {unknown}; choose among {list(names)} or the "
                         f"part of a name before a dot.")
  return [job for job in names if any(named(job, c) for c in cases)]


def describe(e: BaseException) -> str:
  """An exception in a line, with where it was raised (for a results file)."""
  frames = traceback.extract_tb(e.__traceback__)
  where = f" (at {pathlib.Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
  message = str(e).strip().replace("\n", " | ")
  if len(message) > 800:
    message = message[:500] + " ... " + message[-300:]
  return f"{type(e).__name__}: {message}{where}"


class Job:
  """One job in its process: its deadline and its entry in the results file."""

  def __init__(self, name: str, path: pathlib.Path, deadline: float, title: str = "",
               min_rounds: int = 2):
    self.name, self.path, self.deadline, self.min_rounds = name, path, deadline, min_rounds
    self.result = {"title": title or name, "status": "running", "rows": {}, "errors": {},
                   "notes": []}

  def save(self) -> None:
    results = harness.read_results(self.path)
    results.setdefault("results", {})[self.name] = self.result
    harness.write_results(self.path, results)

  def out_of_time(self) -> bool:
    return time.time() > self.deadline

  def error(self, where: str, e: BaseException) -> None:
    self.result["errors"][where] = describe(e)
    print(f"[{self.name}] {where}: {traceback.format_exc()}", flush=True)
    self.save()

  def note(self, text: str) -> None:
    if text not in self.result["notes"]:
      self.result["notes"].append(text)

  def build(self, factories: Dict[str, Callable[[], harness.Arm]]) -> Dict[str, harness.Arm]:
    """Builds (and warms up) each arm; one that fails is recorded and left out."""
    arms = {}
    for name, factory in factories.items():
      try:
        if arms and self.out_of_time():
          raise TimeoutError("not built: time budget spent")
        arms[name] = factory()
      except Exception as e:  # pylint: disable=broad-except
        self.error(name, e)
        free_memory(torch_too="torch" in name)
    return arms

  def alternate(self, arms: Dict[str, harness.Arm], rounds: int,
                publish: Callable[[Dict[str, List[float]]], None]) -> None:
    """`harness.alternate` within the budget; `publish(times)` sets the rows after every
    round, and the results are saved."""
    times = harness.alternate(arms, rounds, min_rounds=self.min_rounds,
                              out_of_time=self.out_of_time, on_error=self.error,
                              after_round=lambda t: (publish(t), self.save()))
    if self.out_of_time() and max(map(len, times.values()), default=0) < rounds:
      self.note(f"stopped before {rounds} rounds: time budget spent")


def run(job: Job, fn: Callable[[Job], None]) -> None:
  """Runs `fn(job)` in a job's process, recording "done", or "failed" and the error."""
  job.save()
  try:
    fn(job)
    job.result["status"] = "done"
  except Exception as e:  # pylint: disable=broad-except
    job.result["status"] = "failed"
    job.error("job", e)
  job.save()


# ----------------------------------------------------------------------------
# Freeing a job's device memory between arms


def free_memory(torch_too: bool, drop_compiled: bool = False) -> None:
  """Frees what the last arm held; `drop_compiled` also forgets every compiled program
  (only between tries of one arm: elsewhere other arms still run theirs)."""
  gc.collect()
  if drop_compiled:
    jax.clear_caches()
  if torch_too:
    import torch  # pylint: disable=g-import-not-at-top
    if drop_compiled:
      torch._dynamo.reset()  # pylint: disable=protected-access
    if torch.cuda.is_available():
      torch.cuda.empty_cache()
      torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------
# The scheduling process


def spawn(module: str, job: str, args: Sequence[str], log: pathlib.Path, timeout: float
          ) -> Tuple[Optional[int], float]:
  """Runs `python -m <module> --worker=<job> <args>` in a process group of its own.

  Returns:
    (its exit code, None if it was killed after `timeout` seconds; seconds it ran).
  """
  # JAX shares the GPU with torch in one process, so it allocates as needed
  # instead of taking 75% up front; its pool may still grow to 95%.
  env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
             XLA_PYTHON_CLIENT_MEM_FRACTION="0.95")
  start = time.time()
  with open(log, "a") as out:
    out.write(f"\n===== {job} ({datetime.datetime.now().isoformat(timespec='seconds')}) =====\n")
    out.flush()
    # A session of its own: on a timeout the whole group goes, torch's compile workers too.
    proc = subprocess.Popen([sys.executable, "-m", module, f"--worker={job}", *args],
                            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      return proc.wait(timeout=max(timeout, 1.0)), time.time() - start
    except subprocess.TimeoutExpired:
      return None, time.time() - start
    finally:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def log_tail(log: pathlib.Path, chars: int) -> str:
  return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def schedule(names: Sequence[str], titles: Dict[str, str], module: str, path: pathlib.Path,
             log: pathlib.Path, deadline: float, grace_s: float, args: Sequence[str]) -> None:
  """Runs each job in turn (`spawn`), recording in `path` any that is skipped, killed or crashed.

  Each job's process gets `--results=<path> --deadline=<deadline>` and `args`.
  """
  started = time.time()
  for name in names:
    remaining = deadline - time.time()
    code, seconds = "skipped", 0.0
    if remaining > 0:
      code, seconds = spawn(module, name, [f"--results={path}", f"--deadline={deadline}",
                                           *args], log, remaining + grace_s)
    results = harness.read_results(path)
    entry = results.setdefault("results", {}).setdefault(
        name, {"title": titles.get(name, name), "errors": {}})
    if code == "skipped":
      entry.update(status="skipped", errors={"job": "not started: time budget spent"})
    elif code != 0 or entry.get("status") == "running":
      entry["status"] = "killed" if code is None else "crashed"
      entry.setdefault("errors", {})["process"] = (
          f"killed after {seconds:.0f} s (time budget + grace)" if code is None else
          f"exit code {code}; log tail: {log_tail(log, 800)}")
    results.setdefault("meta", {})["seconds"] = time.time() - started
    harness.write_results(path, results)
    errors = entry.get("errors")
    print(f"  {name}: {entry.get('status')} in {seconds:.0f} s"
          + (f"; errors: {list(errors)}" if errors else ""), flush=True)


def environment(job: Job) -> None:
  """The "env" job: devices and versions, as JAX, torch and nvidia-smi see them."""
  device = jax.devices()[0]
  job.result.update(jax=jax.__version__, backend=jax.default_backend(),
                    device_kind=device.device_kind,
                    peak_flops_bf16=flops.device_peak_flops(device, "bfloat16"),
                    **harness.device_memory())
  versions = job.result.setdefault("versions", {})
  for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "torch", "optax"):
    try:
      versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  try:
    import torch  # pylint: disable=g-import-not-at-top
    if torch.cuda.is_available():
      job.result.update(torch_device_name=torch.cuda.get_device_name(),
                        cudnn=torch.backends.cudnn.version())
  except ImportError as e:
    job.result["errors"]["torch"] = describe(e)
  if shutil.which("nvidia-smi"):
    job.result["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=60).stdout.strip()


def main(module: str, names: Sequence[str], titles: Dict[str, str],
         table: Callable[[dict], str], args: Sequence[str]) -> pathlib.Path:
  """The scheduling process: reads the devices (the "env" job), then runs `names`.

  The results go to `<out_dir>/<date>-<gpu|cpu>-<cases>[-quick].json` (or
  `--out`), the jobs' output to the `.log` beside it; `args` go to every
  job's process. Prints `table(results)`; returns the results file.
  """
  started = time.time()
  print(f"{module}: reading the devices ...", flush=True)
  with tempfile.TemporaryDirectory() as tmp:  # the results file is named after the device
    env_file, env_log = pathlib.Path(tmp) / "env.json", pathlib.Path(tmp) / "env.log"
    schedule(["env"], {}, module, env_file, env_log, started + 300, 0, args)
    env = harness.read_results(env_file)["results"].get("env", {})
    env_output = log_tail(env_log, 1 << 20)
  platform = "cpu" if env.get("backend") in (None, "cpu") else "gpu"
  cases = "".join(FLAGS.cases) if all(len(c) == 1 for c in FLAGS.cases) else "_".join(
      FLAGS.cases)
  stem = f"{datetime.date.today().isoformat()}-{platform}-{cases}"
  path = (pathlib.Path(FLAGS.out) if FLAGS.out else harness.unused_results_path(
      pathlib.Path(FLAGS.out_dir), stem + ("-quick" if FLAGS.quick else "")))
  log = path.with_suffix(".log")
  path.parent.mkdir(parents=True, exist_ok=True)
  log.write_text(env_output)
  device = env.get("torch_device_name") or env.get("device_kind")
  harness.write_results(path, {"meta": {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "command": " ".join([f"python -m {module}"] + sys.argv[1:]), "quick": FLAGS.quick,
      "time_budget_s": FLAGS.time_budget_s, "jobs": list(names), "device": device,
      "env": env}, "results": {}})
  print(f"{module}: {device}, jax {env.get('jax')}; jobs {list(names)}; results in {path}",
        flush=True)
  schedule(names, titles, module, path, log, started + FLAGS.time_budget_s,
           FLAGS.job_grace_s, args)
  versions = env.get("versions", {})
  print(f"\n{device}; jax {versions.get('jax')}, jaxlib {versions.get('jaxlib')}, torch "
        f"{versions.get('torch')}; ratio = arm time / reference time per round, median "
        f"(min-max), above 1: the reference (`vs` in the file) is faster\n")
  print(table(harness.read_results(path)["results"]))
  print(f"wrote {path} (job output: {log})")
  return path
