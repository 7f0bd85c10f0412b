"""Proton traces of the forward and backward kernels, the command line: capture (GPU), trim,
summarize, plot, compare (CPU). The work is done in trace_capture.py, trace_summary.py and
trace_plot.py.

    python profiling/trace.py --variant tlx_ws --out out/trace         # capture + summary + png
    python profiling/trace.py --variant tlx_ws --pass bwd              # the backward's kernels
    python profiling/trace.py --compare triton tlx_ws --out out/trace  # both, side by side
    python profiling/trace.py --kernels [--pass bwd]                   # kernel-level TFLOPS
    python profiling/trace.py --summarize out/trace/tlx_ws.chrome_trace [--json]    # CPU only
    python profiling/trace.py --plot out/trace/tlx_ws.chrome_trace --png t.png      # CPU only

Capture: `launcher.run(..., profile=...)` runs copies of the variant's kernels with Proton scopes
(its registry record's `scopes`, names of its family's `scopes`, each with a role: load, build,
wait, gemm, softmax, scale, epilogue; --family picks the family, default simplicial).
Proton's instrumentation backend records the cycle
counter at every scope entry and exit for the sampled warps (default: the first warp of every
warp group) of every CTA. A backward call runs several kernels of different widths (Delta,
k-owner, row-owner, reduce; the k-owner and the row-owner have scopes), triple's forward two
scoped ones (partials, apply): one Proton session per scoped kernel, each sampling that kernel's
warps. A whole grid is hundreds of MB, so the trace
keeps --ctas CTAs from the middle of each kernel's launch (steady state, ordered by start time)
and is written as OUT/<variant>.chrome_trace (backward: OUT/<variant>_bwd.chrome_trace; Chrome
trace JSON: open it in ui.perfetto.dev or chrome://tracing). Summaries are per kernel.

Summary (`summarize`): warps are grouped into warp groups of 4 (warp w -> group w // 4). A group
that runs a gemm-role scope is a consumer; one that only loads or builds is a producer (TLX).
In each CTA a
group's span runs from its sampled warps' first scope entry to their last scope exit.
  share      scope cycles / (sampled warps x span), summed over CTAs; "(outside scopes)" is the rest
  tc busy    |union of the gemm scopes' intervals of the group's warps| / span, summed over CTAs
  bubble     share of the consumers' span (first to last consumer event of the CTA) in which no
             consumer group is in a gemm scope; cycle-weighted average over CTAs
Caveats: a gemm scope ends after the warp has waited for the wgmma result, so it measures issue to
completion as seen by the warp (an upper bound of tensor-core busy time: a wgmma in flight while
another group's softmax runs is counted, and the wait is counted too); and the instrumentation
itself (a clock read and a store per scope boundary) perturbs the timing and the schedule.

Exit status: 0 done; 1 a capture produced an unusable trace; 2 bad arguments or no CUDA GPU.
"""
from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # `python3 profiling/trace.py` from a checkout
    sys.path.insert(0, REPO_ROOT)

import argparse  # noqa: E402
import json  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from altattn import registry  # noqa: E402
from profiling.common import (DEFAULT_FAMILY, add_family_arg, add_pass_arg, add_shape_args,  # noqa: E402
                              check_variants, family_in, format_table, metadata_line,
                              positive_int, run_metadata, shape_from_args)
from profiling.timing import peak_words  # noqa: E402
from profiling.trace_capture import (DEFAULT_CTAS, PASSES, capture, kernel_level,  # noqa: E402
                                     sampled_warps, trace_name)
from profiling.trace_kernels import BREAKDOWN_COLUMNS, KERNEL_COLUMNS  # noqa: E402
from profiling.trace_plot import plot_timelines  # noqa: E402
from profiling.trace_summary import (MAX_TRACE_BYTES, format_comparison,  # noqa: E402
                                     format_summary, load_trace, split_kernels, summarize)

PROG = "profiling/trace.py"
DEFAULT_PRESET = "small"   # a family's preset of that name, else its default preset


# ---------------------------------------------------------------------------------------------
# Command line

def trace_preset(fam: registry.Family) -> str:
    """The family's preset a trace takes by default: DEFAULT_PRESET where it has one."""
    return DEFAULT_PRESET if DEFAULT_PRESET in fam.presets else fam.default_preset


