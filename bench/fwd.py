"""Forward benchmark: time the registered 2-simplicial attention variants on one shape or a sweep.

    python bench/fwd.py                                  # every variant, `star` shape
    python bench/fwd.py --variant triton --preset small --peers
    python bench/fwd.py --sweep --csv out/fwd.csv --plot out/fwd.png
    python bench/fwd.py --variant tlx_pipelined_kv --peers --frontier  # + cuDNN, TLX's dense FA
    python bench/fwd.py --variant triton --form trilinear det --peers  # det vs plain, one run

Each variant is first checked against `altattn.simplicial.reference` (fp32, on the GPU) on a reduced
shape (B=1, N = min(N, 2*max(w1, w2) + 37), other dims kept), then timed with
profiling.timing.median_ms (triton's do_bench, median, L2 flushed before every timed call), each
call through `altattn.launcher.run`. TFLOPS use `altattn.simplicial.flops`. A variant or shape
that cannot run is refused before anything touches the GPU (the launcher's message, exit 2).

--form picks the logits' form (`altattn.simplicial.reference` states both): trilinear (the default)
or det, the determinant form, or both (`--form trilinear det`). Each variant is timed in each
asked form that it computes (registry `forms`; 'all' means those variants), check and all, the
two forms of a variant in adjacent rows; a named variant that lacks an asked form is refused
before any GPU work (exit 2). Every variant row carries its `form`; a det row also carries
`vs_trilinear`, its TFLOPS over the same variant's trilinear TFLOPS on the same shape in this run
(the table's "x trilinear" column). The useful FLOPs of det are the plain form's
(`altattn.simplicial.flops`: the same QK and PV GEMMs), so TFLOPS compare directly and the peers
(cuDNN SDPA, matmul) are the same for both forms. A det call's time includes what launcher.run
does for it on the host (the `triton` variant packs K1's two rotations, `det_keys`, each call).

Memory and caches: one input set per shape, no rotation. The `star` q alone is 0.5 GB, far above the
50 MB L2, and do_bench writes a 256 MB buffer before every timed call, so each call starts with a
cold L2 whether or not inputs rotate; rotating would only cost memory (and with --peers the cuDNN
inputs for the largest sweep point already take ~10 GB).

--frontier also times the dense FlashAttention tutorials that ship inside fbtriton
(`triton.language.extra.tlx.tutorials.hopper_fa_ws*`: warp-specialized, + pipelined, + pingpong,
+ persistent) on dense self-attention of length L = w1*w2: the same work as the 2-simplicial
shape when N = w1*w2 (as at `star`). They are imported and run as they ship, as a measured
frontier of what TLX reaches on this GPU for the easier operator; each output is compared with
torch SDPA's before it is timed.

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
import warnings  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402

from altattn import simplicial as simplicial_attn  # noqa: E402
from bench.common import (SWEEP_N, SWEEP_W2, add_form_ratios, check_forms,  # noqa: E402
                          plot_tflops_vs_n, sweep_shapes, table_columns, write_rows)
from profiling.common import (gpu_problem, PRESETS, Shape, add_pass_arg, add_shape_args,  # noqa: E402
                              check_out_path, make_inputs, metadata_line,
                              positive_float, print_table, run_metadata, shape_from_args,
                              variant_names)
from profiling.timing import (H100_SXM_BF16_DENSE_TFLOPS, median_ms, pct_of_peak,  # noqa: E402
                              tflops)
from altattn import launcher, registry  # noqa: E402
from altattn.simplicial.spec import FORMS  # noqa: E402

PROG = "bench/fwd.py"
PASSES = ("fwd",)  # the passes this benchmark times (launcher.run: the forward)

# Correctness thresholds of the pre-timing check (bf16 kernel vs fp32 reference).
OUT_REL_TOL = 2e-2   # ||out - ref||_F / ||ref||_F
LSE_ABS_TOL = 2e-2   # max |lse - ref_lse|

MATMUL_SIZE = 8192                   # the --peers matmul: M = N = K

# --frontier: TLX's dense FlashAttention tutorials (fbtriton), technique added at each step
FRONTIER_TUTORIALS = ("hopper_fa_ws", "hopper_fa_ws_pipelined", "hopper_fa_ws_pipelined_pingpong",
                      "hopper_fa_ws_pipelined_pingpong_persistent")
FRONTIER_PACKAGE = "triton.language.extra.tlx.tutorials"
FRONTIER_BLOCK = 128                 # their tiles: L must be a multiple of it (no masking)

TABLE_COLUMNS = [
    ("variant", "variant"),
    ("form", "form"),
    ("shape", "shape"),
    ("ms", "ms"),
    ("tflops", "TFLOPS"),
    ("pct_peak", f"% of {H100_SXM_BF16_DENSE_TFLOPS:.0f}"),
    ("pct_matmul", "% of matmul"),
    ("note", "note"),
]


class CheckFailed(Exception):
    """A variant's output differs from the reference by more than the thresholds."""


