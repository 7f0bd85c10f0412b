"""Spherical attention's decoding step against the HBM bandwidth and SDPA decoding, in one run.

    python -m bench.spherical_decode [--batch 64] [--hq 32] [--hk 8] [--d 128] [--cached 4096]
                                     [--tokens 1] [--splits S] [--block-n N] [--stages S]
                                     [--warps W] [--json PATH]

Times `altattn.spherical.attention_with_kvcache` (T new tokens of each of B sequences with
`cached` tokens each: the new keys written at rows cached .. cached + T - 1, then every token
reads the L = cached + T visible rows), replayed from a CUDA graph (a serving loop's way) and
eager; beside it softmax attention's decoding through SDPA on the same rows
(`F.scaled_dot_product_attention(q [B, Hq, T, D], k, v [B, Hk, L, D], enable_gqa=True)`, K and
V in SDPA's own head-major layout; T > 1: a bottom-right causal mask), and a copy of as many
bytes (`copy_` of half of them: it reads and writes them, what a memory-bound kernel can reach
on this GPU).
GB/s: the cache rows read (2 B L Hk D 2 bytes, K and V; q, out and the new rows are under 0.1%
at the default shape) over the median time; "of copy": that over the copy's GB/s; tokens/s:
B T over the time. --splits / --block-n / --stages / --warps time the kernel's own launches
with another split count or tile (kernels_triton/spherical/decode.py `prepare`), for tuning.
No L2 flush (a 1 GB cache dwarfs it, and a decode loop does not flush).
"""
from __future__ import annotations

import argparse

import torch

from profiling.common import metadata_line, report
from profiling.timing import graphed, median_ms


def cache_bytes(B: int, L: int, Hk: int, D: int) -> int:
    """Bytes a step reads from the caches: L rows of K and V per sequence and kv head, bf16."""
    return 2 * B * L * Hk * D * 2


def _check(q, kc, vc, lens, out, r, T: int) -> str:
    """Two sequences of the step's result against the fp64 math, within the family's
    tolerances (the new rows are in the caches by then)."""
    from altattn.spherical.family import TOLERANCES
    from altattn.spherical.kvcache import reference_with_kvcache
    n = min(2, q.shape[0])
    want, want_r = reference_with_kvcache(q[:n].cpu(), kc[:n].cpu(), vc[:n].cpu(),
                                          lens[:n].cpu(), True, True, q.shape[-1] ** -0.5, 1e-6)
    e = ((out[:n].double().cpu() - want).norm() / want.norm()).item()
    er = ((r[:n].double().cpu() - want_r).norm() / want_r.norm()).item()
    if e > TOLERANCES["out_rel"] or er > TOLERANCES["r_rel"]:
        raise SystemExit(f"check failed: out_rel {e:.2e} (<= {TOLERANCES['out_rel']}), r_rel "
                         f"{er:.2e} (<= {TOLERANCES['r_rel']})")
    return f"check: out_rel {e:.1e}, r_rel {er:.1e} against fp64 (2 sequences)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spherical_decode",
                                description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hk", type=int, default=8)
    p.add_argument("--d", type=int, default=128, choices=(64, 128))
    p.add_argument("--cached", type=int, default=4096, help="tokens already in each cache")
    p.add_argument("--tokens", type=int, default=1, help="T, new tokens a step")
    p.add_argument("--splits", type=int, help="tuning: the split count")
    p.add_argument("--block-n", type=int, help="tuning: keys a tile")
    p.add_argument("--stages", type=int, help="tuning: num_stages")
    p.add_argument("--warps", type=int, help="tuning: num_warps")
    p.add_argument("--json", help="write the rows (with run metadata) here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    import torch.nn.functional as F

    from altattn.spherical import attention_with_kvcache
    from kernels_triton.spherical.decode import config, prepare

    B, Hq, Hk, D, T, n = a.batch, a.hq, a.hk, a.d, a.tokens, a.cached
    L, R = n + T, n + T
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    q, k, v = randn(B, T, Hq, D), randn(B, T, Hk, D), randn(B, T, Hk, D)
    kc, vc = randn(B, R, Hk, D), randn(B, R, Hk, D)
    lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    step = lambda: attention_with_kvcache(q, kc, vc, lens, k=k, v=v)  # noqa: E731
    with torch.no_grad():
        out, r = step()
    words = _check(q, kc, vc, lens, out, r, T)
    # SDPA's decoding: q [B, Hq, T, D] against the same L rows, K and V head-major
    sq, sk, sv = q.transpose(1, 2).contiguous(), *(c.transpose(1, 2).contiguous() for c in (kc, vc))
    # T > 1: the new tokens are the last T positions (bottom-right causal, as the step's)
    mask = (torch.arange(L, device="cuda")[None] <= torch.arange(T, device="cuda")[:, None]
            + L - T) if T > 1 else None
    sdpa = lambda: F.scaled_dot_product_attention(sq, sk, sv, attn_mask=mask,  # noqa: E731
                                                  enable_gqa=True)
    moved = cache_bytes(B, L, Hk, D)
    source = torch.zeros(moved // 4, dtype=torch.bfloat16, device="cuda")  # copy_: moved/2 each way
    other = torch.empty_like(source)
    calls = {"spherical decode (graph)": graphed(step), "spherical decode (eager)": step}
    tuned = {key: val for key, val in (("splits", a.splits), ("BLOCK_N", a.block_n),
                                       ("num_stages", a.stages), ("num_warps", a.warps))
             if val is not None}
    if tuned:
        cfg = {**config(Hq // Hk, T, D), **{x: y for x, y in tuned.items() if x != "splits"}}
        run = prepare(B, T, Hq, Hk, D, R, True, True, torch.cuda.current_device(),
                      tuple(sorted(cfg.items())), tuned.get("splits"))
        o2, r2 = torch.empty_like(out), torch.empty_like(r)
        kernel = lambda: run(q, kc, vc, lens, k, v, o2, r2, D ** -0.5, 1e-6)  # noqa: E731
        calls[f"kernel {tuned} (graph)"] = graphed(kernel)
    calls["SDPA decode (graph)"] = graphed(sdpa)
    calls["SDPA decode (eager)"] = sdpa
    with torch.no_grad():
        times = {name: median_ms(fn, flush_l2=False) for name, fn in calls.items()}
        times["copy of as many bytes"] = median_ms(lambda: other.copy_(source), flush_l2=False)
    copy_gbs = moved / times["copy of as many bytes"] / 1e6
    rows = [{"call": name, "ms": round(ms, 4), "GB/s": round(moved / ms / 1e6, 1),
             "of copy": round(moved / ms / 1e6 / copy_gbs, 3),
             "tokens/s": None if name.startswith("copy") else round(B * T / ms * 1e3)}
            for name, ms in times.items()]
    split = prepare(B, T, Hq, Hk, D, R, True, True, torch.cuda.current_device()).n_split
    report(rows, [("call", "call"), ("ms", "ms"), ("GB/s", "GB/s"), ("of copy", "of copy"),
                  ("tokens/s", "tokens/s")], a.json,
           lambda meta: f"{metadata_line(meta)}\nB {B}, T {T}, {n} cached, Hq {Hq}, Hk {Hk}, "
                        f"D {D}: {moved / 1e6:.1f} MB of cache read a step; {split} split(s); "
                        f"{words}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
