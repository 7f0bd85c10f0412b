"""Spherical attention's own peers for bench --peers (registry.Peer.runs names these functions):

    torch_bf16      plain PyTorch spherical attention: bf16 matmuls (the reference's math with S
                    materialised), one (sequence, head chunk) at a time so that memory stays
                    bounded; forward and a closed-form backward (it recomputes S, as a kernel
                    would, from out and r)
    triton_sigmoid  triton-sigmoid's sigmoid attention (PyPI `triton-sigmoid`, MIT; softmax-free
                    attention for single-cell models, dense and padded, forward and backward),
                    timed only when importable: its rows say "not installed" otherwise

Both are timed on the spherical shape itself (same B, N, heads, D, causal, padding) and credited
with the family's useful FLOPs (Family.flops: the visible pairs, real tokens only), so their
TFLOPS compare directly with the variants'. Each function: (fam, peer, shape, args, passes) ->
rows (bench/peers.py: peer_rows, time_rows).
"""
from __future__ import annotations

import argparse

import torch

from altattn import registry
from bench.peers import peer_rows, time_rows

S_BYTES = 4 << 30  # torch_bf16: the bf16 [heads, L, L] tensors of one chunk stay under this
EPS = 1e-6         # the family's default eps


def _base(fam: registry.Family, peer: registry.Peer, s, passes) -> list[dict]:
    flops = {"fwd": fam.flops(s, "fwd"), "bwd": fam.flops(s, "bwd")}
    flops["fwd+bwd"] = flops["fwd"] + flops["bwd"]
    return peer_rows({"kind": "peer", "variant": peer.name, "shape": s.short(), **s.fields()},
                     passes, flops)


def _inputs(s, seed: int, device: str = "cuda"):
    """q [B, N, Hq, D], k, v [B, N, Hk, D] bf16 N(0, 1), and the real lengths (a list) or None."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(s.B, s.N, s.Hq, s.D, generator=gen, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(s.B, s.N, s.Hk, s.D, generator=gen, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    return q, k, v, s.lengths()


# ---------------------------------------------------------------------------------------------
# Plain PyTorch, bf16 matmuls


def _chunks(B: int, N: int, Hq: int, lengths, tensors: int):
    """(b, L, h0, h1): sequence b's real length L and a range of query heads whose `tensors`
    bf16 [h1 - h0, L, L] tensors fit S_BYTES (at least one head)."""
    for b in range(B):
        L = N if lengths is None else max(0, min(N, int(lengths[b])))
        if L == 0:
            continue
        step = max(1, S_BYTES // (tensors * 2 * L * L))
        for h0 in range(0, Hq, step):
            yield b, L, h0, min(Hq, h0 + step)


def _heads(t: torch.Tensor, b: int, L: int, heads: torch.Tensor) -> torch.Tensor:
    """[len(heads), L, D]: sequence b's first L rows of the given heads."""
    return t[b, :L].index_select(1, heads).transpose(0, 1)


def _scores(q, k, b, L, h0, h1, G, c, causal):
    """(q chunk, k chunk, S = c q k^T [h, L, L] bf16, hidden pairs 0, KV head of each head)."""
    kv = torch.arange(h0, h1, device=q.device) // G
    qc = q[b, :L, h0:h1].transpose(0, 1)
    kc = _heads(k, b, L, kv)
    S = torch.matmul(qc * c, kc.transpose(1, 2))
    return qc, kc, (S.tril_() if causal else S), kv


def torch_forward(q, k, v, causal: bool = False, lengths=None, eps: float = EPS):
    """(out [B, N, Hq, D] bf16, r [B, Hq, N] fp32), r = each row's L2 norm of scores; rows past a
    sequence's length are 0. bf16 matmuls, fp32 norms."""
    B, N, Hq, D = q.shape
    G, c = Hq // k.shape[2], D ** -0.5
    out = torch.zeros_like(q)
    r = torch.zeros(B, Hq, N, device=q.device, dtype=torch.float32)
    for b, L, h0, h1 in _chunks(B, N, Hq, lengths, 2):
        _, _, S, kv = _scores(q, k, b, L, h0, h1, G, c, causal)
        z = torch.linalg.vector_norm(S, dim=-1, dtype=torch.float32)         # [h, L]
        o = torch.matmul(S, _heads(v, b, L, kv))                             # [h, L, D]
        out[b, :L, h0:h1] = (o / (z + eps)[..., None].to(o.dtype)).transpose(0, 1)
        r[b, h0:h1, :L] = z
    return out, r


