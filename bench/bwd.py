"""Backward benchmark: time the backward variants alone and forward + backward, on one shape.

    python bench/bwd.py                          # `star` shape, every backward variant
    python bench/bwd.py --preset star64 --peers  # + cuDNN SDPA backward on dense equal work
    python bench/bwd.py --d 64 --json out/bwd.json
    python bench/bwd.py --layer 4096             # + one SimplicialAttention layer's training step
    python bench/bwd.py --variant triton --form trilinear det  # det vs plain, one run

Useful TFLOPS (the "TFLOPS" column): 2.5 x the forward FLOPs of `altattn.simplicial.flops` for the
backward, 3.5 x for forward + backward (FlashAttention's convention, ../shared/docs/BACKWARD.md
§2), over the median time (bench.common.median_ms: do_bench, L2 flushed before every call).
"tensor TFLOPS" counts what the variant executes on the tensor cores (its EXECUTED_FLOPS_PER_F
x F). Each variant's gradients are first checked against an fp32 autograd-free reference on a
reduced shape (B=1, N = min(N, 2*max(w1, w2) + 37)). --peers times cuDNN SDPA's backward (and
fwd+bwd) on q [B, Hq, N, D], k/v [B, Hq, w1*w2, D] (the same work, non-causal) and a bf16 matmul.
--layer DIM times a training step (forward + backward) of one bf16 `SimplicialAttention` of width
DIM with the shape's heads, per variant: tokens/s and the share of the step the attention's own
forward + backward (the fwd+bwd row) takes; the rest is the five input and one output projections.
--form picks the logits' form as in bench/fwd.py: trilinear (the default), det, or both; each
variant is timed in each asked form it computes (its check in that form), a named variant that
lacks one is refused before any GPU work, and a det row carries its TFLOPS over the same variant's
trilinear row ("x trilinear"). The useful FLOPs of det are the plain form's; a det call's time
includes the packing of K1's rotations the `triton` backward does on the host (det_keys).

Exit status: 0 done; 1 a correctness check failed; 2 bad arguments or no CUDA GPU.
"""
from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import argparse  # noqa: E402

import torch  # noqa: E402

from altattn import simplicial as sa  # noqa: E402
from bench.common import add_form_ratios, check_forms, table_columns, write_rows  # noqa: E402
from profiling.common import (gpu_problem, Shape, add_shape_args, check_out_path,  # noqa: E402
                              make_inputs, metadata_line, positive_float, positive_int,
                              print_table, run_metadata, shape_from_args)
from profiling.timing import median_ms, tflops  # noqa: E402
from altattn.simplicial import passes as bwd_launcher  # noqa: E402
from altattn import launcher, registry  # noqa: E402
from altattn.simplicial.spec import FORMS  # noqa: E402

PROG = "bench/bwd.py"
GRAD_REL_TOL = 3e-2   # ||grad - ref||_F / ||ref||_F for each gradient, pre-timing check
MATMUL_SIZE = 8192
COLUMNS = [("variant", "variant"), ("form", "form"), ("pass", "pass"), ("shape", "shape"),
           ("ms", "ms"), ("tflops", "TFLOPS"), ("tensor_tflops", "tensor TFLOPS"),
           ("note", "note")]


