"""Shared benchmark helpers: the one timing routine, shapes, inputs, run metadata, rows, table, plot.

Used by bench/fwd.py and meant to be reused by the profiling tools, so that every number in the repo
is timed the same way.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterable, Sequence

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------------------------
# Timing


def median_ms(fn: Callable[[], object], warmup_ms: float = 100.0, rep_ms: float = 1000.0) -> float:
    """Median wall time of `fn()` on the GPU, in milliseconds.

    Uses `triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")`: one call
    plus a 5-call estimate, then about warmup_ms of warm-up calls and rep_ms of timed calls, each
    timed with CUDA events. do_bench clears the L2 cache (writes a 256 MB buffer) before every timed
    call, so each call starts cold and repeated calls on one input set do not measure a warm cache.
    The defaults give at least ~5 timed calls for a 175 ms kernel (the `star` shape).
    """
    import triton.testing  # imported here: needs a GPU driver only when called

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def tflops(flop_count: float, ms: float) -> float:
    """Throughput in TFLOP/s of `flop_count` operations done in `ms` milliseconds."""
    return flop_count / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class Shape:
    """One forward problem: q [B, N, Hq, D], k1/k2/v1/v2 [B, N, Hk, D], windows w1 and w2."""

    B: int
    N: int
    Hq: int
    Hk: int
    D: int
    w1: int
    w2: int

    def short(self) -> str:
        """Compact form for tables, e.g. 'B4 N16384 H128/1 D128 w32x512' (H = Hq/Hk)."""
        return (f"B{self.B} N{self.N} H{self.Hq}/{self.Hk} D{self.D} "
                f"w{self.w1}x{self.w2}")

    def fields(self) -> dict:
        return asdict(self)


PRESETS: dict[str, Shape] = {
    "star": Shape(B=4, N=16384, Hq=128, Hk=1, D=128, w1=32, w2=512),
    "star64": Shape(B=4, N=16384, Hq=64, Hk=1, D=128, w1=32, w2=512),
    "small": Shape(B=1, N=2048, Hq=64, Hk=1, D=128, w1=32, w2=256),
}

SWEEP_N = (1024, 2048, 4096, 8192, 16384)
SWEEP_W2 = (256, 512, 1024)


def sweep_shapes(base: Shape, ns: Sequence[int] = SWEEP_N,
                 w2s: Sequence[int] = SWEEP_W2) -> list[Shape]:
    """`base` with N and w2 replaced by every pair of `ns` x `w2s`; w2 outer, N inner (ascending)."""
    return [replace(base, N=n, w2=w2) for w2 in w2s for n in ns]


# ---------------------------------------------------------------------------------------------
# Command-line pieces (bench/fwd.py, profiling/trace.py)

H100_SXM_BF16_DENSE_TFLOPS = 989.0  # H100 SXM dense bf16 tensor-core peak (datasheet)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_shape_args(p: argparse.ArgumentParser, default_preset: str) -> None:
    """Add --preset and the per-dimension overrides --B --N --hq --hk --d --w1 --w2."""
    p.add_argument("--preset", choices=list(PRESETS), default=default_preset,
                   help=f"base shape (default: {default_preset})")
    for flag, dest, what in (("--B", "B", "batch"), ("--N", "N", "sequence length"),
                             ("--hq", "hq", "query heads Hq"), ("--hk", "hk", "KV heads Hk"),
                             ("--d", "d", "head dim D"), ("--w1", "w1", "window of K1/V1"),
                             ("--w2", "w2", "window of K2/V2")):
        p.add_argument(flag, dest=dest, type=positive_int, metavar="INT",
                       help=f"override the preset's {what}")


def shape_from_args(args: argparse.Namespace) -> Shape:
    """The preset with the command line's overrides (add_shape_args) applied."""
    s = PRESETS[args.preset]
    overrides = dict(B=args.B, N=args.N, Hq=args.hq, Hk=args.hk, D=args.d, w1=args.w1, w2=args.w2)
    return replace(s, **{k: v for k, v in overrides.items() if v is not None})


# ---------------------------------------------------------------------------------------------
# Inputs


