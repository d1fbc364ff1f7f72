"""convert, huggingface, nanogpt: GPT-2 weights in and out of Hugging Face and nanoGPT formats.

The format checks run everywhere (safetensors and numpy only). The checks
against the real consumers, `transformers.GPT2LMHeadModel` and a module
with nanoGPT's layout, need torch and transformers, which the `test` extra
installs: they skip without them. Nothing here uses the network.
"""

import collections
import dataclasses
import datetime
import json
import pathlib
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers.cli import refusal, run_module
from helpers.data import SHAKESPEARE, need
from helpers.models import greedy_continuations
from purejax import checkpoint
from purejax import gpt
from purejax import weights
from purejax.cli import convert as cli_convert
from purejax.data import tokenizers
from purejax.weights import gpt2
from purejax.weights import huggingface
from purejax.weights import nanogpt
from purejax.weights import tensors

CONFIG = gpt.GPTConfig(vocab_size=101, block_size=16, n_layer=2, n_head=2, n_embd=32)


def random_params(config: gpt.GPTConfig, seed: int = 0):
  """Params with every tensor non-trivial (no unit scales or zero biases)."""
  params = gpt.init_params(config, jax.random.PRNGKey(seed))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  return jax.tree.unflatten(
      tree, [np.asarray(p + 0.1 * jax.random.normal(k, p.shape)) for p, k in zip(leaves, keys)])


def tokens(n_batch=3, length=16, vocab=101, seed=2):
  return np.random.default_rng(seed).integers(0, vocab, (n_batch, length))


def logits(params, config, ids):
  return np.asarray(gpt.forward(params, jnp.asarray(ids), config))


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def write_hf_folder(folder: pathlib.Path, params, config, valid_vocab=None):
  return huggingface.to_huggingface(params, config, str(folder), valid_vocab=valid_vocab)


# ----------------------------------------------------------------------------
# Against transformers


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
  """A random tiny GPT2LMHeadModel (weights perturbed off their init) saved as safetensors."""
  torch = need("torch")
  transformers = need("transformers")
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=101,
      bos_token_id=0, eos_token_id=0))
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  model.eval()
  folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
  model.save_pretrained(folder)
  return model, folder


def hf_logits(model, ids):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.from_numpy(ids)).logits.numpy()


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
def test_from_huggingface_computes_the_same_logits(hf_model):
  model, folder = hf_model
  params, config, spec = huggingface.from_huggingface(str(folder))
  assert config == dataclasses.replace(CONFIG, vocab_size=128)  # 101 padded to 2 * 64
  assert spec == tokenizers.ids_spec(101)
  ids = tokens()
  ours = logits(params, config, ids)
  np.testing.assert_allclose(ours[..., :101], hf_logits(model, ids), atol=1e-4, rtol=1e-4)
  assert not ours[..., 101:].any()  # zero padding rows: logits exactly 0
  assert not params["wte"]["embedding"][101:].any()


def test_to_huggingface_round_trip_through_transformers(hf_model, tmp_path):
  transformers = need("transformers")
  model, folder = hf_model
  params, config, spec = huggingface.from_huggingface(str(folder))
  out = huggingface.to_huggingface(params, config, str(tmp_path / "export"),
                                   valid_vocab=spec.vocab_size)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temp dirs left
  assert json.loads((out / "config.json").read_text())["vocab_size"] == 101
  tensors = load_file(str(out / "model.safetensors"))
  assert tensors["transformer.wte.weight"].shape == (101, 32)
  assert "lm_head.weight" not in tensors
  reloaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
  assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()
  ids = tokens(seed=5)
  np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(model, ids), atol=1e-6)
  # and back once more: the same params.
  again, config2, _ = huggingface.from_huggingface(str(out))
  assert config2 == config
  assert_trees_equal(again, params)


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
def test_greedy_generate_matches_transformers(hf_model):
  import torch  # pylint: disable=g-import-not-at-top
  model, folder = hf_model
  # The table is padded to 128 rows; the padding (logits 0) is never sampled.
  params, config, spec = huggingface.from_huggingface(str(folder))
  assert config.vocab_size == 128 and spec.vocab_size == 101
  prompt = np.array([[5, 17, 3, 99, 42]])
  ours = greedy_continuations(params, prompt, config, 11, valid_vocab=spec.vocab_size)
  with torch.no_grad():
    theirs = model.generate(torch.from_numpy(prompt), do_sample=False, max_new_tokens=11,
                            min_new_tokens=11, pad_token_id=0)
  np.testing.assert_array_equal(np.asarray(ours), theirs.numpy())


