"""Triple attention's peers: what bench --peers times beside its kernels (registry.Peer.runs names
`materialised` and `torch_einsum`):

    materialised   cuBLAS bf16 on the two GEMM phases with the outer products built beforehand
                   (FAMILIES.md §2's "materialised" row), per (b, h):
                       phase 1  S = (c K1 (x) V)^T K2       [Dq Dv, N] x [N, Dq]
                       phase 2  out = (Q1 (x) Q2) S'         [N, Dq^2] x [Dq^2, Dv]
                   (S' is S's axes reordered, a [Dq^2, Dv] copy). Only the two matmuls (and that
                   small copy) are timed; forward only, non-causal (a causal shape is timed
                   non-causal, its row says so: the same useful FLOPs). Memory: the two operands
                   take 2 N Dq (Dq + Dv) bytes per head, 8.6 GB at T2 (69 GB for its 8 heads);
                   they are built for as many heads as MAT_BYTES holds (halved on out-of-memory),
                   and the timed call runs the remaining heads as further groups on the same
                   operands (the same work, read from HBM again: far beyond L2).
    torch_einsum   plain PyTorch: bf16 einsums chunked over N (the [chunk, H, Dq, Dv]
                   intermediates under EINSUM_BYTES), the state summed in fp32; causal by the
                   chunked form (the masked quadratic form inside CAUSAL_CHUNK tokens, the prefix
                   state across); forward, and backward by autograd, which keeps every chunk's
                   intermediates (about 4 B N H Dq max(Dq, Dv) bytes: 69 GB at T2).

Both are credited with the family's useful FLOPs (Family.flops), so their TFLOPS compare directly
with the variants'. Each peer is `peer(shape, passes, seed) -> {pass: setup, or a note}`:
`setup()` makes what the timed call needs and returns the call; a string says why that pass is
not timed; "note", a remark every timed row carries. `einsum_forward` and `materialised_forward`
run on any device.
"""
from __future__ import annotations

import torch

from altattn.triple.shapes import make_inputs

MAT_BYTES = 72 << 30      # materialised: its two operands, all groups' heads, under this
EINSUM_BYTES = 1 << 30    # torch_einsum: one chunk's bf16 [B, chunk, H, Dq, Dv] intermediate
CAUSAL_CHUNK = 1024       # torch_einsum causal: tokens per chunk (the [B, H, L, L] scores)
BF16 = torch.bfloat16


def _scale(N: int, scale) -> float:
    return 1.0 / max(N, 1) if scale is None else float(scale)


# ---------------------------------------------------------------------------------------------
# Materialised outer products, cuBLAS bf16


def build_operands(q1, q2, k1, k2, v, c: float, heads: int):
    """(A [heads, N, Dq Dv], K2 [heads, N, Dq], Phi [heads, N, Dq^2]) bf16 of the first `heads`
    (b, h) pairs (in b * H + h order): A = c K1 (x) V, Phi = Q1 (x) Q2, built a head at a time."""
    B, N, H, Dq = q1.shape
    Dv = v.shape[-1]
    A = torch.empty(heads, N, Dq * Dv, dtype=BF16, device=q1.device)
    Phi = torch.empty(heads, N, Dq * Dq, dtype=BF16, device=q1.device)
    for i in range(heads):
        b, h = divmod(i, H)
        torch.mul((k1[b, :, h] * c).to(BF16)[:, :, None], v[b, :, h].to(BF16)[:, None, :],
                  out=A[i].view(N, Dq, Dv))
        torch.mul(q1[b, :, h].to(BF16)[:, :, None], q2[b, :, h].to(BF16)[:, None, :],
                  out=Phi[i].view(N, Dq, Dq))
    K2 = k2.to(BF16).permute(0, 2, 1, 3).reshape(B * H, N, Dq)[:heads].contiguous()
    return A, K2, Phi


def materialised_phases(A, K2, Phi, Dv: int) -> torch.Tensor:
    """out [heads, N, Dv] bf16: phase 1 S = A^T K2 [heads, Dq Dv, Dq], phase 2 Phi S'."""
    n, _, Dq = K2.shape
    S = torch.matmul(A.transpose(1, 2), K2)                                  # [n, (i, j), k]
    W = S.view(n, Dq, Dv, Dq).transpose(2, 3).reshape(n, Dq * Dq, Dv)         # [n, (i, k), j]
    return torch.matmul(Phi, W)


def materialised_forward(q1, q2, k1, k2, v, scale=None) -> torch.Tensor:
    """out [B, N, H, Dv] bf16 (non-causal), every head's operands at once: for tests."""
    B, N, H, _ = q1.shape
    Dv = v.shape[-1]
    ops = build_operands(q1, q2, k1, k2, v, _scale(N, scale), B * H)
    return materialised_phases(*ops, Dv).view(B, H, N, Dv).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Plain PyTorch einsums


