"""The compiler's warp-specialization dispatch in a TLX kernel's SASS, and whether barrier 1 orders
every access of it (docs/sanitizers.md#the-warp-specialization-dispatch); no GPU needed.

Triton lowers `tlx.async_tasks` (ConvertWarpSpecializeToLLVM) to this protocol: the warps
0 .. DEFAULT-1 run the "default" task; the other warps loop in a dispatch loop. A dispatch byte per
worker warp sits in shared memory at STATE + warp id. The default warp group stores every worker's
partition number there (and the values its tasks capture, e.g. scalars loaded before the tasks, in
a capture area), then `barrier.sync 1`; each worker waits at `barrier.sync 1`, reads its byte,
and runs its partition between two more `barrier.sync 1` (the second orders its reads of the
captures before the default group goes on; the third closes the partition); at the end the default
group stores the exit code into every byte between two `barrier.sync 1`, and the workers read it
after their next `barrier.sync 1` and exit. In SASS a `barrier.sync 1` is `BAR.SYNC.DEFER_BLOCKING
0x1`: no thread count, so every thread of the CTA takes part in each of its generations.

`check(sass)` proves the ordering from the SASS alone, or says what it cannot prove:
1. every use of barrier 1 is a `BAR.SYNC 0x1` without a thread count (nothing arrives on it, no
   smaller count), and no barrier takes its id from a register;
2. the control flow of the default warps (from the kernel's entry, the fall-through of its first
   conditional branch, the role split) and of the worker warps (from that branch's target) is
   walked path by path, predicates of guarded instructions tracked (`@P0 BAR; @P0 BAR; @P0 BRA`
   is all or nothing), counting the barrier-1 generations each path has passed when it touches a
   dispatch byte or a capture: the "interval" of the access (k: after its k-th barrier 1);
3. a full-CTA barrier's generation k needs an arrival of every thread and holds each thread until
   it completes, so every thread's k-th arrival belongs to generation k: a write in interval i and
   a read in interval j by another warp are ordered by generation min(i, j) + 1 whenever i != j.
   The check fails when a write interval of the default warps meets a read interval of the
   workers (same area), when the default warps read or the workers write the area, or when a path
   exits or ends somewhere the protocol does not allow.
What it takes as given (each seen in the SASS of our kernels, docs/sanitizers.md): the first
conditional branch is the role split on the warp id; the compiler's accesses to these bytes are
the STS/LDS with their immediate offsets, and no other access reaches them (Triton's allocator
gives them their own place, apart from every buffer and mbarrier the kernel allocates, all of which
live across the tasks: docs/sanitizers.md shows the layout). It does not look at the 128 default
threads storing the same values to the same bytes in one instruction (a write-write of equals).

    python3 -m tools.ws_dispatch                       # every warp-specialized config + probe
    python3 -m tools.ws_dispatch --pass bwd --variant tlx_ws --listing
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_GUARD = re.compile(r"^@(!?U?P[0-9T])\s+")
_SHARED = re.compile(r"^(STS|LDS)(\.[\w.]+)?\s[^\[]*\[([^\]]*)\]")
_WIDTH = {None: 4, ".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2, ".64": 8, ".128": 16}
_BAR1 = re.compile(r"^BAR\.SYNC(\.DEFER_BLOCKING)? 0x1$")
_ANY_BAR = re.compile(r"^BAR\.(SYNC|ARV|RED|SCAN)\S*\s+(\S+?)(,|$)")
_BRANCH = re.compile(r"^BRA(\.[\w.]+)?\s+(0x[0-9a-f]+)$")
_PRED_OPERAND = re.compile(r"^!?U?P[0-9T]$")
MAX_INTERVAL = 32   # a path past this many barrier-1 generations: a barrier inside a loop


@dataclass(frozen=True)
class Instr:
    off: int
    guard: str | None    # "P0", "!UP1", or None
    op: str              # the instruction without its guard

    def text(self) -> str:
        return f"@{self.guard} {self.op}" if self.guard else self.op


@dataclass
class Dispatch:
    """What `check` found in one kernel's SASS."""

    state: int                          # a worker warp's byte is at shared STATE + warp id
    state_bytes: set[int]               # the bytes the default warps store there
    captures: set[int]                  # bytes the default warps store before its first barrier 1
    split: int                          # offset of the role split (first conditional branch)
    # (role, kind, area) -> intervals, e.g. ("default", "STS", "state") -> {0, 3}
    intervals: dict[tuple[str, str, str], set[int]] = field(default_factory=dict)
    # the instructions behind each (role, kind, area, interval)
    where: dict[tuple[str, str, str, int], set[int]] = field(default_factory=dict)
    exits: dict[str, set[int]] = field(default_factory=dict)   # role -> intervals at EXIT
    problems: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, list[int]]:
        """Readable intervals, e.g. {"default STS state": [0, 3], "worker LDS state": [1, 4]}."""
        return {" ".join(k): sorted(v) for k, v in sorted(self.intervals.items())}


