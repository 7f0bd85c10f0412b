"""Registers, spills, shared memory and Hopper features of every registered config, without a GPU.

    python -m profiling.resources [--json] [--pass fwd|bwd|all] [--variant NAME ...] [--keep DIR]

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
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from altattn import registry

HOPPER_SMEM_LIMIT = 232448   # bytes per block, sm_90 opt-in maximum (227 KiB), dynamic + static
GPU_NAME = "sm_90a"


# ----------------------------------------------------------------------------------------- parsers

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_WGMMA = re.compile(r"\bwgmma\.mma_async\b")
_SETMAXNREG = re.compile(r"\bsetmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)\s*;")
# bar.sync / bar.arrive / bar.red, barrier.* and the .cta forms; not mbarrier.*, bar.warp.sync or
# barrier.cluster.* (those have no id).
_NTID = re.compile(r"\.(?:reqntid|maxntid)\s+(\d+)")
_BARRIER = re.compile(
    r"(?<![\w.])(?:bar|barrier)(?:\.cta)?\.(sync|arrive|red)((?:\.\w+)*)\s+([^;]*);")


def _id(token: str) -> int | str:
    token = token.strip()
    return int(token, 0) if re.fullmatch(r"\d+|0[xX][0-9a-fA-F]+", token) else token


def parse_ptx(ptx: str) -> dict:
    """wgmma count, setmaxnreg values, non-zero barrier ids (ints; a register operand stays a
    string) and the block size from `.reqntid`/`.maxntid` (None when absent) of PTX text.
    Comments are ignored."""
    code = _COMMENT.sub("", ptx)
    inc, dec = set(), set()
    for kind, n in _SETMAXNREG.findall(code):
        (inc if kind == "inc" else dec).add(int(n))
    ids = set()
    for op, _mods, operands in _BARRIER.findall(code):
        args = [a for a in operands.split(",") if a.strip()]
        pos = 1 if op == "red" else 0  # bar.red d, a{, b}, {!}c: the id is the second operand
        if len(args) > pos:
            ids.add(_id(args[pos]))
    ids.discard(0)
    ntid = _NTID.search(code)
    return {
        "threads": int(ntid.group(1)) if ntid else None,
        "wgmma": len(_WGMMA.findall(code)),
        "setmaxnreg_inc": sorted(inc),
        "setmaxnreg_dec": sorted(dec),
        "setmaxnreg_values": sorted(inc | dec),
        "named_barrier_ids": sorted(ids, key=lambda i: (isinstance(i, str), i)),
    }


_FN_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FN_PROPS = re.compile(r"Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_FIELDS = {"barriers": re.compile(r"used (\d+) barriers"),
           "smem": re.compile(r"(\d+) bytes smem"),
           "cumulative_stack": re.compile(r"(\d+) bytes cumulative stack size")}
_NOTE = re.compile(r"warning|Performance Loss|\(C\d{4}\)", re.IGNORECASE)


def parse_ptxas(log: str) -> dict:
    """`ptxas -v` stderr -> {"functions": {name: {...}}, "entries": [name], "notes": [line]}.
    Per function: registers, barriers, smem (static), stack, spill_stores, spill_loads,
    cumulative_stack (whichever ptxas printed)."""
    functions: dict[str, dict] = {}
    entries: list[str] = []
    notes: list[str] = []
    current = None
    for line in log.splitlines():
        if m := _FN_ENTRY.search(line):
            current = m.group(1)
            entries.append(current)
            functions.setdefault(current, {})
        elif m := _FN_PROPS.search(line):
            current = m.group(1)
            functions.setdefault(current, {})
        elif (m := _STACK.search(line)) and current is not None:
            functions[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                      spill_loads=int(m.group(3)))
        elif (m := _USED.search(line)) and current is not None:
            f = functions[current]
            f["registers"] = int(m.group(1))
            for key, rx in _FIELDS.items():
                if mm := rx.search(line):
                    f[key] = int(mm.group(1))
        if _NOTE.search(line):
            notes.append(line.strip())
    return {"functions": functions, "entries": entries, "notes": notes}


_CUOBJ_FN = re.compile(r"^\s*Function ([^:\s]+):\s*$")
_CUOBJ_KV = re.compile(r"([A-Z]+(?:\[\d+\])?):(\d+)")


def parse_cuobjdump(text: str) -> dict[str, dict[str, int]]:
    """`cuobjdump -res-usage` -> {function: {"REG": .., "STACK": .., "SHARED": .., ...}}."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        if m := _CUOBJ_FN.match(line):
            current = m.group(1)
            out[current] = {}
        elif current is not None and (kv := _CUOBJ_KV.findall(line)):
            out[current].update({k: int(v) for k, v in kv})
            current = None
    return out


