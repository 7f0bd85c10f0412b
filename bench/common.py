"""Benchmark helpers beyond what profiling/ shares with bench/ (profiling/common.py: shapes,
arguments, inputs, metadata, tables; profiling/timing.py: the one timing routine): the arguments
bench/fwd.py and bench/bwd.py share (--family, --variant, --form, the shape, --peers, outputs,
timing) and the (variant, form) runs they name, the sweep, rows as CSV/JSON, the TFLOPS-vs-N
plot. The family record (altattn.registry.Family) gives the presets, the sweep axes, the
tolerances, the FLOP model and the peers; bench/peers.py times the peers."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from profiling.common import (add_family_arg, add_shape_args, check_out_path, check_variants,
                              forms_of, positive_float, shape_spec)
from profiling.timing import pct_of_peak, tflops
from altattn import registry

TOOLS = {"fwd": "bench/fwd.py", "bwd": "bench/bwd.py"}  # the benchmark of each pass
PASS_WORDS = {"fwd": "forward", "bwd": "backward"}
WORDS = ("auto", "all")  # --variant's words beside the pass's variant names
MATMUL_SIZE = 8192       # the --peers matmul: M = N = K (bench/peers.py)


def sweep_shapes(base, sweep: Mapping[str, Sequence]) -> list:
    """`base` (a family's shape record) with the fields of `sweep` (Family.sweep: field -> values) replaced by every
    combination of their values; the first axis innermost (for the simplicial family: w2 outer,
    N inner, each in the order given)."""
    keys = list(sweep)[::-1]
    return [replace(base, **dict(zip(keys, values)))
            for values in itertools.product(*(sweep[k] for k in keys))]


def timed_row(base: dict, ms: float) -> dict:
    """`base` (with its "flops") timed at `ms`: ms, TFLOPS and % of the GPU's peak."""
    tf = tflops(base["flops"], ms)
    return {**base, "ms": ms, "tflops": tf, "pct_peak": pct_of_peak(tf)}


# ---------------------------------------------------------------------------------------------
# Arguments: one vocabulary for both passes' benchmarks


def pass_variants(fam: registry.Family, pass_: str) -> list[str]:
    return [v.name for v in fam.variants if v.pass_ == pass_]


def variant_type(fam: registry.Family, pass_: str) -> Callable[[str], str]:
    """argparse type of --variant: a variant of `pass_` of `fam`, 'auto' or 'all'; any other name
    is refused naming them (and, for a variant of the other pass, the benchmark that times it)."""
    names = pass_variants(fam, pass_)

    def variant(text: str) -> str:
        if text in names or text in WORDS:
            return text
        other = [p for p in registry.PASSES if p != pass_ and text in pass_variants(fam, p)]
        hint = f" ({text!r} is a {other[0]} variant: use {TOOLS[other[0]]})" if other else ""
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r}{hint}; {pass_} variants of {fam.name}: "
            f"{', '.join(names)}, or {' or '.join(map(repr, WORDS))}")
    return variant


def presets_text(fam: registry.Family) -> str:
    """'Presets: name: shape, ...' for a help text ('(H = Hq/Hk)' where the shape has both)."""
    names = {f.name for f in dataclasses.fields(fam.shape_type)}
    heads = " (H = Hq/Hk)" if {"Hq", "Hk"} <= names else ""
    return f"Presets{heads}: " + ", ".join(f"{k}: {v.short()}" for k, v in fam.presets.items())


def build_parser(prog: str, pass_: str, fam: registry.Family, description: str, epilog: str,
                 all_means: str, peers_time: str, **kwargs) -> argparse.ArgumentParser:
    """The arguments both benchmarks take, for pass `pass_` of family `fam`: --family,
    --variant (`all_means`: what 'all' times), --form, the shape, --peers (`peers_time`: which
    of the peer's passes it times), --csv, --json, --seed, --warmup-ms, --rep-ms."""
    names = pass_variants(fam, pass_)
    forms = forms_of(fam)
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, **kwargs)
    add_family_arg(p)
    p.add_argument("--variant", action="append", type=variant_type(fam, pass_), metavar="NAME",
                   help=f"{PASS_WORDS[pass_]} variant to time, repeatable: one of "
                        f"{', '.join(names)}; "
                        f"'auto' (the one the launcher picks for the shape"
                        f"{' and form' if forms else ''} on this GPU) "
                        f"or 'all' ({all_means}; the default)")
    if forms:  # a family whose variants compute several forms of the logits
        both = " ".join(forms[:2])
        p.add_argument("--form", nargs="+", choices=forms, default=forms[:1], metavar="FORM",
                       help=f"the logits' form(s) to time: {' and/or '.join(forms)} (default: "
                            f"{forms[0]}); '--form {both}' times each variant that computes "
                            f"both in both, in one run, and gives {forms[-1]}'s TFLOPS as a "
                            f"fraction of {forms[0]}'s (column 'x {forms[0]}'). 'all' variants: "
                            f"those that compute the form")
    else:
        p.set_defaults(form=[None])
    add_shape_args(p, default_preset=fam.default_preset, family=fam.name)
    rules = "; ".join(f"{peer.name} on {peer.rule}" for peer in fam.peers)
    same = (f"; the same for every --form: the useful FLOPs of {forms[-1]} equal the plain "
            f"form's (Family.flops)" if forms else "")
    p.add_argument("--peers", action="store_true",
                   help=f"also time {peers_time} of {rules}, and a bf16 {MATMUL_SIZE}^3 "
                        f"matmul{same}")
    p.add_argument("--csv", metavar="PATH", help="write the rows (with run metadata) as CSV")
    p.add_argument("--json", metavar="PATH", help="write the rows (with run metadata) as JSON")
    p.add_argument("--seed", type=int, default=0, metavar="INT", help="input seed (default: 0)")
    p.add_argument("--warmup-ms", type=positive_float, default=100.0, metavar="MS",
                   help="do_bench warm-up time per measurement (default: 100)")
    p.add_argument("--rep-ms", type=positive_float, default=1000.0, metavar="MS",
                   help="do_bench timed-repetition time per measurement (default: 1000)")
    return p


