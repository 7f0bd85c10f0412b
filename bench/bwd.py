"""Backward benchmark: time an attention family's backward variants (default: 2-simplicial
attention) alone and forward + backward, on one shape.

    python bench/bwd.py                          # default preset, every backward variant
    python bench/bwd.py --preset star64 --peers  # + cuDNN SDPA backward on dense equal work
    python bench/bwd.py --d 64 --json out/bwd.json
    python bench/bwd.py --layer 4096             # + one SimplicialAttention layer's training step
    python bench/bwd.py --variant triton --form trilinear det  # det vs plain, one run
    python bench/bwd.py --family spherical --peers             # spherical attention, P1
    python bench/bwd.py --family spherical --preset p2 --causal --pad 0.25 --N 2048 --peers

--variant takes the backward variants of the family, 'auto' (the one the launcher picks for the
shape and form on this GPU) or 'all' (the default: every one that takes the shape), as
bench/fwd.py takes the forward ones; a forward variant is refused, naming bench/fwd.py. The family
record (altattn.registry.Family, --family) gives the presets, the tolerance, the FLOP model and
the peers (bench/peers.py times them).

Useful TFLOPS (the "TFLOPS" column): `Family.flops` of the backward (2.5 x the forward FLOPs),
and of forward + backward (3.5 x) (FlashAttention's convention, docs/MATH.md
§1), over the median time (bench.common.median_ms: do_bench, L2 flushed before every call).
"tensor TFLOPS" counts what the variant executes on the tensor cores (its EXECUTED_FLOPS_PER_F
x F, where its module says). fwd+bwd: the forward ("auto") then the variant's backward, both
through launcher.run, as the family's op calls them under autograd. Each variant's gradients are
first checked against the family's fp32 autograd-free reference on a reduced shape
(`Shape.check_shape`; bench/check.py, "grad_rel"). --peers times each peer of the family record,
backward and fwd+bwd (cuDNN SDPA on the dense shape of its equal-work rule, Peer.dense: for
2-simplicial attention q [B, Hq, N, D], k/v [B, Hq, w1*w2, D], non-causal; for spherical attention
the same B, H, N, D, causal when the shape is; peers of their own, Peer.runs), and a bf16 matmul.
--layer DIM times a training step (forward + backward) of one bf16 layer of the family
(`Family.layer`; 2-simplicial: `SimplicialAttention`) of width DIM with the shape's heads, per
variant: tokens/s and the share of the step the attention's own forward + backward (the fwd+bwd
row) takes; the rest is the projections.
--form picks the logits' form as in bench/fwd.py: trilinear (the default), det, or both; each
variant is timed in each asked form it computes (its check in that form), a named variant that
lacks one is refused before any GPU work, and a det row carries its TFLOPS over the same variant's
trilinear row ("x trilinear"). The useful FLOPs of det are the plain form's; a det call's time
includes the host's packing (`triton`: K1's rotations, det_keys; `tlx_pairs`: K1's and K2's,
det_keys_side, and the unpacking of dK1, dK2).

Exit status: 0 done; 1 a correctness check failed; 2 bad arguments or no CUDA GPU.
"""
from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import argparse  # noqa: E402
import inspect  # noqa: E402

import torch  # noqa: E402

from bench.check import check_pass  # noqa: E402
from bench.common import (add_form_ratios, build_parser, check_out_paths,  # noqa: E402
                          form_note, presets_text, table_columns, variant_runs, write_rows)
from bench.peers import bench_matmul, bench_peers  # noqa: E402
from profiling.common import (gpu_problem, family_in, form_options,  # noqa: E402
                              forms_of, metadata_line, positive_int, print_table, run_metadata,
                              shape_from_args, shape_spec)
from profiling.timing import median_ms, tflops  # noqa: E402
from altattn import launcher, registry  # noqa: E402

PROG = "bench/bwd.py"
PASS = "bwd"  # the pass this benchmark times (launcher.run: the backward)
COLUMNS = [("variant", "variant"), ("form", "form"), ("pass", "pass"), ("shape", "shape"),
           ("ms", "ms"), ("tflops", "TFLOPS"), ("tensor_tflops", "tensor TFLOPS"),
           ("note", "note")]


def check(variant: str, s, form, family: str) -> str | None:
    """None when the variant's gradients (in the logits' `form`, where the family has forms)
    match the family's fp32 reference on `s.check_shape()` within its tolerances (bench.check:
    "grad_rel" for each gradient), else which one does not."""
    for e in check_pass(family, PASS, variant, s, seed=1, form=form):
        if not e.ok:
            return f"{e.output}: {e.words} {e.value:.2e} > {e.tolerance}"
    return None


