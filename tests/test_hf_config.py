"""A bad Hugging Face config.json is one line naming the file, the key, the value and the fix.

Each case writes a tiny model's config.json with one thing wrong into a
folder (no weights: the config is checked before anything else is read)
and imports the folder: wrong types, zeros, negative sizes, booleans for
sizes, missing keys, heads that do not divide the width, and bad
`rope_scaling`.
"""

import json

import pytest

from purejax.weights import huggingface
from purejax.weights.errors import ConversionError

LLAMA = {"model_type": "llama", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "vocab_size": 97, "n_embd": 32, "n_layer": 2, "n_head": 4,
        "n_positions": 32}
MISSING = object()

# (base config, changes, what the one-line error must say)
BAD_CONFIGS = {
    "heads_a_string": (LLAMA, {"num_attention_heads": "4"},
                       "num_attention_heads='4' must be a positive integer"),
    "zero_heads": (LLAMA, {"num_attention_heads": 0},
                   "num_attention_heads=0 must be a positive integer"),
    "negative_width": (LLAMA, {"hidden_size": -32}, "hidden_size=-32 must be a positive integer"),
    "layers_a_bool": (LLAMA, {"num_hidden_layers": True},
                      "num_hidden_layers=True must be a positive integer"),
    "layers_a_float": (LLAMA, {"num_hidden_layers": 2.0},
                       "num_hidden_layers=2.0 must be a positive integer"),
    "zero_vocab": (LLAMA, {"vocab_size": 0}, "vocab_size=0 must be a positive integer"),
    "zero_kv_heads": (LLAMA, {"num_key_value_heads": 0},
                      "num_key_value_heads=0 must be a positive integer"),
    "mlp_a_list": (LLAMA, {"intermediate_size": [48]},
                   "intermediate_size=[48] must be a positive integer"),
    "eps_a_string": (LLAMA, {"rms_norm_eps": "1e-6"},
                     "rms_norm_eps='1e-6' must be a positive number"),
    "zero_theta": (LLAMA, {"rope_theta": 0}, "rope_theta=0 must be a positive number"),
    "tie_an_int": (LLAMA, {"tie_word_embeddings": 1},
                   "tie_word_embeddings=1 must be true or false"),
    "heads_do_not_divide_width": (LLAMA, {"num_attention_heads": 5},
                                  "num_attention_heads=5 does not divide hidden_size=32"),
    "kv_heads_do_not_divide_heads": (LLAMA, {"num_key_value_heads": 3},
                                     "num_key_value_heads=3 does not divide "
                                     "num_attention_heads=4"),
    "rope_scaling_a_string": (LLAMA, {"rope_scaling": "llama3"},
                              "rope_scaling='llama3' must be a JSON object"),
    "rope_factor_a_string": (LLAMA, {"rope_scaling": {"rope_type": "linear", "factor": "8"}},
                             "rope_scaling.factor='8' must be a positive number"),
    "rope_factor_zero": (LLAMA, {"rope_scaling": {"rope_type": "linear", "factor": 0}},
                         "rope_scaling.factor=0 must be a positive number"),
    "rope_llama3_incomplete": (LLAMA, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                               "rope_scaling of type 'llama3' needs "
                               "rope_scaling.low_freq_factor"),
    "rope_parameters_a_list": (LLAMA, {"rope_parameters": [1]},
                               "rope_parameters=[1] must be a JSON object"),
    "no_width": (LLAMA, {"hidden_size": MISSING}, "has no hidden_size"),
    "no_layers": (LLAMA, {"num_hidden_layers": MISSING}, "has no num_hidden_layers"),
    "no_heads": (LLAMA, {"num_attention_heads": MISSING}, "has no num_attention_heads"),
    "no_vocab": (LLAMA, {"vocab_size": MISSING}, "has no vocab_size"),
    "no_mlp_width": (LLAMA, {"intermediate_size": MISSING}, "has no intermediate_size"),
    "null_context": (LLAMA, {"max_position_embeddings": None},
                     "has no max_position_embeddings"),
    "gpt2_zero_heads": (GPT2, {"n_head": 0}, "n_head=0 must be a positive integer"),
    "gpt2_width_a_string": (GPT2, {"n_embd": "32"}, "n_embd='32' must be a positive integer"),
    "gpt2_no_layers": (GPT2, {"n_layer": MISSING}, "has no n_layer"),
    "gpt2_heads_do_not_divide_width": (GPT2, {"n_head": 5}, "n_head=5 does not divide n_embd=32"),
    "gpt2_eps_a_bool": (GPT2, {"layer_norm_epsilon": False},
                        "layer_norm_epsilon=False must be a positive number"),
}


@pytest.mark.parametrize("name", BAD_CONFIGS)
def test_a_bad_config_is_one_line_naming_file_key_value_and_fix(name, tmp_path):
  base, changes, message = BAD_CONFIGS[name]
  config = {**base, **changes}
  config = {key: value for key, value in config.items() if value is not MISSING}
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ConversionError) as e:
    huggingface.from_huggingface(str(tmp_path))
  text = str(e.value)
  assert message in text and str(tmp_path / "config.json") in text, text
  assert "\n" not in text


@pytest.mark.parametrize("base", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_the_good_configs_above_pass_the_checks(base, tmp_path):
  """The cases differ from a config that converts: the error is the weights' absence."""
  (tmp_path / "config.json").write_text(json.dumps(base))
  with pytest.raises(ConversionError, match="has no model.safetensors"):
    huggingface.from_huggingface(str(tmp_path))


def test_optional_keys_take_hugging_faces_documented_defaults():
  from purejax.weights import llama  # pylint: disable=g-import-not-at-top
  bare = {k: v for k, v in LLAMA.items()
          if k not in ("num_key_value_heads", "rms_norm_eps", "rope_theta",
                       "tie_word_embeddings")}
  config = llama.config_from_hf(bare)
  assert (config.kv_heads, config.norm_eps, config.rope_theta, config.tie_embeddings) == (
      4, 1e-6, 10000.0, False)
