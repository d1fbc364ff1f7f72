"""nanoGPT checkpoints in and out: `ckpt.pt` (needs torch) and a character model's `meta.pkl`.

    params, config, tok_spec = nanogpt.from_nanogpt("out/ckpt.pt")
    nanogpt.to_nanogpt(params, config, "ckpt.pt", tokenizer_spec=tok_spec)

nanoGPT stores dense weights as `nn.Linear` does, `[out, in]`, and ties
`lm_head.weight` to the token embedding. `purejax.weights.gpt2` maps the
tensors onto purejax's params; `purejax.weights.torch_files` reads and writes them
with torch. `meta.pkl` is read by `purejax.data.tokenizers.read_nanogpt_meta`, without running
pickled code.
"""

import pathlib
import pickle
from typing import Any, Dict, Optional, Tuple

import numpy as np

from purejax import _files
from purejax import gpt
from purejax.data import tokenizers
from purejax.data.tokenizer_spec import TokenizerSpec
from purejax.weights import gpt2
from purejax.weights import torch_files
from purejax.weights.errors import ConversionError

Params = Dict[str, Any]

_NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")


def from_nanogpt(
    ckpt_path: str,
    *,
    meta_path: Optional[str] = None,
    allow_pickle: bool = False,
) -> Tuple[Params, gpt.GPTConfig, TokenizerSpec]:
  """Imports nanoGPT's `ckpt.pt` (needs torch).

  nanoGPT's MLP uses the exact (erf) GELU, purejax the tanh approximation
  GPT-2 was trained with; logits differ by ~1e-3, the approximation nanoGPT
  itself makes when it loads GPT-2's weights.

  Args:
    ckpt_path: the checkpoint (`{"model_args", "model", ...}`), as nanoGPT's
      train.py writes it; `torch.compile`'s `_orig_mod.` prefixes are fine.
    meta_path: nanoGPT's `meta.pkl` of a character model; default the
      `meta.pkl` beside the checkpoint, if any.
    allow_pickle: load files holding more than tensors and plain containers
      (runs pickled code: only for trusted files).

  Returns:
    `(params, config, tokenizer_spec)`. The spec is, in order: read from
    `meta_path`; the one `to_nanogpt` recorded; read from a `meta.pkl`
    beside the checkpoint. Failing all three, a vocabulary of
    50257 ids or more is taken to be GPT-2's, as nanoGPT's sample.py does
    (the rows past 50257 are nanoGPT's padding).

  Raises:
    ConversionError: missing or damaged file, not a nanoGPT checkpoint,
      unsupported model_args, or weights that do not fit.
  """
  path = pathlib.Path(ckpt_path).expanduser()
  ckpt = torch_files.load(path, allow_pickle)
  if not isinstance(ckpt, dict) or "model_args" not in ckpt or "model" not in ckpt:
    raise ConversionError(f"{path} is not a nanoGPT checkpoint (a dict with 'model_args' "
                          f"and 'model').")
  args = dict(ckpt["model_args"])
  unknown = sorted(set(args) - set(_NANOGPT_ARGS))
  if unknown:
    raise ConversionError(f"{path}: model_args {unknown} are not nanoGPT's; purejax's GPT "
                          f"supports only {', '.join(_NANOGPT_ARGS)}.")
  try:
    config = gpt.GPTConfig(
        vocab_size=int(args["vocab_size"]), block_size=int(args["block_size"]),
        n_layer=int(args["n_layer"]), n_head=int(args["n_head"]),
        n_embd=int(args["n_embd"]), dropout=float(args.get("dropout", 0.0)),
        bias=bool(args.get("bias", True)))
  except KeyError as e:
    raise ConversionError(f"{path}: model_args lacks {e}.") from None
  except (ValueError, TypeError) as e:
    raise ConversionError(f"{path}: {e}") from e
  state = gpt2.strip_prefixes(torch_files.tensors_to_numpy(ckpt["model"], path),
                                      ("_orig_mod.", "transformer."))
  params = gpt2.params_from_state(state, config, transposed=True, source=str(path))

  meta = pathlib.Path(meta_path) if meta_path else path.parent / "meta.pkl"
  recorded = ckpt.get("tokenizer")
  if not meta_path and isinstance(recorded, dict) and "type" in recorded:
    try:
      spec = TokenizerSpec.from_dict(recorded)  # written by to_nanogpt
    except tokenizers.TokenizerError as e:
      raise ConversionError(f"{path}: {e}") from e
  elif meta_path or meta.is_file():
    try:
      tokenizer = tokenizers.read_nanogpt_meta(str(meta))
    except tokenizers.TokenizerError as e:
      raise ConversionError(str(e)) from e
    if tokenizer.vocab_size > config.vocab_size:
      raise ConversionError(f"{meta} has {tokenizer.vocab_size} characters but the model "
                            f"only {config.vocab_size} ids; pass the model's own meta.pkl.")
    spec = tokenizer.spec()
  elif config.vocab_size >= tokenizers.GPT2_VOCAB_SIZE:
    spec = tokenizers.gpt2_spec()
  else:
    spec = tokenizers.ids_spec(config.vocab_size)
  return params, config, spec