def check_out_paths(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    flags: Sequence[str] = ("csv", "json")) -> None:
    """Exit 2 when an output path's directory does not exist (before the run, not after it)."""
    for flag in flags:
        check_out_path(parser, f"--{flag}", getattr(args, flag))


def variant_runs(parser: argparse.ArgumentParser, args: argparse.Namespace, pass_: str,
                 shapes: Sequence, takers_only: bool) -> list[tuple[str, str]]:
    """Check --variant and --form against `shapes` before any GPU work (check_forms; exit 2) and
    return the (variant, form) runs, in --variant order, each variant's forms in --form order
    (args.form: duplicates dropped). 'all': every variant of the pass that computes the form
    (`takers_only`: and takes some shape in it); 'auto' stays 'auto' (the run resolves it)."""
    fam = registry.get_family(args.family)
    args.form = list(dict.fromkeys(args.form))
    chosen = list(dict.fromkeys(args.variant or ["all"]))
    named = [n for n in chosen if n not in WORDS]
    check_forms(parser, pass_, named, args.form, shapes, fam.name)
    if named and len(named) < len(chosen):  # 'auto' / 'all': some variant takes each shape
        check_forms(parser, pass_, [], args.form, shapes, fam.name)

    def takes(v: registry.Variant, form) -> bool:
        try:
            return any(v.cannot_take(shape_spec(s, form)) is None for s in shapes)
        except ImportError:  # e.g. TLX under upstream Triton: the run itself says so
            return True

    runs: list[tuple[str, str]] = []
    for n in chosen:
        if n == "all":
            runs += [(v.name, f) for v in fam.variants if v.pass_ == pass_ for f in args.form
                     if computes(v, f) and (not takers_only or takes(v, f))]
        else:
            runs += [(n, f) for f in args.form
                     if n == "auto" or computes(fam.variant(n, pass_), f)]
    return list(dict.fromkeys(runs))


def computes(v: registry.Variant, form) -> bool:
    """Does `v` compute the logits' `form` (None: a family without forms: yes)?"""
    return form is None or form in v.accepted("form")


def form_note(form) -> str:
    """' form <form>' for messages, '' for a family without forms."""
    return "" if form is None else f" form {form}"


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


# each family's plain form of the logits (the first it accepts), for families that have forms
PLAIN_FORMS = tuple(dict.fromkeys(f.accepts["form"][0] for f in registry.families()
                                  if "form" in f.accepts))


def series_name(row: dict) -> str:
    """A row's line in the plot: its variant, with the form added when that is not the plain one
    ('triton det'), so one run of both forms draws two lines per variant."""
    form = row.get("form")
    return (str(row["variant"]) if form in (None, "", *PLAIN_FORMS)
            else f"{row['variant']} {form}")


def panel_field(family: str) -> str | None:
    """The sweep axis a TFLOPS-vs-N plot draws as panels: the family's first sweep field other
    than N (2-simplicial attention: w2; spherical attention: causal)."""
    return next((k for k in registry.get_family(family).sweep if k != "N"), None)


