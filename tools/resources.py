"""Registers, spills, shared memory and Hopper features of every registered config, without a GPU.

    python -m tools.resources [--family F] [--json] [--pass fwd|bwd|all] [--variant NAME ...]
                                  [--keep DIR]

Each variant's `compile_configs()` (registry.compile_configs, forward and backward variants alike)
is compiled with `triton.compile` for sm_90a (GPUTarget cuda 90), once per process (the CI tests
of compilation and of resources share the compiled kernels and the measured rows).
The numbers come from the wheel's own tools in `triton/backends/nvidia/bin/`:
  ptxas -v      on the PTX: registers ("Used N registers"), spill stores/loads, stack frame, static
                shared memory, ptxas warnings. Run with the flags Triton's own ptxas call uses
                (--regAllocOptLevel=2, --fmad=false when fp fusion is off, the config's ptx_options)
                so the numbers describe the cubin that runs.
  cuobjdump     -res-usage on Triton's cubin: REG as a cross-check (`cubin_registers`) and SHARED;
                -sass (same call): "ex2 under wgmma", the exp2 issued between a wait that leaves
                one wgmma group in flight and the full wait (parse_sass_overlap): whether a
                pipelined consumer's softmax really runs under its PV wgmma in the compiled code;
                and the wgmma register operands a loop overwrites (parse_sass_clobbered_operands:
                ptxas once put P into the registers holding Q; a gate, like spills).
  the PTX text  wgmma.mma_async count, setmaxnreg.{inc,dec} values, bar.sync/bar.arrive ids.

smem_bytes = dynamic (`k.metadata.shared`, what Triton allocates) + static (ptxas "N bytes smem").
cuobjdump's SHARED is static + the 1 KiB per block that the driver reserves on sm_80+; that reserve
is outside the opt-in limit HOPPER_SMEM_LIMIT, so it is shown as `cubin_shared` but not added.

Named barrier ids: every literal id other than 0 is listed. Warp-specialized (TLX) kernels also get
compiler-made per-partition barriers (small ids such as 1-3) besides the ones the kernel names
(e.g. 9/10 for pingpong), so read the ids, not just yes/no.

Exit status: 0 when every config compiles, spills nothing, fits in shared memory and keeps its
wgmma register operands; 1 otherwise,
with one line per offending config on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from altattn import registry
from tools.resource_parsers import (parse_cuobjdump, parse_ptx, parse_ptxas,  # noqa: F401
                                        parse_sass_clobbered_operands, parse_sass_overlap)

HOPPER_SMEM_LIMIT = 232448   # bytes per block, sm_90 opt-in maximum (227 KiB), dynamic + static
GPU_NAME = "sm_90a"


# ------------------------------------------------------------------------------------------- tools

def tool_dir() -> Path:
    import triton
    return Path(os.path.dirname(triton.__file__)) / "backends" / "nvidia" / "bin"


def find_tools() -> dict[str, Path | None]:
    """The wheel's ptxas (the sm_90 one, not ptxas-blackwell) and cuobjdump, None where missing."""
    d = tool_dir()
    return {name: (d / name if (d / name).is_file() and os.access(d / name, os.X_OK) else None)
            for name in ("ptxas", "cuobjdump")}


def _run(cmd: list, cwd: Path) -> str:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout + r.stderr


# --------------------------------------------------------------------------------------- measuring

_COMPILED: dict[tuple, object] = {}   # CompileConfig.key() -> compiled kernel, this process
_MEASURED: dict[tuple, dict] = {}     # (family, pass, variant, config key) -> row, this process


def compile_config(c: registry.CompileConfig):
    """triton.compile of one CompileConfig for sm_90a; no GPU needed. Each config compiles once
    per process: later calls return the same kernel."""
    key = c.key()
    if key not in _COMPILED:
        import triton
        from triton.backends.compiler import GPUTarget
        _COMPILED[key] = triton.compile(c.source(), target=GPUTarget("cuda", 90, 32),
                                        options={"num_warps": c.num_warps,
                                                 "num_stages": c.num_stages})
    return _COMPILED[key]


def _empty_row(v: registry.Variant, c) -> dict:
    return {"pass": v.pass_, "variant": v.name, "config": c.name, "warps": c.num_warps,
            "total_warps": None,
            "num_stages": c.num_stages,
            "registers": None, "cubin_registers": None, "spill_stores": None, "spill_loads": None,
            "spill_bytes": None, "stack_bytes": None, "smem_bytes": None,
            "smem_dynamic_bytes": None, "smem_static_bytes": None, "cubin_shared": None,
            "wgmma": None, "setmaxnreg": None, "setmaxnreg_values": [], "setmaxnreg_inc": [],
            "setmaxnreg_dec": [], "named_barriers": None, "named_barrier_ids": [],
            "ptxas_barriers": None, "ex2_overlap": None, "operand_clobbers": [], "notes": [],
            "error": None}