def test_sharded_safetensors_and_pytorch_bin_import_the_same(hf_model, tmp_path):
  torch = need("torch")
  model, folder = hf_model
  reference, _, _ = huggingface.from_huggingface(str(folder))
  sharded = tmp_path / "sharded"
  model.save_pretrained(sharded, max_shard_size="20KB")
  assert (sharded / "model.safetensors.index.json").is_file()
  assert_trees_equal(huggingface.from_huggingface(str(sharded))[0], reference)
  # The original GPT-2 release: pytorch_model.bin without the "transformer."
  # prefix, with causal-mask buffers.
  legacy = tmp_path / "legacy"
  legacy.mkdir()
  (legacy / "config.json").write_text((folder / "config.json").read_text())
  state = {k.removeprefix("transformer."): v for k, v in model.state_dict().items()}
  state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16))
  state["h.0.attn.masked_bias"] = torch.tensor(-1e4)
  torch.save(state, legacy / "pytorch_model.bin")
  assert_trees_equal(huggingface.from_huggingface(str(legacy))[0], reference)


def test_gpt2_name_resolves_through_the_hub_cache_only(hf_model, tmp_path, monkeypatch):
  hub = need("huggingface_hub")
  _, folder = hf_model
  monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path))
  with pytest.raises(gpt2.ConversionError) as e:
    huggingface.from_huggingface("gpt2")
  assert "not in the Hugging Face cache" in str(e.value)
  assert "pass the folder's path" in str(e.value)
  # A cache laid out as huggingface_hub writes it.
  repo = tmp_path / "models--openai-community--gpt2"
  snapshot = repo / "snapshots" / ("0" * 40)
  snapshot.mkdir(parents=True)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text("0" * 40)
  for name in ("config.json", "model.safetensors"):
    (snapshot / name).write_bytes((folder / name).read_bytes())
  params, config, _ = huggingface.from_huggingface("gpt2")
  assert config.n_layer == 2


# ----------------------------------------------------------------------------
# Against nanoGPT's layout


def nanogpt_module(config: gpt.GPTConfig):
  """A torch module with nanoGPT's module names (tanh GELU, like purejax and GPT-2)."""
  torch = need("torch")
  nn, F = torch.nn, torch.nn.functional

  class Attention(nn.Module):

    def __init__(self):
      super().__init__()
      self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
      self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
      b, t, c = x.shape
      q, k, v = (z.view(b, t, config.n_head, -1).transpose(1, 2)
                 for z in self.c_attn(x).split(c, dim=2))
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      return self.c_proj(y.transpose(1, 2).reshape(b, t, c))

  class MLP(nn.Module):

    def __init__(self):
      super().__init__()
      self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
      self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
      return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

  class Block(nn.Module):

    def __init__(self):
      super().__init__()
      self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
      self.attn = Attention()
      self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
      self.mlp = MLP()

    def forward(self, x):
      x = x + self.attn(self.ln_1(x))
      return x + self.mlp(self.ln_2(x))

  class GPT(nn.Module):

    def __init__(self):
      super().__init__()
      self.transformer = nn.ModuleDict(dict(
          wte=nn.Embedding(config.vocab_size, config.n_embd),
          wpe=nn.Embedding(config.block_size, config.n_embd),
          h=nn.ModuleList([Block() for _ in range(config.n_layer)]),
          ln_f=nn.LayerNorm(config.n_embd, bias=config.bias)))
      self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
      self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
      x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
      for block in self.transformer.h:
        x = block(x)
      return self.lm_head(self.transformer.ln_f(x))

  return GPT().eval()


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_round_trip(tmp_path, bias):
  torch = need("torch")
  config = dataclasses.replace(CONFIG, bias=bias)
  params = random_params(config)
  path = nanogpt.to_nanogpt(params, config, str(tmp_path / "out" / "ckpt.pt"))
  ckpt = torch.load(path, weights_only=True)
  assert ckpt["model_args"] == {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16,
                                "bias": bias, "vocab_size": 101, "dropout": 0.0}
  assert ckpt["model"]["transformer.h.0.mlp.c_fc.weight"].shape == (128, 32)  # [out, in]
  # nanoGPT loads the state dict strictly into its module tree.
  model = nanogpt_module(config)
  model.load_state_dict(ckpt["model"], strict=True)
  assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
  ids = tokens()
  with torch.no_grad():
    theirs = model(torch.from_numpy(ids)).numpy()
  np.testing.assert_allclose(logits(params, config, ids), theirs, atol=1e-4, rtol=1e-4)
  again, config2, spec = nanogpt.from_nanogpt(str(path))
  assert config2 == config and spec == tokenizers.ids_spec(101)
  assert_trees_equal(again, params)
  # A padded vocabulary keeps its real size through the trip.
  padded = dataclasses.replace(config, vocab_size=128)
  path = nanogpt.to_nanogpt(random_params(padded), padded, str(tmp_path / "p.pt"),
                            tokenizer_spec=tokenizers.ids_spec(101))
  assert nanogpt.from_nanogpt(str(path))[2].vocab_size == 101