def plot_tflops_vs_n(rows: Sequence[dict], path: str, title: str, family: str) -> None:
    """TFLOPS vs N (log2 x axis): one line per variant and peer, one panel per value of the
    family's other sweep axis (panel_field) when the rows hold several (panels share the y axis,
    so heights compare across them).

    Rows need 'variant', 'N', 'tflops' and the panel field (rows without a number are skipped);
    a row's 'form', other than the plain one, names a line of its own (series_name). Rows with
    kind 'matmul' become a dashed grey horizontal line. Each variant keeps one colour and line
    style in every panel (peers dotted). The title names the shape fields that are fixed.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = panel_field(family)
    timed = [r for r in rows if isinstance(r.get("tflops"), (int, float))]
    matmul = [r for r in timed if r.get("kind") == "matmul"]
    points = [r for r in timed if r.get("kind") != "matmul" and r.get("N") is not None]
    series: dict[tuple[str, object], list[tuple[int, float]]] = {}
    for r in points:
        series.setdefault((series_name(r), r.get(key) if key else None), []).append(
            (int(r["N"]), float(r["tflops"])))
    variants = list(dict.fromkeys(v for v, _ in series))
    panels = list(dict.fromkeys(w for _, w in series)) or [None]
    peers = {series_name(r) for r in points if r.get("kind") == "peer"}
    styles = ["-", "--", "-.", (0, (5, 1, 1, 1))]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ns = sorted({p[0] for pts in series.values() for p in pts})

    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 2.2, 4.6), sharey=True,
                             squeeze=False)
    for ax, value in zip(axes[0], panels):
        for vi, variant in enumerate(variants):
            pts = sorted(series.get((variant, value), []))
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
        if len(panels) > 1:
            ax.set_title(f"{key} = {value}", fontsize=10)
        ax.grid(True, alpha=0.3)
    top = max([p[1] for pts in series.values() for p in pts] + [float(r["tflops"]) for r in matmul],
              default=1.0)
    axes[0][0].set_ylim(0, top * 1.06)  # shared: the highest point of any panel fits
    axes[0][0].set_ylabel("TFLOPS")
    fields = [f.name for f in dataclasses.fields(registry.get_family(family).shape_type)]
    fixed = _fixed_params(points, [f for f in fields if f != "N"])
    gpu = {r.get("gpu") for r in timed if r.get("gpu") not in (None, "", "none")}
    suffix = f" on {gpu.pop()}" if len(gpu) == 1 else ""
    fig.suptitle(f"{title}{suffix}\n{fixed}", fontsize=10)
    if series or matmul:
        axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ratio_column(plain: str | None) -> tuple[str, str]:
    """(row key, header) of a form's TFLOPS over the plain form's: ("vs_trilinear",
    "x trilinear") for 2-simplicial attention."""
    return f"vs_{plain}", f"x {plain}"


def add_form_ratios(rows: Sequence[dict], plain: str | None) -> None:
    """Give each row of another form than `plain` (the family's plain form; None: a family
    without forms, nothing to do) `vs_<plain>`: its TFLOPS over those of the `plain` row of the
    same variant, pass and shape (the same run), or None when either was not timed. Other rows
    get no such key (a plain-only run's CSV has no such column)."""
    if plain is None:
        return
    key = ratio_column(plain)[0]
    twins = {(r.get("pass"), r["variant"], r["shape"]): r["tflops"] for r in rows
             if r.get("kind") == "variant" and r.get("form") == plain
             and r.get("tflops") is not None}
    for r in rows:
        if r.get("kind") == "variant" and r.get("form") not in (None, "", plain):
            twin = twins.get((r.get("pass"), r["variant"], r["shape"]))
            r[key] = (r["tflops"] / twin if twin and r.get("tflops") is not None else None)


def table_columns(rows: Sequence[dict], columns: Sequence[tuple[str, str]],
                  plain: str | None) -> list[tuple[str, str]]:
    """`columns`, with the ratio column (ratio_column(plain)) after TFLOPS when some row has a
    ratio, and without "form" when no row has one (a family without forms)."""
    cols = [c for c in columns if c[0] != "form" or any(r.get("form") for r in rows)]
    ratio = ratio_column(plain)
    if plain is None or not any(r.get(ratio[0]) is not None for r in rows):
        return cols
    i = [k for k, _ in cols].index("tflops") + 1
    return [*cols[:i], ratio, *cols[i:]]


def check_forms(parser, pass_: str, named: Sequence[str], forms: Sequence[str],
                shapes: Sequence, family: str) -> None:
    """Before any GPU work, exit 2 (parser.error) unless every named variant of pass `pass_`
    computes each of `forms` (the form first: a variant that lacks it fails whatever the shape),
    some variant does, and each shape passes the checks in that form with each named variant
    (profiling.common.check_variants; none named: "auto")."""
    for form in forms:
        if form is None:  # a family without forms: the shapes and the named variants only
            check_variants(parser, pass_, list(named) or ["auto"], shapes, None, family=family)
            continue
        computing = [v.name for v in registry.all_variants(pass_, family)
                     if form in v.accepted("form")]
        for n in named:
            try:
                have = registry.get(n, pass_, family).accepted("form")
            except ValueError as e:  # a variant of another pass only
                parser.error(str(e))
            if form not in have:
                parser.error(f"--form {form}: variant {n!r} computes form {' / '.join(have)} "
                             f"only; variants that compute {form}: "
                             f"{', '.join(computing) or 'none'}")
        if not computing:
            parser.error(f"--form {form}: no {pass_} variant computes it")
        check_variants(parser, pass_, list(named) or ["auto"], shapes, form, family=family)