def measure(v: registry.Variant, c, tools: dict, keep: Path | None = None) -> dict:
    """One config of variant `v` -> one row (see `report`), measured once per process unless
    `keep` is given. Work files go to a fresh temp dir, or to keep/pass/variant/config."""
    key = (v.family, v.pass_, v.name, c.key())
    if keep is None and key in _MEASURED:
        return dict(_MEASURED[key])
    row = _measure(v, c, tools, keep)
    if keep is None:
        _MEASURED[key] = dict(row)
    return row


def _measure(v: registry.Variant, c, tools: dict, keep: Path | None) -> dict:
    row = _empty_row(v, c)
    try:
        k = compile_config(c)
    except Exception as e:  # noqa: BLE001 - a config that does not compile is a reported failure
        lines = str(e).strip().splitlines() or [""]
        row["error"] = f"compile: {type(e).__name__}: {lines[-1]}"  # Triton ends with the message
        return row
    md = k.metadata
    with tempfile.TemporaryDirectory(prefix="resources-") as tmp:
        work = Path(tmp)
        if keep is not None:
            work = keep / v.pass_ / v.name / c.name
            work.mkdir(parents=True, exist_ok=True)
        (work / "kernel.ptx").write_text(k.asm["ptx"])
        (work / "triton.cubin").write_bytes(k.asm["cubin"])
        flags = ["-v", "--regAllocOptLevel=2"]
        if not getattr(md, "enable_fp_fusion", True):
            flags.append("--fmad=false")
        if getattr(md, "ptx_options", None):
            flags += md.ptx_options.split()
        try:
            log = _run([tools["ptxas"], *flags, "--gpu-name", GPU_NAME, "kernel.ptx",
                        "-o", "ptxas.cubin"], work)
        except RuntimeError as e:
            row["error"] = str(e)
            return row
        (work / "ptxas.log").write_text(log)
        cuobj, notes = {}, []
        if tools.get("cuobjdump") is None:
            notes.append("cuobjdump not found: no cubin cross-check")
        else:
            try:
                # one call: the per-function resource lines, then the SASS
                text = _run([tools["cuobjdump"], "-res-usage", "-sass", "triton.cubin"], work)
                (work / "cuobjdump.txt").write_text(text)
                cuobj = parse_cuobjdump(text)
                row["ex2_overlap"] = parse_sass_overlap(text)
                row["operand_clobbers"] = parse_sass_clobbered_operands(text)
            except RuntimeError as e:
                notes.append(str(e))

    px = parse_ptxas(log)
    name = md.name if md.name in px["functions"] else (px["entries"] or [None])[0]
    if name is None:
        row["error"] = "ptxas printed no entry function"
        return row
    entry = px["functions"][name]
    stores = sum(f.get("spill_stores", 0) for f in px["functions"].values())
    loads = sum(f.get("spill_loads", 0) for f in px["functions"].values())
    static = entry.get("smem", 0)
    ptx = parse_ptx(k.asm["ptx"])
    cu = cuobj.get(name, {})
    notes = px["notes"] + notes
    if cu.get("REG") not in (None, entry.get("registers")):
        notes.append(f"cuobjdump REG {cu['REG']} != ptxas {entry.get('registers')}")
    row.update(
        total_warps=ptx["threads"] // 32 if ptx["threads"] else c.num_warps,
        registers=entry.get("registers"), cubin_registers=cu.get("REG"),
        spill_stores=stores, spill_loads=loads, spill_bytes=stores + loads,
        stack_bytes=max(entry.get("stack", 0), entry.get("cumulative_stack", 0)),
        smem_dynamic_bytes=int(md.shared), smem_static_bytes=static,
        smem_bytes=int(md.shared) + static, cubin_shared=cu.get("SHARED"),
        wgmma=ptx["wgmma"], setmaxnreg=bool(ptx["setmaxnreg_values"]),
        setmaxnreg_values=ptx["setmaxnreg_values"], setmaxnreg_inc=ptx["setmaxnreg_inc"],
        setmaxnreg_dec=ptx["setmaxnreg_dec"], named_barriers=bool(ptx["named_barrier_ids"]),
        named_barrier_ids=ptx["named_barrier_ids"], ptxas_barriers=entry.get("barriers"),
        notes=notes)
    return row


class _NoConfig:
    """Stands in for the configs of a variant whose module does not import."""
    name, num_warps, num_stages = "-", None, None


def report(variant_names=None, keep: str | Path | None = None,
           pass_: str | None = None, *, family: str) -> list[dict]:
    """Compile every config of the named variants of pass `pass_` (None: every pass; no names: all
    of them) and return one dict per config: pass, variant, config, warps (the config's
    num_warps), total_warps (from the PTX
    .reqntid: warp-specialized kernels add their tasks' warps), num_stages, registers,
    cubin_registers, spill_stores, spill_loads, spill_bytes, stack_bytes, smem_bytes
    (= dynamic + static), smem_dynamic_bytes, smem_static_bytes, cubin_shared, wgmma,
    setmaxnreg (bool), setmaxnreg_values/_inc/_dec, named_barriers (bool), named_barrier_ids,
    ptxas_barriers, ex2_overlap (parse_sass_overlap of the cubin's SASS), notes, error (None
    when it compiled).
    Variants are those of `family`'s record. Unknown names (no variant of that name in the pass or
    passes) raise ValueError."""
    tools = find_tools()
    if tools["ptxas"] is None:
        raise RuntimeError(f"no ptxas in {tool_dir()}")
    variants = registry.all_variants(pass_, family)
    if variant_names is not None:
        for n in dict.fromkeys(variant_names):
            if not any(v.name == n for v in variants):
                registry.get(n, pass_ or "fwd", family)  # raises, naming the known variants
        variants = [v for v in variants if v.name in variant_names]
    keep = Path(keep) if keep is not None else None
    rows = []
    for v in variants:
        try:
            configs = v.compile_configs()
        except Exception as e:  # noqa: BLE001 - report the variant, keep going with the others
            rows.append({**_empty_row(v, _NoConfig), "error": f"load: {type(e).__name__}: {e}"})
            continue
        rows.extend(measure(v, c, tools, keep) for c in configs)
    return rows


