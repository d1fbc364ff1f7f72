"""Gemma 3 in GGUF files (llama.cpp's `gemma3` architecture), in and out.

A tiny random `Gemma3ForCausalLM` is built offline with llama.cpp's gemma3
conventions, which a GGUF file cannot state otherwise: every 6th layer global
(here six layers, the last global), a sliding window shorter than the test
sequence, the sliding layers' RoPE base 10000, `query_pre_attn_scalar ==
head_dim` (transformers' GGUF loader leaves it at its default, 256, so
head_dim is 256), no soft-caps, a tied head. Every weight, norms included,
is moved off its init. purejax imports its Hugging Face folder and writes
GGUF files; transformers' GGUF loader must compute the original model's
logits from them, and `from_gguf` must read back what was written. The
tokenizer is a Gemma-style SentencePiece vocabulary (`<pad>`, `<eos>`,
`<bos>`, `<unk>`, byte tokens, scored pieces, no prefix space) carried by a
tokenizer-only GGUF file, as a model read from a Gemma GGUF carries it.
"""

import dataclasses
import re

import numpy as np
import pytest

from helpers.data import need
from purejax import gpt
from purejax import nn
from purejax.data import gguf_reader
from purejax.data import gguf_tokenizer
from purejax.data import tokenizers
from purejax.weights import gguf_files
from purejax.weights import huggingface
from purejax.weights import llama
from purejax.weights.errors import ConversionError

pytestmark = pytest.mark.slow  # a conversion's round trips: the full suite's

gguf = need("gguf")
Q = gguf.GGMLQuantizationType

WINDOW = 5
N_LAYER = 6  # layers 0-4 slide, layer 5 is global: llama.cpp's every-6th rule
PIECES = ["▁", "a", "b", "h", "e", "l", "o", "w", "r", "d", "▁a", "ab", "▁ab", "he", "ll",
          "llo", "hello", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "▁h", "el", "\n",
          "▁▁", "lo"]
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
VOCAB = len(TOKENS)  # 288: one token per embedding row, as llama.cpp wants
EPS = float(np.float32(1e-6))  # GGUF stores the epsilon as float32


def write_tokenizer_gguf(path):
  """A tokenizer-only GGUF with Gemma's SentencePiece layout (as llama.cpp's converter
  writes Gemma 3's: model "llama", scores, token types, BOS prepended, no prefix space)."""
  w = gguf.GGUFWriter(str(path), "gemma3")
  w.add_tokenizer_model("llama")
  w.add_tokenizer_pre("default")
  w.add_token_list(TOKENS)
  w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * len(PIECES))
  w.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(PIECES))])
  w.add_bos_token_id(2)
  w.add_eos_token_id(1)
  w.add_unk_token_id(3)
  w.add_pad_token_id(0)
  w.add_add_bos_token(True)
  w.add_add_eos_token(False)
  w.add_add_space_prefix(False)
  w.add_chat_template("{{ bos_token }}{{ messages[0]['content'] }}")
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
  """`(torch model, purejax params, config, tokenizer spec, tmp folder)`."""
  torch = need("torch")
  transformers = need("transformers")
  root = tmp_path_factory.mktemp("gemma3_gguf")
  hf_config = transformers.Gemma3TextConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=N_LAYER,
      num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
      sliding_window=WINDOW, max_position_embeddings=64, rms_norm_eps=EPS,
      final_logit_softcapping=None,
      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
  torch.manual_seed(0)
  model = transformers.Gemma3ForCausalLM(hf_config)
  with torch.no_grad():
    for p in model.parameters():  # norms start at 0 (a scale of 1): move them too
      p.add_(0.05 * torch.randn_like(p))
  model.eval()
  model.save_pretrained(root / "hf")
  params, config, _ = huggingface.from_huggingface(str(root / "hf"))
  write_tokenizer_gguf(root / "tokenizer.gguf")
  spec = gguf_tokenizer.load(str(root / "tokenizer.gguf")).spec()
  return model, params, config, spec, root


def ids(batch=2, length=20, seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, length))


def torch_logits(model, tokens):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(tokens))).logits.numpy()


def load_in_transformers(path):
  """transformers' GGUF loader on `path` (alone in its folder: no config.json beside it)."""
  torch = need("torch")
  transformers = need("transformers")
  return transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def f32_file(gemma):
  _, params, config, spec, root = gemma
  (root / "f32").mkdir()
  return gguf_files.to_gguf(params, config, str(root / "f32" / "model.gguf"), spec,
                            gguf_type="f32")


