r"""What a GPU would run per training step, counted without a GPU: the kernel account.

    python -m bench.gpu_kernels                                  # GPT-2 124M, batch 12, H100
    python -m bench.gpu_kernels --gpu=h200 --scan_layers=false --top=40
    python -m bench.gpu_kernels --out=bench/results/account.json

The step (`steps.train_steps`, as `gpt_loop.train_gpt` jits it) is compiled
for the card by XLA's GPU compiler on this machine (`gpu_plan`, JAX's CUDA
plugin, no GPU), and its optimised HLO is read as the GPU would run it:
every fusion, product (Triton or cuBLAS), cuDNN call, copy and in-place
update is one kernel, and a while loop's body counts its trip count times
(XLA records `known_trip_count`). Per kernel: the bytes it reads and
writes (an operand it only slices counts the slice; an in-place update
writes only its update) and its FLOPs (products and attention); per
category the count, bytes and a roofline time, max(bytes / bandwidth,
FLOPs / peak) from the card's spec.

What it does not know: the autotuner's choices (tile sizes, Triton or
cuBLAS, which fusions it splits), cache reuse, launch gaps and how far
below the roofline each kernel runs. docs/performance.md holds the account
against a GPU profile of the same step, and the factor between them.
"""

import collections
import dataclasses
import json
import re
from typing import Dict, List, Optional, Tuple

from absl import app
from absl import flags
import numpy as np

from purejax import gpt
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.loops import recipes
from purejax.training.pure import flops as flops_lib
from purejax.training.tools import gpu_plan

_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_BODY = re.compile(r"\bbody=%([\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%([\w.\-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations=\{([^}]*)\}|to_apply=%([\w.\-]+))")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_BACKEND_KIND = re.compile(r'backend_config=.*?"kind":"([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CUBLAS_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')

# Ops that launch nothing: views, tuples, control flow (its parts are counted).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
         "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
         "add-dependency", "copy-done", "send-done", "recv-done", "all-reduce-done",
         "all-gather-done", "collective-permute-done", "async-done", "async-update",
         "get-dimension-size"}
_MOVES = {"parameter", "constant", "bitcast", "copy", "transpose", "slice", "dynamic-slice",
          "dynamic-update-slice", "concatenate", "broadcast", "reshape", "tuple",
          "get-tuple-element", "pad", "reverse", "iota"}
# The share of its roofline time each kind of kernel reached on one H200 (GPT-2
# 124M's step, three arms: bench/results/2026-11-26-gpu-profile*.txt against
# this account of the same forms; docs/performance.md): a measured kernel took
# its roofline time divided by this.
MEASURED_SHARE = {"products": 0.68, "attention": 0.25, "rest": 0.58}
CATEGORIES = ("products", "attention", "loss", "norms", "converts", "optimizer", "batch",
              "embedding", "copies", "elementwise", "loop control", "collectives")


