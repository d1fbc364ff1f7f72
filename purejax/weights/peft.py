"""A LoRA fine-tune's adapters in PEFT's format, to load onto the base model in transformers.

    peft.to_peft(adapters, lora_config, config, "adapter-dir", base_model="path/to/base")
    # then: peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir)

The folder holds `adapter_config.json` and `adapter_model.safetensors`, as
PEFT's `save_pretrained` writes them. purejax's adapters sit on its fused
dense layers (`attn.qkv` holds q, k and v side by side; `mlp.fc` gate and
up); PEFT's on each Hugging Face projection. The split is exact: the update
`A B` of a fused weight is `A B_q | A B_k | A B_v`, so each projection gets
the shared `A` and its own columns of `B`, at the same rank. PEFT scales by
`lora_alpha / r`, as purejax does (`lora.merge`). Llama-family models only.
"""

import json
import pathlib
import shutil
from typing import Any, Dict, Optional

import numpy as np

from purejax import _files
from purejax import gpt
from purejax import lora
from purejax.weights import huggingface
from purejax.weights import llama
from purejax.weights.errors import ConversionError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers."


def adapter_tensors(adapters: lora.Adapters, config: gpt.GPTConfig
                    ) -> Dict[str, np.ndarray]:
  """PEFT's `{name: tensor}` of purejax adapters (float32, `lora_A` `[r, in]`, `lora_B` `[out, r]`).

  Raises:
    ConversionError: the model is not of the Llama family, or an adapter sits
      on a weight PEFT's Llama names do not cover.
  """
  llama.hf_config_dict(config)  # refuses models outside the family
  tensors = {}
  known = {f"blocks.{sub}.{dense}.w": (names, cuts)
           for (sub, dense), names, cuts in llama.fused_projections(config)}
  for path, ab in adapters.items():
    if path not in known:
      raise ConversionError(f"the adapter of {path} has no PEFT name (PEFT's Llama adapters "
                            f"sit on the blocks' attention and MLP projections).")
    names, cuts = known[path]
    a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
    for i in range(config.n_layer):
      for name, piece in zip(names, np.split(b[i], cuts, axis=-1)):
        key = f"{_PREFIX}{i}.{name}"
        tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
        tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(piece.T)
  return tensors


def adapter_config(adapters: lora.Adapters, lora_config: lora.LoraConfig,
                   config: gpt.GPTConfig, base_model: Optional[str]) -> Dict[str, Any]:
  """PEFT's `adapter_config.json` for these adapters."""
  known = {f"blocks.{sub}.{dense}.w": names
           for (sub, dense), names, _ in llama.fused_projections(config)}
  modules = sorted({name.split(".")[-1] for path in adapters for name in known.get(path, ())})
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank_of(adapters),
          "lora_alpha": lora_config.scale_alpha, "lora_dropout": 0.0, "bias": "none",
          "target_modules": modules, "fan_in_fan_out": False, "use_rslora": False,
          "inference_mode": True, "base_model_name_or_path": base_model}


# The tokenizer files an adapter folder carries (as trainers save them beside the
# adapters): enough for `AutoTokenizer.from_pretrained(folder)` and its chat template.
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def to_peft(adapters: lora.Adapters, lora_config: lora.LoraConfig, config: gpt.GPTConfig,
            out_dir: str, *, base_model: Optional[str] = None,
            overwrite: bool = False, tokenizer_spec=None) -> pathlib.Path:
  """Writes the adapters as a PEFT folder (whole or not at all); returns its path.

  Args:
    adapters: a LoRA run's adapters (`lora.init`'s structure), unmerged.
    lora_config: their rank, alpha and targets.
    config: the base model's config (Llama family).
    out_dir: the folder to create.
    base_model: recorded as `base_model_name_or_path` (the run's `init_from`).
    overwrite: replace an existing non-empty `out_dir`.
    tokenizer_spec: the run's tokenizer: its `tokenizer.json`, chat template
      and special tokens are written beside the adapters (`TOKENIZER_FILES`).

  Raises:
    ConversionError: see `adapter_tensors`; `out_dir` exists and not `overwrite`.
  """
  huggingface.check_target(out_dir, overwrite)
  tensors = adapter_tensors(adapters, config)
  settings = adapter_config(adapters, lora_config, config, base_model)
  safetensors = huggingface.import_safetensors()
  out = pathlib.Path(out_dir).expanduser().absolute()
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = _files.make_temp(out, directory=True)
  try:
    safetensors.numpy.save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(settings, indent=2))
    if tokenizer_spec is not None:
      tokenizer_file, tokenizer_text, extra = huggingface.tokenizer_files(tokenizer_spec,
                                                                         config)
      if tokenizer_file:
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
      if tokenizer_text:
        (tmp / "tokenizer.json").write_text(tokenizer_text, encoding="utf-8")
      for name in TOKENIZER_FILES:
        if name in extra.files:
          (tmp / name).write_text(json.dumps(extra.files[name], indent=2, ensure_ascii=False),
                                  encoding="utf-8")
    for path in tmp.iterdir():
      _files.fsync(path)
    _files.publish_dir(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out