def test_the_model_is_one_llama_cpp_can_hold(gemma):
  _, _, config, _, _ = gemma
  assert config.layer_kinds == (1, 1, 1, 1, 1, 0) and config.window == WINDOW
  assert config.attn_scalar == config.head_dim == 256
  assert config.kind_rope(1) == (10000.0, None) and config.rope_theta == 50000.0
  assert config.logit_softcap is None and config.tie_embeddings


def test_the_file_has_llama_cpps_names_metadata_and_norms_plus_one(gemma, f32_file):
  _, params, config, _, _ = gemma
  header = gguf_reader.read(str(f32_file))
  meta = header.meta
  assert meta["general.architecture"] == "gemma3"
  assert (meta["gemma3.attention.key_length"], meta["gemma3.attention.value_length"],
          meta["gemma3.attention.sliding_window"], meta["gemma3.rope.freq_base"],
          meta["gemma3.block_count"]) == (256, 256, WINDOW, 50000.0, N_LAYER)
  assert meta["tokenizer.ggml.model"] == "llama"
  assert meta["tokenizer.ggml.add_space_prefix"] is False
  tensors = {t.name: t for t in gguf_reader.tensors(str(f32_file), header)}
  assert "output.weight" not in tensors  # tied
  assert {n.split(".", 2)[2] for n in tensors if n.startswith("blk.0.")} == {
      f"{part}.weight" for part in (
          "attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
          "attn_output", "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up",
          "ffn_down", "post_ffw_norm")}
  stored = np.asarray(tensors["blk.0.post_ffw_norm.weight"].data)
  np.testing.assert_array_equal(stored, params["blocks"]["ln_mlp_out"]["scale"][0] + 1)
  np.testing.assert_array_equal(np.asarray(tensors["blk.0.attn_q_norm.weight"].data),
                                params["blocks"]["attn"]["q_norm"]["scale"][0] + 1)
  assert all(t.tensor_type == Q.F32 for t in tensors.values())


def test_transformers_loads_the_export_with_the_original_logits(gemma, f32_file):
  model, _, _, _, _ = gemma
  loaded = load_in_transformers(f32_file)
  assert loaded.config.layer_types == model.config.layer_types
  tokens = ids()  # 20 positions, a window of 5
  np.testing.assert_allclose(torch_logits(loaded, tokens), torch_logits(model, tokens),
                             atol=1e-5, rtol=1e-5)


def test_from_gguf_reads_back_what_was_written(gemma, f32_file):
  model, params, config, spec, _ = gemma
  back, back_config, back_spec = gguf_files.from_gguf(str(f32_file))
  assert back_config == config
  assert (back_spec.kind, back_spec.fingerprint, back_spec.bos_token, back_spec.eos_token,
          back_spec.add_bos, back_spec.chat_template) == (
              "gguf", spec.fingerprint, "<bos>", "<eos>", True, spec.chat_template)
  want = llama.state_from_params(params, config)
  got = llama.state_from_params(back, back_config)
  assert set(got) == set(want)
  for name, w in want.items():
    if name.endswith("norm.weight"):  # the file holds float32(1 + w); reading subtracts 1
      w = (w + np.float32(1)) - np.float32(1)
    np.testing.assert_array_equal(got[name], w, err_msg=name)
  tokens = ids(seed=1)
  np.testing.assert_allclose(gpt.forward(back, tokens, back_config), torch_logits(model, tokens),
                             atol=1e-5, rtol=1e-5)


def test_a_q8_0_file_reads_back_as_its_rounded_weights_in_both_loaders(gemma, tmp_path):
  model, params, config, spec, _ = gemma
  out = gguf_files.to_gguf(params, config, str(tmp_path / "q8.gguf"), spec, gguf_type="q8_0")
  kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
  assert kinds["blk.0.attn_q.weight"] == Q.Q8_0 and kinds["blk.0.attn_norm.weight"] == Q.F32
  back, back_config, _ = gguf_files.from_gguf(str(out))
  assert back_config == config
  got = llama.state_from_params(back, back_config)
  for name, w in llama.state_from_params(params, config).items():
    if w.ndim == 2:
      w = gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0).reshape(w.shape)
    else:
      w = (w + np.float32(1)) - np.float32(1)
    np.testing.assert_array_equal(got[name], w, err_msg=name)
  tokens = ids(seed=2)
  ours = np.asarray(gpt.forward(back, tokens, back_config))
  theirs = torch_logits(load_in_transformers(out), tokens)
  assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()
  original = torch_logits(model, tokens)  # 8-bit weights: close, not equal
  assert np.abs(ours - original).max() <= 0.1 * np.abs(original).max()