def _arrays(shape: str) -> List[Tuple[str, Tuple[int, ...]]]:
  return [(dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims in _ARRAY.findall(shape)]


def _bytes(shape: str) -> int:
  return sum(_BYTES[dtype] * int(np.prod(dims)) for dtype, dims in _arrays(shape))


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str  # the result's type text
  op: str
  operands: List[str]
  rest: str  # attributes

  @property
  def out_bytes(self) -> int:
    # A cuBLAS call's second result is its workspace (s8/u8), not data.
    arrays = _arrays(self.shape)
    if self.op == "custom-call" and len(arrays) > 1 and arrays[-1][0] in ("s8", "u8"):
      arrays = arrays[:-1]
    return sum(_BYTES[d] * int(np.prod(s)) for d, s in arrays)


@dataclasses.dataclass
class Computation:
  name: str
  instructions: Dict[str, Instruction] = dataclasses.field(default_factory=dict)
  root: Optional[str] = None


def parse(hlo: str) -> Tuple[Dict[str, Computation], str]:
  """The computations of an optimised HLO module, and the entry's name."""
  computations: Dict[str, Computation] = {}
  current, entry = None, None
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header and line.rstrip().endswith("{"):
      current = computations.setdefault(header[1], Computation(header[1]))
      if line.startswith("ENTRY"):
        entry = header[1]
      continue
    if current is None:
      continue
    if line.startswith("}"):
      current = None
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, shape, op, rest = match.groups()
    # Operands are the %names before the closing parenthesis of the op's call.
    depth, end = 1, 0
    for end, char in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(char, 0)
      if depth == 0:
        break
    current.instructions[name] = Instruction(name, shape, op, _OPERAND.findall(rest[:end]),
                                             rest[end:])
    if line.lstrip().startswith("ROOT "):
      current.root = name
  return computations, entry


@dataclasses.dataclass
class Kernel:
  """One kernel launch site and what it does per launch."""
  name: str
  category: str
  launches: int  # per step
  read: int  # bytes per launch
  written: int
  flops: float
  dtype: str  # of a product's operands

  def seconds(self, card: gpu_plan.Card, peak: Dict[str, float]) -> float:
    memory = (self.read + self.written) / card.bandwidth
    compute = self.flops / peak.get(self.dtype, peak["bf16"]) if self.flops else 0.0
    return max(memory, compute)


class Account:
  """The kernels of one compiled program (`parse`d), per step."""

  def __init__(self, hlo: str, vocab_size: int):
    self.computations, entry = parse(hlo)
    self.vocab = vocab_size
    self.kernels: List[Kernel] = []
    self._walk(entry, 1)

  # -- what each fused computation does

  def _ops(self, name: str) -> List[Instruction]:
    """The instructions of a computation and of those it calls, recursively."""
    seen, out, todo = set(), [], [name]
    while todo:
      comp = self.computations.get(todo.pop())
      if comp is None or comp.name in seen:
        continue
      seen.add(comp.name)
      for inst in comp.instructions.values():
        out.append(inst)
        todo.extend(_CALLS.findall(inst.rest))
    return out

  def _dot_flops(self, comp_name: str) -> Tuple[float, str]:
    total, dtype = 0.0, "bf16"
    for comp in [self.computations[c] for c in self._reachable(comp_name)]:
      for inst in comp.instructions.values():
        if inst.op != "dot":
          continue
        lhs = comp.instructions.get(inst.operands[0])
        dims = _arrays(lhs.shape)[0][1] if lhs is not None else ()
        contracting = _LHS_CONTRACTING.search(inst.rest)
        k = int(np.prod([dims[int(i)] for i in contracting[1].split(",") if i])) if (
            contracting and dims) else 1
        out = _arrays(inst.shape)[0]
        total += 2.0 * int(np.prod(out[1])) * k
        dtype = _arrays(lhs.shape)[0][0] if lhs is not None else dtype
    return total, dtype

  def _reachable(self, name: str) -> List[str]:
    seen, todo = [], [name]
    while todo:
      current = todo.pop()
      if current in seen or current not in self.computations:
        continue
      seen.append(current)
      for inst in self.computations[current].instructions.values():
        todo.extend(_CALLS.findall(inst.rest))
    return seen

  def _fusion_traffic(self, comp_name: str) -> Tuple[int, int]:
    """Bytes a fusion reads and writes: a sliced operand (converted or not) counts its
    slices, the buffer of an in-place update counts nothing read and only the update
    written."""
    comp = self.computations[comp_name]
    by_index = {i.name: i for i in comp.instructions.values() if i.op == "parameter"}
    users = collections.defaultdict(list)
    for i in comp.instructions.values():
      for o in i.operands:
        users[o].append(i)

    def readers(name, convert_ok=True):
      """`(user, the operand it reads, whether through a convert)` for each instruction
      reading `name`'s elements, past bitcasts and one convert (a loop fusion converts
      only the elements a slice or gather after it reads)."""
      found = []
      for user in users[name]:
        if user.op == "bitcast":
          found.extend(readers(user.name, convert_ok))
        elif user.op == "convert" and convert_ok:
          found.extend((u, via, True) for u, via, _ in readers(user.name, False))
        else:
          found.append((user, name, False))
      return found

    read = 0
    in_place = set()
    for pname, param in by_index.items():
      uses = readers(pname)
      full = _bytes(param.shape)
      sliced = [(u, via) for u, via, _ in uses
                if u.op in ("slice", "dynamic-slice", "gather") and u.operands[0] == via]
      if uses and len(sliced) == len(uses):
        # What the slices take, in the parameter's own element type.
        dtype = param.shape[:param.shape.index("[")]
        read += min(full, sum(_bytes(dtype + u.shape[u.shape.index("["):]) for u, _ in sliced))
      elif uses and all(u.op == "dynamic-update-slice" and u.operands[0] == via and not cv
                        for u, via, cv in uses):
        in_place.add(pname)
      else:
        read += full
    root = comp.instructions.get(comp.root)
    roots = ([comp.instructions[o] for o in root.operands] if root is not None
             and root.op == "tuple" else [root])
    written = 0
    for r in roots:
      if r is None:
        continue
      if r.op == "dynamic-update-slice":
        written += _bytes(comp.instructions[r.operands[1]].shape)
      else:
        written += _bytes(r.shape)
    return read, written

  def _category(self, inst: Instruction, comp_name: Optional[str]) -> str:
    if comp_name is None:
      return "copies"
    ops = self._ops(comp_name)
    names = {o.op for o in ops}
    kind = _BACKEND_KIND.search(inst.rest)
    kind = kind[1] if kind else ""
    if "gemm" in kind or "cublas" in kind or "dot" in names:
      return "products"
    if "dynamic_slice_fusion" in inst.rest or names <= _MOVES:
      return "copies"
    # The gradient's ops are traced under jvp() (forward) and transpose(jvp())
    # (backward); arithmetic outside both is the optimizer's (and clipping's), or
    # the batch's draw. A fusion doing any of it counts as the optimizer's.
    traced = [n for o in ops if o.op not in _MOVES for n in _OP_NAME.findall(o.rest)]
    outside = [n for n in traced if "jvp(" not in n]
    if outside:
      random = all(any(w in n for w in ("threefry", "randint", "random_")) for n in outside)
      return "batch" if random else "optimizer"
    shapes = [inst.shape] + [o.shape for o in ops]
    if any(self.vocab in dims for s in shapes for _, dims in _arrays(s)):
      return "loss"
    if names <= _MOVES | {"convert"}:
      return "converts"
    if "rsqrt" in names:
      return "norms"
    if names & {"gather", "scatter"}:
      return "embedding"
    return "elementwise"

  # -- the walk over what runs

  def _walk(self, comp_name: str, times: int) -> None:
    comp = self.computations[comp_name]
    for inst in comp.instructions.values():
      if inst.op == "while":
        trips = _TRIP_COUNT.search(inst.rest)
        n = int(trips[1]) if trips else 1
        self._walk(_BODY.search(inst.rest)[1], times * n)
        if not trips:  # the condition runs on the device, and its answer is copied back
          self._walk(_CONDITION.search(inst.rest)[1], times * (n + 1))
          self.kernels.append(Kernel(f"{inst.name} predicate", "loop control", times * (n + 1),
                                     1, 1, 0.0, ""))
        continue
      if inst.op in ("call", "conditional"):
        for found in _BRANCHES.findall(inst.rest):
          for name in (found[0].replace("%", "").split(",") if found[0] else [found[1]]):
            self._walk(name.strip(), times)
        for name in _CALLS.findall(inst.rest):
          self._walk(name, times)
        continue
      if inst.op in _FREE:
        continue
      self.kernels.append(self._kernel(inst, comp, times))

  def _kernel(self, inst: Instruction, comp: Computation, times: int) -> Kernel:
    operand_bytes = sum(_bytes(comp.instructions[o].shape) for o in inst.operands
                        if o in comp.instructions)
    if inst.op == "fusion":
      called = _CALLS.search(inst.rest)[1]
      category = self._category(inst, called)
      read, written = self._fusion_traffic(called)
      flop, dtype = self._dot_flops(called) if category == "products" else (0.0, "")
      return Kernel(inst.name, category, times, read, written, flop, dtype)
    if inst.op == "custom-call":
      target = _TARGET.search(inst.rest)[1]
      if "fmha" in target:
        return Kernel(inst.name, "attention", times, operand_bytes, inst.out_bytes,
                      self._attention_flops(inst, comp, target), "bf16")
      if "gemm" in target or "matmul" in target:
        return Kernel(inst.name, "products", times, operand_bytes, inst.out_bytes,
                      self._cublas_flops(inst, comp), self._dtype_of(inst.operands[0], comp))
      return Kernel(inst.name, "elementwise", times, operand_bytes, inst.out_bytes, 0.0, "")
    if inst.op.startswith(("all-", "reduce-scatter", "collective")):
      return Kernel(inst.name, "collectives", times, operand_bytes, inst.out_bytes, 0.0, "")
    if inst.op in ("copy", "copy-start", "transpose"):
      return Kernel(inst.name, "copies", times, operand_bytes, inst.out_bytes, 0.0, "")
    if inst.op == "dynamic-update-slice":
      update = _bytes(comp.instructions[inst.operands[1]].shape)
      return Kernel(inst.name, "copies", times, update, update, 0.0, "")
    return Kernel(inst.name, "elementwise", times, operand_bytes, inst.out_bytes, 0.0, "")

  @staticmethod
  def _dtype_of(name: str, comp: Computation) -> str:
    arrays = _arrays(comp.instructions[name].shape) if name in comp.instructions else []
    return arrays[0][0] if arrays else "bf16"

  @staticmethod
  def _cublas_flops(inst: Instruction, comp: Computation) -> float:
    lhs = _arrays(comp.instructions[inst.operands[0]].shape)[0][1]
    contracting = _CUBLAS_CONTRACTING.search(inst.rest)
    dims = [int(d.strip('"')) for d in contracting[1].split(",")] if contracting else [-1]
    k = int(np.prod([lhs[d] for d in dims]))
    return 2.0 * int(np.prod(_arrays(inst.shape)[0][1])) * k

  @staticmethod
  def _attention_flops(inst: Instruction, comp: Computation, target: str) -> float:
    # q, k, v: [batch, time, heads, head_dim]. QK^T and PV: 4 B H T^2 D; a causal
    # mask computes half; the backward pass five products of those sizes, not two.
    b, t, h, d = _arrays(comp.instructions[inst.operands[0]].shape)[0][1]
    forward = 4.0 * b * h * t * t * d
    if "CAUSAL" in inst.rest or "causal" in inst.rest.lower():
      forward /= 2
    return forward * (2.5 if "Backward" in target else 1.0)


def summarize(account: Account, card: gpu_plan.Card, peak: Dict[str, float]) -> dict:
  rows = collections.OrderedDict((c, {"kernels": 0, "bytes": 0, "flops": 0.0, "ms": 0.0})
                                 for c in CATEGORIES)
  for k in account.kernels:
    row = rows[k.category]
    row["kernels"] += k.launches
    row["bytes"] += k.launches * (k.read + k.written)
    row["flops"] += k.launches * k.flops
    row["ms"] += k.launches * k.seconds(card, peak) * 1e3
  total = {key: sum(r[key] for r in rows.values()) for key in ("kernels", "bytes", "flops", "ms")}
  between = {key: sum(r[key] for c, r in rows.items() if c not in ("products", "attention"))
             for key in ("kernels", "bytes", "ms")}
  estimate = (rows["products"]["ms"] / MEASURED_SHARE["products"]
              + rows["attention"]["ms"] / MEASURED_SHARE["attention"]
              + between["ms"] / MEASURED_SHARE["rest"])
  return {"categories": {c: r for c, r in rows.items() if r["kernels"]}, "total": total,
          "between_products": between, "estimated_ms": estimate}


def report(summary: dict, account: Account, card: gpu_plan.Card, peak, top: int) -> str:
  lines = [f"{'category':13s} {'kernels':>8s} {'GiB moved':>10s} {'TFLOP':>8s} "
           f"{'roofline ms':>12s}"]
  for name, row in list(summary["categories"].items()) + [("total", summary["total"])]:
    lines.append(f"{name:13s} {row['kernels']:8d} {row['bytes'] / 2**30:10.2f} "
                 f"{row['flops'] / 1e12:8.2f} {row['ms']:12.2f}")
  between = summary["between_products"]
  lines.append(f"between the products and attention: {between['kernels']} kernels, "
               f"{between['bytes'] / 2**30:.2f} GiB, {between['ms']:.2f} ms at the roofline")
  lines.append(f"estimated kernel time per step: {summary['estimated_ms']:.1f} ms (each kind at "
               f"the share of its roofline measured on an H200: "
               + ", ".join(f"{k} {v:.2f}" for k, v in MEASURED_SHARE.items()) + ")")
  lines.append("")
  lines.append(f"top {top} kernel sites by roofline time per step:")
  ranked = sorted(account.kernels, key=lambda k: -k.launches * k.seconds(card, peak))
  for k in ranked[:top]:
    lines.append(f"  {k.launches * k.seconds(card, peak) * 1e3:7.3f} ms  x{k.launches:<4d} "
                 f"{k.category:12s} read {k.read / 2**20:8.1f} MiB  write "
                 f"{k.written / 2**20:8.1f} MiB  {k.name}")
  return "\n".join(lines)


def account_for(config: gpt.GPTConfig, gpu: str, batch_size: int, forms: kernels.Forms,
                opt_config: optim.OptimizerConfig) -> Tuple[Account, str]:
  """The `Account` of the training step compiled for `gpu`, and the optimised HLO."""
  devices = gpu_plan.target_devices(gpu)
  compiled = gpu_plan.compile_train_step(config, devices, batch_size=batch_size, forms=forms,
                                         opt_config=opt_config)
  hlo = compiled.as_text()
  return Account(hlo, config.vocab_size), hlo


def card_peaks(gpu: str) -> Tuple[gpu_plan.Card, Dict[str, float]]:
  card = gpu_plan.card(gpu)
  device = gpu_plan.target_devices(gpu)[0]
  peak = {name: flops_lib.device_peak_flops(device, name) for name in ("bfloat16", "float32")}
  return card, {"bf16": peak["bfloat16"], "f16": peak["bfloat16"], "f32": peak["float32"]}


# The forms this command's flags override (`kernels.Forms` fields).
_FORM_FLAGS = ("scan_layers", "remat", "matmul_output", "loss_logits", "recompute_activation")

GPT2_124M = gpt.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                          bias=False, compute_dtype="bfloat16")


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  truth = {"true": True, "false": False}
  # `select` keeps the GPU's choice for any form left at "auto".
  forms = kernels.select("gpu", **{name: truth.get(FLAGS[name].value, FLAGS[name].value)
                                   for name in _FORM_FLAGS})
  opt = optim.with_schedule_end(recipes.GPT_OPTIMIZER, 5000)
  account, _ = account_for(GPT2_124M, FLAGS.gpu, FLAGS.batch_size, forms, opt)
  card, peak = card_peaks(FLAGS.gpu)
  summary = summarize(account, card, peak)
  print(f"GPT-2 124M step, batch {FLAGS.batch_size} x 1024, bf16, AdamW, for {FLAGS.gpu} "
        f"({card.bandwidth / 1e12:.2f} TB/s, {peak['bf16'] / 1e12:.0f} TFLOP/s bf16): "
        f"{forms.describe()}")
  print(report(summary, account, card, peak, FLAGS.top))
  if FLAGS.out:
    with open(FLAGS.out, "w", encoding="utf-8") as f:
      json.dump({"gpu": FLAGS.gpu, "batch_size": FLAGS.batch_size, "forms": forms.describe(),
                 **summary}, f, indent=1)


if __name__ == "__main__":
  flags.DEFINE_string("gpu", "h100", f"The card: {', '.join(gpu_plan.TARGETS)}.")
  flags.DEFINE_integer("batch_size", 12, "The global batch.")
  flags.DEFINE_enum("scan_layers", "auto", ["auto", "true", "false"], "The layer loop's form.")
  flags.DEFINE_enum("remat", "auto", ["auto", *kernels.REMAT_POLICIES], "The remat policy.")
  flags.DEFINE_enum("matmul_output", "auto", ["auto", *kernels.MATMUL_OUTPUT_FORMS],
                    "The products' output dtype.")
  flags.DEFINE_enum("loss_logits", "auto", ["auto", *kernels.LOSS_LOGITS_FORMS],
                    "The dtype of the head's logits.")
  flags.DEFINE_enum("recompute_activation", "auto", ["auto", "true", "false"],
                    "Whether the MLP's backward recomputes its activation.")
  flags.DEFINE_integer("top", 25, "Kernel sites listed.")
  flags.DEFINE_string("out", None, "Also write the account as JSON here.")
  app.run(main)