def instructions(sass: str) -> list[Instr]:
    """The instructions of one kernel's `cuobjdump -sass` listing (the first function in it)."""
    out = []
    for line in sass.splitlines():
        m = _INSTR.search(line)
        if not m:
            if out and line.strip().startswith("Function :"):
                break
            continue
        text = m.group(2).strip()
        g = _GUARD.match(text)
        out.append(Instr(int(m.group(1), 16), g.group(1) if g else None,
                         text[g.end():] if g else text))
    return out


def shared_access(op: str) -> tuple[str, int, int] | None:
    """(STS or LDS, immediate offset (0 without one), bytes) of a plain shared store or load;
    None for anything else (LDSM/STSM, wgmma, TMA, mbarrier operations)."""
    m = _SHARED.match(op)
    if m is None:
        return None
    imm = re.search(r"0x([0-9a-f]+)", m.group(3))
    return m.group(1), int(imm.group(1), 16) if imm else 0, _WIDTH.get(m.group(2), 4)


STATE_LOAD_WINDOW = 4  # the workers' LDS.U8 of their byte: this many instructions after the barrier


def _state_offset(ins: list[Instr]) -> int:
    """The dispatch bytes' offset: that of the first unguarded LDS.U8 within STATE_LOAD_WINDOW
    instructions after an unguarded BAR.SYNC 0x1 (the loop head; ptxas may schedule the address
    arithmetic between them)."""
    for i, bar in enumerate(ins):
        if not (_BAR1.match(bar.op) and bar.guard is None):
            continue
        for cur in ins[i + 1:i + 1 + STATE_LOAD_WINDOW]:
            if cur.op.startswith("LDS.U8") and cur.guard is None:
                return shared_access(cur.op)[1]
    raise ValueError(f"no LDS.U8 within {STATE_LOAD_WINDOW} instructions after a BAR.SYNC 0x1: "
                     "not a warp-specialized kernel?")


def _pred_touched(op: str) -> set[str]:
    """The predicate registers an instruction may write, over-approximated as every predicate among
    its operands (ISETP P0, PT, ...; PLOP3.LUT; USETMAXREG.TRY_ALLOC UP0; ELECT; a carry-out of
    IADD3; ...), or all of them for R2P/UR2UP. Forgetting a predicate only adds paths to the walk."""
    name, _, rest = op.partition(" ")
    if name.startswith(("R2P", "UR2UP")):
        return {"*"}
    if name.startswith("BRA"):
        return set()
    return {t.lstrip("!") for t in re.split(r"[\s,\[\]+]+", rest)
            if _PRED_OPERAND.match(t) and t.lstrip("!") not in ("PT", "UPT")}


def indirect_targets(elf: str) -> dict[int, list[int]]:
    """{offset of a BRX: its targets} from `cuobjdump -elf` (EIATTR_INDIRECT_BRANCH_TARGETS): the
    jump table a switch over 3 or more partitions compiles to."""
    out = {}
    for m in re.finditer(r"Offset of Indirect Branch:\s*(0x[0-9a-f]+).*?Targets:\s*((?:0x[0-9a-f]+"
                         r"\s*)+)", elf, re.DOTALL):
        out[int(m.group(1), 16)] = [int(t, 16) for t in m.group(2).split()]
    return out