def fwd_bwd_calls(fam: registry.Family, args: tuple):
    """(forward arguments, backward(outs) -> its arguments) from one backward call's arguments
    (Family.make_inputs of "bwd"): the forward's are those of the backward's parameters that the
    forward's `validate` names; the backward's take the forward's fresh outputs by their names
    (the forward's `outputs`: out and lse, or out and r; those the backward does not take, as
    triple attention's out, are dropped)."""
    fwd, bwd = fam.passes["fwd"], fam.passes[PASS]
    bound = inspect.signature(bwd.validate).bind(*args)
    bound.apply_defaults()
    given = dict(bound.arguments)
    fwd_args = tuple(given[n] for n in inspect.signature(fwd.validate).parameters if n in given)

    def bwd_args(outs: tuple) -> tuple:
        fresh = {n: o for n, o in zip(fwd.outputs, outs) if n in given}
        return tuple({**given, **fresh}.values())
    return fwd_args, bwd_args


def bench_variant(variant: str, form, s, args) -> list[dict]:
    """The backward alone and forward ("auto") + backward, both through launcher.run, as the
    family's op calls them under autograd."""
    fam = registry.get_family(args.family)
    f = fam.flops(s, "fwd")
    base = {"kind": "variant", "variant": variant, "form": form, "shape": s.short(),
            **s.fields()}
    why = check(variant, s, form, fam.name)
    if why is not None:
        raise SystemExit(f"{PROG}: {variant}{form_note(form)} failed its correctness check: "
                         f"{why}")
    inputs = tuple(fam.make_inputs(s, PASS, seed=args.seed, device="cuda", **form_options(form)))
    fwd_args, bwd_args = fwd_bwd_calls(fam, inputs)
    per_f = getattr(fam.variant(variant, PASS).load(), "EXECUTED_FLOPS_PER_F", None)

    def bwd():
        return launcher.run(fam.name, PASS, *inputs, variant=variant)

    def fwd_bwd():
        outs = launcher.run(fam.name, "fwd", *fwd_args)
        return launcher.run(fam.name, PASS, *bwd_args(outs), variant=variant)

    rows = []
    for pass_, fn, flops, executed in (("bwd", bwd, fam.flops(s, PASS), per_f),
                                       ("fwd+bwd", fwd_bwd, f + fam.flops(s, PASS),
                                        None if per_f is None else 2 + per_f)):
        ms = median_ms(fn, args.warmup_ms, args.rep_ms)
        rows.append({**base, "pass": pass_, "ms": ms, "flops": flops,
                     "tflops": tflops(flops, ms),
                     "tensor_tflops": None if executed is None else tflops(executed * f, ms)})
    return rows


def bench_layer(variant: str, form, s, args, attention_ms: float) -> dict:
    """One layer of the family (Family.layer) of width args.layer in bf16, x [B, N, width]: a
    training step."""
    fam = registry.get_family(args.family)
    layer = fam.layer(s, args.layer, variant, **form_options(form)).to("cuda", torch.bfloat16)
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
        epilog=f"{presets_text(fam)}. Check threshold: each gradient's "
               f"rel. Frobenius error <= {fam.tolerances['grad_rel']}.",
        all_means="every backward variant that takes the shape",
        peers_time="the backward and forward + backward")
    p.add_argument("--layer", type=positive_int, metavar="DIM",
                   help=f"also time one {fam.title} layer of width DIM (a training step)")
    args = p.parse_args(argv)
    if args.layer and fam.layer is None:
        p.error(f"--layer: {fam.title} has no layer in its record (Family.layer)")
    return args, p


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
    runs = list(dict.fromkeys((launcher.select(shape_spec(s, f), n, "cuda", PASS,
                                               family=fam.name).name, f) for n, f in named))
    meta = run_metadata()
    print(metadata_line(meta), flush=True)
    rows = []
    steps = len(runs) + int(args.peers)
    for i, (v, form) in enumerate(runs, 1):
        print(f"[{i}/{steps}] {v}{form_note(form)} on {s.short()} ...", flush=True)
        rows += bench_variant(v, form, s, args)
        if args.layer:
            rows.append(bench_layer(v, form, s, args, rows[-1]["ms"]))
    if args.peers:
        print(f"[{steps}/{steps}] peers ...", flush=True)
        rows += bench_peers(fam, s, args, ("bwd", "fwd+bwd"))
        rows.append(bench_matmul(args, PASS))
    plain = (forms_of(fam) or [None])[0]
    add_form_ratios(rows, plain)
    write_rows([{**meta, **r} for r in rows], args.csv, args.json)
    print_table(rows, table_columns(rows, COLUMNS, plain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