def problems(row: dict) -> list[str]:
    """Why a row fails the gate: compile error, any spill, shared memory over HOPPER_SMEM_LIMIT,
    a wgmma register operand that its loop overwrites (parse_sass_clobbered_operands)."""
    if row["error"]:
        return [row["error"]]
    out = []
    if row["spill_bytes"]:
        out.append(f"spills {row['spill_bytes']} bytes ({row['spill_stores']} stores + "
                   f"{row['spill_loads']} loads)")
    if row["smem_bytes"] > HOPPER_SMEM_LIMIT:
        out.append(f"shared memory {row['smem_bytes']} bytes > limit {HOPPER_SMEM_LIMIT}")
    if row["operand_clobbers"]:
        out.append("wgmma register operands overwritten in their loop: "
                   + ", ".join(row["operand_clobbers"][:4]))
    return out


# ------------------------------------------------------------------------------------------ output

def _ints(xs) -> str:
    return ",".join(str(x) for x in xs)


def where(row: dict) -> str:
    """pass/variant/config of a row, as messages name it."""
    return f"{row['pass']}/{row['variant']}/{row['config']}"


def format_table(rows: list[dict]) -> str:
    head = ["pass", "variant", "config", "warps", "registers", "spill B", "stack B", "smem B",
            "wgmma", "ex2 under wgmma", "setmaxnreg", "named barriers"]
    right = {"warps", "spill B", "stack B", "smem B", "wgmma", "ex2 under wgmma"}
    body = []
    for r in rows:
        if r["error"]:
            body.append([r["pass"], r["variant"], r["config"], str(r["warps"] or "-"), "ERROR",
                         "", "", "", "", "", "", ""])
            continue
        regs = str(r["registers"])
        if r["setmaxnreg_values"]:
            regs += f" (wg {'/'.join(map(str, r['setmaxnreg_values']))})"
        smr = "no"
        if r["setmaxnreg"]:
            smr = "yes " + " ".join(f"{k} {_ints(r['setmaxnreg_' + k])}" for k in ("dec", "inc")
                                    if r["setmaxnreg_" + k])
        warps = str(r["warps"])
        if r["total_warps"] != r["warps"]:  # warp-specialized: the launch num_warps + the tasks'
            warps += f" ({r['total_warps']} total)"
        body.append([r["pass"], r["variant"], r["config"], warps, regs, str(r["spill_bytes"]),
                     str(r["stack_bytes"]), str(r["smem_bytes"]), str(r["wgmma"]),
                     "-" if r["ex2_overlap"] is None else str(r["ex2_overlap"]), smr,
                     _ints(r["named_barrier_ids"]) or "-"])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.rjust(w) if h in right else x.ljust(w)
                       for x, w, h in zip(line, widths, head)).rstrip()
             for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        for n in r["notes"]:
            lines.append(f"note {where(r)}: {n}")
        if r["error"]:
            lines.append(f"error {where(r)}: {r['error']}")
    lines.append(f"target {GPU_NAME}; smem = dynamic + static, limit {HOPPER_SMEM_LIMIT} bytes")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from profiling.common import add_family_arg
    ap = argparse.ArgumentParser(
        prog="python -m tools.resources",
        description="Per-config sm_90a resources of the registered variants (no GPU needed).")
    ap.add_argument("--json", action="store_true",
                    help="print a JSON list of rows instead of a table")
    ap.add_argument("--pass", dest="pass_", choices=[*registry.PASSES, "all"], default="all",
                    help="only the variants of this pass (default: all)")
    ap.add_argument("--variant", action="append", metavar="NAME",
                    help="only this variant (repeatable); default: all registered")
    ap.add_argument("--keep", metavar="DIR",
                    help="keep kernel.ptx, ptxas.log, cubins under DIR/pass/variant/config")
    add_family_arg(ap)
    args = ap.parse_args(argv)
    try:
        rows = report(args.variant, keep=args.keep,
                      pass_=None if args.pass_ == "all" else args.pass_, family=args.family)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    if not rows:
        print(f"no variant of pass {args.pass_} is registered", file=sys.stderr)
    bad = [(r, p) for r in rows for p in problems(r)]
    for r, p in bad:
        print(f"FAIL {where(r)}: {p}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
