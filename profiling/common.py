"""What the command-line tools share (bench/fwd.py, bench/bwd.py, profiling/trace.py,
tools/sanitize.py): each family's shape flags (its shape record's fields) and presets, the
other arguments, the pass, shape, variant and output-path checks that come before any GPU work,
run metadata and text tables. Installed with the package, so `python -m profiling.trace` needs
no checkout."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import subprocess
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from altattn import launcher, registry, triton_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The family a command line means when it names none (--family; add_family_arg, family_in): the
# one place that picks a family for the caller. The library (altattn) always takes one.
DEFAULT_FAMILY = "simplicial"

# ---------------------------------------------------------------------------------------------
# Shapes: each family's record holds its shape type (a dataclass: the tools' shape flags are its
# fields), presets and input maker (registry.get_family(name).shape_type, .presets,
# .make_inputs).

# The flag and words of the shape fields attention families share; any other field of a family's
# shape record is --<field> (a bool: --<field> / --no-<field>), its help the field's metadata
# "help" where given. A field's metadata "flag" overrides both.
SHARED_FIELDS = {"B": ("--B", "batch"), "N": ("--N", "sequence length"),
                 "Hq": ("--hq", "query heads Hq"), "Hk": ("--hk", "KV heads Hk"),
                 "D": ("--d", "head dim D")}


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


def nonnegative_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def bool_text(text: str) -> bool:
    """argparse type: True/False (also true/false, 1/0)."""
    words = {"true": True, "1": True, "false": False, "0": False}
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"must be True or False, got {text!r}")
    return words[text.lower()]


def add_family_arg(p: argparse.ArgumentParser) -> None:
    """Add --family: the attention family whose variants the tool runs (registry.FAMILIES)."""
    p.add_argument("--family", choices=list(registry.FAMILIES), default=DEFAULT_FAMILY,
                   help=f"attention family (default: {DEFAULT_FAMILY}; "
                        f"{', '.join(f'{f.name}: {f.title}' for f in registry.families())})")


def family_in(argv: Sequence[str] | None) -> registry.Family:
    """The family --family names in `argv` (a parser's shape flags and variants depend on it, so
    it is read first); an unknown name gives the default one, whose parser then refuses it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = DEFAULT_FAMILY
    for i, a in enumerate(argv):
        if a == "--family" and i + 1 < len(argv):
            name = argv[i + 1]
        elif a.startswith("--family="):
            name = a.split("=", 1)[1]
    return registry.get_family(name if name in registry.FAMILIES else DEFAULT_FAMILY)


def shape_fields(fam: registry.Family) -> list[tuple[str, type, str, str]]:
    """(field, type, flag, help words) of each field of the family's shape record, in order."""
    hints = typing.get_type_hints(fam.shape_type)
    out = []
    for f in dataclasses.fields(fam.shape_type):
        flag, words = SHARED_FIELDS.get(f.name, (f"--{f.name}", f.name))
        out.append((f.name, hints[f.name], f.metadata.get("flag", flag),
                    f.metadata.get("help", words)))
    return out


def shape_flags(fam: registry.Family) -> dict[str, str]:
    """Shape field -> its command-line flag."""
    return {name: flag for name, _, flag, _ in shape_fields(fam)}


FIELD_TYPES = {int: positive_int, float: nonnegative_float, bool: bool_text}


def add_shape_args(p: argparse.ArgumentParser, default_preset: str | None = None, *,
                   family: str) -> None:
    """Add --preset (the family's presets) and one override per field of its shape record: for
    2-simplicial attention --B --N --hq --hk --d --w1 --w2 (positive ints); a bool field is
    --<field> / --no-<field>, a float one a number >= 0."""
    fam = registry.get_family(family)
    default_preset = default_preset or fam.default_preset
    p.add_argument("--preset", choices=list(fam.presets), default=default_preset,
                   help=f"base shape (default: {default_preset})")
    for name, kind, flag, words in shape_fields(fam):
        if kind is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                           help=f"override the preset's {words}")
        else:
            p.add_argument(flag, dest=name, type=FIELD_TYPES.get(kind, kind),
                           metavar="INT" if kind is int else kind.__name__.upper(),
                           help=f"override the preset's {words}")


