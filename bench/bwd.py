"""Backward benchmark: time an attention family's backward variants (default: 2-simplicial
attention) alone and forward + backward, on one shape.

    python bench/bwd.py                          # default preset, every backward variant
    python bench/bwd.py --preset star64 --peers  # + cuDNN SDPA backward on dense equal work
    python bench/bwd.py --d 64 --json out/bwd.json
    python bench/bwd.py --layer 4096             # + one SimplicialAttention layer's training step
    python bench/bwd.py --variant triton --form trilinear det  # det vs plain, one run

--variant takes the backward variants of the family, 'auto' (the one the launcher picks for the
shape and form on this GPU) or 'all' (the default: every one that takes the shape), as
bench/fwd.py takes the forward ones; a forward variant is refused, naming bench/fwd.py. The family
record (altattn.registry.Family, --family) gives the presets, the tolerance, the FLOP model and
the peers (bench/peers.py times them).

Useful TFLOPS (the "TFLOPS" column): `Family.flops` of the backward (2.5 x the forward FLOPs),
and of forward + backward (3.5 x) (FlashAttention's convention, ../shared/docs/BACKWARD.md
§2), over the median time (bench.common.median_ms: do_bench, L2 flushed before every call).
"tensor TFLOPS" counts what the variant executes on the tensor cores (its EXECUTED_FLOPS_PER_F
x F). Each variant's gradients are first checked against an fp32 autograd-free reference on a
reduced shape (`Shape.check_shape`: B=1, N = min(N, 2*max(w1, w2) + 37)). --peers times cuDNN
SDPA's backward (and fwd+bwd) on the dense shape of the family's equal-work rule (Peer.dense:
q [B, Hq, N, D], k/v [B, Hq, w1*w2, D], non-causal) and a bf16 matmul.
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
from bench.common import (add_form_ratios, build_parser, check_out_paths,  # noqa: E402
                          family_in, presets_text, table_columns, variant_runs, write_rows)
from bench.peers import bench_matmul, bench_sdpa  # noqa: E402
from profiling.common import (gpu_problem, Shape, make_inputs, metadata_line,  # noqa: E402
                              positive_int, print_table, run_metadata, shape_from_args)
from profiling.timing import median_ms, tflops  # noqa: E402
from altattn import launcher, registry  # noqa: E402

PROG = "bench/bwd.py"
PASS = "bwd"  # the pass this benchmark times (launcher.run: the backward)
COLUMNS = [("variant", "variant"), ("form", "form"), ("pass", "pass"), ("shape", "shape"),
           ("ms", "ms"), ("tflops", "TFLOPS"), ("tensor_tflops", "tensor TFLOPS"),
           ("note", "note")]


def check(variant: str, s: Shape, form: str = "trilinear",
          family: str = registry.DEFAULT_FAMILY) -> str | None:
    """None when the variant's gradients in the logits' `form` match the fp32 reference on
    `s.check_shape()` within the family's "grad_rel" tolerance, else which one does not."""
    tol = registry.get_family(family).tolerances["grad_rel"]
    c = s.check_shape()
    x = make_inputs(c.B, c.N, c.Hq, c.Hk, c.D, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    dout = torch.randn(c.B, c.N, c.Hq, c.D, generator=gen, device="cuda", dtype=torch.bfloat16)
    out, lse = sa.forward(*x, c.w1, c.w2, form=form)
    got = launcher.run(family, PASS, dout, None, *x, out, lse, c.w1, c.w2, variant=variant,
                       form=form)
    ref = sa.reference_backward(*x, c.w1, c.w2, dout, dtype=torch.float32, form=form)
    for name, g, r in zip(("dq", "dk1", "dk2", "dv1", "dv2"), got, ref):
        rel = ((g.float() - r).norm() / r.norm().clamp(min=1e-30)).item()
        if not rel <= tol:
            return f"{name}: relative error {rel:.2e} > {tol}"
    return None


def bench_variant(variant: str, form: str, s: Shape, args) -> list[dict]:
    fam = registry.get_family(args.family)
    f = fam.flops(s, "fwd")
    base = {"kind": "variant", "variant": variant, "form": form, "shape": s.short(),
            **s.fields()}
    why = check(variant, s, form, fam.name)
    if why is not None:
        raise SystemExit(f"{PROG}: {variant} (form {form}) failed its correctness check: {why}")
    x = [t.requires_grad_() for t in make_inputs(s.B, s.N, s.Hq, s.Hk, s.D, seed=args.seed)]
    out, lse = sa.attention(*x, s.w1, s.w2, bwd_variant=variant, form=form)
    dout = torch.randn_like(out)
    saved = [t.detach() for t in x] + [out.detach(), lse.detach()]
    per_f = fam.variant(variant, PASS).load().EXECUTED_FLOPS_PER_F

    def bwd():
        return launcher.run(fam.name, PASS, dout, None, *saved, s.w1, s.w2, variant=variant,
                            form=form)

    def fwd_bwd():
        o, _ = sa.attention(*x, s.w1, s.w2, bwd_variant=variant, form=form)
        o.backward(dout)

    rows = []
    for pass_, fn, flops, executed in (("bwd", bwd, fam.flops(s, PASS), per_f * f),
                                       ("fwd+bwd", fwd_bwd, f + fam.flops(s, PASS),
                                        (2 + per_f) * f)):
        ms = median_ms(fn, args.warmup_ms, args.rep_ms)
        rows.append({**base, "pass": pass_, "ms": ms, "flops": flops,
                     "tflops": tflops(flops, ms), "tensor_tflops": tflops(executed, ms)})
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


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    fam = family_in(argv)
    p = build_parser(
        PROG, PASS, fam, description=__doc__.split("\n\n")[0],
        epilog=f"Presets (H = Hq/Hk): {presets_text(fam)}. Check threshold: each gradient's "
               f"rel. Frobenius error <= {fam.tolerances['grad_rel']}.",
        all_means="every backward variant that takes the shape",
        peers_time="the backward and forward + backward")
    p.add_argument("--layer", type=positive_int, metavar="DIM",
                   help="also time one SimplicialAttention layer of width DIM (a training step)")
    return p.parse_args(argv), p


def main(argv=None) -> int:
    args, parser = parse_args(argv)
    s = shape_from_args(args)
    # errors first, on any machine: each named variant computes each form and takes the shape
    named = variant_runs(parser, args, PASS, [s], takers_only=True)
    check_out_paths(parser, args)
    if (status := gpu_problem(PROG)) is not None:
        return status
    fam = registry.get_family(args.family)
    # "auto" times the variant it resolves to on this GPU (a row needs a name and a FLOP count)
    runs = list(dict.fromkeys((launcher.select(s.spec(f), n, "cuda", PASS, family=fam.name).name,
                               f) for n, f in named))
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
        rows += bench_sdpa(fam, s, args, ("bwd", "fwd+bwd"))
        rows.append(bench_matmul(args, PASS))
    add_form_ratios(rows)
    write_rows([{**meta, **r} for r in rows], args.csv, args.json)
    print_table(rows, table_columns(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
