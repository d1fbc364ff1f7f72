"""Datasets through TensorFlow Datasets: MNIST, and Tiny Shakespeare's text.

MNIST is prepared once by TFDS (into `data_dir`, default
`~/tensorflow_datasets`) and then read whole as numpy arrays
(`batch_size=-1`): it is small enough to live on the device, where the
training loop indexes it without any per-step host round-trip. The first
read keeps those arrays beside TFDS's files (`purejax-arrays-<split>.npz`);
later reads load them without TensorFlow, for as long as the prepared files
are the ones they were made from.

Offline use: TFDS accepts the original files from a "manual dir" and checks
them against its registered checksums.

* MNIST: `manual_dir=/path/to/mnist`, a folder with the four original
  `.gz` files (`MNIST_FILES`).
* Tiny Shakespeare: the text ships inside this package and is the default
  manual dir, so it never needs the network (`shakespeare_texts` reads it
  without TFDS).

When the data can be had neither from `data_dir`, nor from the manual dir,
nor from the network, loading fails at once with a `DataUnavailableError`
naming the flag that fixes it (TFDS on its own retries for minutes).

Text corpora for the GPT (files, nanoGPT folders, any TFDS text) come
through `purejax.data.corpus`, which uses the TFDS helpers here.
"""

import dataclasses
import gzip
import os
import pathlib
import socket
import struct
import zipfile
from typing import Dict, List, Optional, Sequence, Tuple
from urllib import parse

import numpy as np

from purejax import _files

# The text shipped inside the package (public domain), used as TFDS's manual
# dir for `tiny_shakespeare` unless another is given.
EMBEDDED_SHAKESPEARE_DIR = pathlib.Path(__file__).parent / "_datasets" / "tinyshakespeare"

_NETWORK_PROBE_TIMEOUT_S = 5.0


class DataUnavailableError(RuntimeError):
  """The dataset cannot be loaded; the message says which flag fixes it."""


# ----------------------------------------------------------------------------
# TFDS plumbing shared by both datasets


def _import_tfds():
  # TensorFlow logs a screenful at import; only errors matter here. Its
  # oneDNN line (TF 2.21) is written before that level applies, so it is
  # stopped the way it says: TensorFlow only prepares data here (no model
  # math), so its oneDNN kernels are of no use to us anyway.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  tfds.disable_progress_bar()
  return tfds


def _is_prepared(builder) -> bool:
  # Asked about a dataset not prepared yet (a first run), TFDS's
  # is_prepared() answers no with a warning that its folder lacks
  # dataset_info.json; that file's absence is the answer, without the warning.
  info = pathlib.Path(str(builder.data_path)) / "dataset_info.json"
  return info.is_file() and builder.is_prepared()


def _non_matching_checksum_error():
  # Not re-exported by `tfds.download` in TFDS 4.9.
  from tensorflow_datasets.core.download import download_manager  # pylint: disable=g-import-not-at-top
  return download_manager.NonMatchingChecksumError


def _host_reachable(url: str) -> bool:
  host = parse.urlparse(url).hostname
  try:
    with socket.create_connection((host, 443), timeout=_NETWORK_PROBE_TIMEOUT_S):
      return True
  except OSError:
    return False


def load_tfds_splits(
    name: str,
    splits: Sequence[str],
    *,
    data_dir: Optional[str] = None,
    manual_dir: Optional[str] = None,
) -> Dict[str, Dict[str, np.ndarray]]:
  """Prepares (if needed) and reads whole TFDS splits as numpy arrays.

  Args:
    name: TFDS dataset name, e.g. `"mnist"`.
    splits: split names, e.g. `("train", "test")`.
    data_dir: where TFDS keeps prepared datasets (None: TFDS's default).
    manual_dir: a directory holding the dataset's original files, used
      instead of the network and verified against TFDS's checksums.

  Returns:
    `{split: {feature: array}}` with every example of the split.

  Raises:
    DataUnavailableError: the data is neither prepared, nor in `manual_dir`,
      nor downloadable; or the manual files fail their checksums.
  """
  tfds = _import_tfds()
  builder = tfds.builder(name, data_dir=data_dir)
  if not _is_prepared(builder):
    expected = {info.filename: url for url, info in builder.url_infos.items()}
    if manual_dir is not None:
      manual = pathlib.Path(manual_dir).expanduser()
      if not manual.is_dir():
        raise DataUnavailableError(
            f"`manual_dir={manual_dir}` is not a directory; point it at the "
            f"folder holding the original {name} files: {sorted(expected)}.")
      missing = sorted(f for f in expected if not (manual / f).is_file())
      if missing:
        raise DataUnavailableError(
            f"`manual_dir={manual_dir}` lacks {missing} for {name}; put the "
            f"original files {sorted(expected)} there.")
    elif not all(_host_reachable(url) for url in expected.values()):
      raise DataUnavailableError(
          f"{name} is not prepared in the TFDS data dir ({builder.data_dir}) and "
          f"its download host cannot be reached. Offline, pass "
          f"`manual_dir=DIR` with the original files {sorted(expected)} "
          f"(e.g. `manual_dir=/path/to/{name}`), or `data_dir` "
          f"pointing at an already prepared copy.")
    config = tfds.download.DownloadConfig(manual_dir=manual_dir)
    try:
      builder.download_and_prepare(download_config=config)
    except _non_matching_checksum_error() as e:
      raise DataUnavailableError(
          f"The {name} files in `manual_dir={manual_dir}` fail TFDS's "
          f"checksums (corrupt or not the original files): {e}. Replace them "
          f"with the original downloads.") from e
  out = {}
  for split in splits:
    out[split] = _read_arrays(builder, split)
    if out[split] is None:
      out[split] = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1))
      _keep_arrays(builder, split, out[split])
  return out


