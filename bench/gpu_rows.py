"""`bench.gpu`'s rows: what they add to `harness.summarise`'s, and the table they print as.

    row = harness.summarise(times, {}, "s/iter")["purejax"]
    gpu_rows.add_speed(row, config, batch, peak_flops)   # ms/iter, tokens/s, MFU
    print(gpu_rows.markdown(results))   # a line per arm of each job, then the job's notes

MFU is `flops.transformer_flops_per_token` times tokens/s over the GPU's
bf16 peak: one FLOP count and one peak for purejax and the twin.
"""

import functools
from typing import List, Optional

import jax
import jax.numpy as jnp

from bench import harness
from bench.harness import fmt
from purejax import gpt
from purejax.training.pure import flops


@functools.lru_cache(maxsize=None)
def flops_per_token(config: gpt.GPTConfig) -> float:
  """`flops.transformer_flops_per_token` of `config`, params counted without a device."""
  shapes = jax.eval_shape(lambda k: gpt.init_params(config, k),
                          jax.ShapeDtypeStruct((2,), jnp.uint32))
  # `num_params` leaves out the position embeddings, as nanoGPT counts.
  return flops.transformer_flops_per_token(gpt.num_params(shapes), config.n_layer,
                                           config.n_head, config.head_dim, config.block_size)


def add_speed(row: dict, config: gpt.GPTConfig, batch: int, peak_flops: Optional[float]
              ) -> dict:
  """ms/iter, tokens/s and MFU of a row whose median is seconds per step of `batch` sequences."""
  tokens_per_s = batch * config.block_size / row["median"]
  row.update(ms_per_iter=1000 * row["median"], tokens_per_s=tokens_per_s,
             flops_per_token=flops_per_token(config),
             mfu=flops.mfu(flops_per_token(config), tokens_per_s, peak_flops or None))
  return row


def losses_of(history: List[dict]) -> dict:
  """The best and final val loss, final train loss and count of a run's evaluations."""
  if not history:
    return {}
  return {"best_val_loss": min(h["val_loss"] for h in history),
          "final_val_loss": history[-1]["val_loss"],
          "final_train_loss": history[-1]["train_loss"], "evals": len(history)}


# ----------------------------------------------------------------------------
# The table


def _median(row: dict) -> str:
  per_iter = row.get("unit") == "s/iter"
  spec, unit = (".2f", "ms/iter") if per_iter else (".3g", "ms/token")
  spread = (f" ({fmt(row['min'], spec, 1000)}-{fmt(row['max'], spec, 1000)})"
            if row.get("min") is not None else "")
  return f"{fmt(row.get('median'), spec, 1000)} {unit}{spread}"


def _other(row: dict) -> str:
  labels = (("wall_s", "wall {:.0f} s"), ("best_val_loss", "best val {:.4f}"),
            ("final_val_loss", "final val {:.4f}"), ("wait_ms_max", "waited at most {:.2f} ms"),
            ("n", "n={}"))
  return ", ".join(label.format(row[key]) for key, label in labels if row.get(key) is not None)


COLUMNS = (
    ("median (min-max)", _median),
    ("tokens/s", lambda row: fmt(row.get("tokens_per_s"), ",.0f")),
    ("MFU", lambda row: fmt(row.get("mfu"), ".1%")),
    ("peak GiB", lambda row: fmt(row.get("peak_bytes"), ".1f", 1 / 2**30)),
    ("program peak GiB", lambda row: fmt(row.get("program_peak_bytes"), ".2f", 1 / 2**30)),
    ("cuDNN attention calls", lambda row: fmt(row.get("cudnn_attention_calls"), ".0f")),
    ("ratio vs ref", harness.ratio_text),
    ("other", _other),
)


def _notes(result: dict) -> List[str]:
  notes = []
  if "trains_without_oom" in result:
    notes.append(f"trains without OOM: {result['trains_without_oom']}")
  if "largest_batch" in result:
    notes.append(f"largest batch {result['largest_batch']}, first failing "
                 f"{result.get('smallest_failed_batch')}")
  if "host_vs_device" in result:
    notes.append(f"host/device {result['host_vs_device']:.3f}: the feed "
                 f"{'costs nothing' if result.get('feed_costs_nothing') else 'slows the step'}"
                 f" (<= 1.02 is free)")
  if result.get("status") not in ("done", None):
    notes.append(f"status {result['status']}")
  notes += [f"error in {where}: {error[:160]}"
            for where, error in (result.get("errors") or {}).items()]
  return notes


def markdown(results: dict) -> str:
  """`{job: result}` as a markdown table: a line per arm, then the job's notes."""
  return harness.markdown(results, COLUMNS, first="job", notes=_notes)