def torch_backward(dout, q, k, v, out, r, causal: bool = False, lengths=None,
                   eps: float = EPS):
    """(dq, dk, dv) bf16 of out (dr = 0), by the closed form (altattn.spherical.reference):
    a = 1/(r + eps), ds = a dP - delta a s / r, dv = (a s)^T dout, dq = c ds k, dk = c ds^T q;
    dk and dv summed over each KV head's query heads in fp32."""
    B, N, Hq, D = q.shape
    G, c = Hq // k.shape[2], D ** -0.5
    dq = torch.zeros_like(q)
    dk, dv = (torch.zeros(k.shape, device=k.device, dtype=torch.float32) for _ in range(2))
    for b, L, h0, h1 in _chunks(B, N, Hq, lengths, 4):
        qc, kc, S, kv = _scores(q, k, b, L, h0, h1, G, c, causal)
        doc, oc = dout[b, :L, h0:h1].transpose(0, 1), out[b, :L, h0:h1].transpose(0, 1)
        rc = r[b, h0:h1, :L]
        a = 1.0 / (rc + eps)
        delta = (doc.float() * oc.float()).sum(-1)
        beta = torch.where(rc > 0, -delta * a / torch.where(rc > 0, rc, 1.0), 0.0)
        dP = torch.matmul(doc, _heads(v, b, L, kv).transpose(1, 2))            # [h, L, L]
        ds = dP * a.to(dP.dtype)[..., None] + S * beta.to(S.dtype)[..., None]
        if causal:
            ds.tril_()
        P = S * a.to(S.dtype)[..., None]
        dq[b, :L, h0:h1] = (torch.matmul(ds, kc) * c).transpose(0, 1)
        dk[b, :L].index_add_(1, kv, (torch.matmul(ds.transpose(1, 2), qc) * c)
                             .transpose(0, 1).float())
        dv[b, :L].index_add_(1, kv, torch.matmul(P.transpose(1, 2), doc).transpose(0, 1).float())
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def torch_bf16(fam: registry.Family, peer: registry.Peer, s, args: argparse.Namespace,
               passes: tuple[str, ...]) -> list[dict]:
    """Plain PyTorch spherical attention on `s` (module docstring), one row per pass."""
    rows = _base(fam, peer, s, passes)
    try:
        q, k, v, lengths = _inputs(s, args.seed)
        out, r = torch_forward(q, k, v, s.causal, lengths)
        dout = torch.randn_like(out) if passes != ("fwd",) else None
    except torch.cuda.OutOfMemoryError as e:
        return [{**row, "note": f"out of memory: {str(e).splitlines()[0]}"} for row in rows]
    calls = {"fwd": lambda: torch_forward(q, k, v, s.causal, lengths),
             "bwd": lambda: torch_backward(dout, q, k, v, out, r, s.causal, lengths),
             "fwd+bwd": lambda: torch_backward(dout, q, k, v,
                                               *torch_forward(q, k, v, s.causal, lengths),
                                               s.causal, lengths)}
    return time_rows(rows, passes, calls, args)


# ---------------------------------------------------------------------------------------------
# triton-sigmoid (optional)


def triton_sigmoid(fam: registry.Family, peer: registry.Peer, s, args: argparse.Namespace,
                   passes: tuple[str, ...]) -> list[dict]:
    """triton-sigmoid's sigmoid attention on `s`: dense, or padded with the shape's real lengths;
    k and v repeated to Hq heads first (it takes one head count), outside the timed calls."""
    rows = _base(fam, peer, s, passes)
    try:
        import triton_sigmoid as ts
    except ImportError:
        return [{**row, "note": "not installed (pip install triton-sigmoid)"} for row in rows]
    grad = passes != ("fwd",)
    try:
        q, k, v, lengths = _inputs(s, args.seed)
        G = s.Hq // s.Hk
        k, v = (t.repeat_interleave(G, dim=2) for t in (k, v))
        q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
        if lengths is None:
            def fwd():
                return ts.sigmoid_attention(q, k, v, is_causal=s.causal)
        else:
            lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)

            def fwd():
                return ts.sigmoid_attention_padded(q, k, v, seq_lens_k=lens, seq_lens_q=lens,
                                                   is_causal=s.causal)
        o = fwd()
        do = torch.randn_like(o) if grad else None
    except torch.cuda.OutOfMemoryError as e:
        return [{**row, "note": f"out of memory: {str(e).splitlines()[0]}"} for row in rows]
    except Exception as e:  # noqa: BLE001  (a third-party kernel: any failure is its row's note)
        return [{**row, "note": f"not run: {type(e).__name__}: {str(e).splitlines()[0]}"}
                for row in rows]
    calls = {"fwd": fwd,
             "bwd": lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
             "fwd+bwd": lambda: torch.autograd.grad(fwd(), (q, k, v), do)}
    return time_rows(rows, passes, calls, args)
