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


class FakePrepared:
  """A prepared TFDS dataset's builder: its version folder, and the reads of its splits."""

  def __init__(self, folder: pathlib.Path):
    self.data_path = folder
    self.reads = []
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset_info.json").write_text("{}")
    self.prepare(60)

  def prepare(self, n: int):
    """(Re)writes the split's records: `n` images of 2x2 pixels."""
    (self.data_path / "fake-train.tfrecord-00000-of-00001").write_bytes(b"r" * n)
    self.images = np.arange(n * 4, dtype=np.uint8).reshape(n, 2, 2)

  def is_prepared(self):
    return True

  def as_dataset(self, split, batch_size):
    assert batch_size == -1
    self.reads.append(split)
    return {"image": self.images, "label": np.arange(len(self.images), dtype=np.int64)}


@pytest.fixture
def fake_tfds(tmp_path, monkeypatch):
  builder = FakePrepared(tmp_path / "fake" / "1.0.0")
  fake = type("FakeTfds", (), {"builder": staticmethod(lambda name, data_dir: builder),
                               "as_numpy": staticmethod(lambda ds: ds)})
  monkeypatch.setattr(datasets, "_import_tfds", lambda: fake)
  return builder


def test_a_split_read_once_is_read_again_from_its_arrays_without_tfds(fake_tfds):
  first = datasets.load_tfds_splits("fake", ("train",))["train"]
  again = datasets.load_tfds_splits("fake", ("train",))["train"]
  assert fake_tfds.reads == ["train"]  # the second read never asked TFDS
  assert again.keys() == first.keys()
  for name in first:
    np.testing.assert_array_equal(again[name], first[name])
    assert again[name].dtype == first[name].dtype


def test_a_re_prepared_or_damaged_split_is_read_through_tfds_again(fake_tfds):
  datasets.load_tfds_splits("fake", ("train",))
  fake_tfds.prepare(30)  # the dataset prepared anew: other records
  assert len(datasets.load_tfds_splits("fake", ("train",))["train"]["image"]) == 30
  assert fake_tfds.reads == ["train", "train"]
  kept = fake_tfds.data_path / "purejax-arrays-train.npz"
  kept.write_bytes(kept.read_bytes()[:100])  # a damaged copy is not read
  assert len(datasets.load_tfds_splits("fake", ("train",))["train"]["label"]) == 30
  assert fake_tfds.reads == ["train"] * 3
  assert sorted(p.name for p in fake_tfds.data_path.iterdir()) == [
      "dataset_info.json", "fake-train.tfrecord-00000-of-00001", "purejax-arrays-train.npz"]


def test_a_read_only_data_dir_is_read_through_tfds_each_time(fake_tfds, monkeypatch):
  def read_only(path, write_fn):
    raise PermissionError(13, "Read-only file system", str(path))
  monkeypatch.setattr(datasets._files, "atomic_write", read_only)
  for _ in range(2):
    assert len(datasets.load_tfds_splits("fake", ("train",))["train"]["image"]) == 60
  assert fake_tfds.reads == ["train", "train"]


def test_embedded_shakespeare_is_the_original_text():
  import hashlib
  text = (datasets.EMBEDDED_SHAKESPEARE_DIR / "input.txt").read_bytes()
  assert hashlib.md5(text).hexdigest() == "6fb458f1232090904fb40fe944165e91"