def build_parser(family: str = DEFAULT_FAMILY) -> argparse.ArgumentParser:
    """The arguments, with the shape flags and presets of `family` (--family's)."""
    # every family's variant names (the family's own are checked after parsing)
    names = list(dict.fromkeys(v.name for v in registry.all_variants(None, None)))
    fam = registry.get_family(family)
    presets, preset = fam.presets, trace_preset(fam)
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Proton traces of the forward and backward kernels (--pass). Capture modes "
                    "(--variant, --compare, --kernels) need a CUDA GPU; --summarize and --plot "
                    "run anywhere.",
        epilog=f"Default shape: preset {preset} ({presets[preset].short()}; --family picks "
               f"the presets and shape flags). "
               "Numbers: cycles of the SM clock; gemm scopes include the wait for the wgmma "
               "result (an upper bound of tensor-core busy time); instrumentation perturbs "
               "timing. Open a .chrome_trace in ui.perfetto.dev. Exit status: 0 ok, 1 unusable "
               "capture, 2 bad arguments or no GPU.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--compare", nargs=2, metavar=("A", "B"), choices=names,
                      help="capture two variants; summaries side by side, OUT/compare_A_B.png")
    mode.add_argument("--kernels", action="store_true",
                      help="kernel-level CUPTI table (median of --reps calls, TFLOPS, %% of the "
                           "GPU's dense bf16 peak; backward: also per kernel) for the "
                           "--variant(s), default every variant that takes the shape")
    mode.add_argument("--summarize", nargs="+", metavar="TRACE",
                      help="summarize .chrome_trace file(s) (no GPU); two or more: side by side")
    mode.add_argument("--plot", nargs="+", metavar="TRACE",
                      help="timeline PNG of .chrome_trace file(s), stacked (no GPU); needs --png")
    p.add_argument("--variant", action="append", choices=names, metavar="NAME",
                   help=f"variant to capture (repeatable): {', '.join(names)}")
    add_family_arg(p)
    add_pass_arg(p, PASSES)
    add_shape_args(p, default_preset=preset, family=fam.name)
    p.add_argument("--out", metavar="DIR", default="out/trace",
                   help="output directory of captures (default: out/trace; created)")
    p.add_argument("--ctas", type=positive_int, default=DEFAULT_CTAS, metavar="K",
                   help=f"CTAs kept in a captured trace, from the middle of the launch "
                        f"(default: {DEFAULT_CTAS}; fewer if the file would pass "
                        f"{MAX_TRACE_BYTES // 1_000_000} MB)")
    p.add_argument("--warps", metavar="LIST",
                   help="warps to sample, e.g. 0,4,8 or 'all' (default: the first warp of every "
                        "warp group); each traced kernel must have them (a backward traces "
                        "kernels of 4, 8 and 12 warps)")
    p.add_argument("--buffer-size", type=positive_int, default=None, metavar="BYTES",
                   help="Proton's profile buffer per CTA: the sampled warps times a power of two "
                        "(8 bytes an event; default: Proton's, and a capture whose warps lost "
                        "events is made again with as many as a trace file holds)")
    p.add_argument("--max-ctas", type=positive_int, default=None, metavar="K",
                   help="CTAs per trace in a timeline picture (default: 4, 2 per trace when "
                        "comparing)")
    p.add_argument("--png", metavar="OUT.png", help="output picture of --plot")
    p.add_argument("--json", action="store_true",
                   help="print the summary (or the --kernels rows) as JSON instead of text")
    p.add_argument("--reps", type=positive_int, default=5, metavar="R",
                   help="launches per variant for --kernels (default: 5)")
    p.add_argument("--keep-full", action="store_true",
                   help="also keep the untrimmed trace as OUT/<variant>.full.chrome_trace")
    p.add_argument("--seed", type=int, default=0, metavar="INT", help="input seed (default: 0)")
    return p


def _per_kernel(named: Sequence[tuple[str, list[dict]]]) -> list[tuple[str, list[dict]]]:
    """(label, events) per kernel of each named trace (trace_summary.split_kernels)."""
    return [part for name, events in named for part in split_kernels(events, name)]