@pytest.mark.parametrize("change, named", [
    (dict(window_pattern="SSL"), "window_pattern='SSL'"),
    (dict(window=None, window_pattern=None), "window=None"),
    (dict(rope_local_theta=500.0), "rope_local_theta=500.0"),
    (dict(attn_scalar=24.0), "attn_scalar=24.0"),
    (dict(logit_softcap=30.0), "logit_softcap=30.0"),
    (dict(attn_softcap=50.0), "attn_softcap=50.0"),
    (dict(rope_scaling=nn.RopeScaling("llama3", 8.0)), "rope_scaling.rope_type='llama3'"),
])
def test_what_llama_cpps_gemma3_cannot_hold_is_refused_in_one_line(gemma, tmp_path, change,
                                                                   named):
  _, params, config, spec, _ = gemma
  with pytest.raises(ConversionError) as e:
    gguf_files.to_gguf(params, dataclasses.replace(config, **change),
                       str(tmp_path / "x.gguf"), spec)
  message = str(e.value)
  assert named in message and "export to hf:" in message and "\n" not in message, message
  assert not list(tmp_path.iterdir())


def test_a_file_needs_a_tokenizer_an_ids_spec_is_refused(gemma, tmp_path):
  _, params, config, _, _ = gemma
  with pytest.raises(ConversionError, match="needs the model's tokenizer"):
    gguf_files.to_gguf(params, config, str(tmp_path / "x.gguf"), tokenizers.ids_spec(VOCAB))


def reread_config(meta, **changes):
  """The config of the written file's metadata with `changes` (None deletes a key)."""
  meta = {**meta, **{f"gemma3.{k}": v for k, v in changes.items()}}
  meta = {k: v for k, v in meta.items() if v is not None}
  hf = gguf_files._hf_config(meta, set(), "m.gguf")  # pylint: disable=protected-access
  return llama.config_from_hf(hf, "m.gguf")


def test_what_llama_cpp_fixes_is_read_as_llama_cpp_reads_it(gemma, f32_file):
  # Keys newer llama.cpp reads if present: the period (or per-layer flags) of the
  # sliding layers, and their RoPE base.
  _, _, config, _, _ = gemma
  meta = gguf_reader.read(str(f32_file)).meta
  assert reread_config(meta) == config
  assert reread_config(meta, **{"attention.sliding_window_pattern": 3}).layer_kinds == (
      1, 1, 0, 1, 1, 0)
  flags = [True, False, True, True, True, False]
  assert reread_config(meta, **{"attention.sliding_window_pattern": flags}).layer_kinds == (
      1, 0, 1, 1, 1, 0)
  assert reread_config(meta, **{"rope.freq_base_swa": 500.0}).kind_rope(1) == (500.0, None)
  scaled = reread_config(meta, **{"rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
  assert scaled.kind_rope(0) == (50000.0, nn.RopeScaling("linear", 8.0))
  assert scaled.kind_rope(1) == (10000.0, None)  # the global layers' only
  # A final soft-cap is not applied by llama.cpp's graph for sliding-window models.
  assert reread_config(meta, final_logit_softcapping=30.0).logit_softcap is None
  # llama.cpp scales the 62-layer 27B's attention by n_embd / n_head, not head_dim.
  assert reread_config(meta, block_count=62).attn_scalar == 64 // 2
  for key, value, message in [("attention.sliding_window", None, "sliding_window is missing"),
                              ("rope.scaling.type", "yarn", "RoPE scaling (yarn)"),
                              ("attention.value_length", 128, "value_length=128")]:
    with pytest.raises(ConversionError, match=re.escape(message)):
      reread_config(meta, **{key: value})


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(gemma):
  transformers = need("transformers")
  _, _, _, spec, root = gemma
  ours = tokenizers.from_spec(spec)
  theirs = transformers.AutoTokenizer.from_pretrained(str(root), gguf_file="tokenizer.gguf")
  for text in ["hello world", "ab hello", "  hello\nworld é"]:
    assert ours.encode(text).tolist() == theirs(text, add_special_tokens=False)["input_ids"]