def test_from_nanogpt_reads_a_training_checkpoint(tmp_path):
  """As nanoGPT's train.py saves: compiled-model prefixes, optimizer state, meta.pkl."""
  torch = need("torch")
  config = dataclasses.replace(CONFIG, vocab_size=65, dropout=0.2)
  model = nanogpt_module(config)
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
  model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
  optimizer.step()
  chars = tokenizers.CharTokenizer.from_text(SHAKESPEARE).chars
  ckpt = {
      "model": {f"_orig_mod.{k}": v for k, v in model.state_dict().items()},
      "optimizer": optimizer.state_dict(),
      "model_args": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16,
                     "bias": True, "vocab_size": 65, "dropout": 0.2},
      "iter_num": 5000,
      "best_val_loss": torch.tensor(1.47),
      "config": {"dataset": "shakespeare_char", "learning_rate": 1e-3, "compile": True},
  }
  torch.save(ckpt, tmp_path / "ckpt.pt")
  with open(tmp_path / "meta.pkl", "wb") as f:
    pickle.dump({"vocab_size": 65, "itos": dict(enumerate(chars)),
                 "stoi": {c: i for i, c in enumerate(chars)}}, f)
  params, config2, spec = nanogpt.from_nanogpt(str(tmp_path / "ckpt.pt"))
  assert config2 == config
  assert spec == tokenizers.CharTokenizer(chars).spec()
  ids = tokens(vocab=65)
  with torch.no_grad():
    theirs = model(torch.from_numpy(ids)).numpy()
  np.testing.assert_allclose(logits(params, config, ids), theirs, atol=1e-4, rtol=1e-4)
  # to_nanogpt writes meta.pkl back for a character tokenizer.
  nanogpt.to_nanogpt(params, config, str(tmp_path / "back" / "ckpt.pt"), tokenizer_spec=spec)
  assert tokenizers.read_nanogpt_meta(str(tmp_path / "back" / "meta.pkl")).chars == chars


def test_nanogpt_errors(tmp_path):
  torch = need("torch")
  params = random_params(CONFIG)
  path = nanogpt.to_nanogpt(params, CONFIG, str(tmp_path / "ckpt.pt"))
  ckpt = torch.load(path, weights_only=True)

  untied = dict(ckpt, model=dict(ckpt["model"]))
  untied["model"]["lm_head.weight"] = untied["model"]["lm_head.weight"].clone() + 1
  torch.save(untied, tmp_path / "untied.pt")
  with pytest.raises(gpt2.ConversionError, match="untied output heads are not supported"):
    nanogpt.from_nanogpt(str(tmp_path / "untied.pt"))

  fork = dict(ckpt, model_args=dict(ckpt["model_args"], use_rmsnorm=True))
  torch.save(fork, tmp_path / "fork.pt")
  with pytest.raises(gpt2.ConversionError, match=r"model_args \['use_rmsnorm'\]"):
    nanogpt.from_nanogpt(str(tmp_path / "fork.pt"))

  (tmp_path / "trunc.pt").write_bytes(path.read_bytes()[:1000])
  with pytest.raises(gpt2.ConversionError, match="truncated or damaged"):
    nanogpt.from_nanogpt(str(tmp_path / "trunc.pt"))

  with pytest.raises(gpt2.ConversionError, match="is missing"):
    nanogpt.from_nanogpt(str(tmp_path / "nope.pt"))

  # A pickled object that torch's safe loader refuses.
  torch.save({"model": {}, "model_args": {}, "extra": datetime.date(2024, 1, 1)},
             tmp_path / "obj.pt")
  with pytest.raises(gpt2.ConversionError, match="`allow_pickle`"):
    nanogpt.from_nanogpt(str(tmp_path / "obj.pt"))

  wrong_meta = tmp_path / "evil.pkl"
  wrong_meta.write_bytes(pickle.dumps({"itos": collections.OrderedDict({0: "a"})}))
  with pytest.raises(gpt2.ConversionError, match="only plain"):
    nanogpt.from_nanogpt(str(path), meta_path=str(wrong_meta))


