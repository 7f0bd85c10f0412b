"""What the command-line tools share (bench/fwd.py, bench/bwd.py, profiling/trace.py): shapes and
presets, their arguments, the pass, shape, variant and output-path checks that come before any GPU
work, inputs, run metadata and text tables. Installed with the package, so
`python -m profiling.trace` needs no checkout."""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace

import torch

from altattn import launcher, registry, triton_env
from altattn.simplicial import shapes
from altattn.simplicial.family import FAMILY
from altattn.simplicial.spec import SUPPORTED_HEAD_DIMS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------------------------
# Shapes: the simplicial family's (the tools take --family; its record holds its shape type,
# presets and input maker)

Shape = FAMILY.shape_type
PRESETS = FAMILY.presets
make_inputs = shapes.make_inputs


# ---------------------------------------------------------------------------------------------
# Arguments


def _positive(text: str, convert, what: str):
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a {what}, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a {what}, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _positive(text, int, "positive integer")


def positive_float(text: str) -> float:
    """argparse type: a float > 0."""
    return _positive(text, float, "positive number")


def add_family_arg(p: argparse.ArgumentParser) -> None:
    """Add --family: the attention family whose variants the tool runs (registry.FAMILIES)."""
    p.add_argument("--family", choices=list(registry.FAMILIES), default=registry.DEFAULT_FAMILY,
                   help=f"attention family (default: {registry.DEFAULT_FAMILY}; "
                        f"{', '.join(f'{f.name}: {f.title}' for f in registry.families())})")


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
    overrides = {"B": args.B, "N": args.N, "Hq": args.hq, "Hk": args.hk, "D": args.d,
                 "w1": args.w1, "w2": args.w2}
    return replace(PRESETS[args.preset], **{k: v for k, v in overrides.items() if v is not None})


def add_pass_arg(p: argparse.ArgumentParser, passes: Sequence[str]) -> None:
    """Add --pass: the pass whose variants --variant names, one of `passes` (those the tool can
    run: a pass's inputs and runner are its own)."""
    p.add_argument("--pass", dest="pass_", choices=list(passes), default=passes[0],
                   help=f"the pass whose variants are meant (default: {passes[0]}; "
                        f"registered passes: {', '.join(registry.PASSES)})")


def check_out_path(parser: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """Exit 2 (parser.error) when `path`, given to `flag`, lies in a directory that does not exist:
    before the run, not after minutes of timing."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        parser.error(f"{flag} {path}: directory {parent} does not exist")


def check_variants(parser: argparse.ArgumentParser, pass_: str, names: Sequence[str],
                   shapes: Sequence[Shape], form: str = "trilinear") -> None:
    """Before any GPU work, exit 2 (parser.error) with the launcher's own message unless every
    shape passes the library's checks and each named variant of pass `pass_` takes it in the
    logits' `form` ("auto": some variant does).
    The two rules that positive overrides (add_shape_args) can still break
    are named by their flags first; the shape's other checks are the library's, in its words."""
    if not registry.all_variants(pass_):
        parser.error(f"no {pass_} variant is registered")
    for s in shapes:
        if s.Hq % s.Hk != 0:
            parser.error(f"--hq {s.Hq} must be a multiple of --hk {s.Hk} (grouped-query heads)")
        if s.D not in SUPPORTED_HEAD_DIMS:
            parser.error(f"--d {s.D}: head dim not supported; supported: "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
        try:
            spec = s.spec(form)
        except (ValueError, TypeError) as e:
            parser.error(f"shape {s.short()}: {e}")
        for name in names:
            try:
                launcher.pick(spec, name, pass_=pass_)
            except (ValueError, NotImplementedError) as e:  # NotImplementedError: no such form
                parser.error(str(e))
            except ImportError:  # e.g. TLX under upstream Triton: the run itself says so
                pass


def gpu_problem(prog: str) -> int | None:
    """None when the kernels can run here; else print one line saying why on stderr (a `triton`
    without TLX, naming the fix, or no CUDA GPU) and return the exit status 2."""
    try:
        triton_env.require_tlx()
    except triton_env.TritonWithoutTLX as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"{prog}: no CUDA GPU found; this benchmark needs one (H100/H200)", file=sys.stderr)
        return 2
    return None


# ---------------------------------------------------------------------------------------------
# Run metadata


def git_commit() -> str:
    """Short commit hash of the repo, or 'unknown' (no git, not a checkout). $ALTATTN_COMMIT
    overrides it, for copies of the tree without .git (the device machine)."""
    if os.environ.get("ALTATTN_COMMIT"):
        return os.environ["ALTATTN_COMMIT"]
    try:
        res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=10, check=False)
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
# Text tables


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
