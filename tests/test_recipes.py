"""Named recipes: one flag sets the block, optimizer and steps; any flag overrides one.

`python -m purejax.train --recipe=NAME` takes `recipes.RECIPES[NAME]` as its
flags' defaults, and every model option of `gpt.GPTConfig` has a flag of its
own (derived from the dataclass), so a recipe is reachable, and changeable
piece by piece, from the command line. The speedrun bench trains the same
definitions.
"""

import dataclasses

import pytest

from bench import speedrun
from helpers.cli import refusal
from purejax import gpt
from purejax.cli import command
from purejax.cli import train
from purejax.cli import train_flags
from purejax.optimizers import optim
from purejax.training.loops import recipes

VOCAB = 65


def parsed(*argv: str):
  """The GPT's flags of `train argv`, parsed as the command line parses them."""
  argv = ["train", *argv]
  recipe = train_flags.recipe_from_argv(argv)
  return command.parse(argv, lambda args: train_flags.define_flags(args, "gpt", recipe))


@pytest.mark.parametrize("name", list(recipes.RECIPES))
def test_a_recipe_on_the_command_line_is_its_definition(name):
  recipe = recipes.RECIPES[name]
  args = parsed(f"--recipe={name}")
  assert train.gpt_config(args, VOCAB) == recipe.model_config(vocab_size=VOCAB)
  assert train.optimizer_config(args) == recipe.optimizer
  assert args.max_iters == recipe.max_iters


def test_without_a_recipe_the_command_line_trains_nanogpts():
  args = parsed()
  assert train.gpt_config(args, VOCAB) == recipes.SHAKESPEARE_CHAR
  assert train.optimizer_config(args) == recipes.GPT_OPTIMIZER
  assert args.max_iters == 2000


def test_the_modern_recipe_is_nanochats_block_with_norm_scales_and_muon():
  config = recipes.RECIPES["modern"].model_config(vocab_size=VOCAB)
  nanochat = dataclasses.replace(recipes.SHAKESPEARE_CHAR, **gpt.ARCHITECTURES["nanochat"])
  assert config == dataclasses.replace(nanochat, norm_scale=True, embed_norm=False)
  optimizer = recipes.RECIPES["modern"].optimizer
  assert (optimizer.name, optimizer.settings.ns_steps, optimizer.settings.ns_coeffs) == (
      "muon", 3, "minimax")


def test_a_flag_overrides_one_setting_of_the_recipe():
  recipe = recipes.RECIPES["modern"]
  args = parsed("--recipe=modern", "--muon_ns_steps=5", "--noembed_norm", "--embed_norm",
                "--max_iters=50", "--qk_norm=false")
  assert train.optimizer_config(args) == optim.replace(recipe.optimizer, muon_ns_steps=5)
  assert train.gpt_config(args, VOCAB) == recipe.model_config(
      vocab_size=VOCAB, embed_norm=True, qk_norm=False)
  assert args.max_iters == 50


def test_every_option_of_the_model_has_a_flag():
  args = parsed()
  for field in dataclasses.fields(gpt.GPTConfig):
    if field.name in train_flags.NOT_FLAGS:
      continue
    flag = train_flags.HAND_WRITTEN.get(field.name, field.name)
    assert flag in args, f"GPTConfig.{field.name} has no flag"
    if field.name in train_flags.block_field_flags():
      assert f"GPTConfig.{field.name}: " in args[flag].help  # its docstring, as help


def test_option_flags_change_the_architecture_they_are_given_with():
  config = train.gpt_config(parsed("--arch=llama", "--rope_theta=500000", "--qk_norm",
                                   "--mlp_hidden=96", "--logit_softcap=15"), VOCAB)
  llama = dataclasses.replace(recipes.SHAKESPEARE_CHAR, **gpt.ARCHITECTURES["llama"])
  assert config == dataclasses.replace(llama, rope_theta=500000.0, qk_norm=True,
                                       mlp_hidden=96, logit_softcap=15.0)


def test_an_unknown_recipe_is_refused_in_one_line(capsys):
  line = refusal(capsys, train, "--recipe=fastest")
  assert "--recipe" in line and "nanogpt" in line and "modern" in line, line


def test_an_option_flag_is_refused_with_pretrained_weights(capsys, tmp_path):
  line = refusal(capsys, train, "--init_from=gpt2", "--qk_norm", f"--out_dir={tmp_path}")
  assert line.startswith("error: --qk_norm has no effect on weights from"), line


def test_the_speedrun_bench_trains_the_librarys_recipes():
  for name in ("nanogpt", "llama", "modern"):
    recipe = recipes.RECIPES[name]
    assert speedrun.arm_configs(name, speedrun.SIZES["cpu"]) == (
        recipe.model_config(), recipe.optimizer)