# ----------------------------------------------------------------------------
# Format checks without torch


def test_gpt2_vocabulary_is_padded_and_unpadded(tmp_path):
  config = dataclasses.replace(CONFIG, vocab_size=50304)
  params = random_params(config)
  out = write_hf_folder(tmp_path / "gpt2ish", params, config, valid_vocab=50257)
  assert load_file(str(out / "model.safetensors"))["transformer.wte.weight"].shape == (50257, 32)
  hf_config = json.loads((out / "config.json").read_text())
  assert hf_config["vocab_size"] == 50257 and hf_config["eos_token_id"] == 50256
  again, config2, spec = huggingface.from_huggingface(str(out))
  assert config2 == config
  assert spec == tokenizers.gpt2_spec() and spec.vocab_size == 50257
  wte = again["wte"]["embedding"]
  np.testing.assert_array_equal(wte[:50257], params["wte"]["embedding"][:50257])
  assert not wte[50257:].any()


def test_bias_free_params_export_with_zero_biases(tmp_path):
  config = dataclasses.replace(CONFIG, bias=False)
  params = random_params(config)
  out = write_hf_folder(tmp_path / "nobias", params, config)
  tensors = load_file(str(out / "model.safetensors"))
  assert not tensors["transformer.h.1.mlp.c_fc.bias"].any()
  assert tensors["transformer.ln_f.bias"].shape == (32,)
  again, config2, _ = huggingface.from_huggingface(str(out), pad_vocab_multiple=1)
  assert config2.bias and config2.vocab_size == 101
  ids = tokens()
  np.testing.assert_allclose(logits(again, config2, ids), logits(params, config, ids),
                             atol=1e-5)


def test_to_huggingface_is_atomic_and_does_not_clobber(tmp_path, monkeypatch):
  params = random_params(CONFIG)
  out = write_hf_folder(tmp_path / "m", params, CONFIG)
  with pytest.raises(gpt2.ConversionError, match="pass `overwrite`"):
    write_hf_folder(out, params, CONFIG)
  params2 = random_params(CONFIG, seed=7)
  huggingface.to_huggingface(params2, CONFIG, str(out), overwrite=True)
  assert_trees_equal(huggingface.from_huggingface(str(out), pad_vocab_multiple=1)[0], params2)

  import safetensors.numpy  # pylint: disable=g-import-not-at-top

  def crash(tensors, filename, metadata=None):
    pathlib.Path(filename).write_bytes(b"half a file")
    raise KeyboardInterrupt

  monkeypatch.setattr(safetensors.numpy, "save_file", crash)
  with pytest.raises(KeyboardInterrupt):
    huggingface.to_huggingface(params, CONFIG, str(tmp_path / "crashed"))
  with pytest.raises(KeyboardInterrupt):
    huggingface.to_huggingface(params, CONFIG, str(out), overwrite=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp folders left
  assert_trees_equal(huggingface.from_huggingface(str(out), pad_vocab_multiple=1)[0], params2)


@pytest.fixture
def hf_folder(tmp_path):
  return write_hf_folder(tmp_path / "model", random_params(CONFIG), CONFIG)


def edit_config(folder: pathlib.Path, **changes):
  path = folder / "config.json"
  cfg = json.loads(path.read_text())
  cfg.update(changes)
  path.write_text(json.dumps(cfg))


# An architecture that does not convert (the Llama family does: tests/test_llama.py).
MIXTRAL_CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                  "hidden_size": 32, "num_hidden_layers": 2, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("changes, message", [
    (MIXTRAL_CONFIG, "describes a 'mixtral' model (MixtralForCausalLM); only GPT-2"),
    ({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]},
     "describes a 'gpt_neox' model (GPTNeoXForCausalLM)"),
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"n_inner": 100}, "n_inner=100"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=false"),
    ({"n_embd": 64}, "do not belong together"),
    ({"n_layer": 3}, "missing ['h.2.attn.c_attn.bias'"),
    ({"vocab_size": 120}, "wte.weight has 101 rows but config.json says vocab_size=120"),
    ({"n_head": 5}, "n_head=5 does not divide n_embd=32"),
])
def test_unsupported_configs_are_one_line_errors(hf_folder, changes, message):
  edit_config(hf_folder, **changes)
  with pytest.raises(gpt2.ConversionError) as e:
    huggingface.from_huggingface(str(hf_folder))
  assert message in str(e.value)
  assert "\n" not in str(e.value)