def to_nanogpt(
    params: Params,
    config: gpt.GPTConfig,
    path: str,
    *,
    tokenizer_spec: Optional[TokenizerSpec] = None,
    dataset: Optional[str] = None,
    overwrite: bool = False,
) -> pathlib.Path:
  """Writes a `ckpt.pt` that nanoGPT's `sample.py` (`init_from='resume'`) loads (needs torch).

  The file holds `model_args` and the `model` state dict (`nn.Linear`
  weights `[out, in]`, `lm_head.weight` the same tensor as
  `transformer.wte.weight`), plus `iter_num` 0, `config` (`{"dataset": dataset}`)
  and the tokenizer spec under `"tokenizer"` (nanoGPT ignores it). It has
  no optimizer state, so nanoGPT's train.py cannot resume from it. The
  vocabulary is kept as is, padding included (nanoGPT pads too). With a
  character tokenizer spec, nanoGPT's `meta.pkl` is written beside it;
  nanoGPT's `sample.py` reads it from `data/<dataset>/meta.pkl`.
  Written atomically (temp file, then rename).

  Args:
    params: purejax GPT params.
    config: their config.
    path: the checkpoint file to write.
    tokenizer_spec: the model's tokenizer spec; a character one also writes
      `meta.pkl`.
    dataset: the training data's name (`Corpus.name`), recorded as
      `config["dataset"]`; nanoGPT's `sample.py` looks for the vocabulary in
      `data/<dataset>/meta.pkl`.
    overwrite: replace an existing file.

  Returns:
    The checkpoint's path.

  Raises:
    ConversionError: `path` exists and not `overwrite`.
  """
  # What the model and target allow is checked before the optional dependency: a
  # model nanoGPT cannot hold is refused as such, torch or not.
  check_target(path, overwrite)
  state = gpt2.state_from_params(params, config, transposed=True)
  torch = torch_files.import_torch("writing a nanoGPT checkpoint")
  # Copies: arrays that came from jax are read-only, which torch tensors cannot wrap.
  model = {f"transformer.{name}": torch.from_numpy(np.array(value))
           for name, value in state.items()}
  model["lm_head.weight"] = model["transformer.wte.weight"]  # tied: one storage
  ckpt = {
      "model": model,
      "model_args": {"n_layer": config.n_layer, "n_head": config.n_head,
                     "n_embd": config.n_embd, "block_size": config.block_size,
                     "bias": config.bias, "vocab_size": config.vocab_size,
                     "dropout": config.dropout},
      "iter_num": 0,
      "config": {"dataset": dataset} if dataset else {},
  }
  if tokenizer_spec:
    # nanoGPT ignores keys it does not know; from_nanogpt reads it back, so
    # the real vocabulary size survives the trip.
    ckpt["tokenizer"] = tokenizer_spec.to_dict()
  out = pathlib.Path(path).expanduser()
  out.parent.mkdir(parents=True, exist_ok=True)
  _files.atomic_write(out, lambda f: torch.save(ckpt, f))
  if tokenizer_spec and tokenizer_spec.kind == "char":
    chars = tokenizer_spec.chars
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)),
            "stoi": {c: i for i, c in enumerate(chars)}}
    _files.atomic_write(out.parent / "meta.pkl", lambda f: pickle.dump(meta, f))
  return out


def check_target(path: str, overwrite: bool) -> None:
  """Refuses to replace an existing file unless `overwrite` (checked before any work)."""
  target = pathlib.Path(path).expanduser()
  if target.exists() and not overwrite:
    raise ConversionError(f"{target} exists; pass `overwrite` to replace it, or choose "
                          f"another file.")
