"""Where BPE merges come from: encoding files, tiktoken's cache, GPT-2's download host.

    ranks = bpe_files.load_ranks("gpt2-files/")   # vocab.bpe + encoder.json, or a .tiktoken file
    bpe_files.fingerprint(ranks)                  # sha256 of the merges, whatever the file
    ranks = bpe_files.cached_gpt2_ranks(fingerprint)  # tiktoken's cache, offline; None if absent

Ranks are tiktoken's `{token bytes: rank}`. Files are read with tiktoken's
own loaders, with its caching turned off (`_tiktoken_cache_off`), so reading a
local file never writes into the user's cache. tiktoken caches its downloads
under the sha1 of their URL (`GPT2_URLS`, `R50K_URL`); `cached_gpt2_ranks`
finds them there without touching the network, and `host_reachable` tells in
seconds whether a download could work at all. `purejax.data.tokenizers` builds
tokenizers from these ranks.
"""

import base64
import contextlib
import hashlib
import os
import pathlib
import tempfile
import threading
from typing import Dict, Optional, Tuple

from purejax.data.errors import TokenizerError

# Where tiktoken's "gpt2" and "r50k_base" encodings (the same merges) come from;
# tiktoken caches each under the sha1 of its URL.
GPT2_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
_NETWORK_PROBE_TIMEOUT_S = 3.0


def import_tiktoken():
  """The `tiktoken` module, its loaders imported; TokenizerError if it is not installed."""
  try:
    import tiktoken  # pylint: disable=g-import-not-at-top
    import tiktoken.load  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise TokenizerError("BPE tokenizers need tiktoken: pip install tiktoken.") from e
  return tiktoken