def test_damaged_or_missing_files(hf_folder, tmp_path):
  weights_file = hf_folder / "model.safetensors"
  whole = weights_file.read_bytes()
  for size in (len(whole) - 100, 50, 3):
    weights_file.write_bytes(whole[:size])
    with pytest.raises(gpt2.ConversionError, match="truncated or damaged: download it"):
      huggingface.from_huggingface(str(hf_folder))
  weights_file.unlink()
  with pytest.raises(gpt2.ConversionError, match="has no model.safetensors"):
    huggingface.from_huggingface(str(hf_folder))
  (hf_folder / "config.json").unlink()
  with pytest.raises(gpt2.ConversionError, match="config.json is missing"):
    huggingface.from_huggingface(str(hf_folder))
  with pytest.raises(gpt2.ConversionError, match="neither a folder nor one of gpt2"):
    huggingface.from_huggingface(str(tmp_path / "no-such-model"))


def test_untied_head_and_foreign_tensors_are_refused(hf_folder):
  path = hf_folder / "model.safetensors"
  tensors = load_file(str(path))
  tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1.0
  save_file(tensors, str(path), metadata={"format": "pt"})
  with pytest.raises(gpt2.ConversionError, match="untied output heads are not supported"):
    huggingface.from_huggingface(str(hf_folder))
  tensors["lm_head.weight"] = tensors["transformer.wte.weight"]  # a tied copy is fine
  save_file(tensors, str(path), metadata={"format": "pt"})
  huggingface.from_huggingface(str(hf_folder))
  tensors["transformer.h.0.attn.q_norm.weight"] = np.ones(32, np.float32)
  save_file(tensors, str(path), metadata={"format": "pt"})
  with pytest.raises(gpt2.ConversionError,
                     match=r"unexpected \['h.0.attn.q_norm.weight'\]"):
    huggingface.from_huggingface(str(hf_folder))


def test_bfloat16_weights_import_as_float32(hf_folder):
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  path = hf_folder / "model.safetensors"
  tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(str(path)).items()}
  save_file(tensors, str(path), metadata={"format": "pt"})
  params, _, _ = huggingface.from_huggingface(str(hf_folder))
  assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(params))


# ----------------------------------------------------------------------------
# purejax checkpoints and the command line


def save_purejax_run(out_dir: pathlib.Path, params, config, vocab: str):
  """A checkpoint as purejax.train writes one (params beside optimizer state)."""
  state = {"params": params, "opt_state": {"mu": params}, "step": np.int32(100)}
  meta = {"model": "gpt", "config": dataclasses.asdict(config), "vocab": vocab}
  checkpoint.save(str(out_dir), 100, state, meta)


def test_purejax_checkpoint_to_huggingface_and_back(tmp_path):
  chars = "".join(chr(32 + i) for i in range(101))
  params = random_params(CONFIG)
  save_purejax_run(tmp_path / "run", params, CONFIG, chars)
  summary = weights.convert(f"purejax:{tmp_path / 'run'}", f"hf:{tmp_path / 'hf'}")
  assert "101 ids of 101" in summary and "tokenizer char" in summary
  back, config, spec = huggingface.from_huggingface(str(tmp_path / "hf"), pad_vocab_multiple=1)
  assert config == CONFIG and spec.vocab_size == 101
  assert_trees_equal(back, params)
  # HF -> purejax: a checkpoint purejax.sample's loader reads.
  weights.convert(f"hf:{tmp_path / 'hf'}", f"purejax:{tmp_path / 'imported'}")
  params2, config2, spec2 = weights.from_purejax(str(tmp_path / "imported"))
  assert config2.vocab_size == 128 and spec2 == tokenizers.ids_spec(101)
  np.testing.assert_array_equal(params2["wte"]["embedding"][:101], params["wte"]["embedding"])