# ---------------------------------------------------------------------------------------------
# Arguments


def build_parser() -> argparse.ArgumentParser:
    names = variant_names()
    presets = ", ".join(f"{k}: {v.short()}" for k, v in PRESETS.items())
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Time the 2-simplicial attention forward variants (needs a CUDA GPU).",
        epilog=f"Presets (H = Hq/Hk): {presets}. Sweep: N in {list(SWEEP_N)} x w2 in "
               f"{list(SWEEP_W2)}. Check thresholds: out rel. Frobenius error <= {OUT_REL_TOL}, "
               f"lse max abs error <= {LSE_ABS_TOL}. Exit status: 0 ok, 1 check failed or "
               f"nothing timed, 2 bad arguments or no GPU.")
    p.add_argument("--variant", action="append", choices=names + ["all"], metavar="NAME",
                   help=f"variant to time, repeatable; one of {', '.join(names)}, or 'all' "
                        f"(default: all of the pass)")
    p.add_argument("--form", nargs="+", choices=FORMS, default=["trilinear"], metavar="FORM",
                   help=f"the logits' form(s) to time: {' and/or '.join(FORMS)} (default: "
                        f"trilinear); '--form trilinear det' times each variant that computes "
                        f"both in both, in one run, and gives det's TFLOPS as a fraction of "
                        f"trilinear's (column 'x trilinear'). 'all' variants: those that compute "
                        f"the form")
    add_pass_arg(p, PASSES)
    add_shape_args(p, default_preset="star")
    p.add_argument("--sweep", action="store_true",
                   help="time every N x w2 of the sweep (other dims from preset/overrides)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the correctness check against the reference")
    p.add_argument("--peers", action="store_true",
                   help=f"also time cuDNN SDPA on equal work (Lkv = w1*w2) and a bf16 "
                        f"{MATMUL_SIZE}^3 matmul; the same for every --form: the useful FLOPs "
                        f"of det equal the plain form's (altattn.simplicial.flops)")
    p.add_argument("--frontier", action="store_true",
                   help="also time TLX's dense FlashAttention tutorials (shipped in fbtriton: ws, "
                        "pipelined, pipelined pingpong, persistent) on dense self-attention of "
                        "length w1*w2 (equal work when N = w1*w2)")
    p.add_argument("--csv", metavar="PATH", help="write the rows (with run metadata) as CSV")
    p.add_argument("--json", metavar="PATH", help="write the rows (with run metadata) as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="plot TFLOPS vs N per variant (matplotlib)")
    p.add_argument("--seed", type=int, default=0, metavar="INT", help="input seed (default: 0)")
    p.add_argument("--warmup-ms", type=positive_float, default=100.0, metavar="MS",
                   help="do_bench warm-up time per measurement (default: 100)")
    p.add_argument("--rep-ms", type=positive_float, default=1000.0, metavar="MS",
                   help="do_bench timed-repetition time per measurement (default: 1000)")
    return p


def parse_args(argv: Sequence[str] | None = None
               ) -> tuple[argparse.Namespace, list[Shape], list[tuple[str, str]]]:
    """Parse and validate everything that needs no GPU, the variants' forms and shape limits
    included; argument errors exit 2 via parser.error. Returns (args, shapes, runs): runs are the
    (variant, form) pairs to time, in --variant order, each variant's forms in --form order
    (args.form: the forms asked, duplicates dropped)."""
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.sweep and (args.N is not None or args.w2 is not None):
        parser.error("--sweep sets N and w2 itself; drop --N/--w2")
    shape = shape_from_args(args)
    shapes = sweep_shapes(shape) if args.sweep else [shape]
    chosen = args.variant or ["all"]
    args.form = list(dict.fromkeys(args.form))
    check_forms(parser, args.pass_, [n for n in chosen if n != "all"], args.form, shapes)

    if args.plot is not None and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot {args.plot}: the plot is written as PNG; give a path ending in .png")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib, which is not installed")
    for flag in ("csv", "json", "plot"):
        check_out_path(parser, f"--{flag}", getattr(args, flag))

    names: list[str] = []
    for n in chosen:
        for m in ([v.name for v in registry.all_variants(args.pass_)] if n == "all" else [n]):
            if m not in names:
                names.append(m)
    runs = [(n, f) for n in names for f in args.form if f in registry.get(n, args.pass_).accepted("form")]
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