def fingerprint(ranks: Dict[bytes, int]) -> str:
  """sha256 of `ranks` written as tiktoken's `.tiktoken` file (one line per rank)."""
  sha = hashlib.sha256()
  for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
    sha.update(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
  return sha.hexdigest()


@contextlib.contextmanager
def _tiktoken_cache_off():
  """Stops tiktoken's loaders from copying local files into its cache.

  `tiktoken.load` caches every file it reads, local ones too, keyed by
  path: a side effect in the user's cache, and an error when the cache dir
  is read-only. An empty TIKTOKEN_CACHE_DIR turns caching off.
  """
  saved = os.environ.get("TIKTOKEN_CACHE_DIR")
  os.environ["TIKTOKEN_CACHE_DIR"] = ""
  try:
    yield
  finally:
    if saved is None:
      del os.environ["TIKTOKEN_CACHE_DIR"]
    else:
      os.environ["TIKTOKEN_CACHE_DIR"] = saved


def _resolve_encoding_file(path: str) -> Tuple[str, Optional[pathlib.Path], pathlib.Path]:
  """`("tiktoken", None, file)` or `("data_gym", vocab.bpe, encoder.json)` for `path`."""
  p = pathlib.Path(path).expanduser()
  if p.is_dir():
    vocab, encoder = p / "vocab.bpe", p / "encoder.json"
    tiktoken_files = sorted(p.glob("*.tiktoken"))
    if vocab.is_file() and encoder.is_file():
      return "data_gym", vocab, encoder
    if len(tiktoken_files) == 1:
      return "tiktoken", None, tiktoken_files[0]
    raise TokenizerError(
        f"`encoding_file={path}` is a folder without vocab.bpe and encoder.json (or "
        f"one .tiktoken file); put GPT-2's vocab.bpe and encoder.json there.")
  if not p.is_file():
    raise TokenizerError(
        f"`encoding_file={path}` does not exist; pass a folder with vocab.bpe and "
        f"encoder.json, or a .tiktoken file.")
  if p.name == "vocab.bpe" or p.name == "encoder.json":
    vocab, encoder = p.parent / "vocab.bpe", p.parent / "encoder.json"
    if not (vocab.is_file() and encoder.is_file()):
      raise TokenizerError(f"{p.parent} needs both vocab.bpe and encoder.json; "
                                      f"one of them is missing.")
    return "data_gym", vocab, encoder
  return "tiktoken", None, p


def load_ranks(path: str) -> Dict[bytes, int]:
  """The mergeable ranks in a `.tiktoken` file or a vocab.bpe + encoder.json pair."""
  tiktoken = import_tiktoken()
  kind, vocab, target = _resolve_encoding_file(path)
  try:
    with _tiktoken_cache_off():
      if kind == "data_gym":
        return tiktoken.load.data_gym_to_mergeable_bpe_ranks(str(vocab), str(target))
      return tiktoken.load.load_tiktoken_bpe(str(target))
  except (ValueError, KeyError, AssertionError, UnicodeDecodeError) as e:
    what = f"{vocab} + {target}" if kind == "data_gym" else str(target)
    raise TokenizerError(
        f"{what} is not a readable BPE encoding ({type(e).__name__}: "
        f"{str(e)[:120]}); pass GPT-2's vocab.bpe + encoder.json or a .tiktoken "
        f"file.") from e
  except OSError as e:
    raise TokenizerError(f"cannot read {target}: {e.strerror or e}.") from e


def _tiktoken_cache_dir() -> Optional[pathlib.Path]:
  """tiktoken's cache folder, by its own rules; None when caching is off."""
  for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
    if var in os.environ:
      return pathlib.Path(os.environ[var]) if os.environ[var] else None
  return pathlib.Path(tempfile.gettempdir()) / "data-gym-cache"


def _cached(url: str) -> Optional[pathlib.Path]:
  cache = _tiktoken_cache_dir()
  if cache is None:
    return None
  path = cache / hashlib.sha1(url.encode()).hexdigest()
  return path if path.is_file() else None


def host_reachable(url: str, timeout: float = _NETWORK_PROBE_TIMEOUT_S) -> bool:
  """Whether `url`'s host accepts a connection within `timeout` seconds.

  tiktoken downloads without a timeout, and a DNS lookup ignores socket
  timeouts: the probe runs in a daemon thread so a dead network costs at
  most `timeout`.
  """
  import socket  # pylint: disable=g-import-not-at-top
  from urllib import parse  # pylint: disable=g-import-not-at-top
  result = []

  def probe():
    try:
      socket.create_connection((parse.urlparse(url).hostname, 443), timeout=timeout).close()
      result.append(True)
    except OSError:
      pass

  thread = threading.Thread(target=probe, daemon=True)
  thread.start()
  thread.join(timeout)
  return bool(result)


def gpt2_missing_message() -> str:
  """The error when GPT-2's files are neither cached nor downloadable: what to provide."""
  cache = _tiktoken_cache_dir()
  where = f"tiktoken's cache ({cache})" if cache else "tiktoken's cache (turned off)"
  return (f"GPT-2's BPE files are not available: {where} has neither GPT-2's vocab.bpe "
          f"and encoder.json nor r50k_base.tiktoken, and the download host cannot be "
          f"reached. Pass `encoding_file=PATH` (a folder with vocab.bpe and "
          f"encoder.json, or a .tiktoken file), or set TIKTOKEN_CACHE_DIR to a tiktoken "
          f"cache that has them.")


def _gpt2_ranks_from_data_gym_cache(vocab: pathlib.Path, encoder: pathlib.Path
                                    ) -> Dict[bytes, int]:
  with tempfile.TemporaryDirectory(prefix="purejax-gpt2-") as folder:
    # The loader wants the two files under their real names.
    os.symlink(vocab, os.path.join(folder, "vocab.bpe"))
    os.symlink(encoder, os.path.join(folder, "encoder.json"))
    return load_ranks(folder)


def cached_gpt2_ranks(expected_fingerprint: str) -> Optional[Dict[bytes, int]]:
  """GPT-2's ranks from tiktoken's cache, without any network access; None if not there.

  Args:
    expected_fingerprint: GPT-2's `fingerprint`; cached files with other merges
      are passed over.
  """
  vocab, encoder = (_cached(url) for url in GPT2_URLS)
  r50k = _cached(R50K_URL)
  candidates = []
  if vocab and encoder:
    candidates.append(lambda: _gpt2_ranks_from_data_gym_cache(vocab, encoder))
  if r50k:
    candidates.append(lambda: load_ranks(str(r50k)))
  for load in candidates:
    try:
      ranks = load()
    except (TokenizerError, OSError):
      continue  # a damaged cache entry: try the next, then the network
    if fingerprint(ranks) == expected_fingerprint:
      return ranks
  return None