# A split read whole is kept as numpy arrays beside TFDS's prepared files: reading MNIST
# through `as_dataset` imports TensorFlow and decodes 70 000 records (~9 s on 2 cores);
# the arrays load in a fraction of a second. They are read only while the prepared files
# are the ones they were made from (a re-prepared dataset is read through TFDS again).
_ARRAYS_PREFIX = "purejax-arrays-"
_ARRAYS_KEY = "__prepared_files__"


def _prepared_files_key(version_dir: pathlib.Path) -> str:
  """Names, sizes and modification times of TFDS's files for this version."""
  stats = sorted((p.name, p.stat()) for p in version_dir.iterdir()
                 if p.is_file() and not p.name.startswith((_ARRAYS_PREFIX, ".")))
  return "\n".join(f"{name} {st.st_size} {st.st_mtime_ns}" for name, st in stats)


def _arrays_path(builder, split: str) -> pathlib.Path:
  return pathlib.Path(str(builder.data_path)) / f"{_ARRAYS_PREFIX}{split}.npz"


def _read_arrays(builder, split: str) -> Optional[Dict[str, np.ndarray]]:
  """The split's kept arrays, or None when there are none from the current files."""
  path = _arrays_path(builder, split)
  try:
    with np.load(path, allow_pickle=False) as kept:
      if str(kept[_ARRAYS_KEY]) != _prepared_files_key(path.parent):
        return None
      return {name: kept[name] for name in kept.files if name != _ARRAYS_KEY}
  except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
    return None  # none yet, or damaged: read through TFDS and write them again


def _keep_arrays(builder, split: str, arrays) -> None:
  """Writes the split's arrays beside the prepared files (atomically); where that
  folder is read-only, or the features are not a flat dict of arrays, keeps nothing."""
  if not (isinstance(arrays, dict) and all(isinstance(a, np.ndarray) and a.dtype != object
                                           for a in arrays.values())):
    return
  path = _arrays_path(builder, split)
  try:
    key = _prepared_files_key(path.parent)
    _files.atomic_write(path, lambda f: np.savez(f, **arrays, **{_ARRAYS_KEY: np.str_(key)}))
  except OSError:
    pass


def tfds_text_feature(features, name: str) -> str:
  """The text feature of a TFDS dataset: the one named "text", else the first scalar string.

  Args:
    features: `builder.info.features`.
    name: the dataset, for the error.

  Returns:
    The feature's name.

  Raises:
    ValueError: no scalar string feature.
  """
  strings = [k for k, f in features.items()  # scalar strings: not sequences of them
             if getattr(f, "np_dtype", None) == np.dtype(object)
             and getattr(f, "shape", None) == ()]
  if not strings:
    raise ValueError(f"TFDS dataset {name} has no text feature (its features: "
                     f"{sorted(features.keys())}); pick a dataset with a string feature.")
  return "text" if "text" in strings else strings[0]


def tfds_text_splits(name: str, splits) -> Tuple[List[str], List[str]]:
  """`(train splits, val splits)` for language modelling on a TFDS dataset.

  Tiny Shakespeare is split 90/5/5: validation + test is nanoGPT's 10%.
  Others: train, and validation (or test when there is none).
  """
  if name == "tiny_shakespeare":
    return ["train"], ["validation", "test"]
  for val in ("validation", "test"):
    if "train" in splits and val in splits:
      return ["train"], [val]
  raise ValueError(f"TFDS dataset {name} needs a train split and a validation or test "
                   f"split; it has {sorted(splits)}.")


def write_tfds_text(builder, splits: Sequence[str], feature: str, f) -> None:
  """Writes a prepared dataset's text to the binary file `f`, a batch of examples at a time.

  Examples are joined with "\\n" within a split and the splits written back
  to back, so Tiny Shakespeare's validation + test is one text (nanoGPT's last 10 %).
  """
  tfds = _import_tfds()
  for split in splits:
    first = True
    for batch in tfds.as_numpy(builder.as_dataset(split=split, batch_size=4096)):
      f.write((b"" if first else b"\n") + b"\n".join(batch[feature].tolist()))
      first = False