def check_shape(s: Shape) -> Shape:
    """The reduced shape of the correctness check: B=1 and N long enough to pass both windows."""
    return replace(s, B=1, N=min(s.N, 2 * max(s.w1, s.w2) + 37))


def check_variant(name: str, s: Shape, seed: int, form: str = "trilinear"
                  ) -> tuple[float, float]:
    """Compare `name` with the fp32 reference of the logits' `form` on `check_shape(s)`; raise
    CheckFailed above the thresholds (NaN fails). Returns (out relative Frobenius error, lse max
    abs error)."""
    c = check_shape(s)
    inputs = make_inputs(c.B, c.N, c.Hq, c.Hk, c.D, device="cuda", seed=seed + 1)
    out, lse = simplicial_attn.forward(*inputs, c.w1, c.w2, variant=name, form=form)
    ref_out, ref_lse = simplicial_attn.reference(*inputs, c.w1, c.w2, dtype=torch.float32,
                                                 form=form)
    out_err = float(torch.linalg.norm(out.float() - ref_out) / torch.linalg.norm(ref_out))
    lse_err = float((lse - ref_lse).abs().max())
    if not (out_err <= OUT_REL_TOL and lse_err <= LSE_ABS_TOL):
        raise CheckFailed(
            f"variant {name!r} form {form} on {c.short()}: out relative error {out_err:.3g} "
            f"(OUT_REL_TOL={OUT_REL_TOL}), lse max abs error {lse_err:.3g} "
            f"(LSE_ABS_TOL={LSE_ABS_TOL})")
    return out_err, lse_err


def _timed_row(base: dict, ms: float) -> dict:
    tf = tflops(base["flops"], ms)
    return {**base, "ms": ms, "tflops": tf, "pct_peak": pct_of_peak(tf)}


def bench_variant(name: str, form: str, s: Shape, inputs: tuple[torch.Tensor, ...],
                  args: argparse.Namespace, checked: dict, log: Callable[[str], None]) -> dict:
    """One row: the variant's time on `s` in the logits' `form`, or a note saying why it was not
    timed. Useful FLOPs: altattn.simplicial.flops, the same for every form."""
    base = {"kind": "variant", "pass": args.pass_, "variant": name, "form": form,
            "shape": s.short(), **s.fields(),
            "flops": simplicial_attn.flops(s.B, s.N, s.Hq, s.D, s.w1, s.w2)}
    spec = s.spec(form)
    v = registry.get(name, args.pass_)
    try:  # e.g. a TLX variant under upstream Triton (no triton.language.extra.tlx)
        v.load()
    except ImportError as e:
        return {**base, "note": f"not run: cannot import {v.module}: {e}"}
    try:
        launcher.select(spec, name, inputs[0].device, args.pass_)
    except (ValueError, RuntimeError) as e:
        return {**base, "note": f"not run: {e}"}
    except ImportError:  # pick loads the other variants only to list those that can take the shape
        return {**base, "note": f"not run: variant {name!r} cannot take {spec.short()}: "
                                f"{v.cannot_take(spec)}"}
    if args.check:
        key = (name, form, check_shape(s))
        if key not in checked:
            checked[key] = check_variant(name, s, args.seed, form)
            out_err, lse_err = checked[key]
            log(f"check {name} {form} {key[2].short()}: out rel err {out_err:.2e}, "
                f"lse max abs err {lse_err:.2e} (ok)")
        base["check_out_rel"], base["check_lse_abs"] = checked[key]

    def fn() -> object:
        return simplicial_attn.forward(*inputs, s.w1, s.w2, variant=name, form=form)

    try:
        ms = median_ms(fn, args.warmup_ms, args.rep_ms)
    except torch.cuda.OutOfMemoryError as e:
        return {**base, "note": f"out of memory: {str(e).splitlines()[0]}"}
    return _timed_row(base, ms)


