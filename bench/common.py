"""Benchmark helpers beyond what profiling/ shares with bench/ (profiling/common.py: shapes,
arguments, inputs, metadata, tables; profiling/timing.py: the one timing routine): the sweep,
rows as CSV/JSON, the TFLOPS-vs-N plot."""
from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import replace

from profiling.common import Shape, check_variants
from altattn import registry

SWEEP_N = (1024, 2048, 4096, 8192, 16384)
SWEEP_W2 = (256, 512, 1024)


def sweep_shapes(base: Shape, ns: Sequence[int] = SWEEP_N,
                 w2s: Sequence[int] = SWEEP_W2) -> list[Shape]:
    """`base` with N and w2 replaced by every pair of `ns` x `w2s`; w2 outer, N inner
    (ascending)."""
    return [replace(base, N=n, w2=w2) for w2 in w2s for n in ns]


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


def series_name(row: dict) -> str:
    """A row's line in the plot: its variant, with the form added when that is not the plain one
    ('triton det'), so one run of both forms draws two lines per variant."""
    form = row.get("form")
    return str(row["variant"]) if form in (None, "", "trilinear") else f"{row['variant']} {form}"


def plot_tflops_vs_n(rows: Sequence[dict], path: str, title: str = "2-simplicial attention forward"
                     ) -> None:
    """TFLOPS vs N (log2 x axis): one line per variant, one panel per w2 when the rows hold
    several (panels share the y axis, so heights compare across them).

    Rows need 'variant', 'N', 'w2', 'tflops' (rows without a number are skipped); a row's
    'form', other than trilinear, names a line of its own (series_name). Rows with kind
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
        series.setdefault((series_name(r), r.get("w2")), []).append(
            (int(r["N"]), float(r["tflops"])))
    variants = list(dict.fromkeys(v for v, _ in series))
    w2s = list(dict.fromkeys(w for _, w in series)) or [None]
    peers = {series_name(r) for r in points if r.get("kind") == "peer"}
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


# printed after "TFLOPS" when some row has it (a det row with its trilinear twin in the run)
RATIO_COLUMN = ("vs_trilinear", "x trilinear")


def add_form_ratios(rows: Sequence[dict]) -> None:
    """Give each det row `vs_trilinear`: its TFLOPS over those of the trilinear row of the same
    variant, pass and shape (the same run), or None when either was not timed. Other rows get no
    such key (a trilinear-only run's CSV has no such column)."""
    plain = {(r.get("pass"), r["variant"], r["shape"]): r["tflops"] for r in rows
             if r.get("kind") == "variant" and r.get("form") == "trilinear"
             and r.get("tflops") is not None}
    for r in rows:
        if r.get("form") == "det":
            twin = plain.get((r.get("pass"), r["variant"], r["shape"]))
            r["vs_trilinear"] = (r["tflops"] / twin if twin and r.get("tflops") is not None
                                 else None)


def table_columns(rows: Sequence[dict], columns: Sequence[tuple[str, str]]
                  ) -> list[tuple[str, str]]:
    """`columns`, with RATIO_COLUMN after TFLOPS when some row has a ratio."""
    if not any(r.get(RATIO_COLUMN[0]) is not None for r in rows):
        return list(columns)
    i = [k for k, _ in columns].index("tflops") + 1
    return [*columns[:i], RATIO_COLUMN, *columns[i:]]


def check_forms(parser, pass_: str, named: Sequence[str], forms: Sequence[str],
                shapes: Sequence[Shape]) -> None:
    """Before any GPU work, exit 2 (parser.error) unless every named variant of pass `pass_`
    computes each of `forms` (the form first: a variant that lacks it fails whatever the shape),
    some variant does, and each shape passes the checks in that form with each named variant
    (profiling.common.check_variants; none named: "auto")."""
    for form in forms:
        computing = [v.name for v in registry.all_variants(pass_) if form in v.accepted("form")]
        for n in named:
            try:
                have = registry.get(n, pass_).accepted("form")
            except ValueError as e:  # a variant of another pass only
                parser.error(str(e))
            if form not in have:
                parser.error(f"--form {form}: variant {n!r} computes form {' / '.join(have)} "
                             f"only; variants that compute {form}: "
                             f"{', '.join(computing) or 'none'}")
        if not computing:
            parser.error(f"--form {form}: no {pass_} variant computes it")
        check_variants(parser, pass_, list(named) or ["auto"], shapes, form)
