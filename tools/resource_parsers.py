"""Parsers of what compiling a config leaves behind (tools.resources): the PTX text, ptxas -v's
log, cuobjdump's -res-usage lines and its SASS. Text in, numbers out: no compiler, no GPU."""
from __future__ import annotations

import math
import re

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
    overwritten values. A register the loop body writes before the HGMMA that reads it is built
    in the loop, step by step (an A operand made per step, as kernels_tlx/triple/apply.py's), not
    held: not reported. One text per such register, e.g. "R180 (HGMMA at 0x3c40, written at
    0x4c90)". This is what ptxas did to `tlx_ws_kv`'s consumers with the det build
    (docs/perf.md), where the PTX keeps the registers apart."""
    insns = []
    for line in sass.splitlines():
        if m := _INSN.match(line):
            operands = [o.strip() for o in m.group(4).split(",") if o.strip()]
            insns.append((int(m.group(1), 16), m.group(3), operands))
    # back edges; those past the last EXIT are a barrier wait's out-of-line retry, which jumps
    # back to the wait before anything after it has run: not a loop over the code between
    exits = [addr for addr, op, _ in insns if op == "EXIT"]
    end_of_code = max(exits) if exits else math.inf
    loops = [(int(ops[0], 16), addr) for addr, op, ops in insns
             if op.startswith("BRA") and ops and re.fullmatch(r"0x[0-9a-f]+", ops[0])
             and int(ops[0], 16) < addr < end_of_code]
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
                    for r in range(int(m.group(1)), int(m.group(1)) + 4):
                        regs.setdefault(r, a2)  # the first HGMMA of the chain reading it
                end = a2
        enclosing = [(hi - lo, lo, hi) for lo, hi in loops if lo <= addr <= hi]
        for _, lo, hi in sorted(enclosing)[:1]:  # the innermost loop (not, e.g., the dispatch's)
            before = {r for r, read in regs.items()
                      if any(r in _writes(op2, ops2) for a2, op2, ops2 in insns if lo <= a2 < read)}
            for a2, op2, ops2 in insns:
                if end < a2 <= hi:
                    for r in _writes(op2, ops2):
                        if r in regs and r not in before:
                            found.append(f"R{r} (HGMMA at {addr:#x}, written at {a2:#x})")
                            before.add(r)
    return found