def bench_sdpa(s: Shape, args: argparse.Namespace) -> dict:
    """cuDNN SDPA on equal work: q [B, Hq, N, D], k/v [B, Hq, w1*w2, D], non-causal, bf16."""
    lkv = s.w1 * s.w2
    base = {"kind": "peer", "variant": "cudnn_sdpa", "shape": f"B{s.B} H{s.Hq} N{s.N} "
            f"Lkv{lkv} D{s.D}", **s.fields(), "Lkv": lkv, "flops": 4 * s.B * s.Hq * s.N * lkv * s.D}
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        return {**base, "note": f"cuDNN SDPA unavailable: {e}"}
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    try:
        q = torch.randn(s.B, s.Hq, s.N, s.D, generator=gen, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(s.B, s.Hq, lkv, s.D, generator=gen, device="cuda",
                            dtype=torch.bfloat16) for _ in range(2))
    except torch.cuda.OutOfMemoryError as e:
        return {**base, "note": f"cuDNN SDPA inputs: out of memory: {str(e).splitlines()[0]}"}

    def fn() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn()
                torch.cuda.synchronize()
            except RuntimeError as e:
                why = "; ".join([str(e).splitlines()[0]] + [str(w.message).splitlines()[0]
                                                           for w in caught])
                return {**base, "note": f"cuDNN SDPA unavailable: {why}"}
        ms = median_ms(fn, args.warmup_ms, args.rep_ms)
    return _timed_row(base, ms)