def make_inputs(B: int, N: int, Hq: int, Hk: int, D: int, device: str | torch.device = "cuda",
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random (q, k1, k2, v1, v2) in bf16: q [B, N, Hq, D], the others [B, N, Hk, D], all N(0, 1).

    Score spread: with N(0, 1) entries and sm_scale = 1/sqrt(D), a score
    s = sm_scale * sum_d q k1 k2 has mean 0 and standard deviation 1 (D terms of variance 1, scaled
    by 1/D in variance). Measured on CPU for D = 128, w1 x w2 = 32 x 512 (16384 scores per query):
    score std 1.00, max - min about 8.3 (so exp() spans ~4000x), largest softmax weight ~0.25%,
    effective count 1/sum(p^2) ~5700 of 16384: neither flat (uniform would give 16384) nor one-hot.
    (q scaled by 2 gives ~350, by 3 gives ~40.) Deterministic for a given seed and device.
    """
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    q = randn(B, N, Hq, D)
    k1, k2, v1, v2 = (randn(B, N, Hk, D) for _ in range(4))
    return q, k1, k2, v1, v2


# ---------------------------------------------------------------------------------------------
# Run metadata


def git_commit() -> str:
    """Short commit hash of the repo, or 'unknown' (no git, not a checkout). $SIMPLICIAL_COMMIT
    overrides it, for copies of the tree without .git (the device machine)."""
    if os.environ.get("SIMPLICIAL_COMMIT"):
        return os.environ["SIMPLICIAL_COMMIT"]
    try:
        res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    out = res.stdout.strip()
    return out if res.returncode == 0 and out else "unknown"


def run_metadata() -> dict:
    """What a row needs to be traceable: GPU, library versions, commit, UTC time (ISO 8601)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": git_commit(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def metadata_line(meta: dict) -> str:
    return (f"GPU: {meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | "
            f"commit {meta['commit']} | {meta['time_utc']}")


# ---------------------------------------------------------------------------------------------
# Rows: list of flat dicts, one per measurement


def _columns(rows: Sequence[dict]) -> list[str]:
    """Union of the rows' keys, in first-seen order."""
    cols: list[str] = []
    for row in rows:
        cols.extend(k for k in row if k not in cols)
    return cols


def write_rows(rows: Sequence[dict], csv_path: str | None = None,
               json_path: str | None = None) -> None:
    """Write rows as CSV (header = union of keys, missing/None as empty) and/or as a JSON list."""
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=_columns(rows), restval="")
            writer.writeheader()
            for row in rows:
                writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    if json_path:
        with open(json_path, "w") as f:
            json.dump(list(rows), f, indent=1)
            f.write("\n")


def _cell(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """Plain-text table; `columns` is a list of (row key, header). Numbers right-aligned."""
    header = [h for _, h in columns]
    body = [[_cell(row.get(k)) for k, _ in columns] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]
    numeric = [all(isinstance(row.get(k), (int, float)) or row.get(k) is None for row in rows)
               for k, _ in columns]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(cells, widths, numeric)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep] + [line(r) for r in body])


def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> None:
    """Print `format_table(rows, columns)` to stdout."""
    print(format_table(rows, columns), flush=True)


# ---------------------------------------------------------------------------------------------
# Plot


def _fixed_params(rows: Iterable[dict], keys: Sequence[str]) -> str:
    """'B=4 Hq=128 ...' for the keys that have one value over all rows."""
    parts = []
    for k in keys:
        values = {r.get(k) for r in rows if r.get(k) is not None}
        if len(values) == 1:
            parts.append(f"{k}={values.pop()}")
    return " ".join(parts)


def plot_tflops_vs_n(rows: Sequence[dict], path: str, title: str = "2-simplicial attention forward"
                     ) -> None:
    """TFLOPS vs N (log2 x axis): one line per variant, one panel per w2 when the rows hold
    several (panels share the y axis, so heights compare across them).

    Rows need 'variant', 'N', 'w2', 'tflops' (rows without a number are skipped). Rows with kind
    'matmul' become a dashed grey horizontal line. Each variant keeps one colour and line style in
    every panel (peers dotted). The title names the shape fields that are fixed.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if isinstance(r.get("tflops"), (int, float))]
    matmul = [r for r in timed if r.get("kind") == "matmul"]
    points = [r for r in timed if r.get("kind") != "matmul" and r.get("N") is not None]
    series: dict[tuple[str, object], list[tuple[int, float]]] = {}
    for r in points:
        series.setdefault((str(r["variant"]), r.get("w2")), []).append(
            (int(r["N"]), float(r["tflops"])))
    variants = list(dict.fromkeys(v for v, _ in series))
    w2s = list(dict.fromkeys(w for _, w in series)) or [None]
    peers = {str(r["variant"]) for r in points if r.get("kind") == "peer"}
    styles = ["-", "--", "-.", (0, (5, 1, 1, 1))]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ns = sorted({p[0] for pts in series.values() for p in pts})

    fig, axes = plt.subplots(1, len(w2s), figsize=(3.2 * len(w2s) + 2.2, 4.6), sharey=True,
                             squeeze=False)
    for ax, w2 in zip(axes[0], w2s):
        for vi, variant in enumerate(variants):
            pts = sorted(series.get((variant, w2), []))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[vi % len(colors)],
                        linestyle=":" if variant in peers else styles[vi % len(styles)],
                        marker="o", markersize=4, label=variant)
        for r in matmul:
            ax.axhline(float(r["tflops"]), linestyle="--", color="gray",
                       label=f"{r['variant']} ({float(r['tflops']):.0f} TFLOPS)")
        ax.set_xscale("log", base=2)
        if ns:
            ax.set_xticks(ns)
            ax.set_xticklabels([str(n) for n in ns], fontsize=8)
        ax.set_xlabel("N (sequence length)")
        if len(w2s) > 1:
            ax.set_title(f"w2 = {w2}", fontsize=10)
        ax.grid(True, alpha=0.3)
    top = max([p[1] for pts in series.values() for p in pts] + [float(r["tflops"]) for r in matmul],
              default=1.0)
    axes[0][0].set_ylim(0, top * 1.06)  # shared: the highest point of any panel fits
    axes[0][0].set_ylabel("TFLOPS")
    fixed = _fixed_params(points, ("B", "Hq", "Hk", "D", "w1", "w2"))
    gpu = {r.get("gpu") for r in timed if r.get("gpu") not in (None, "", "none")}
    suffix = f" on {gpu.pop()}" if len(gpu) == 1 else ""
    fig.suptitle(f"{title}{suffix}\n{fixed}", fontsize=10)
    if series or matmul:
        axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
