"""checkpoint: atomic, verified, pruned saves of whole training states."""

import errno
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from purejax import checkpoint
from purejax import gpt

CONFIG = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)


def training_state(seed=0, config=CONFIG):
  params = gpt.init_params(config, jax.random.PRNGKey(seed))
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  opt_state = optimizer.init(params)
  # Take one step so the moments are non-zero (jitted: one program, not one per op).
  grads = jax.tree.map(jnp.ones_like, params)
  _, opt_state = jax.jit(optimizer.update)(grads, opt_state, params)
  return {"params": params, "opt_state": opt_state,
          "keys": {"train": jax.random.PRNGKey(seed + 1)}}


@pytest.mark.slow
def test_roundtrip_restores_every_leaf_and_the_structure(tmp_path):
  state = training_state()
  checkpoint.save(str(tmp_path), 7, state, {"model": "gpt", "history": [1.5]})
  restored = checkpoint.restore(checkpoint.checkpoint_path(str(tmp_path), 7),
                                training_state(seed=5))
  assert restored.step == 7 and restored.meta == {"model": "gpt", "history": [1.5]}
  chex.assert_trees_all_equal(restored.state, jax.device_get(state))
  assert jax.tree.structure(restored.state) == jax.tree.structure(state)


def test_files_open_with_plain_numpy(tmp_path):
  path = checkpoint.save(str(tmp_path), 1, training_state(), {})
  with np.load(path) as npz:
    assert "['params']['blocks']['attn']['qkv']['w']" in npz.files


def test_keeps_the_newest_k(tmp_path):
  state = training_state()
  for step in (10, 20, 30, 40):
    checkpoint.save(str(tmp_path), step, state, {}, keep=2)
  assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [40, 30]
  assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def truncate(path):
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])


def flip_a_bit(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 3] ^= 0x10
  path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, flip_a_bit])
def test_damage_is_detected_and_resume_falls_back(tmp_path, damage):
  older, newer = training_state(seed=1), training_state(seed=2)
  checkpoint.save(str(tmp_path), 10, older, {})
  damage(checkpoint.save(str(tmp_path), 20, newer, {}))
  with pytest.raises(checkpoint.CheckpointError, match="damaged|truncated|checksum"):
    checkpoint.read(checkpoint.checkpoint_path(str(tmp_path), 20))
  restored, warnings = checkpoint.restore_latest(str(tmp_path), training_state())
  assert restored.step == 10
  chex.assert_trees_all_equal(restored.state, jax.device_get(older))
  assert len(warnings) == 1 and "ckpt_000000020" in warnings[0]
  # The damaged file is kept for inspection, not deleted.
  assert checkpoint.checkpoint_path(str(tmp_path), 20).exists()


def test_checksum_catches_a_changed_array(tmp_path):
  # Rewrite a valid zip with one array changed: the CRCs pass, the SHA-256 must not.
  path = checkpoint.save(str(tmp_path), 1, training_state(), {})
  with np.load(path) as npz:
    arrays = {name: npz[name] for name in npz.files}
  arrays["['params']['wte']['embedding']"] = arrays["['params']['wte']['embedding']"] + 1
  np.savez(path, **arrays)
  with pytest.raises(checkpoint.CheckpointError, match="checksum"):
    checkpoint.read(path)


@pytest.mark.slow
def test_another_config_is_refused(tmp_path):
  checkpoint.save(str(tmp_path), 1, training_state(), {})
  other = training_state(config=gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2,
                                              n_head=2, n_embd=32))
  with pytest.raises(checkpoint.CheckpointError, match="does not fit this model/config"):
    checkpoint.restore_latest(str(tmp_path), other)
  deeper = training_state(config=gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=3,
                                               n_head=2, n_embd=16))
  with pytest.raises(checkpoint.CheckpointError, match="does not fit|different model"):
    checkpoint.restore_latest(str(tmp_path), deeper)


