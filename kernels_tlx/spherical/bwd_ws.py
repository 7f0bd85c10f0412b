"""`tlx_ws` spherical backward: FlashAttention-3's shape, dQ reduce-added (not bitwise repeatable).

One warp-specialized kernel after kernels_triton/spherical/bwd_common.row_coeffs:
`_dkv_kernel` of bwd_common.py with WITH_DQ=True (technique, warp-group roles, masks: its
docstring): per key block of 128 keys a producer streams 64-row Q/dO tiles over every query block
and the G query heads of its KV head; two consumer warp groups (64 keys each) keep dK, dV in
registers and, per tile, share dS^T through shared memory for dQ = dS K (D = 128: a column half
each; D = 64: the whole tile, consumers alternating), which a TMA reduce-add adds into an fp32
[B, N, Hq, D] scratch; a last small kernel converts it to bf16 dq. 5 tensor-core GEMM units per
(row, key) tile pair.
Supports every spherical spec (D 64 and 128, any B, N, Nk, G, causal, seqlens) and packed
sequences (bwd_common.py's PACKED).
Differs from `tlx_ws_det` (bwd_ws_det.py): dQ comes from the key-block kernel through reduce-adds
in the hardware's order (fp32 sums in varying order: not bitwise repeatable) instead of a second
kernel that recomputes S and dP per row block. Scratch: 4 * B * N * Hq * D bytes.
"""
from __future__ import annotations

import torch

from altattn.registry import CompileConfig
from kernels_triton.proton import profiled
from kernels_triton.spherical.bwd_common import prepare_row_coeffs
from kernels_tlx.spherical.bwd_common import (
    build_compile_configs,
    _dkv_kernel,
    prepare_convert,
    prepare_dkv,
)
from kernels_tlx.spherical.bwd_common import supports as common_supports


def supports(spec) -> str | None:
    return common_supports(spec)


def profiled_kernels(spec) -> dict[str, int]:
    """One scoped kernel, the key-block kernel ("dkv"), 12 warps (the convert has no scopes)."""
    return {"dkv": 12}


def prepare(spec, profile: bool | str = False):
    """row_coeffs (A and R = Bt / A), `_dkv_kernel` (dk, dv, dQ into a zeroed fp32 scratch),
    convert to dq: run(q, k, v, out, r, dout, dr, seqlens, dq, dk, dv). profile: True or "dkv"
    scopes the key-block kernel."""
    coeffs = prepare_row_coeffs(spec, ratio=True, zero_dq=True, slots=spec.packed)
    dkv = prepare_dkv(spec, True, profiled(profile, "dkv", ("dkv",)))
    convert = prepare_convert(spec.B * spec.N * spec.Hq * spec.D)

    def run(q, k, v, out, r, dout, dr, seqlens, dq, dk, dv) -> None:
        dq_acc = torch.empty(dq.shape, dtype=torch.float32, device=dq.device)
        # zeroes dq_acc too; packed: A, R in 64-row slots per sequence (seqlens: the offsets)
        A, R = coeffs(out, dout, r, dr, seqlens.cu_q if spec.packed else seqlens, dq_acc)
        dkv(q, k, v, dout, A, R, seqlens, dk, dv, dq_acc)
        convert(dq_acc, dq)

    return run


def launch(spec, q, k, v, out, r, dout, dr, seqlens, dq, dk, dv, profile: bool | str = False
           ) -> None:
    prepare(spec, profile)(q, k, v, out, r, dout, dr, seqlens, dq, dk, dv)


def compile_configs() -> list[CompileConfig]:
    """The key-block kernel with dQ at every compile shape (bwd_common.compile_specs)."""
    return build_compile_configs(prepare, {_dkv_kernel: "dkv"})
