"""The optimizers by name: each one's settings class is its flags, sweeps and record.

`registry.OPTIMIZERS` maps a name to a settings class and a factory; the flat
names of the settings (`settings.flat_fields`) are the command line's flags,
a sweep's grid names and a checkpoint's record, with the class's docstring as
each flag's help. Adding an optimizer is one module registered there.
"""

import dataclasses

import pytest

from purejax.cli import command
from purejax.cli import train_flags
from purejax.optimizers import adam
from purejax.optimizers import lion
from purejax.optimizers import muon
from purejax.optimizers import optim
from purejax.optimizers import registry
from purejax.optimizers import settings as settings_lib


@pytest.mark.parametrize("name", list(registry.OPTIMIZERS))
def test_every_optimizers_settings_are_flat_names_with_a_doc_a_flag_and_a_round_trip(name):
  cls = registry.OPTIMIZERS[name].settings
  flat = settings_lib.to_flat(cls())
  assert set(flat) == set(settings_lib.flat_fields(cls)) == set(optim.settings_names(name))
  assert settings_lib.from_flat(cls, flat) == cls()
  docs = settings_lib.field_docs(cls)
  args = command.parse(["train"], lambda a: train_flags.define_flags(a, "gpt"))
  for setting in flat:
    assert docs.get(setting), f"{name}'s {setting} has no docstring"
    assert setting in args and docs[setting] in args[setting].help
    assert name in args[setting].help  # which optimizer reads it


def test_a_setting_two_optimizers_share_has_one_default():
  seen = {}
  for name, entry in registry.OPTIMIZERS.items():
    for setting, default in settings_lib.to_flat(entry.settings()).items():
      assert seen.setdefault(setting, default) == default, (name, setting)


def test_muons_adamw_group_flattens_to_adamws_own_names():
  settings = muon.Muon(ns_steps=3, adamw=adam.AdamW(beta2=0.99))
  flat = settings_lib.to_flat(settings)
  assert flat["beta2"] == 0.99 and flat["muon_ns_steps"] == 3 and "muon_beta2" not in flat
  assert settings_lib.hyperparams(muon.Muon) == (
      "beta1", "beta2", "weight_decay", "muon_learning_rate", "muon_momentum",
      "muon_weight_decay")


def test_a_config_names_its_optimizer_once():
  assert optim.OptimizerConfig(settings=muon.Muon()).name == "muon"
  assert optim.OptimizerConfig().settings == adam.AdamW()
  assert optim.named("lion", learning_rate=0.1) == optim.OptimizerConfig(
      learning_rate=0.1, settings=lion.Lion())
  # The name is its settings' type: replacing the settings renames it.
  assert dataclasses.replace(optim.named("lion"), settings=muon.Muon()).name == "muon"
  with pytest.raises(ValueError, match="unknown optimizer 'adafactor'"):
    optim.named("adafactor")
  with pytest.raises(ValueError, match="str is not a registered optimizer's settings"):
    optim.OptimizerConfig(settings="adam")
  with pytest.raises(ValueError, match="`muon_ns_steps` must be an integer >= 1"):
    optim.OptimizerConfig(settings=muon.Muon(ns_steps=0))


def test_replace_changes_shared_fields_and_settings_by_flat_name():
  base = optim.from_flat(learning_rate=1e-3, beta2=0.99, weight_decay=0.1)
  to_muon = optim.replace(base, name="muon", muon_ns_steps=3)
  # AdamW's settings carry over into Muon's AdamW group: the same names.
  assert to_muon.settings == muon.Muon(ns_steps=3, adamw=adam.AdamW(beta2=0.99,
                                                                    weight_decay=0.1))
  assert optim.replace(base, learning_rate=2e-3) == dataclasses.replace(base,
                                                                        learning_rate=2e-3)
  with pytest.raises(ValueError, match="`muon_ns_steps` is not a setting of adamw; it is "
                     "muon's"):
    optim.replace(base, muon_ns_steps=3)


def test_a_record_of_every_version_reads_back():
  # The record before the registry: the shared fields and every setting, flat (20 fields).
  before = {"name": "muon", "learning_rate": 0.01, "schedule": "cosine", "warmup_iters": 20,
            "decay_iters": 400, "min_lr": 1e-4, "warmdown_frac": 0.2, "beta1": 0.9,
            "beta2": 0.99, "momentum": 0.9, "weight_decay": 0.1, "grad_clip": 1.0,
            "muon_learning_rate": 0.01, "muon_momentum": 0.95, "muon_weight_decay": 0.0,
            "muon_ns_steps": 3, "muon_momentum_warmup_iters": 0, "muon_momentum_start": 0.85,
            "muon_split_qkv": False, "muon_ns_coeffs": "minimax"}
  config = optim.from_saved(before)
  assert config.settings == muon.Muon(learning_rate=0.01, ns_steps=3, split_qkv=False,
                                      ns_coeffs="minimax",
                                      adamw=adam.AdamW(beta2=0.99, weight_decay=0.1))
  # Written again, it holds Muon's settings only (SGD's `momentum` is not Muon's).
  record = optim.to_saved(config)
  assert record == {k: v for k, v in before.items() if k != "momentum"}
  assert optim.saved_record(before) == record
