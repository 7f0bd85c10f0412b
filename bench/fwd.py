"""Forward benchmark: time the registered variants of an attention family's forward (default:
2-simplicial attention) on one shape or a sweep.

    python bench/fwd.py                                  # every variant, the default preset
    python bench/fwd.py --variant triton --preset small --peers
    python bench/fwd.py --variant auto --sweep --csv out/fwd.csv --plot out/fwd.png
    python bench/fwd.py --variant tlx_pipelined_kv --peers --frontier  # + cuDNN, TLX's dense FA
    python bench/fwd.py --variant triton --form trilinear det --peers  # det vs plain, one run
    python bench/fwd.py --family spherical --peers --frontier          # spherical attention, P1
    python bench/fwd.py --family spherical --preset p2 --causal --pad 0.25 --N 2048 --peers
    python bench/fwd.py --family spherical --variant auto --sweep --plot out/sph.png  # N x causal

--variant takes the forward variants of the family, 'auto' (the one the launcher picks for each
shape and form on this GPU: its row names it) or 'all' (the default), as bench/bwd.py takes the
backward ones; a backward variant is refused, naming bench/bwd.py. The family record
(altattn.registry.Family, --family) gives the presets, the sweep axes, the check tolerances, the
FLOP model and the peers.

The shape flags are the fields of the family's shape record (profiling.common.add_shape_args:
--B --N --hq --hk --d, then its own: --w1 --w2 for 2-simplicial attention, --causal/--no-causal
and --pad for spherical attention), over --preset (its presets).

Each variant is first checked against the family's reference (fp32, on the GPU) on a reduced
shape (`Shape.check_shape`; bench/check.py: every output, each against its tolerance in
`Family.tolerances`: out_rel, lse_abs for 2-simplicial attention, out_rel, r_rel for spherical
attention; 2-simplicial: B=1, N = min(N, 2*max(w1, w2) + 37), other dims kept), then timed
with profiling.timing.median_ms (triton's do_bench, median, L2 flushed before every timed call),
each call through `altattn.launcher.run`. TFLOPS use `Family.flops`. A variant or shape that
cannot run is refused before anything touches the GPU (the launcher's message, exit 2).

--form picks the logits' form (`altattn.simplicial.reference` states both): trilinear (the default)
or det, the determinant form, or both (`--form trilinear det`). Each variant is timed in each
asked form that it computes (registry `accepts`; 'all' means those variants), check and all, the
two forms of a variant in adjacent rows; a named variant that lacks an asked form is refused
before any GPU work (exit 2). Every variant row carries its `form`; a det row also carries
`vs_trilinear`, its TFLOPS over the same variant's trilinear TFLOPS on the same shape in this run
(the table's "x trilinear" column). The useful FLOPs of det are the plain form's (the same QK
and PV GEMMs), so TFLOPS compare directly and the peers (cuDNN SDPA, matmul) are the same for
both forms. A det call's time includes what launcher.run does for it on the host (the `triton`
variant packs K1's two rotations, `det_keys`, each call).

Memory and caches: one input set per shape, no rotation. The `star` q alone is 0.5 GB, far above the
50 MB L2, and do_bench writes a 256 MB buffer before every timed call, so each call starts with a
cold L2 whether or not inputs rotate; rotating would only cost memory (and with --peers the cuDNN
inputs for the largest sweep point already take ~10 GB).

--peers and --frontier run bench/peers.py: each peer of the family record (cuDNN SDPA on the
dense shape of its equal-work rule, Peer.dense: Lkv = w1*w2 keys per query for 2-simplicial
attention, softmax attention at the same B, H, N, D and causal for spherical attention; peers
that run their own kernel, Peer.runs: altattn/<family>/peers.py), a bf16 matmul, and the dense
FlashAttention tutorials that ship inside fbtriton (`triton.language.extra.tlx.tutorials.
hopper_fa_ws*`: warp-specialized, + pipelined, + pingpong, + persistent) on dense self-attention
of length L = Lkv: the same work as the 2-simplicial shape when N = w1*w2 (as at `star`). They
are imported and run as they ship, as a measured frontier of what TLX reaches on this GPU for the
easier operator; each output is compared with torch SDPA's before it is timed.

Exit status: 0 done; 1 a correctness check failed, or no variant was timed at all; 2 bad
arguments, a `triton` without TLX (altattn.triton_env: one line naming the fix) or no
CUDA GPU.
"""
from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import argparse  # noqa: E402
import importlib.util  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402