def bench_frontier(s: Shape, args: argparse.Namespace, log: Callable[[str], None]) -> list[dict]:
    """One row per FRONTIER_TUTORIALS kernel: dense non-causal self-attention, q/k/v
    [B, Hq, L, D] with L = w1*w2, timed as the tutorial ships it (its own autotuning). Its output
    is first compared with torch SDPA's on the same inputs; above OUT_REL_TOL it is not timed."""
    L = s.w1 * s.w2
    base = {"kind": "frontier", "shape": f"B{s.B} H{s.Hq} L{L} D{s.D} dense", "B": s.B,
            "Hq": s.Hq, "D": s.D, "Lkv": L, "flops": 4 * s.B * s.Hq * L * L * s.D}
    rows = [{**base, "variant": f"tutorial:{name.removeprefix('hopper_')}"}
            for name in FRONTIER_TUTORIALS]
    if L % FRONTIER_BLOCK:
        return [{**r, "note": f"not run: L = w1*w2 = {L} is not a multiple of {FRONTIER_BLOCK}"}
                for r in rows]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    try:
        q, k, v = (torch.randn(s.B, s.Hq, L, s.D, generator=gen, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).float()
    except torch.cuda.OutOfMemoryError as e:
        return [{**r, "note": f"inputs: out of memory: {str(e).splitlines()[0]}"} for r in rows]
    scale = s.D ** -0.5
    out_rows = []
    for name, row in zip(FRONTIER_TUTORIALS, rows):
        try:
            attention = importlib.import_module(f"{FRONTIER_PACKAGE}.{name}").attention
        except Exception as e:  # noqa: BLE001  (upstream Triton has no tutorials; any import error)
            out_rows.append({**row, "note": f"not run: cannot import {name}: {e}"})
            continue

        def fn(attention: Callable = attention) -> torch.Tensor:
            return attention(q, k, v, scale)

        try:
            err = float(torch.linalg.norm(fn().float() - ref) / torch.linalg.norm(ref))
            if not err <= OUT_REL_TOL:
                out_rows.append({**row, "note": f"not timed: out rel err {err:.3g} vs SDPA "
                                                f"(OUT_REL_TOL={OUT_REL_TOL})"})
                continue
            log(f"check {row['variant']} {row['shape']}: out rel err vs SDPA {err:.2e} (ok)")
            ms = median_ms(fn, args.warmup_ms, args.rep_ms)
        except torch.cuda.OutOfMemoryError as e:
            out_rows.append({**row, "note": f"out of memory: {str(e).splitlines()[0]}"})
            continue
        out_rows.append({**_timed_row(row, ms), "check_out_rel": err})
    return out_rows


def bench_matmul(args: argparse.Namespace) -> dict:
    """bf16 MATMUL_SIZE^3 matmul (torch / cuBLAS): the measured tensor-core ceiling."""
    n = MATMUL_SIZE
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    a, b = (torch.randn(n, n, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    ms = median_ms(lambda: a @ b, args.warmup_ms, args.rep_ms)
    return _timed_row({"kind": "matmul", "variant": "matmul_bf16", "shape": f"{n}x{n}x{n}",
                       "flops": 2 * n * n * n}, ms)


# ---------------------------------------------------------------------------------------------
# Main


def main(argv: Sequence[str] | None = None) -> int:
    args, shapes, runs = parse_args(argv)
    if (status := gpu_problem(PROG)) is not None:
        return status

    meta = run_metadata()
    print(metadata_line(meta), flush=True)
    progress = Progress(len(shapes), enabled=args.sweep)
    rows: list[dict] = []
    checked: dict = {}
    frontier_done: set[tuple[int, ...]] = set()  # (B, Hq, L, D): a sweep repeats L = w1*w2
    try:
        matmul = None
        if args.peers:
            progress.set_description("matmul")
            matmul = bench_matmul(args)
            rows.append(matmul)
        for s in shapes:
            progress.set_description(s.short())
            inputs = make_inputs(s.B, s.N, s.Hq, s.Hk, s.D, device="cuda", seed=args.seed)
            for name, form in runs:
                rows.append(bench_variant(name, form, s, inputs, args, checked, progress.write))
            del inputs
            if args.peers:
                rows.append(bench_sdpa(s, args))
                torch.cuda.empty_cache()
            if args.frontier and (s.B, s.Hq, s.w1 * s.w2, s.D) not in frontier_done:
                frontier_done.add((s.B, s.Hq, s.w1 * s.w2, s.D))
                rows.extend(bench_frontier(s, args, progress.write))
                torch.cuda.empty_cache()
            progress.update()
    except CheckFailed as e:
        progress.close()
        print(f"{PROG}: correctness check FAILED: {e}", file=sys.stderr)
        return 1
    progress.close()

    add_form_ratios(rows)
    for r in rows:
        r.setdefault("ms", None)
        r.setdefault("tflops", None)
        r.setdefault("pct_peak", None)
        r["pct_matmul"] = (100.0 * r["tflops"] / matmul["tflops"]
                           if matmul is not None and r["tflops"] is not None else None)
        r.setdefault("note", "")
        r.update(meta)
    print_table(rows, table_columns(rows, TABLE_COLUMNS))

    write_rows(rows, csv_path=args.csv, json_path=args.json)
    for flag in ("csv", "json"):
        if getattr(args, flag):
            print(f"wrote {getattr(args, flag)}")
    if args.plot:
        plot_tflops_vs_n(rows, args.plot)
        print(f"wrote {args.plot}")
    if not any(r.get("kind") == "variant" and r.get("tflops") is not None for r in rows):
        print("bench/fwd.py: no variant could run this shape (see the notes above)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