@pytest.mark.slow  # a subprocess or a long one; the full suite runs it
def test_cli_converts(tmp_path, hf_folder):
  ok = run_module("purejax.convert", f"--from=hf:{hf_folder}",
                  f"--to=hf:{tmp_path / 'copy'}", timeout=300)
  assert ok.returncode == 0, ok.stderr
  assert ok.stdout.startswith("wrote hf:")
  assert_trees_equal(huggingface.from_huggingface(str(tmp_path / "copy"))[0],
                     huggingface.from_huggingface(str(hf_folder))[0])


def test_cli_refuses_in_one_line(tmp_path, hf_folder, capsys):
  assert "--overwrite" in refusal(capsys, cli_convert, f"--from=hf:{hf_folder}",
                                  f"--to=hf:{hf_folder}")
  assert refusal(capsys, cli_convert, "--from=onnx:model", f"--to=hf:{tmp_path / 'x'}") == (
      "error: --from=onnx:model must be KIND:PATH with KIND one of hf, gguf, nanogpt, purejax.")
  edit_config(hf_folder, **MIXTRAL_CONFIG)
  assert "describes a 'mixtral' model" in refusal(
      capsys, cli_convert, f"--from=hf:{hf_folder}", f"--to=hf:{tmp_path / 'x'}")


def test_char_run_to_nanogpt_records_its_dataset_for_nanogpts_sampler(tmp_path):
  # nanoGPT's sample.py --init_from=resume reads data/<config['dataset']>/meta.pkl.
  torch = need("torch")
  config = dataclasses.replace(CONFIG, vocab_size=4)
  chars = "abc\n"
  checkpoint.save(str(tmp_path / "run"), 10, {"params": random_params(config)},
                  {"model": "gpt", "config": dataclasses.asdict(config),
                   "tokenizer": tokenizers.CharTokenizer(chars).spec().to_dict(),
                   "dataset": "my_notes"})
  weights.convert(f"purejax:{tmp_path / 'run'}", f"nanogpt:{tmp_path / 'out' / 'ckpt.pt'}")
  ckpt = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=False)
  assert ckpt["config"] == {"dataset": "my_notes"}
  assert tokenizers.read_nanogpt_meta(str(tmp_path / "out" / "meta.pkl")).chars == chars


def test_every_format_checks_its_tensors_with_one_helper():
  # float32 out, stored-transposed matrices turned to [in, out], and a shape
  # that does not fit named with both shapes.
  state = {"w": np.arange(6, dtype=np.float16).reshape(3, 2), "b": np.zeros(3, np.float64)}
  arrays = tensors.float32_tensors(state, {"w": (2, 3), "b": (3,)}, source="x.bin",
                                   needs="the model", partner="its config",
                                   transpose=lambda name: name == "w")
  assert all(a.dtype == np.float32 for a in arrays.values())
  np.testing.assert_array_equal(arrays["w"], state["w"].T)
  with pytest.raises(weights.ConversionError,
                     match=r"x.bin: w has shape \(3, 2\), but the model needs \(2, 3\); "
                           r"the weights and its config do not belong together"):
    tensors.float32_tensors(state, {"w": (2, 3)}, source="x.bin", needs="the model",
                            partner="its config")


def test_peft_takes_only_a_lora_runs_adapters(tmp_path):
  save_purejax_run(tmp_path / "run", random_params(CONFIG), CONFIG, "".join(
      chr(32 + i) for i in range(101)))
  with pytest.raises(weights.ConversionError, match="not a LoRA fine-tune"):
    weights.convert(f"purejax:{tmp_path / 'run'}", f"peft:{tmp_path / 'adapter'}")
  with pytest.raises(weights.ConversionError, match="take a purejax LoRA run's adapters"):
    weights.convert(f"hf:{tmp_path}", f"peft:{tmp_path / 'adapter'}")
  with pytest.raises(weights.ConversionError, match="KIND one of hf, gguf, nanogpt, purejax.$"):
    weights.convert(f"peft:{tmp_path}", f"hf:{tmp_path / 'x'}")  # a target, not a source