def check(sass: str, indirect: dict[int, list[int]] | None = None) -> Dispatch:
    """Walk the default and worker warps' paths through the dispatch (module docstring);
    `indirect`: the targets of each BRX (indirect_targets)."""
    indirect = indirect or {}
    ins = instructions(sass)
    at = {x.off: i for i, x in enumerate(ins)}
    state = _state_offset(ins)
    state_bytes, captures = set(), set()
    first_bar = next(x.off for x in ins if _BAR1.match(x.op))
    for x in ins:
        a = shared_access(x.op)
        if a and a[0] == "STS" and state < a[1] < state + 32:
            state_bytes.update(range(a[1], a[1] + a[2]))
    for x in ins:
        a = shared_access(x.op)
        if a and a[0] == "STS" and x.off < first_bar:
            bytes_ = set(range(a[1], a[1] + a[2]))
            if not bytes_ & state_bytes:
                captures |= bytes_
    split_i = next((i for i, x in enumerate(ins) if x.guard and _BRANCH.match(x.op)), None)
    if split_i is None:
        raise ValueError("no conditional branch: no role split")
    split = ins[split_i]
    d = Dispatch(state, state_bytes, captures, split.off)

    for x in ins:  # 1. barrier 1 is always a full-CTA bar.sync
        m = _ANY_BAR.match(x.op)
        if m is None:
            continue
        bar_id = m.group(2)
        if m.group(1) == "RED":  # BAR.RED.POPC Rd, id, ...: the id is the second operand
            ops = x.op.split(None, 1)[1].split(",")
            bar_id = ops[1].strip() if len(ops) > 1 else bar_id
        if not re.fullmatch(r"0x[0-9a-f]+", bar_id):
            d.problems.append(f"/*{x.off:04x}*/ {x.text()}: barrier id from a register")
        elif int(bar_id, 16) == 1 and not _BAR1.match(x.op):
            d.problems.append(f"/*{x.off:04x}*/ {x.text()}: barrier 1 not as a full-CTA "
                              "BAR.SYNC")
    for x in ins:
        name = x.op.split()[0]
        if (name.startswith(("CALL", "RET", "JMX")) or (name.startswith("BRX")
                                                        and x.off not in indirect)):
            d.problems.append(f"/*{x.off:04x}*/ {x.text()}: control flow not walked")

    def area(x: Instr) -> tuple[str, str] | None:
        a = shared_access(x.op)
        if a is None:
            return None
        bytes_ = set(range(a[1], a[1] + a[2]))
        if a[0] == "LDS" and a[1] == state and a[2] == 1:
            return "LDS", "state"           # the dispatch read: state + warp id
        if bytes_ & state_bytes:
            return a[0], "state"
        if bytes_ & captures:
            return a[0], "captures"
        return None

    # 2. paths; a walker's state: (index, interval, assumed predicates). A predicate value is
    # assumed where a guarded barrier 1, EXIT or dispatch access splits the walk, and used by
    # later guards and branches until an instruction may rewrite it; other guarded branches split
    # the walk without assuming anything (more paths than the warps can take: sound).
    def walk(role: str, start: int, first_guard: tuple[str, bool], cap: int | None = None):
        todo, seen = [(start, 0, frozenset([first_guard]))], set()
        while todo:
            item = todo.pop()
            if item in seen:
                continue
            seen.add(item)
            i, k, assumed = item
            if i >= len(ins):
                d.problems.append(f"{role} warps run past the end of the code")
                continue
            x = ins[i]
            acc = area(x)
            relevant = bool(_BAR1.match(x.op) or x.op == "EXIT" or acc)
            branch = _BRANCH.match(x.op)
            known = dict(assumed)
            runs, record = [True], False
            if x.guard:
                p, want = x.guard.lstrip("!"), not x.guard.startswith("!")
                if p in ("PT", "UPT"):
                    runs = [want]
                elif p in known:
                    runs = [known[p] == want]
                elif relevant or branch:
                    runs, record = [True, False], relevant
            for run in runs:
                a2 = dict(known)
                if record:
                    a2[x.guard.lstrip("!")] = run == (not x.guard.startswith("!"))
                k2, targets = k, [i + 1]
                if run:
                    touched = _pred_touched(x.op)
                    a2 = {} if "*" in touched else {q: v for q, v in a2.items()
                                                    if q not in touched}
                    if acc is not None:
                        key = (role, acc[0], acc[1])
                        d.intervals.setdefault(key, set()).add(k)
                        d.where.setdefault((*key, k), set()).add(x.off)
                    if _BAR1.match(x.op):
                        k2 = k + 1 if cap is None else min(k + 1, cap)
                        if k2 > MAX_INTERVAL:
                            d.problems.append(f"/*{x.off:04x}*/ {role} warps pass more than "
                                              f"{MAX_INTERVAL} barrier-1 generations (a barrier "
                                              "1 in a loop?)")
                            continue
                    if x.op == "EXIT":
                        targets = []
                        d.exits.setdefault(role, set()).add(k)
                    elif x.op.startswith("BRX"):
                        targets = [at[t] for t in indirect.get(x.off, ()) if t in at]
                    elif branch:
                        t = int(branch.group(2), 16)
                        if t not in at:
                            d.problems.append(f"/*{x.off:04x}*/ branch to 0x{t:x}: no such "
                                              "instruction")
                            targets = []
                        else:
                            targets = [at[t]]
                todo.extend((t, k2, frozenset(a2.items())) for t in targets)

    g = split.guard
    p, neg = g.lstrip("!"), g.startswith("!")
    walk("default", split_i + 1, (p, neg))          # the fall-through: the guard is false
    # The default warps pass at most `last` generations. A worker's count is capped there:
    # interval `last` stands for "after generation `last` or later", which is after every write
    # of the default warps unless they write after their own last barrier 1 (then the sets meet).
    if not d.exits.get("default"):
        d.problems.append("the default warps never reach an EXIT")
    last = max(d.exits.get("default", {0}))
    walk("worker", at[int(_BRANCH.match(split.op).group(2), 16)], (p, not neg), cap=last)

    # 3. roles and intervals
    for kind, role in (("LDS", "default"), ("STS", "worker")):
        for ar in ("state", "captures"):
            for k in sorted(d.intervals.get((role, kind, ar), ())):
                offs = ", ".join(f"0x{o:04x}" for o in sorted(d.where[(role, kind, ar, k)]))
                d.problems.append(f"{role} warps {'read' if kind == 'LDS' else 'write'} the "
                                  f"{ar} (at {offs}): not the protocol")
    for ar in ("state", "captures"):
        writes = d.intervals.get(("default", "STS", ar), set())
        reads = d.intervals.get(("worker", "LDS", ar), set())
        for k in sorted(writes & reads):
            w = ", ".join(f"0x{o:04x}" for o in sorted(d.where[("default", "STS", ar, k)]))
            r = ", ".join(f"0x{o:04x}" for o in sorted(d.where[("worker", "LDS", ar, k)]))
            d.problems.append(f"{ar}: a write (at {w}) and a read (at {r}) both after barrier-1 "
                              f"generation {k} and before {k + 1}: no barrier orders them")
    if not d.intervals.get(("default", "STS", "state")):
        d.problems.append("the default warps never write the dispatch bytes")
    if not d.intervals.get(("worker", "LDS", "state")):
        d.problems.append("the worker warps never read their dispatch byte")
    return d