_DEPBAR = re.compile(r"\bWARPGROUP\.DEPBAR\.LE\s+gsb0\s*,\s*(0x[0-9a-fA-F]+|\d+)")
_EX2 = re.compile(r"\bMUFU\.EX2\b")


def parse_sass_overlap(sass: str) -> int | None:
    """The exp2 that run while a wgmma is still in flight: the most MUFU.EX2 found, in listing
    order, between a `WARPGROUP.DEPBAR.LE gsb0, 0x1` (wait until one wgmma group is left) and the
    next `WARPGROUP.DEPBAR.LE gsb0, 0x0` (wait for all). None when no wait leaves a group in flight.
    A FlashAttention-3 style consumer (softmax of step c under the PV wgmma of step c - 1) shows
    its whole softmax here; 0 means ptxas put the full wait before the softmax."""
    best, count = None, None
    for line in sass.splitlines():
        if m := _DEPBAR.search(line):
            pending = int(m.group(1), 0)
            if pending >= 1:
                count = 0
            elif count is not None:
                best, count = max(best or 0, count), None
        elif count is not None and _EX2.search(line):
            count += 1
    return best


_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,6})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_REG = re.compile(r"^R(\d+)$")
_HGMMA_N = re.compile(r"^HGMMA\.64x(\d+)x\d+\.(F32|F16)")
# opcodes whose first operand is not a register they write
_NO_DEST = ("ST", "RED", "BRA", "BAR", "SYNCS", "WARPGROUP", "EXIT", "RET", "CALL", "UTMA",
            "FENCE", "MEMBAR", "DEPBAR", "NOP", "BSSY", "BSYNC", "WARPSYNC", "YIELD")


def _writes(op: str, operands: list[str]) -> range:
    """The registers an instruction writes (its first operand and the registers that follow it
    for a vector result), empty when its first operand is no register it writes."""
    m = _REG.match(operands[0]) if operands else None
    if m is None or op.startswith(_NO_DEST):
        return range(0)
    if hgmma := _HGMMA_N.match(op):  # the accumulator: N/2 fp32 (N/4 fp16) registers a thread
        return range(int(m.group(1)), int(m.group(1)) + int(hgmma.group(1)) // (
            2 if hgmma.group(2) == "F32" else 4))
    parts = op.split(".")
    width = 4 if "128" in parts or (op.startswith("LDSM") and parts[-1] == "4") else (
        2 if "64" in parts or "WIDE" in parts or (op.startswith("LDSM") and parts[-1] == "2")
        else 1)
    return range(int(m.group(1)), int(m.group(1)) + width)