def shape_from_args(args: argparse.Namespace, family: str | None = None):
    """The preset with the command line's overrides (add_shape_args) applied, of `family`
    (None: the one args.family names, add_family_arg)."""
    fam = registry.get_family(family or args.family)
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(fam.shape_type)}
    return replace(fam.presets[args.preset],
                   **{k: v for k, v in overrides.items() if v is not None})


def parse_shape(fam: registry.Family, texts: Sequence[str]):
    """The family's shape from its fields' values as text, in field order (what
    `dataclasses.astuple` wrote); ValueError naming the field."""
    fields = shape_fields(fam)
    if len(texts) != len(fields):
        raise ValueError(f"a {fam.name} shape has {len(fields)} fields "
                         f"({', '.join(f[0] for f in fields)}), got {len(texts)} values")
    values = []
    for (name, kind, _, _), text in zip(fields, texts):
        try:
            values.append(FIELD_TYPES.get(kind, kind)(text))
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ValueError(f"shape field {name}: {e}") from None
    return fam.shape_type(*values)


def forms_of(fam: registry.Family) -> list | None:
    """The logits' forms the family's variants compute (its `accepts` has "form"), the family's
    own first; None when the family has no forms."""
    if "form" not in fam.accepts:
        return None
    return list(dict.fromkeys([*fam.accepts["form"],
                               *(f for v in fam.variants for f in v.accepted("form"))]))


def form_options(form) -> dict:
    """The keyword a family's make_inputs and Shape.spec take for `form` (none for None)."""
    return {} if form is None else {"form": form}


def shape_spec(s, form=None):
    """`s.spec()` in the logits' `form` (None: the family's only or default one)."""
    return s.spec(**form_options(form))


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
                   shapes: Sequence, form=None, *, family: str) -> None:
    """Before any GPU work, exit 2 (parser.error) with the launcher's own message unless every
    shape passes the library's checks and each named variant of pass `pass_` of `family` takes it
    in the logits' `form` (None: the family's default; "auto": some variant does).
    The two rules that positive overrides (add_shape_args) can still break are named by their
    flags first (Hq a multiple of Hk; D one of the spec module's SUPPORTED_HEAD_DIMS, where the
    family's shape has those fields); the shape's other checks are the library's, in its words."""
    fam = registry.get_family(family)
    if not registry.all_variants(pass_, family):
        parser.error(f"no {pass_} variant of {fam.name} is registered")
    flags = shape_flags(fam)
    head_dims = getattr(importlib.import_module(fam.spec_type.__module__),
                        "SUPPORTED_HEAD_DIMS", None)
    for s in shapes:
        f = s.fields()
        if "Hq" in f and "Hk" in f and f["Hq"] % f["Hk"] != 0:
            parser.error(f"{flags['Hq']} {f['Hq']} must be a multiple of {flags['Hk']} "
                         f"{f['Hk']} (grouped-query heads)")
        if head_dims and "D" in f and f["D"] not in head_dims:
            parser.error(f"{flags['D']} {f['D']}: head dim not supported; supported: "
                         f"{', '.join(map(str, head_dims))}")
        try:
            spec = shape_spec(s, form)
        except (ValueError, TypeError) as e:
            parser.error(f"shape {s.short()}: {e}")
        for name in names:
            try:
                launcher.pick(spec, name, pass_=pass_, family=family)
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


def report(rows: Sequence[dict], columns: Sequence[tuple[str, str]], json_path: str | None = None,
           header: str | Callable[[dict], str] = metadata_line) -> dict:
    """A benchmark's ending: the run's metadata (`run_metadata`), `header` (a line, or a function
    of the metadata; default `metadata_line`), the table, and with `json_path` the JSON
    {"meta": ..., "rows": ...}. Returns the metadata."""
    meta = run_metadata()
    print(header if isinstance(header, str) else header(meta))
    print_table(rows, columns)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "rows": list(rows)}, f, indent=1)
    return meta
