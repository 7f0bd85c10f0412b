"""Spherical attention's peers: what bench --peers times beside its kernels (registry.Peer.runs
names `torch_bf16` and `triton_sigmoid`), on the spherical shape itself (same B, N, heads, D,
causal, padding) and credited with the family's useful FLOPs (Family.flops), so their TFLOPS
compare directly with the variants'.

    torch_bf16      plain PyTorch: bf16 matmuls (the reference's math with S materialised), one
                    (sequence, head chunk) at a time so that memory stays bounded; forward and a
                    closed-form backward that recomputes S from out and r, as a kernel would
                    (`torch_forward`, `torch_backward`: any device)
    triton_sigmoid  triton-sigmoid's sigmoid attention (PyPI `triton-sigmoid`, MIT; softmax-free
                    attention for single-cell models, dense and padded, forward and backward),
                    timed where it is installed; its rows say "not installed" otherwise

Each peer is `peer(shape, passes, seed) -> {pass: setup, or a note}`: `setup()` makes what the
timed call needs and returns the call; a string says why that pass is not timed.
"""
from __future__ import annotations

import torch

S_BYTES = 4 << 30  # torch_bf16: the bf16 [heads, L, L] tensors of one chunk stay under this
EPS = 1e-6         # the family's default eps


def inputs(s, seed: int, device: str = "cuda"):
    """q [B, N, Hq, D], k, v [B, N, Hk, D] bf16 N(0, 1), and the real lengths (a list) or None."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(s.B, s.N, s.Hq, s.D, generator=gen, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(s.B, s.N, s.Hk, s.D, generator=gen, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    return q, k, v, s.lengths()


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


def torch_bf16(s, passes: tuple[str, ...], seed: int) -> dict:
    """Plain PyTorch spherical attention on `s` (module docstring)."""
    q, k, v, lengths = inputs(s, seed)
    out, r = torch_forward(q, k, v, s.causal, lengths)
    dout = torch.randn_like(out) if passes != ("fwd",) else None

    def fwd():
        return torch_forward(q, k, v, s.causal, lengths)

    return {"fwd": lambda: fwd,
            "bwd": lambda: lambda: torch_backward(dout, q, k, v, out, r, s.causal, lengths),
            "fwd+bwd": lambda: lambda: torch_backward(dout, q, k, v, *fwd(), s.causal, lengths)}


def triton_sigmoid(s, passes: tuple[str, ...], seed: int) -> dict:
    """triton-sigmoid's sigmoid attention on `s`: dense, or padded with the shape's real lengths;
    k and v repeated to Hq heads first (it takes one head count), outside the timed calls."""
    try:
        import triton_sigmoid as ts
    except ImportError:
        return dict.fromkeys(passes, "not installed (pip install triton-sigmoid)")
    grad = passes != ("fwd",)
    try:
        q, k, v, lengths = inputs(s, seed)
        k, v = (t.repeat_interleave(s.Hq // s.Hk, dim=2) for t in (k, v))
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
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001  (a third-party kernel: any failure is its rows' note)
        return dict.fromkeys(passes, f"not run: {type(e).__name__}: {str(e).splitlines()[0]}")
    return {"fwd": lambda: fwd,
            "bwd": lambda: lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
            "fwd+bwd": lambda: lambda: torch.autograd.grad(fwd(), (q, k, v), do)}