def parse_sass_clobbered_operands(sass: str) -> list[str]:
    """Register A operands of a zero-initialized wgmma chain inside a loop (S = Q @ B^T: Q held in
    registers over the loop) that the innermost such loop overwrites after the chain, with no
    write of them before the chain in the loop body: the next iteration's chain would read the
    overwritten values. One text per such register, e.g. "R180 (HGMMA at 0x3c40, written at
    0x4c90)". This is what ptxas did to `tlx_ws_kv`'s consumers with the det build
    (docs/perf.md), where the PTX keeps the registers apart."""
    insns = []
    for line in sass.splitlines():
        if m := _INSN.match(line):
            operands = [o.strip() for o in m.group(4).split(",") if o.strip()]
            insns.append((int(m.group(1), 16), m.group(3), operands))
    loops = [(int(ops[0], 16), addr) for addr, op, ops in insns
             if op.startswith("BRA") and ops and re.fullmatch(r"0x[0-9a-f]+", ops[0])
             and int(ops[0], 16) < addr]
    found = []
    for i, (addr, op, ops) in enumerate(insns):
        # a chain's first HGMMA zero-initializes its accumulator ("RZ, !UPT"); A in registers
        if not (op.startswith("HGMMA") and "!UPT" in ops and _REG.match(ops[1])):
            continue
        acc, regs, end = ops[0], {}, addr  # the chain: HGMMAs into the same accumulator
        for a2, op2, ops2 in insns[i:]:
            if op2.startswith("HGMMA"):
                if ops2[0] != acc or (a2 != addr and "!UPT" in ops2):
                    break
                if m := _REG.match(ops2[1]):
                    regs.update((r, addr) for r in range(int(m.group(1)), int(m.group(1)) + 4))
                end = a2
        enclosing = [(hi - lo, lo, hi) for lo, hi in loops if lo <= addr <= hi]
        for _, lo, hi in sorted(enclosing)[:1]:  # the innermost loop (not, e.g., the dispatch's)
            before = {r for a2, op2, ops2 in insns if lo <= a2 < addr for r in _writes(op2, ops2)}
            for a2, op2, ops2 in insns:
                if end < a2 <= hi:
                    for r in _writes(op2, ops2):
                        if r in regs and r not in before:
                            found.append(f"R{r} (HGMMA at {addr:#x}, written at {a2:#x})")
                            before.add(r)
    return found


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
_MEASURED: dict[tuple, dict] = {}     # (pass, variant, config key) -> row, this process


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
    key = (v.pass_, v.name, c.key())
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
           pass_: str | None = None) -> list[dict]:
    """Compile every config of the named variants of pass `pass_` (None: every pass; no names: all
    of them) and return one dict per config: pass, variant, config, warps (the config's
    num_warps), total_warps (from the PTX
    .reqntid: warp-specialized kernels add their tasks' warps), num_stages, registers,
    cubin_registers, spill_stores, spill_loads, spill_bytes, stack_bytes, smem_bytes
    (= dynamic + static), smem_dynamic_bytes, smem_static_bytes, cubin_shared, wgmma,
    setmaxnreg (bool), setmaxnreg_values/_inc/_dec, named_barriers (bool), named_barrier_ids,
    ptxas_barriers, ex2_overlap (parse_sass_overlap of the cubin's SASS), notes, error (None
    when it compiled).
    Unknown names (no variant of that name in the pass or passes) raise ValueError."""
    tools = find_tools()
    if tools["ptxas"] is None:
        raise RuntimeError(f"no ptxas in {tool_dir()}")
    variants = registry.all_variants(pass_)
    if variant_names is not None:
        for n in dict.fromkeys(variant_names):
            if not any(v.name == n for v in variants):
                registry.get(n, pass_ or "fwd")  # raises, naming the known variants
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
    ap = argparse.ArgumentParser(
        prog="python -m profiling.resources",
        description="Per-config sm_90a resources of the registered variants (no GPU needed).")
    ap.add_argument("--json", action="store_true",
                    help="print a JSON list of rows instead of a table")
    ap.add_argument("--pass", dest="pass_", choices=[*registry.PASSES, "all"], default="all",
                    help="only the variants of this pass (default: all)")
    ap.add_argument("--variant", action="append", metavar="NAME",
                    help="only this variant (repeatable); default: all registered")
    ap.add_argument("--keep", metavar="DIR",
                    help="keep kernel.ptx, ptxas.log, cubins under DIR/pass/variant/config")
    args = ap.parse_args(argv)
    try:
        rows = report(args.variant, keep=args.keep,
                      pass_=None if args.pass_ == "all" else args.pass_)
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