def _summary_text(paths: Sequence[str], as_json: bool, family: str) -> str:
    traces = [(os.path.basename(p).replace(".chrome_trace", ""), load_trace(p)) for p in paths]
    where = {label: p for p, (name, ev) in zip(paths, traces)
             for label, _ in split_kernels(ev, name)}
    named = [(label, summarize(ev, family)) for label, ev in _per_kernel(traces)]
    if as_json:
        out = [dict(s, path=where[label], label=label) for label, s in named]
        return json.dumps(out[0] if len(out) == 1 else out, indent=1)
    parts = [format_summary(s, title=f"trace: {where[label]} ({label})") for label, s in named]
    if len(named) > 1:
        parts.append("side by side:\n" + format_comparison(named))
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(family_in(argv).name)
    args = parser.parse_args(argv)

    if args.summarize or args.plot:
        paths = args.summarize or args.plot
        for path in paths:
            if not os.path.isfile(path):
                parser.error(f"{path}: no such file")
        if args.plot:
            if not args.png or not args.png.lower().endswith(".png"):
                parser.error("--plot needs --png OUT.png")
            try:
                panels = _per_kernel([(os.path.basename(p).replace(".chrome_trace", ""),
                                       load_trace(p)) for p in paths])
                plot_timelines(panels, args.png, args.max_ctas or (4 if len(panels) == 1 else 2),
                               args.family)
            except (ValueError, OSError) as e:
                print(f"{PROG}: {e}", file=sys.stderr)
                return 1
            print(f"wrote {args.png}")
            return 0
        try:
            print(_summary_text(paths, args.json, args.family))
        except (ValueError, OSError, json.JSONDecodeError) as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 1
        return 0

    if args.kernels:
        names = args.variant or []
    elif args.compare:
        if args.compare[0] == args.compare[1]:
            parser.error("--compare needs two different variants")
        names = list(args.compare)
    else:
        if not args.variant:
            parser.error("say what to do: --variant NAME (capture), --compare A B, --kernels, "
                         "--summarize PATH or --plot PATH --png OUT.png")
        names = list(dict.fromkeys(args.variant))
    for n in names:
        try:
            registry.get(n, args.pass_, args.family)
        except ValueError as e:
            parser.error(str(e))
    shape = shape_from_args(args)
    check_variants(parser, args.pass_, names or ["auto"], [shape], family=args.family)
    if not names:  # --kernels: every variant that takes the shape
        names = [v.name for v in registry.all_variants(args.pass_, args.family)
                 if v.cannot_take(shape.spec()) is None]
    for n in names if not args.kernels else ():
        try:  # every traced kernel must have the sampled warps (Proton refuses others)
            sampled_warps(n, shape, args.pass_, args.warps, family=args.family)
        except ValueError as e:
            parser.error(str(e))
        except ImportError:  # e.g. TLX under upstream Triton: the run itself says so
            pass

    import torch
    if not torch.cuda.is_available():
        print(f"{PROG}: no CUDA GPU found; capturing a trace needs one (H100/H200)",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    print(metadata_line(run_metadata()), flush=True)

    if args.kernels:
        rows, per_kernel = kernel_level(names, shape, args.out, reps=args.reps, seed=args.seed,
                                        pass_=args.pass_, family=args.family)
        if args.json:
            print(json.dumps({"variants": rows, "kernels": per_kernel}, indent=1))
        else:
            print(format_table(rows, KERNEL_COLUMNS))
            if any(r["kernels"] > 1 for r in rows):
                print("\nper kernel:\n" + format_table(per_kernel, BREAKDOWN_COLUMNS))
            print(f"CUPTI kernel time per call (median of {args.reps}, L2 flushed before each; "
                  f"TFLOPS: useful FLOPs, {args.pass_}; {peak_words()}); raw tree: "
                  f"{os.path.join(args.out, 'kernels.hatchet')}")
        return 0

    captured = []
    for n in names:
        try:
            path = capture(n, shape, args.out, ctas=args.ctas, warps=args.warps, seed=args.seed,
                           keep_full=args.keep_full, pass_=args.pass_, family=args.family,
                           buffer_size=args.buffer_size)
        except (RuntimeError, ValueError, OSError, json.JSONDecodeError) as e:
            print(f"{PROG}: capture of {n} failed: {e}", file=sys.stderr)
            return 1
        events = load_trace(path)
        if not events:
            print(f"{PROG}: {path} holds no scope events", file=sys.stderr)
            return 1
        missing = set(registry.get(n, args.pass_, args.family).scopes) - {e["name"] for e in events}
        if missing and not args.warps:
            print(f"warning: {n}: scopes missing from the trace: {', '.join(sorted(missing))}",
                  file=sys.stderr)
        captured.append((n, path, events))
    panels = _per_kernel([(n, ev) for n, _, ev in captured])
    where = {label: p for n, p, ev in captured for label, _ in split_kernels(ev, n)}
    summaries = [(label, summarize(ev, args.family)) for label, ev in panels]
    if args.json:
        print(json.dumps([dict(s, variant=label, path=where[label]) for label, s in summaries],
                         indent=1))
    else:
        for label, s in summaries:
            print()
            print(format_summary(s, title=f"{label}: {where[label]}"))
        if len(summaries) > 1:
            print("\nside by side:\n" + format_comparison(summaries))
    if args.compare:
        stem = trace_name(f"compare_{names[0]}_{names[1]}", args.pass_)
        png = os.path.join(args.out, f"{stem}.png")
        plot_timelines(panels, png, args.max_ctas or 2, args.family)
        print(f"wrote {png}")
    else:
        for n, _, ev in captured:
            png = os.path.join(args.out, f"{trace_name(n, args.pass_)}.png")
            mine = split_kernels(ev, n)
            plot_timelines(mine, png, args.max_ctas or (4 if len(mine) == 1 else 2), args.family)
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