def listing(sass: str, indirect: dict[int, list[int]] | None = None) -> list[str]:
    """The protocol's instructions in listing order, each access with the intervals `check` found:
    every barrier-1 BAR.SYNC, BAR.ARV/RED (any id), USETMAXREG, EXIT, store or load of the
    dispatch bytes and captures, and the branches among them (the role split, unconditional
    branches, and conditional ones up to 4 instructions after one of the others; the branches
    inside the tasks' own code are left out)."""
    d = check(sass, indirect)
    rev: dict[int, list[str]] = {}
    for (role, kind, ar, k), offs in d.where.items():
        for o in offs:
            rev.setdefault(o, []).append(f"{role} {ar}, interval {k}")
    out, since = [], 99
    for x in instructions(sass):
        since += 1
        touches = shared_access(x.op) is not None and x.off in rev
        core = (_BAR1.match(x.op) or re.match(r"BAR\.(ARV|RED)", x.op) or touches
                or re.match(r"(USETMAXREG|EXIT)\b", x.op))
        branch = ((_BRANCH.match(x.op) and not x.op.startswith("BRA.U.ANY"))
                  or x.op.startswith("BRX"))
        if core:
            since = 0
        if core or (branch and (x.guard is None or since <= 4 or x.off == d.split)):
            note = f"   <- {'; '.join(sorted(rev[x.off]))}" if touches else ""
            out.append(f"/*{x.off:04x}*/ {x.text()}{note}")
    return out