def check(variant: str, s: Shape, form: str = "trilinear") -> str | None:
    """None when the variant's gradients in the logits' `form` match the fp32 reference on a
    reduced shape."""
    n = min(s.N, 2 * max(s.w1, s.w2) + 37)
    x = make_inputs(1, n, s.Hq, s.Hk, s.D, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    dout = torch.randn(1, n, s.Hq, s.D, generator=gen, device="cuda", dtype=torch.bfloat16)
    out, lse = sa.forward(*x, s.w1, s.w2, form=form)
    got = bwd_launcher.backward(dout, None, *x, out, lse, s.w1, s.w2, variant=variant, form=form)
    ref = sa.reference_backward(*x, s.w1, s.w2, dout, dtype=torch.float32, form=form)
    for name, g, r in zip(("dq", "dk1", "dk2", "dv1", "dv2"), got, ref):
        rel = ((g.float() - r).norm() / r.norm().clamp(min=1e-30)).item()
        if not rel <= GRAD_REL_TOL:
            return f"{name}: relative error {rel:.2e} > {GRAD_REL_TOL}"
    return None


def bench_variant(variant: str, form: str, s: Shape, args) -> list[dict]:
    f = sa.flops(s.B, s.N, s.Hq, s.D, s.w1, s.w2)
    base = {"kind": "variant", "variant": variant, "form": form, "shape": s.short(),
            **s.fields()}
    why = check(variant, s, form)
    if why is not None:
        raise SystemExit(f"{PROG}: {variant} (form {form}) failed its correctness check: {why}")
    x = [t.requires_grad_() for t in make_inputs(s.B, s.N, s.Hq, s.Hk, s.D, seed=args.seed)]
    out, lse = sa.attention(*x, s.w1, s.w2, bwd_variant=variant, form=form)
    dout = torch.randn_like(out)
    saved = [t.detach() for t in x] + [out.detach(), lse.detach()]
    per_f = registry.get(variant, "bwd").load().EXECUTED_FLOPS_PER_F

    def bwd():
        return bwd_launcher.backward(dout, None, *saved[:5], *saved[5:], s.w1, s.w2,
                                     variant=variant, form=form)

    def fwd_bwd():
        o, _ = sa.attention(*x, s.w1, s.w2, bwd_variant=variant, form=form)
        o.backward(dout)

    rows = []
    ms = median_ms(bwd, args.warmup_ms, args.rep_ms)
    rows.append({**base, "pass": "bwd", "ms": ms, "flops": 2.5 * f, "tflops": tflops(2.5 * f, ms),
                 "tensor_tflops": tflops(per_f * f, ms)})
    ms = median_ms(fwd_bwd, args.warmup_ms, args.rep_ms)
    rows.append({**base, "pass": "fwd+bwd", "ms": ms, "flops": 3.5 * f,
                 "tflops": tflops(3.5 * f, ms), "tensor_tflops": tflops((2 + per_f) * f, ms)})
    return rows


def bench_layer(variant: str, form: str, s: Shape, args, attention_ms: float) -> dict:
    """One SimplicialAttention of width args.layer in bf16, x [B, N, width]: a training step."""
    layer = sa.SimplicialAttention(args.layer, s.Hq, s.Hk, s.D, s.w1, s.w2, bwd_variant=variant,
                                   form=form).to("cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    x = torch.randn(s.B, s.N, args.layer, generator=gen, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    dy = torch.randn(x.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: layer(x).backward(dy), args.warmup_ms, args.rep_ms)
    tokens_per_s = s.B * s.N / (ms * 1e-3)
    share = attention_ms / ms
    return {"kind": "layer", "variant": variant, "form": form, "shape": s.short(), **s.fields(),
            "pass": "layer step", "ms": ms, "layer_dim": args.layer,
            "tokens_per_s": tokens_per_s, "attention_share": share,
            "note": f"width {args.layer}: {tokens_per_s:,.0f} tokens/s, attention {share:.0%}"}


def bench_peers(s: Shape, args) -> list[dict]:
    """cuDNN SDPA backward and fwd+bwd on dense equal work; the bf16 matmul."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lkv = s.w1 * s.w2
    f = 4 * s.B * s.Hq * s.N * lkv * s.D
    base = {"kind": "peer", "variant": "cudnn_sdpa", "shape": f"B{s.B} H{s.Hq} N{s.N} "
            f"Lkv{lkv} D{s.D}", **s.fields()}
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    q = torch.randn(s.B, s.Hq, s.N, s.D, generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(s.B, s.Hq, lkv, s.D, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    rows = []
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        do = torch.randn_like(o)
        ms = median_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                       args.warmup_ms, args.rep_ms)
        rows.append({**base, "pass": "bwd", "ms": ms, "flops": 2.5 * f,
                     "tflops": tflops(2.5 * f, ms)})

        def fwd_bwd():
            torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q, k, v),
                                (q, k, v), do)
        ms = median_ms(fwd_bwd, args.warmup_ms, args.rep_ms)
        rows.append({**base, "pass": "fwd+bwd", "ms": ms, "flops": 3.5 * f,
                     "tflops": tflops(3.5 * f, ms)})
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    ms = median_ms(lambda: a @ b, args.warmup_ms, args.rep_ms)
    rows.append({"kind": "peer", "variant": "matmul", "pass": "-", "shape": f"{MATMUL_SIZE}^3",
                 "ms": ms, "tflops": tflops(2 * MATMUL_SIZE ** 3, ms)})
    return rows


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, "star")
    names = list(registry.variants("bwd"))
    p.add_argument("--variant", action="append", choices=names + ["auto"], metavar="NAME",
                   help=f"backward variant, repeatable: one of {', '.join(names)}, or 'auto' "
                        f"(the one `sa.attention` takes for the shape; default: all that take it)")
    p.add_argument("--form", nargs="+", choices=FORMS, default=["trilinear"], metavar="FORM",
                   help=f"the logits' form(s) to time: {' and/or '.join(FORMS)} (default: "
                        f"trilinear); each variant in each asked form it computes, det rows "
                        f"with their TFLOPS over the trilinear row's ('x trilinear')")
    p.add_argument("--peers", action="store_true", help="also time cuDNN SDPA and a matmul")
    p.add_argument("--layer", type=positive_int, metavar="DIM",
                   help="also time one SimplicialAttention layer of width DIM (a training step)")
    p.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    p.add_argument("--json", metavar="PATH", help="write the rows and run metadata as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-ms", type=positive_float, default=100.0, metavar="MS")
    p.add_argument("--rep-ms", type=positive_float, default=1000.0, metavar="MS")
    return p.parse_args(argv), p


def main(argv=None) -> int:
    args, parser = parse_args(argv)
    s = shape_from_args(args)
    args.form = list(dict.fromkeys(args.form))
    # errors first, on any machine: each named variant computes each form and takes the shape
    asked = args.variant or ["auto"]
    check_forms(parser, "bwd", [n for n in asked if n != "auto"], args.form, [s])
    if "auto" in asked:  # some variant takes the shape in each form
        check_forms(parser, "bwd", [], args.form, [s])
    # default: every backward variant that takes the shape in some asked form
    named = args.variant or [v.name for v in registry.all_variants("bwd")
                             if any(v.cannot_take(s.spec(f)) is None for f in args.form)]
    for flag in ("csv", "json"):
        check_out_path(parser, f"--{flag}", getattr(args, flag))
    if (status := gpu_problem(PROG)) is not None:
        return status
    # "auto" times the variant it resolves to on this GPU (a row needs a name and a FLOP count)
    runs = list(dict.fromkeys((launcher.select(s.spec(f), n, "cuda", "bwd").name, f)
                              for n in named for f in args.form
                              if n == "auto" or f in registry.get(n, "bwd").accepted("form")))
    meta = run_metadata()
    print(metadata_line(meta), flush=True)
    rows = []
    steps = len(runs) + int(args.peers)
    for i, (v, form) in enumerate(runs, 1):
        print(f"[{i}/{steps}] {v} {form} on {s.short()} ...", flush=True)
        rows += bench_variant(v, form, s, args)
        if args.layer:
            rows.append(bench_layer(v, form, s, args, rows[-1]["ms"]))
    if args.peers:
        print(f"[{steps}/{steps}] peers ...", flush=True)
        rows += bench_peers(s, args)
    add_form_ratios(rows)
    write_rows([{**meta, **r} for r in rows], args.csv, args.json)
    print_table(rows, table_columns(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
