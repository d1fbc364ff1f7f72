"""GGUF files in and out (`purejax.weights.gguf_files`), on tiny files written here.

Each test writes its own small GGUF with llama.cpp's `gguf` package: the
tensor types read, the query/key row order llama.cpp's RoPE wants, the
types written, the tokenizer carried across, and the one-line refusals.
The real model's checks against transformers are in test_real_gguf.py.
"""

import dataclasses
import json
import signal
import subprocess
import sys

import chex
import jax
import ml_dtypes
import numpy as np
import pytest

from helpers.cli import refusal
from helpers.data import REPO_ROOT, need
from purejax import gpt
from purejax import weights
from purejax.cli import convert as cli_convert
from purejax.data import gguf_reader
from purejax.data import gguf_tokenizer
from purejax.data import tokenizers
from purejax.data.tokenizer_spec import TokenizerSpec
from purejax.weights import gguf_files
from purejax.weights import llama

gguf = need("gguf")
Q = gguf.GGMLQuantizationType

# head_dim 128 and widths of 256: every type's blocks (32 or 256 values) fit a row.
# GGUF stores norm_eps as float32, and reads back as that float32's value.
CONFIG = gpt.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=256,
                       dropout=0.0, bias=False, norm="rmsnorm", norm_eps=float(np.float32(1e-5)),
                       position="rope",
                       rope_theta=10000.0, mlp="swiglu", mlp_hidden=256, n_kv_head=1,
                       tie_embeddings=False)
# A byte-level vocabulary: GPT-2's 256 byte characters, no merges, two control tokens.
_ALPHABET = list(gguf_tokenizer._bytes_to_unicode().values())  # pylint: disable=protected-access
TOKENS = ["<s>", "</s>"] + _ALPHABET[:254]


def random_params(seed=0):
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(seed))
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(tree, [np.asarray(p) + 0.05 * rng.standard_normal(p.shape,
                                                                             np.float32)
                                   for p in leaves])


def write_gguf(path, state, types=None, arch="llama", tokens=TOKENS, template="{{ x }}"):
  """A GGUF of Hugging Face-named float32 `state`, each tensor of `types[name]` (F32 default).

  Query/key rows are reordered for llama.cpp's RoPE as its converter does
  (written out here, not taken from purejax). K-quant types, which the gguf
  package cannot quantize, get random blocks with small scales.
  """
  types = types or {}
  w = gguf.GGUFWriter(str(path), arch)
  w.add_context_length(CONFIG.block_size)
  w.add_embedding_length(CONFIG.n_embd)
  w.add_block_count(CONFIG.n_layer)
  w.add_feed_forward_length(CONFIG.mlp_width)
  w.add_head_count(CONFIG.n_head)
  w.add_head_count_kv(CONFIG.kv_heads)
  w.add_rope_freq_base(CONFIG.rope_theta)
  w.add_layer_norm_rms_eps(CONFIG.norm_eps)
  if tokens:
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template(template)
  names = {hf: gguf_files._gguf_name(hf) for hf in state}  # pylint: disable=protected-access
  written = {}
  for hf, value in state.items():
    name = names[hf]
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
      heads = CONFIG.n_head if ".attn_q." in name else CONFIG.kv_heads
      value = value.reshape(heads, 2, -1, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)
    kind = types.get(hf, Q.F32)
    if kind == Q.F32:
      data = value.astype(np.float32)
    elif kind == Q.F16:
      data = value.astype(np.float16)
    else:
      try:
        data = gguf.quants.quantize(value, kind)
      except NotImplementedError:
        data = random_blocks(value.shape, kind)
    w.add_tensor(name, data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    written[hf] = gguf.quants.dequantize(data, kind).reshape(value.shape)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return written  # what the file holds, dequantized, in llama.cpp's row order


# Byte offsets of a block's float16 scales (d, dmin), in llama.cpp's layouts.
_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
           Q.IQ4_NL: (0,)}