import torch  # noqa: E402

from bench.check import check_pass, summary, tolerance_key  # noqa: E402
from bench.common import (add_form_ratios, build_parser, check_out_paths,  # noqa: E402
                          form_note, plot_tflops_vs_n, presets_text, sweep_shapes,
                          table_columns, timed_row, variant_runs, write_rows)
from bench.peers import (bench_frontier, bench_matmul, bench_peers, dense_peer,  # noqa: E402
                         frontier_key)
from profiling.common import (gpu_problem, family_in, forms_of,  # noqa: E402
                              form_options,
                              metadata_line, print_table, run_metadata, shape_flags,
                              shape_from_args, shape_spec)
from profiling.timing import median_ms, peak_words  # noqa: E402
from altattn import launcher, registry  # noqa: E402

PROG = "bench/fwd.py"
PASS = "fwd"  # the pass this benchmark times (launcher.run: the forward)

TABLE_COLUMNS = [
    ("variant", "variant"),
    ("form", "form"),
    ("shape", "shape"),
    ("ms", "ms"),
    ("tflops", "TFLOPS"),
    ("pct_peak", "% of peak"),
    ("pct_matmul", "% of matmul"),
    ("note", "note"),
]


class CheckFailed(Exception):
    """A variant's output differs from the reference by more than the tolerances."""


# ---------------------------------------------------------------------------------------------
# Arguments


def check_words(fam: registry.Family, pass_: str = "fwd") -> str:
    """The check's thresholds in words, from the family's tolerances."""
    keys = dict.fromkeys(tolerance_key(fam, pass_, o) for o in fam.passes[pass_].outputs)
    return ", ".join(f"{k.rsplit('_', 1)[0]} "
                     f"{'max abs' if k.endswith('_abs') else 'rel. Frobenius'} error <= "
                     f"{fam.tolerances[k]}" for k in keys)


def build_fwd_parser(fam: registry.Family) -> argparse.ArgumentParser:
    sweep = " x ".join(f"{k} in {list(v)}" for k, v in fam.sweep.items())
    p = build_parser(
        PROG, PASS, fam, description=f"Time the {fam.title} forward variants (needs a CUDA GPU).",
        epilog=f"{presets_text(fam)}. Sweep: {sweep}. Check thresholds: "
               f"{check_words(fam)}. Exit status: 0 ok, 1 check failed or nothing timed, 2 bad "
               f"arguments or no GPU.",
        all_means="every forward variant; one that cannot take a shape gets a row saying why",
        peers_time="the forward")
    p.add_argument("--sweep", action="store_true",
                   help=f"time every {' x '.join(fam.sweep)} of the sweep (other dims from "
                        f"preset/overrides)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the correctness check against the reference")
    dense = dense_peer(fam)
    p.add_argument("--frontier", action="store_true",
                   help="also time TLX's dense FlashAttention tutorials (shipped in fbtriton: "
                        "ws, pipelined, pipelined pingpong, persistent) on dense self-attention "
                        + (f"of length Lkv ({dense.rule}; equal work when N = Lkv)" if dense else
                           f"(not for {fam.title}: it has no dense softmax peer, Peer.dense)"))
    p.add_argument("--plot", metavar="PATH.png", help="plot TFLOPS vs N per variant (matplotlib)")
    return p