# ---------------------------------------------------------------------------------------------
# Compiled kernels (sm_90a, the wheel's cuobjdump)


def compiled_sass(config) -> tuple[str, dict[int, list[int]]]:
    """The SASS of one registry.CompileConfig and its indirect branch targets (tools.resources
    compiles it once per process)."""
    from tools import resources
    k = resources.compile_config(config)
    tool = resources.find_tools()["cuobjdump"]
    if tool is None:
        raise RuntimeError(f"no cuobjdump in {resources.tool_dir()}")
    with tempfile.TemporaryDirectory(prefix="ws-dispatch-") as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        sass, elf = (subprocess.run([str(tool), flag, path], capture_output=True, text=True,
                                    check=True).stdout for flag in ("-sass", "-elf"))
        return sass, indirect_targets(elf)


def warp_specialized_configs(pass_: str | None = None, names: Sequence[str] | None = None, *,
                             family: str):
    """(label, CompileConfig) of every compile config whose kernel uses tlx.async_tasks (the
    probe's first), of the variants named (default: all) of the pass (default: both) of
    `family`."""
    from tools import ws_probe
    from altattn import registry
    out = [("probe ws_probe", ws_probe.compile_config())] if pass_ in (None, "probe") else []
    if pass_ == "probe":
        return out
    for v, c in registry.compile_configs(pass_, family):
        if names and v.name not in names:
            continue
        import inspect
        src = inspect.getsource(c.fn.fn if hasattr(c.fn, "fn") else c.fn)
        if "async_tasks" in src:
            out.append((f"{v.pass_} {v.name} {c.name}", c))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from profiling.common import add_family_arg
    p = argparse.ArgumentParser(prog="python3 -m tools.ws_dispatch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--pass", dest="pass_", choices=["fwd", "bwd", "probe"],
                   help="only this pass's configs (probe: only the probe)")
    p.add_argument("--variant", action="append", metavar="NAME", help="only this variant")
    p.add_argument("--listing", action="store_true", help="print each kernel's protocol listing")
    add_family_arg(p)
    args = p.parse_args(argv)
    bad = 0
    for label, c in warp_specialized_configs(args.pass_, args.variant, family=args.family):
        sass, indirect = compiled_sass(c)
        d = check(sass, indirect)
        verdict = "ordered" if not d.problems else "NOT PROVEN"
        print(f"{label}: {verdict}; bytes at shared 0x{d.state:x} + warp, written "
              f"0x{min(d.state_bytes):x}..0x{max(d.state_bytes):x}"
              + (f", captures 0x{min(d.captures):x}..0x{max(d.captures):x}" if d.captures
                 else "") + f"; intervals {d.summary()}")
        for prob in d.problems:
            print(f"  problem: {prob}")
        if args.listing:
            for line in listing(sass, indirect):
                print(f"  {line}")
        bad += bool(d.problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