def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
  state = training_state()
  checkpoint.save(str(tmp_path), 10, state, {"n": 1}, keep=1)

  def full_disk(file, **arrays):
    file.write(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(np, "savez", full_disk)
  with pytest.raises(checkpoint.CheckpointError, match="No space left.*previous checkpoints"):
    checkpoint.save(str(tmp_path), 20, state, {"n": 2}, keep=1)
  monkeypatch.undo()
  assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [10]
  assert sorted(os.listdir(tmp_path)) == ["ckpt_000000010.npz"]  # no temp file left
  restored, _ = checkpoint.restore_latest(str(tmp_path), state)
  assert restored.meta == {"n": 1}


# ----------------------------------------------------------------------------
# Frozen arrays (a LoRA run's base): written once, shared by the checkpoints.

BASE = "['params']['base']"


def lora_state(seed):
  """A LoRA run's state: a frozen base, adapters that move each step."""
  return {"params": {"base": gpt.init_params(CONFIG, jax.random.PRNGKey(0)),
                     "adapters": {"a": jnp.full((4, 2), float(seed))}},
          "keys": {"train": jax.random.PRNGKey(seed)}}


def frozen_files(folder):
  return sorted(p.name for p in folder.iterdir() if p.name.startswith("frozen_"))


def test_frozen_arrays_are_written_once_and_every_checkpoint_reads_them(tmp_path):
  for step in (1, 2, 3):
    checkpoint.save(str(tmp_path), step, lora_state(step), {"step": step}, keep=2,
                    frozen=(BASE,))
  (shared,) = frozen_files(tmp_path)
  with np.load(checkpoint.checkpoint_path(str(tmp_path), 3)) as npz:
    assert not [n for n in npz.files if n.startswith(BASE)]  # the base is not in it
    assert "['params']['adapters']['a']" in npz.files
  with np.load(tmp_path / shared) as npz:
    assert BASE + "['wte']['embedding']" in npz.files       # plain numpy opens it too
  for step in (2, 3):
    restored = checkpoint.restore(checkpoint.checkpoint_path(str(tmp_path), step),
                                  lora_state(0))
    chex.assert_trees_all_equal(restored.state, jax.device_get(lora_state(step)))
  # Smaller than a checkpoint holding the whole state.
  whole = checkpoint.save(str(tmp_path / "whole"), 3, lora_state(3), {})
  assert checkpoint.checkpoint_path(str(tmp_path), 3).stat().st_size < (
      whole.stat().st_size / 10)


def test_a_frozen_file_goes_with_the_last_checkpoint_naming_it(tmp_path):
  checkpoint.save(str(tmp_path), 1, lora_state(1), {}, keep=1, frozen=(BASE,))
  first = frozen_files(tmp_path)
  other = lora_state(2)
  other["params"]["base"] = gpt.init_params(CONFIG, jax.random.PRNGKey(9))  # a new base
  checkpoint.save_best(str(tmp_path), 1, lora_state(1), {}, frozen=(BASE,))
  checkpoint.save(str(tmp_path), 2, other, {}, keep=1, frozen=(BASE,))
  assert len(frozen_files(tmp_path)) == 2  # the best checkpoint still names the first
  checkpoint.best_path(str(tmp_path)).unlink()
  checkpoint.save(str(tmp_path), 3, other, {}, keep=1, frozen=(BASE,))
  assert frozen_files(tmp_path) != first and len(frozen_files(tmp_path)) == 1


@pytest.mark.parametrize("damage", [truncate, flip_a_bit, os.remove])
def test_a_damaged_or_missing_frozen_file_is_named_and_taken_from_the_template(tmp_path,
                                                                              damage):
  checkpoint.save(str(tmp_path), 1, lora_state(1), {}, frozen=(BASE,))
  (shared,) = frozen_files(tmp_path)
  damage(tmp_path / shared)
  with pytest.raises(checkpoint.CheckpointError, match=shared[:20]):
    checkpoint.read(checkpoint.checkpoint_path(str(tmp_path), 1))
  # A template of another base cannot stand in: the checkpoint is skipped, named.
  other = lora_state(0)
  other["params"]["base"] = gpt.init_params(CONFIG, jax.random.PRNGKey(9))
  restored, warnings = checkpoint.restore_latest(str(tmp_path), other)
  assert restored is None and shared[:20] in warnings[0]
  # The run's own starting base has the same SHA-256: it stands in, with a warning.
  restored, warnings = checkpoint.restore_latest(str(tmp_path), lora_state(0))
  chex.assert_trees_all_equal(restored.state, jax.device_get(lora_state(1)))
  assert len(warnings) == 1 and shared[:20] in warnings[0] and "starting weights" in warnings[0]
  # The next save writes the file again; the checkpoints read without a template.
  checkpoint.save(str(tmp_path), 2, lora_state(2), {}, frozen=(BASE,))
  assert frozen_files(tmp_path) == [shared]
  checkpoint.read(checkpoint.checkpoint_path(str(tmp_path), 1))


def test_unwritable_out_dir_is_a_clear_error(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(checkpoint.CheckpointError, match="writable `out_dir`"):
    checkpoint.save(str(blocker / "run"), 1, training_state(), {})


def test_no_checkpoint_messages(tmp_path):
  assert checkpoint.restore_latest(str(tmp_path / "none"), training_state()) == (None, [])
  with pytest.raises(checkpoint.CheckpointError, match="train first"):
    checkpoint.latest_meta(str(tmp_path))


def test_extract_a_subtree_for_sampling(tmp_path):
  state = training_state()
  path = checkpoint.save(str(tmp_path), 3, state, {})
  arrays, _ = checkpoint.read(path)
  params = checkpoint.extract(arrays, {"params": gpt.init_params(CONFIG, jax.random.PRNGKey(9))})
  chex.assert_trees_all_equal(params["params"], jax.device_get(state["params"]))