def _chunk(B: int, H: int, Dq: int, Dv: int) -> int:
    return max(1, EINSUM_BYTES // (2 * B * H * Dq * max(Dq, Dv)))


def einsum_forward(q1, q2, k1, k2, v, scale=None, causal: bool = False, chunk: int | None = None):
    """(out [B, N, H, Dv] bf16, state [B, H, Dq, Dv, Dq] fp32) by bf16 einsums over chunks of
    `chunk` tokens (default: EINSUM_BYTES; causal at most CAUSAL_CHUNK), the state summed in
    fp32; differentiable (autograd)."""
    B, N, H, Dq = q1.shape
    Dv = v.shape[-1]
    c = _scale(N, scale)
    L = chunk or (min(_chunk(B, H, Dq, Dv), CAUSAL_CHUNK) if causal else _chunk(B, H, Dq, Dv))
    S = torch.zeros(B, H, Dq, Dv, Dq, dtype=torch.float32, device=q1.device)
    outs = []
    for a in range(0, N, L):
        y1, y2, x1, x2, vv = (t[:, a:a + L] for t in (q1, q2, k1, k2, v))
        if causal:  # the prefix state, then this chunk's masked quadratic form
            inter = torch.einsum("bnhi,bhijk,bnhk->bnhj", y1, S.to(BF16), y2)
            s = torch.einsum("bnhi,bmhi->bhnm", y1, x1) * torch.einsum("bnhk,bmhk->bhnm", y2, x2)
            outs.append(inter + c * torch.einsum("bhnm,bmhj->bnhj", s.tril(), vv))
        S = S + c * torch.einsum("bnhi,bnhj,bnhk->bhijk", x1, vv, x2).float()
    if not causal:
        W = S.to(BF16)
        outs = [torch.einsum("bnhi,bhijk,bnhk->bnhj", q1[:, a:a + L], W, q2[:, a:a + L])
                for a in range(0, N, L)]
    out = torch.cat(outs, dim=1) if outs else q1.new_zeros(B, N, H, Dv)
    return out, S


def materialised(s, passes: tuple[str, ...], seed: int) -> dict:
    """The two phases on cuBLAS with the outer products built beforehand (module docstring)."""
    plan: dict = {p: "forward only" for p in passes if p != "fwd"}
    if "fwd" not in passes:
        return plan
    per_head = 2 * s.N * s.Dq * (s.Dq + s.Dv)
    heads = max(1, min(s.B * s.H, MAT_BYTES // per_head))
    notes = ["non-causal (the materialised phases read one global state)"] if s.causal else []
    ops = None
    try:
        x = make_inputs(s, "cuda", seed)
        while ops is None:
            try:
                ops = build_operands(*x, 1.0 / max(s.N, 1), heads)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                if heads == 1:
                    raise
                heads //= 2
    except torch.cuda.OutOfMemoryError as e:  # the other passes keep "forward only"
        return {**plan, "fwd": f"operands: out of memory: {str(e).splitlines()[0]}"}
    groups = [min(heads, s.B * s.H - h0) for h0 in range(0, s.B * s.H, heads)]
    if len(groups) > 1:
        notes.append(f"operands of {heads} of {s.B * s.H} heads "
                     f"({heads * per_head / 1e9:.1f} GB), reused by {len(groups)} groups")

    def fwd() -> None:
        for n in groups:
            materialised_phases(*(t[:n] for t in ops), s.Dv)

    return {**plan, "fwd": lambda: fwd, "note": "; ".join(notes)}


def torch_einsum(s, passes: tuple[str, ...], seed: int) -> dict:
    """Plain PyTorch triple attention on `s` (module docstring); a backward's graph is built by
    its setup (one graph alive at a time)."""
    grad = passes != ("fwd",)
    x = [t.requires_grad_(grad) for t in make_inputs(s, "cuda", seed)]
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    dout = torch.randn(s.B, s.N, s.H, s.Dv, generator=gen, device="cuda", dtype=BF16)

    def fwd():
        with torch.no_grad():
            return einsum_forward(*x, causal=s.causal)

    def bwd():
        out, _ = einsum_forward(*x, causal=s.causal)  # the graph the timed calls walk
        return lambda: torch.autograd.grad(out, x, dout, retain_graph=True)

    return {"fwd": lambda: fwd, "bwd": bwd,
            "fwd+bwd": lambda: lambda: torch.autograd.grad(einsum_forward(*x, causal=s.causal)[0],
                                                           x, dout)}
