"""data: IDX reading, TFDS error handling, character vocabulary."""

import gzip
import pathlib
import struct
import time

import numpy as np
import pytest

from purejax.data import datasets


def write_idx(path: pathlib.Path, array: np.ndarray, compress: bool = True) -> None:
  """Writes `array` (uint8) as an IDX file, the original MNIST format."""
  header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
  payload = header + array.astype(np.uint8).tobytes()
  (gzip.open if compress else open)(path, "wb").write(payload)


@pytest.fixture
def fake_mnist_dir(tmp_path):
  """A tiny MNIST-shaped IDX set: 6 train and 3 test images of 28x28."""
  rng = np.random.default_rng(0)
  arrays = {
      "train_images": rng.integers(0, 256, (6, 28, 28), dtype=np.uint8),
      "train_labels": np.array([0, 1, 2, 3, 4, 9], np.uint8),
      "test_images": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
      "test_labels": np.array([5, 6, 7], np.uint8),
  }
  for field, name in datasets.MNIST_FILES.items():
    write_idx(tmp_path / name, arrays[field])
  return tmp_path, arrays


def test_read_idx_roundtrip_gz_and_plain(tmp_path):
  array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
  write_idx(tmp_path / "a.gz", array)
  write_idx(tmp_path / "a", array, compress=False)
  np.testing.assert_array_equal(datasets.read_idx(str(tmp_path / "a.gz")), array)
  np.testing.assert_array_equal(datasets.read_idx(str(tmp_path / "a")), array)


def test_read_idx_rejects_bad_magic_and_truncation(tmp_path):
  (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04rest")
  with pytest.raises(ValueError, match="magic"):
    datasets.read_idx(str(tmp_path / "bad"))
  array = np.zeros((4, 5), np.uint8)
  write_idx(tmp_path / "t", array, compress=False)
  raw = (tmp_path / "t").read_bytes()
  (tmp_path / "t").write_bytes(raw[:-3])
  with pytest.raises(ValueError, match="truncated"):
    datasets.read_idx(str(tmp_path / "t"))


def test_load_mnist_idx_on_fake_set(fake_mnist_dir):
  directory, arrays = fake_mnist_dir
  mnist = datasets.load_mnist_idx(str(directory))
  assert mnist.train_images.shape == (6, 784) and mnist.train_images.dtype == np.float32
  assert mnist.test_images.shape == (3, 784)
  assert mnist.num_features == 784
  np.testing.assert_allclose(mnist.train_images[2],
                             arrays["train_images"][2].reshape(-1) / 255.0)
  np.testing.assert_array_equal(mnist.train_labels, [0, 1, 2, 3, 4, 9])
  assert mnist.train_labels.dtype == np.int32
  raw = datasets.load_mnist_idx(str(directory), pixels="raw")
  np.testing.assert_array_equal(raw.test_images[0], arrays["test_images"][0].reshape(-1))


def test_load_mnist_idx_rejects_mismatched_counts(fake_mnist_dir):
  directory, _ = fake_mnist_dir
  write_idx(directory / datasets.MNIST_FILES["test_labels"], np.array([1, 2], np.uint8))
  with pytest.raises(ValueError, match="3 test images but 2 labels"):
    datasets.load_mnist_idx(str(directory))


def test_tfds_rejects_missing_manual_dir(tmp_path):
  with pytest.raises(datasets.DataUnavailableError, match="`manual_dir=.*` is not a directory"):
    datasets.load_mnist(str(tmp_path / "tfds"), str(tmp_path / "nowhere"))


def test_tfds_names_the_missing_files(tmp_path):
  (tmp_path / "manual").mkdir()
  with pytest.raises(datasets.DataUnavailableError, match="train-images-idx3-ubyte.gz"):
    datasets.load_mnist(str(tmp_path / "tfds"), str(tmp_path / "manual"))


def test_tfds_rejects_wrong_files_by_checksum(fake_mnist_dir, tmp_path):
  directory, _ = fake_mnist_dir
  with pytest.raises(datasets.DataUnavailableError, match="checksums"):
    datasets.load_mnist(str(tmp_path / "tfds"), str(directory))


def test_tfds_offline_without_manual_dir_fails_fast(tmp_path, monkeypatch):
  monkeypatch.setattr(datasets, "_host_reachable", lambda url: False)
  start = time.monotonic()
  with pytest.raises(datasets.DataUnavailableError, match="`manual_dir"):
    datasets.load_mnist(str(tmp_path / "tfds"))
  assert time.monotonic() - start < 60  # TFDS alone would retry for minutes


def test_embedded_shakespeare_is_the_original_text():
  import hashlib
  text = (datasets.EMBEDDED_SHAKESPEARE_DIR / "input.txt").read_bytes()
  assert hashlib.md5(text).hexdigest() == "6fb458f1232090904fb40fe944165e91"