def parse_args(argv: Sequence[str] | None = None
               ) -> tuple[argparse.Namespace, list, list[tuple[str, str]]]:
    """Parse and validate everything that needs no GPU, the variants' forms and shape limits
    included; argument errors exit 2 via parser.error. Returns (args, shapes, runs): runs are the
    (variant, form) pairs to time, in --variant order, each variant's forms in --form order
    (args.form: the forms asked, duplicates dropped; 'auto' stays 'auto')."""
    fam = family_in(argv)
    parser = build_fwd_parser(fam)
    args = parser.parse_args(argv)

    flags = shape_flags(fam)
    if args.sweep and (swept := [k for k in fam.sweep if getattr(args, k, None) is not None]):
        parser.error(f"--sweep sets {' and '.join(fam.sweep)} itself; drop "
                     f"{'/'.join(flags[k] for k in swept)}")
    if args.frontier and dense_peer(fam) is None:
        parser.error(f"--frontier: {fam.title} has no dense softmax peer (Peer.dense) whose "
                     f"length the tutorials would take")
    shape = shape_from_args(args)
    shapes = sweep_shapes(shape, fam.sweep) if args.sweep else [shape]
    runs = variant_runs(parser, args, PASS, shapes, takers_only=False)

    if args.plot is not None and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot {args.plot}: the plot is written as PNG; give a path ending in .png")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib, which is not installed")
    check_out_paths(parser, args, ("csv", "json", "plot"))
    return args, shapes, runs


# ---------------------------------------------------------------------------------------------
# Progress bar (tqdm when importable, else one line on stderr)


