"""The kernel account (`bench.gpu_kernels`): what a GPU would run per step, read from
the optimised HLO. A small hand-written module pins the reading rules; the
GPT-2 step compiled for an H100 checks the products' FLOPs against the model's own count
in tests/test_gpu_program.py, which compiles that step once for all it reads."""

import types

import pytest

from bench import gpu_kernels

# A loop of 4 trips whose body slices a stacked weight, converts it, multiplies
# with it (a Triton product) and writes its row of a stacked output in place;
# then one fusion over a [8, 50] "vocabulary" and a copy.
HLO = """HloModule tiny

%fused_slice (p0: f32[4,16,16], p1: s32[]) -> bf16[16,16] {
  %p0 = f32[4,16,16]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = f32[1,16,16]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,16,16}, metadata={op_name="jit(f)/jvp()/dynamic_slice"}
  %b = f32[16,16]{1,0} bitcast(%ds)
  ROOT %cv = bf16[16,16]{1,0} convert(%b), metadata={op_name="jit(f)/jvp()/convert"}
}

%gemm (g0: bf16[8,16], g1: bf16[16,16]) -> bf16[8,16] {
  %g0 = bf16[8,16]{1,0} parameter(0)
  %g1 = bf16[16,16]{1,0} parameter(1)
  ROOT %dot = bf16[8,16]{1,0} dot(%g0, %g1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_update (u0: bf16[4,8,16], u1: s32[], u2: bf16[8,16]) -> bf16[4,8,16] {
  %u0 = bf16[4,8,16]{2,1,0} parameter(0)
  %u2 = bf16[8,16]{1,0} parameter(2)
  %ub = bf16[1,8,16]{2,1,0} bitcast(%u2)
  %u1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %dus = bf16[4,8,16]{2,1,0} dynamic-update-slice(%u0, %ub, %u1, %z, %z), metadata={op_name="jit(f)/jvp()/dynamic_update_slice"}
}

%body (t: (s32[], f32[4,16,16], bf16[8,16], bf16[4,8,16])) -> (s32[], f32[4,16,16], bf16[8,16], bf16[4,8,16]) {
  %t = (s32[], f32[4,16,16]{2,1,0}, bf16[8,16]{1,0}, bf16[4,8,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = f32[4,16,16]{2,1,0} get-tuple-element(%t), index=1
  %x = bf16[8,16]{1,0} get-tuple-element(%t), index=2
  %out = bf16[4,8,16]{2,1,0} get-tuple-element(%t), index=3
  %slice = bf16[16,16]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %product = bf16[8,16]{1,0} fusion(%x, %slice), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %written = bf16[4,8,16]{2,1,0} fusion(%out, %i, %product), kind=kLoop, calls=%fused_update
  ROOT %r = (s32[], f32[4,16,16]{2,1,0}, bf16[8,16]{1,0}, bf16[4,8,16]{2,1,0}) tuple(%i, %w, %product, %written)
}

%cond (c: (s32[], f32[4,16,16], bf16[8,16], bf16[4,8,16])) -> pred[] {
  %c = (s32[], f32[4,16,16]{2,1,0}, bf16[8,16]{1,0}, bf16[4,8,16]{2,1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%fused_logits (l0: bf16[8,16]) -> f32[8,50] {
  %l0 = bf16[8,16]{1,0} parameter(0)
  %lc = f32[8,16]{1,0} convert(%l0), metadata={op_name="jit(f)/jvp()/convert"}
  ROOT %lb = f32[8,50]{1,0} broadcast(%lc), dimensions={}, metadata={op_name="jit(f)/jvp()/broadcast"}
}

ENTRY %main (a: f32[4,16,16], x: bf16[8,16], o: bf16[4,8,16]) -> f32[8,50] {
  %a = f32[4,16,16]{2,1,0} parameter(0)
  %x = bf16[8,16]{1,0} parameter(1)
  %o = bf16[4,8,16]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,16,16]{2,1,0}, bf16[8,16]{1,0}, bf16[4,8,16]{2,1,0}) tuple(%zero, %a, %x, %o)
  %loop = (s32[], f32[4,16,16]{2,1,0}, bf16[8,16]{1,0}, bf16[4,8,16]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %last = bf16[8,16]{1,0} get-tuple-element(%loop), index=2
  %copied = bf16[8,16]{1,0} copy(%last)
  ROOT %logits = f32[8,50]{1,0} fusion(%copied), kind=kLoop, calls=%fused_logits
}
"""


def sites(account):
  return {k.name: k for k in account.kernels}


def test_a_loop_body_counts_its_trips_and_reads_only_what_it_slices():
  account = gpu_kernels.Account(HLO, vocab_size=50)
  found = sites(account)
  assert set(found) == {"slice", "product", "written", "copied", "logits"}
  assert [found[n].launches for n in ("slice", "product", "written")] == [4, 4, 4]
  assert found["copied"].launches == found["logits"].launches == 1
  # The slice reads one [16, 16] float32 row of the stacked weight (and its index),
  # not all four rows.
  assert (found["slice"].read, found["slice"].written) == (16 * 16 * 4 + 4, 16 * 16 * 2)
  assert found["slice"].category == "converts"
  # In place: the stacked output is neither read nor written whole, only its row.
  assert (found["written"].read, found["written"].written) == (8 * 16 * 2 + 4, 8 * 16 * 2)
  assert found["written"].category == "copies"
  assert found["product"].category == "products"
  assert found["product"].flops == 2 * 8 * 16 * 16 and found["product"].dtype == "bf16"
  assert found["logits"].category == "loss"  # it touches the vocabulary's dimension
  assert found["copied"].category == "copies"


# A fusion that converts bf16 logits to float32 and takes one row of them: the
# kernel reads that row (in bf16), not the whole operand.
PICKED = """HloModule picked

%fused_pick (q0: bf16[8,50], q1: s32[]) -> f32[1,50] {
  %q0 = bf16[8,50]{1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %qc = f32[8,50]{1,0} convert(%q0), metadata={op_name="jit(f)/jvp()/convert"}
  ROOT %row = f32[1,50]{1,0} dynamic-slice(%qc, %q1, %c), dynamic_slice_sizes={1,50}, metadata={op_name="jit(f)/jvp()/dynamic_slice"}
}

ENTRY %main (l: bf16[8,50], i: s32[]) -> f32[1,50] {
  %l = bf16[8,50]{1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %picked = f32[1,50]{1,0} fusion(%l, %i), kind=kLoop, calls=%fused_pick
}
"""


def test_a_converted_operand_that_is_sliced_counts_only_its_slice():
  picked = sites(gpu_kernels.Account(PICKED, vocab_size=50))["picked"]
  assert (picked.read, picked.written) == (50 * 2 + 4, 50 * 4)


def test_the_summary_adds_up_and_the_roofline_takes_the_slower_of_bytes_and_flops():
  account = gpu_kernels.Account(HLO, vocab_size=50)
  card = types.SimpleNamespace(bandwidth=1e9)  # bytes/s: all the account reads of a card
  peak = {"bf16": 1e6, "f32": 1e6}
  summary = gpu_kernels.summarize(account, card, peak)
  assert summary["total"]["kernels"] == 4 + 4 + 4 + 1 + 1
  assert summary["total"]["kernels"] == sum(
      row["kernels"] for row in summary["categories"].values())
  product = sites(account)["product"]
  # 4096 FLOPs at 1 MFLOP/s (4.1 ms) beat its 1 KiB at 1 GB/s (1 us).
  assert product.seconds(card, peak) == pytest.approx(2 * 8 * 16 * 16 / 1e6)