# ----------------------------------------------------------------------------
# MNIST


@dataclasses.dataclass(frozen=True)
class MnistData:
  """MNIST as flat float32 pixels in [0, 1] and int32 labels.

  Attributes:
    train_images: `[60000, 784]` float32.
    train_labels: `[60000]` int32.
    test_images: `[10000, 784]` float32.
    test_labels: `[10000]` int32.
  """
  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray

  @property
  def num_features(self) -> int:
    return self.train_images.shape[1]


PIXEL_RANGES = ("unit", "raw")


def _flatten_images(images: np.ndarray, pixels: str = "unit") -> np.ndarray:
  # [N, 28, 28] or [N, 28, 28, 1] uint8 -> [N, 784] float32
  if pixels not in PIXEL_RANGES:
    raise ValueError(f"pixels must be one of {PIXEL_RANGES}, got {pixels!r}.")
  flat = images.reshape(images.shape[0], -1).astype(np.float32)
  return flat / 255.0 if pixels == "unit" else flat


def load_mnist(
    data_dir: Optional[str] = None,
    manual_dir: Optional[str] = None,
    pixels: str = "unit",
) -> MnistData:
  """Loads MNIST through TFDS.

  Args:
    data_dir: TFDS data dir (None: TFDS's default).
    manual_dir: folder with the four original `.gz` files, for offline use.
    pixels: "unit" scales pixels to [0, 1]; "raw" keeps 0..255 as floats, as
      JAX's TFDS MNIST tutorial feeds them (its small-init SGD recipe relies
      on that input scale).

  Returns:
    `MnistData`.
  """
  splits = load_tfds_splits("mnist", ("train", "test"), data_dir=data_dir,
                            manual_dir=manual_dir)
  return MnistData(
      train_images=_flatten_images(splits["train"]["image"], pixels),
      train_labels=splits["train"]["label"].astype(np.int32),
      test_images=_flatten_images(splits["test"]["image"], pixels),
      test_labels=splits["test"]["label"].astype(np.int32),
  )


_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4",
               0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
  """Reads an IDX file (the original MNIST format), gzipped or not.

  Args:
    path: file path; names ending in `.gz` are decompressed.

  Returns:
    The array with the shape stored in the file header.

  Raises:
    ValueError: the file is not a well-formed IDX file.
  """
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "rb") as f:
    raw = f.read()
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
    raise ValueError(f"{path} is not an IDX file (bad magic number).")
  ndim = raw[3]
  header = 4 + 4 * ndim
  shape = struct.unpack(f">{ndim}I", raw[4:header])
  dtype = np.dtype(_IDX_DTYPES[raw[2]])
  if len(raw) - header != int(np.prod(shape)) * dtype.itemsize:
    raise ValueError(f"{path}: header says shape {shape} but the file holds "
                     f"{len(raw) - header} bytes of data (truncated?).")
  return np.frombuffer(raw, dtype, offset=header).reshape(shape)


MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


def load_mnist_idx(directory: str, pixels: str = "unit") -> MnistData:
  """Reads MNIST straight from the original IDX files, without TFDS.

  Useful to check what TFDS prepared, or for IDX data of your own in the
  same layout (`MNIST_FILES` names the four files). `pixels` as in
  `load_mnist`.
  """
  arrays = {field: read_idx(os.path.join(directory, fname))
            for field, fname in MNIST_FILES.items()}
  for split in ("train", "test"):
    n_img, n_lab = len(arrays[f"{split}_images"]), len(arrays[f"{split}_labels"])
    if n_img != n_lab:
      raise ValueError(f"{directory}: {n_img} {split} images but {n_lab} labels.")
  return MnistData(
      train_images=_flatten_images(arrays["train_images"], pixels),
      train_labels=arrays["train_labels"].astype(np.int32),
      test_images=_flatten_images(arrays["test_images"], pixels),
      test_labels=arrays["test_labels"].astype(np.int32),
  )


# ----------------------------------------------------------------------------
# Tiny Shakespeare without TFDS


def shakespeare_texts(manual_dir: Optional[str] = None) -> Tuple[str, str]:
  """Tiny Shakespeare's `input.txt` split 90/10 by characters, without TFDS.

  The same texts as TFDS's train and validation + test (nanoGPT's split).

  Args:
    manual_dir: folder with `input.txt`; default the copy in the package.

  Returns:
    `(train text, val text)`.
  """
  folder = pathlib.Path(manual_dir).expanduser() if manual_dir else EMBEDDED_SHAKESPEARE_DIR
  path = folder / "input.txt"
  if not path.is_file():
    raise DataUnavailableError(f"`manual_dir={manual_dir}` has no input.txt for "
                               f"tiny_shakespeare; put the original input.txt there.")
  text = path.read_text(encoding="utf-8")
  cut = int(len(text) * 0.9)
  return text[:cut], text[cut:]