class Progress:
    """Counts finished steps; `write` prints a message without breaking the bar."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30) -> None:
        self.total, self.done, self.width, self.desc = total, 0, width, ""
        self.enabled = enabled
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm
                self._tqdm = tqdm(total=total, file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self._draw()

    def _draw(self) -> None:
        filled = self.width * self.done // max(1, self.total)
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {self.desc}\033[K")
        sys.stderr.flush()

    def set_description(self, desc: str) -> None:
        self.desc = desc
        if self._tqdm is not None:
            self._tqdm.set_description(desc)
        elif self.enabled:
            self._draw()

    def update(self) -> None:
        self.done += 1
        if self._tqdm is not None:
            self._tqdm.update(1)
        elif self.enabled:
            self._draw()

    def write(self, msg: str) -> None:
        if self._tqdm is not None:
            self._tqdm.write(msg, file=sys.stderr)
        elif self.enabled:
            sys.stderr.write("\r\033[K" + msg + "\n")
            self._draw()
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# Measurements


def check_variant(name: str, s, seed: int, form, family: str) -> dict[str, float]:
    """Compare `name` with the family's fp32 reference (in the logits' `form`, where the family
    has forms) on `s.check_shape()` (bench.check); raise CheckFailed above the family's
    tolerances (NaN fails). Returns {tolerance name: error}, e.g. {"out_rel": .., "lse_abs": ..}."""
    errors = check_pass(family, PASS, name, s, seed + 1, form)
    if not all(e.ok for e in errors):
        raise CheckFailed(f"variant {name!r}{form_note(form)} on {s.check_shape().short()}: "
                          f"{summary(errors, short=False)}")
    return {e.key: e.value for e in errors}


def bench_variant(name: str, form, s, inputs: tuple, args: argparse.Namespace,
                  checked: dict, log: Callable[[str], None]) -> dict:
    """One row: the variant's time on `s` (in the logits' `form` where the family has forms;
    "auto": the variant the launcher picks, named in the row), or a note saying why it was not
    timed. `inputs`: one call's arguments (Family.make_inputs). Useful FLOPs: the family's FLOP
    model, the same for every form."""
    fam = registry.get_family(args.family)
    base = {"kind": "variant", "pass": PASS, "variant": name, "form": form,
            "shape": s.short(), **s.fields(), "flops": fam.flops(s, PASS)}
    spec = shape_spec(s, form)
    v = fam.variant(name, PASS) if name != "auto" else None
    try:  # e.g. a TLX variant under upstream Triton (no triton.language.extra.tlx)
        if v is not None:
            v.load()
    except ImportError as e:
        return {**base, "note": f"not run: cannot import {v.module}: {e}"}
    try:
        picked = launcher.select(spec, name, inputs[0].device, PASS, family=fam.name)
    except (ValueError, RuntimeError) as e:
        return {**base, "note": f"not run: {e}"}
    except ImportError as e:  # select loads the other variants to list those that can take the
        why = (f"variant {name!r} cannot take {spec.short()}: {v.cannot_take(spec)}"  # shape
               if v is not None else f"cannot import a variant: {e}")  # "auto": to pick one
        return {**base, "note": f"not run: {why}"}
    name = base["variant"] = picked.name
    if args.check:
        key = (name, form, s.check_shape())
        if key not in checked:
            checked[key] = check_variant(name, s, args.seed, form, fam.name)
            errs = ", ".join(f"{k.rsplit('_', 1)[0]} {'max abs' if k.endswith('_abs') else 'rel'}"
                             f" err {e:.2e}" for k, e in checked[key].items())
            log(f"check {name}{'' if form is None else ' ' + form} {key[2].short()}: {errs} (ok)")
        base.update({f"check_{k}": e for k, e in checked[key].items()})

    def fn() -> object:
        return launcher.run(fam.name, PASS, *inputs, variant=name)

    try:
        ms = median_ms(fn, args.warmup_ms, args.rep_ms)
    except torch.cuda.OutOfMemoryError as e:
        return {**base, "note": f"out of memory: {str(e).splitlines()[0]}"}
    return timed_row(base, ms)


# ---------------------------------------------------------------------------------------------
# Main


def main(argv: Sequence[str] | None = None) -> int:
    args, shapes, runs = parse_args(argv)
    if (status := gpu_problem(PROG)) is not None:
        return status
    fam = registry.get_family(args.family)

    meta = run_metadata()
    print(metadata_line(meta), flush=True)
    progress = Progress(len(shapes), enabled=args.sweep)
    rows: list[dict] = []
    checked: dict = {}
    frontier_done: set[tuple[int, ...]] = set()  # dense (B, H, Nk, D): a sweep repeats them
    try:
        matmul = None
        if args.peers:
            progress.set_description("matmul")
            matmul = bench_matmul(args)
            rows.append(matmul)
        for s in shapes:
            progress.set_description(s.short())
            inputs: dict = {}  # form -> one call's arguments (Family.make_inputs)
            for name, form in runs:
                if form not in inputs:
                    inputs[form] = fam.make_inputs(s, PASS, seed=args.seed, device="cuda",
                                                   **form_options(form))
                rows.append(bench_variant(name, form, s, inputs[form], args, checked,
                                          progress.write))
            del inputs
            if args.peers:
                rows += bench_peers(fam, s, args)
                torch.cuda.empty_cache()
            if args.frontier and (key := frontier_key(fam, s)) not in frontier_done:
                frontier_done.add(key)
                rows.extend(bench_frontier(s, args, progress.write))
                torch.cuda.empty_cache()
            progress.update()
    except CheckFailed as e:
        progress.close()
        print(f"{PROG}: correctness check FAILED: {e}", file=sys.stderr)
        return 1
    progress.close()

    plain = (forms_of(fam) or [None])[0]
    add_form_ratios(rows, plain)
    for r in rows:
        r.setdefault("ms", None)
        r.setdefault("tflops", None)
        r.setdefault("pct_peak", None)
        r["pct_matmul"] = (100.0 * r["tflops"] / matmul["tflops"]
                           if matmul is not None and r["tflops"] is not None else None)
        r.setdefault("note", "")
        r.update(meta)
    print_table(rows, table_columns(rows, TABLE_COLUMNS, plain))
    print(peak_words())

    write_rows(rows, csv_path=args.csv, json_path=args.json)
    for flag in ("csv", "json"):
        if getattr(args, flag):
            print(f"wrote {getattr(args, flag)}")
    if args.plot:
        plot_tflops_vs_n(rows, args.plot, f"{fam.title} forward", fam.name)
        print(f"wrote {args.plot}")
    if not any(r.get("kind") == "variant" and r.get("tflops") is not None for r in rows):
        print("bench/fwd.py: no variant could run this shape (see the notes above)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