def random_blocks(shape, kind):
  block, size = gguf.GGML_QUANT_SIZES[kind]
  rng = np.random.default_rng(1)
  data = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
  blocks = data.reshape(-1, size)
  for offset in _SCALES[kind]:
    blocks[:, offset:offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
  return data


def hf_state(params):
  return llama.state_from_params(params, CONFIG)


def unpermuted(rows, heads):
  """llama.cpp's query/key rows back in Hugging Face's order (the converter's inverse)."""
  return rows.reshape(heads, -1, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def test_every_read_type_dequantizes_with_the_gguf_package(tmp_path):
  state = hf_state(random_params())
  kinds = [Q[name] for name in gguf_files.READ_TYPES]
  matrices = [name for name in state if state[name].ndim == 2]
  assert len(matrices) >= len(kinds)
  types = dict(zip(matrices, kinds))
  held = write_gguf(tmp_path / "m.gguf", state, types)
  params, config, _ = weights.from_pretrained(str(tmp_path / "m.gguf"))
  assert config == CONFIG
  got = llama.state_from_params(params, config)
  for name, kind in types.items():
    want = held[name]
    if ".q_proj." in name or ".k_proj." in name:
      want = unpermuted(want, CONFIG.n_head if ".q_proj." in name else CONFIG.kv_heads)
    np.testing.assert_array_equal(got[name], want, err_msg=kind.name)
    if kind.name not in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):  # quantized from `state`
      scale = np.abs(state[name]).max()
      bits = {"F32": 0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2}.get(kind.name, 0.2)
      assert np.abs(got[name] - state[name]).max() <= bits * scale, kind.name


def test_kept_blocks_run_as_the_dequantized_file_and_other_types_are_named(tmp_path, caplog):
  from purejax.ops import kernels
  from purejax.ops import quant
  state = hf_state(random_params())
  # Each layer's projections in the kept types, mixed across layers and within the
  # fused q/k/v and gate/up weights; the head in a type not kept.
  kept = ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"]
  matrices = [name for name in state if state[name].ndim == 2 and "layers" in name]
  types = {name: Q[kept[i % len(kept)]] for i, name in enumerate(matrices)}
  types.update({"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q5_1})
  write_gguf(tmp_path / "m.gguf", state, types)
  floats, config, _ = gguf_files.from_gguf(str(tmp_path / "m.gguf"))
  with caplog.at_level("WARNING"):
    params, _, _ = gguf_files.from_gguf(str(tmp_path / "m.gguf"), keep_quantized=True)
  warned = [r.getMessage() for r in caplog.records if "kept as float32" in r.getMessage()]
  assert len(warned) == 1 and "1 Q5_1 tensor" in warned[0]
  is_kept = lambda x: isinstance(x, quant.QuantizedWeight)
  for path in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"):
    sub, dense = path.split(".")
    assert is_kept(params["blocks"][sub][dense]["w"]), path
  assert is_kept(params["wte"]["embedding"]) and params["wte"]["embedding"].shape == (256, 256)
  assert not is_kept(params["lm_head"]["w"])
  as_floats = jax.tree.map(quant.dense, params, is_leaf=is_kept)
  chex.assert_trees_all_equal(as_floats, jax.tree.map(np.asarray, floats))
  tokens = np.arange(12)[None] % 256
  forms = kernels.select("cpu")
  np.testing.assert_array_equal(np.asarray(gpt.forward(params, tokens, config, forms=forms)),
                                np.asarray(gpt.forward(floats, tokens, config, forms=forms)))


def test_tensors_read_in_pieces_load_as_read_whole_as_device_arrays(tmp_path, monkeypatch):
  # The loader reads and decodes a tensor a few rows at a time (a token embedding is
  # never held twice); pieces of 3 rows here, against the whole tensor at once.
  from purejax.ops import quant
  state = hf_state(random_params())
  types = {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q4_K,
           "model.layers.0.mlp.up_proj.weight": Q.Q5_0, "model.layers.1.mlp.up_proj.weight":
           Q.F16}
  write_gguf(tmp_path / "m.gguf", state, types)
  whole = [gguf_files.from_gguf(str(tmp_path / "m.gguf"), keep_quantized=keep)[0]
           for keep in (False, True)]
  monkeypatch.setattr(gguf_files, "_CHUNK_BYTES", 3 * 256 * 4)  # 3 rows of 256 float32
  pieces = [gguf_files.from_gguf(str(tmp_path / "m.gguf"), keep_quantized=keep)[0]
            for keep in (False, True)]
  assert isinstance(pieces[1]["wte"]["embedding"], quant.QuantizedWeight)
  for a, b in zip(whole, pieces):
    chex.assert_trees_all_equal(a, b)
    # Device arrays in C order, as the model reads them: no copy on each call.
    for leaf in jax.tree.leaves(b):
      assert isinstance(leaf, jax.Array), type(leaf)


@pytest.mark.parametrize("keep", [False, True])
def test_a_truncated_file_is_a_one_line_error(tmp_path, keep):
  path = tmp_path / "m.gguf"
  write_gguf(path, hf_state(random_params()), {"model.embed_tokens.weight": Q.Q8_0})
  data = path.read_bytes()
  path.write_bytes(data[:len(data) - 1000])  # the header whole, the last tensor cut
  with pytest.raises(weights.ConversionError, match="truncated: download it again"):
    weights.from_gguf(str(path), keep_quantized=keep)


def test_another_type_is_a_one_line_error_naming_it(tmp_path):
  state = hf_state(random_params())
  write_gguf(tmp_path / "m.gguf", state, {"model.layers.0.mlp.up_proj.weight": Q.IQ4_NL})
  with pytest.raises(weights.ConversionError, match=r"up\.weight is IQ4_NL, a type purejax"):
    weights.from_gguf(str(tmp_path / "m.gguf"))


def test_a_file_is_parsed_once_and_read_again_when_it_is_rewritten(tmp_path):
  path = tmp_path / "m.gguf"
  write_gguf(path, hf_state(random_params()))
  header = gguf_tokenizer.read_header(str(path))
  assert gguf_tokenizer.read_header(str(tmp_path / "." / "m.gguf")) is header  # kept
  write_gguf(path, hf_state(random_params()), tokens=TOKENS[:-1])  # a new file, same path
  again = gguf_tokenizer.read_header(str(path))
  assert again is not header
  assert len(gguf_tokenizer.read_fields(str(path))["tokens"]) == len(TOKENS) - 1
  path.write_bytes(b"not a gguf")
  with pytest.raises(tokenizers.TokenizerError, match="is not a GGUF file"):
    gguf_tokenizer.read_header(str(path))


def test_the_header_reader_reads_what_the_gguf_package_reads(tmp_path):
  gguf = need("gguf")
  path = tmp_path / "m.gguf"
  write_gguf(path, hf_state(random_params()), {"model.layers.0.mlp.up_proj.weight": Q.Q4_K})
  theirs = gguf.GGUFReader(str(path))
  ours = gguf_reader.read(str(path))
  assert ours.meta == {key: field.contents() for key, field in theirs.fields.items()
                       if not key.startswith("GGUF.")}
  tensors = list(gguf_reader.tensors(str(path), ours))
  assert [t.name for t in tensors] == [t.name for t in theirs.tensors]
  for mine, their in zip(tensors, theirs.tensors):
    assert mine.tensor_type == their.tensor_type and list(mine.shape) == list(their.shape)
    np.testing.assert_array_equal(mine.data, their.data, err_msg=mine.name)


def rope_scores(q, k, pairs):
  """Attention scores of one head after RoPE, the pairs rotated together being
  `(i, i + d/2)` ("half", Hugging Face's) or `(2i, 2i + 1)` ("interleaved", llama.cpp's)."""
  d = q.shape[-1]
  pos = np.arange(q.shape[0])[:, None]
  angle = pos / 10000.0 ** (np.arange(0, d, 2) / d)
  cos, sin = np.cos(angle), np.sin(angle)

  def rotate(x):
    a, b = (x[:, :d // 2], x[:, d // 2:]) if pairs == "half" else (x[:, 0::2], x[:, 1::2])
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

  return rotate(q) @ rotate(k).T


def test_llama_query_key_rows_are_in_llama_cpps_rope_order(tmp_path):
  # The file's rows under llama.cpp's (interleaved) RoPE give the scores that
  # Hugging Face's rows give under its rotate-half RoPE.
  params = random_params()
  state = hf_state(params)
  held = write_gguf(tmp_path / "m.gguf", state)
  x = np.random.default_rng(3).standard_normal((5, CONFIG.n_embd)).astype(np.float32)
  d = CONFIG.head_dim
  hf_q = x @ state["model.layers.0.self_attn.q_proj.weight"][:d].T
  hf_k = x @ state["model.layers.0.self_attn.k_proj.weight"][:d].T
  cpp_q = x @ held["model.layers.0.self_attn.q_proj.weight"][:d].T
  cpp_k = x @ held["model.layers.0.self_attn.k_proj.weight"][:d].T
  np.testing.assert_allclose(rope_scores(cpp_q, cpp_k, "interleaved"),
                             rope_scores(hf_q, hf_k, "half"), rtol=1e-4, atol=1e-4)
  # purejax reads them back into its (rotate-half) order: the same logits.
  params_back, config, _ = weights.from_gguf(str(tmp_path / "m.gguf"))
  ids = np.arange(12)[None] % 256
  np.testing.assert_allclose(gpt.forward(params_back, ids, config),
                             gpt.forward(params, ids, CONFIG), rtol=1e-5, atol=1e-5)


def test_qwen2_rows_are_kept_and_its_qkv_biases_read(tmp_path):
  config = dataclasses.replace(CONFIG, qkv_bias=True)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  params = jax.tree.map(lambda p: np.asarray(p) + 0.05, params)
  state = llama.state_from_params(params, config)
  write_gguf(tmp_path / "q.gguf", state, arch="qwen2")
  got, got_config, _ = weights.from_gguf(str(tmp_path / "q.gguf"))
  assert got_config == config
  jax.tree.map(np.testing.assert_array_equal, got, jax.tree.map(np.asarray, params))


# Exports a GGUF and is killed once its tensors are in the temporary file.
KILLED_EXPORT = """
import sys, time, gguf
from purejax import weights
params, config, spec = weights.from_gguf(sys.argv[1])
write_tensors = gguf.GGUFWriter.write_tensors_to_file
def write_then_wait(self, *args, **kwargs):
  write_tensors(self, *args, **kwargs)
  print("written", flush=True)
  time.sleep(600)
gguf.GGUFWriter.write_tensors_to_file = write_then_wait
weights.to_gguf(params, config, sys.argv[2], spec)
"""


def test_an_export_killed_midway_leaves_no_file_after_the_next(tmp_path):
  write_gguf(tmp_path / "src.gguf", hf_state(random_params()))
  out = tmp_path / "out.gguf"
  process = subprocess.Popen([sys.executable, "-c", KILLED_EXPORT, str(tmp_path / "src.gguf"),
                              str(out)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
  assert process.stdout.readline().strip() == "written"
  process.send_signal(signal.SIGKILL)
  process.wait()
  (left,) = tmp_path.glob(".out.gguf.*.tmp")  # the whole file but its rename
  assert not out.exists() and left.stat().st_size > 0
  params, config, spec = weights.from_gguf(str(tmp_path / "src.gguf"))
  weights.to_gguf(params, config, str(out), spec)  # the user runs it again
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf", "src.gguf"]


@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0"])
def test_written_files_read_back_as_the_rounded_weights(tmp_path, gguf_type):
  params = random_params()
  write_gguf(tmp_path / "src.gguf", hf_state(params))
  params, config, spec = weights.from_gguf(str(tmp_path / "src.gguf"))
  out = weights.to_gguf(params, config, str(tmp_path / "out.gguf"), spec, gguf_type=gguf_type)
  back, back_config, back_spec = weights.from_gguf(str(out))
  assert back_config == config and back_spec.fingerprint == spec.fingerprint

  def rounded(w):
    if w.ndim == 1:  # norms stay float32
      return w
    if gguf_type == "f16":
      return w.astype(np.float16).astype(np.float32)
    if gguf_type == "bf16":
      return w.astype(ml_dtypes.bfloat16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0).reshape(w.shape)

  want = {name: rounded(w) for name, w in llama.state_from_params(params, config).items()}
  got = llama.state_from_params(back, config)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  meta = gguf_reader.read(str(out)).meta
  assert meta["general.architecture"] == "llama"
  assert meta["llama.context_length"] == CONFIG.block_size
  assert meta["llama.attention.head_count_kv"] == CONFIG.kv_heads
  assert meta["tokenizer.chat_template"] == "{{ x }}"
  assert meta["tokenizer.ggml.tokens"] == TOKENS and meta["tokenizer.ggml.add_bos_token"]


@pytest.mark.parametrize("block_size, written", [(16, 32), (64, 64)])
def test_a_fine_tune_states_the_base_models_context_not_its_blocks(tmp_path, block_size,
                                                                   written):
  # A run fine-tunes the 32-token model on 16-token blocks: the file keeps the
  # base's context (rotary positions carry that far); a longer block is stated as is.
  write_gguf(tmp_path / "src.gguf", hf_state(random_params()))
  params, config, spec = weights.from_gguf(str(tmp_path / "src.gguf"))
  tuned = dataclasses.replace(config, block_size=block_size)
  out = weights.to_gguf(params, tuned, str(tmp_path / "out.gguf"), spec)
  meta = gguf_reader.read(str(out)).meta
  assert meta["llama.context_length"] == written


def test_the_tokenizer_and_its_chat_data_travel_in_the_spec(tmp_path):
  write_gguf(tmp_path / "m.gguf", hf_state(random_params()), template="{{ bos_token }}hi")
  _, _, spec = weights.from_gguf(str(tmp_path / "m.gguf"))
  assert (spec.kind, spec.vocab_size, spec.bos_token, spec.eos_token, spec.add_bos,
          spec.chat_template) == ("gguf", 256, "<s>", "</s>", True, "{{ bos_token }}hi")
  again = TokenizerSpec.from_dict(spec.to_dict())
  assert again == spec
  tok = tokenizers.from_spec(again)
  text = "héllo <s>"
  ids = tok.encode(text)
  assert ids[-1] == 0 and tok.decode(ids) == text  # the control token matched whole
  other = tmp_path / "other.gguf"
  write_gguf(other, hf_state(random_params()), tokens=TOKENS[:-1] + ["zz"])
  with pytest.raises(tokenizers.TokenizerError, match="another tokenizer"):
    tokenizers.from_spec(spec, encoding_file=str(other))


def test_a_load_records_the_spec_of_the_tokenizer_it_does_not_build(tmp_path):
  # The load only records the tokenizer (building a 262144-token one costs seconds):
  # the record is what building it gives, user-defined tokens outside the vocabulary's
  # spelling (which take new ids) counted.
  cases = {"bytes": TOKENS, "user": TOKENS[:-2] + ["<tool>", "a b"]}
  for name, tokens in cases.items():
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, hf_state(random_params()), tokens=tokens)
    fields = gguf_tokenizer.read_fields(str(path))
    if name == "user":
      fields["token_type"] = [3, 3] + [1] * (len(tokens) - 4) + [4, 4]  # 4: USER_DEFINED
    built = gguf_tokenizer.from_fields(fields, str(path)).spec()
    assert gguf_tokenizer.spec_of_fields(fields, str(path)) == built, name
  assert built.vocab_size == 257  # "a b" is spelled outside GPT-2's alphabet: a new id
  write_sentencepiece_gguf(tmp_path / "spm.gguf")
  fields = gguf_tokenizer.read_fields(str(tmp_path / "spm.gguf"))
  assert (gguf_tokenizer.spec_of_fields(fields, str(tmp_path / "spm.gguf"))
          == gguf_tokenizer.from_fields(fields, str(tmp_path / "spm.gguf")).spec())
  _, _, spec = weights.from_gguf(str(tmp_path / "spm.gguf"))
  assert spec == gguf_tokenizer.load(str(tmp_path / "spm.gguf")).spec()


def test_a_plain_prompt_starts_with_bos_where_the_file_says_so(tmp_path):
  # llama.cpp prepends BOS to a prompt when the file's add_bos_token says so (a base
  # Gemma's continuation depends on it); sampling and /v1/completions do too.
  write_gguf(tmp_path / "m.gguf", hf_state(random_params()))
  tok = gguf_tokenizer.load(str(tmp_path / "m.gguf"))
  assert tok.add_bos and tok.bos_token == "<s>"
  text = tok.encode("héllo").tolist()
  assert tokenizers.prompt_ids(tok, "héllo") == [0] + text
  assert tokenizers.prompt_ids(tok, "<s>héllo") == [0] + text  # not twice
  chars = tokenizers.CharTokenizer("abc")
  assert tokenizers.prompt_ids(chars, "cab") == [2, 0, 1]  # no BOS to add


def test_convert_writes_gguf_and_refuses_bad_input(tmp_path, capsys):
  src = tmp_path / "src.gguf"
  write_gguf(src, hf_state(random_params()))
  out = tmp_path / "out.gguf"
  assert cli_convert.run(["convert", f"--from=gguf:{src}", f"--to=gguf:{out}",
                          "--gguf_type=q8_0"]) == 0
  assert gguf.GGUFReader(str(out)).get_tensor(0).tensor_type in (Q.Q8_0, Q.F32)
  assert "exists" in refusal(capsys, cli_convert, f"--from=gguf:{src}", f"--to=gguf:{out}")
  (tmp_path / "not.gguf").write_text("hello")
  assert "not a GGUF file" in refusal(capsys, cli_convert, f"--from=gguf:{tmp_path}/not.gguf",
                                      f"--to=gguf:{tmp_path}/x.gguf")
  write_gguf(tmp_path / "g.gguf", hf_state(random_params()), arch="gemma")
  assert "'gemma' model" in refusal(capsys, cli_convert, f"--from=gguf:{tmp_path}/g.gguf",
                                    f"--to=gguf:{tmp_path}/y.gguf")
  folder = tmp_path / "hf"
  assert cli_convert.run(["convert", f"--from=gguf:{src}", f"--to=hf:{folder}"]) == 0
  _, _, folder_spec = weights.from_pretrained(str(folder))
  assert folder_spec.kind == "tokenizer.json"  # the GGUF's tokenizer, as a file
  # ... with what the GGUF says about talking to the model: its template, its
  # special tokens, and the eos id generate stops at.
  tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
  assert (tokenizer_config["chat_template"], tokenizer_config["eos_token"]) == ("{{ x }}", "</s>")
  assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 1
  assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 1
  text = "héllo </s>"
  assert (tokenizers.from_spec(folder_spec).encode(text).tolist()
          == gguf_tokenizer.load(str(src)).encode(text).tolist())
  # and back: a byte-level tokenizer.json becomes GGUF metadata with the same ids
  again = tmp_path / "again.gguf"
  assert cli_convert.run(["convert", f"--from=hf:{folder}", f"--to=gguf:{again}"]) == 0
  assert (gguf_tokenizer.load(str(again)).encode(text).tolist()
          == gguf_tokenizer.load(str(src)).encode(text).tolist())
  meta = gguf_reader.read(str(again)).meta
  assert meta["tokenizer.chat_template"] == "{{ x }}"  # the folder's template, carried back
  assert meta["tokenizer.ggml.eos_token_id"] == 1 and meta["tokenizer.ggml.add_bos_token"]
  gpt2_like = gpt.GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)
  with pytest.raises(weights.ConversionError, match="neither GPT-2's"):
    weights.to_gguf(gpt.init_params(gpt2_like, jax.random.PRNGKey(0)), gpt2_like,
                    str(tmp_path / "z.gguf"), tokenizers.ids_spec(256))


@pytest.mark.slow
def test_written_files_load_in_transformers_with_purejaxs_logits(tmp_path):
  # transformers' GGUF loader on each written type: the logits purejax computes
  # from the same rounded weights (the f16/bf16/q8_0 values the file holds).
  torch = need("torch")
  transformers = need("transformers")
  write_gguf(tmp_path / "src.gguf", hf_state(random_params()))
  params, config, spec = weights.from_gguf(str(tmp_path / "src.gguf"))
  ids = np.random.default_rng(0).integers(0, 256, (2, 12))
  for gguf_type in gguf_files.WRITE_TYPES:
    out = weights.to_gguf(params, config, str(tmp_path / f"{gguf_type}.gguf"), spec,
                          gguf_type=gguf_type)
    back, _, _ = weights.from_gguf(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=out.name, dtype=torch.float32).eval()
    with torch.no_grad():
      theirs = model(torch.from_numpy(ids)).logits.numpy()
    ours = np.asarray(gpt.forward(back, ids, config))
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max(), gguf_type


def write_sentencepiece_gguf(path):
  """A one-layer llama GGUF with a small SentencePiece vocabulary: byte tokens, scored
  pieces and no merges (as Llama 2's files have)."""
  pieces = ["▁", "a", "b", "h", "e", "l", "o", "w", "r", "d", "▁a", "ab", "▁ab", "he", "ll",
            "llo", "hello", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "▁h", "el"]
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
  w = gguf.GGUFWriter(str(path), "llama")
  for add, value in [("add_context_length", 16), ("add_embedding_length", 64),
                     ("add_block_count", 1), ("add_feed_forward_length", 64),
                     ("add_head_count", 2), ("add_head_count_kv", 2),
                     ("add_layer_norm_rms_eps", 1e-5)]:
    getattr(w, add)(value)
  w.add_tokenizer_model("llama")
  w.add_token_list(tokens)
  w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
  w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_unk_token_id(0)
  rng = np.random.default_rng(0)
  shapes = {"token_embd.weight": (len(tokens), 64), "output_norm.weight": (64,)}
  for name in ("attn_norm", "ffn_norm"):
    shapes[f"blk.0.{name}.weight"] = (64,)
  for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
    shapes[f"blk.0.{name}.weight"] = (64, 64)
  for name, shape in shapes.items():
    w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.slow
def test_tokenizer_ids_equal_transformers_gguf_tokenizer(tmp_path):
  # Both tokenizer models: SentencePiece BPE (merges from the scores, byte
  # fallback, BOS by default) here, byte-level BPE on the real model.
  transformers = need("transformers")
  write_sentencepiece_gguf(tmp_path / "spm.gguf")
  ours = gguf_tokenizer.load(str(tmp_path / "spm.gguf"))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
  for text in ["hello world", "ab hello", "  hello\nworld é", "hellohello ab</s>"]:
    ids = ours.encode(text).tolist()
    assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
    assert ours.decode(ids) == theirs.decode(ids)
  assert ours.add_bos and theirs("hi")["input_ids"][0] == 1
