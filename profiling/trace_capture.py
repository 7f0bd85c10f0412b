"""Proton traces of the forward and backward kernels captured on a GPU: one instrumented call
per variant, trimmed to a few CTAs from the middle of each kernel's launch and written as a
Chrome trace; and the kernel-level (CUPTI) times. Every call goes through `launcher.run` of the
variant's family, on the inputs its record makes (Family.make_inputs); what a trace of a variant
holds (its scoped kernels and their warps, its scopes) comes from its registry record."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence

from altattn import launcher, registry
from profiling.timing import L2_FLUSH_BYTES
from profiling.trace_kernels import kernel_breakdown, kernel_table
from profiling.trace_summary import (MAX_TRACE_BYTES, WARPS_PER_GROUP, ctas_per_kernel,
                                     read_trace_file, write_trimmed)

DEFAULT_CTAS = 8
# Proton keeps each sampled warp's events in a circular buffer of its CTA's share of the profile
# buffer (8 bytes an event at 32-bit clocks) and says on stderr when the first ones were
# overwritten; a capture that lost events is made again once with a buffer that holds them all
# (buffer_for), within what a trace file holds and this, the whole grid's buffers (GPU memory)
MAX_PROFILE_BYTES = 16 << 30
EVENT_BYTES = 8
JSON_EVENT_BYTES = 512  # an event in the written trace (340-380 bytes measured), rounded up
_DROPPED = re.compile(r"first (\d+) events are dropped due to insufficient buffer size "
                      r"\((\d+)/(\d+)\)")
PASSES = ("fwd", "bwd")  # the passes whose variants can be captured (launcher.run)


def _check_pass(pass_: str) -> None:
    if pass_ not in PASSES:
        raise ValueError(f"only {', '.join(PASSES)} variants can be captured so far, not {pass_}")


def trace_name(variant: str, pass_: str) -> str:
    """File stem of a capture: the variant's name, with "_bwd" for the backward (both passes
    have a `triton` and a `tlx_ws`)."""
    return variant if pass_ == "fwd" else f"{variant}_{pass_}"


def default_sampled_warps(total: int) -> list[int]:
    """The first warp of every warp group: 0, 4, 8, ... below `total`."""
    return list(range(0, total, WARPS_PER_GROUP))


def parse_warps(text: str, total: int) -> list[int]:
    """'all', or a comma-separated list of warp ids below `total` -> sorted ids."""
    if text.strip() == "all":
        return list(range(total))
    try:
        ws = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        raise ValueError(f"--warps {text!r}: give 'all' or a list like 0,4,8") from None
    bad = [w for w in ws if not 0 <= w < total]
    if not ws or bad:
        raise ValueError(f"--warps {text!r}: the kernel has warps 0-{total - 1}")
    return ws


def _written_file(folder: str, ext: str) -> str:
    """The file proton wrote into `folder` (a fresh directory): the one ending in `ext`, else the
    only file there."""
    files = sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f)))
    named = [f for f in files if f.endswith(ext)]
    if named or len(files) == 1:
        return os.path.join(folder, (named or files)[0])
    raise RuntimeError(f"proton wrote no {ext} file in {folder} (found: {files})")


@contextlib.contextmanager
def one_buffer_per_kernel() -> Iterator[None]:
    """Within it, Proton's instrumentation hook forgets a kernel's profile buffer when the kernel
    returns. The hook keeps the buffer of the last instrumented kernel and hands it to the parser
    at the exit of every later launch of the session; for a kernel without scopes (the backward's
    row-owner and reduce after its traced k-owner) the parser then divides by that kernel's zero
    scratch size and checks the sampled warps against its warp count. An instrumented kernel gets
    a fresh buffer from Proton's allocator before it starts. Exit hooks run last-added first, so
    this one, first in the chain, runs after Proton's has read the buffer."""
    from triton import knobs
    from triton.profiler.hooks.hook import HookManager
    from triton.profiler.hooks.instrumentation import InstrumentationHook

    def forget(metadata) -> None:
        for hook in HookManager.active_hooks:
            if isinstance(hook, InstrumentationHook):
                hook.buffer = None

    knobs.runtime.launch_exit_hook.calls.insert(0, forget)
    try:
        yield
    finally:
        knobs.runtime.launch_exit_hook.remove(forget)


@contextlib.contextmanager
def stderr_lines(lines: list[str], path: str | None = None) -> Iterator[None]:
    """Within it, what the process writes to file descriptor 2 (Proton's C++ messages too) goes
    to `path` (default: a temporary file; a process that dies meanwhile leaves it there), then to
    stderr as well, and its lines are appended to `lines`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with (open(path, "w+b") if path else tempfile.TemporaryFile(mode="w+b")) as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            sys.stderr.write(text)
            lines.extend(text.splitlines())


def dropped_events(lines: Sequence[str]) -> tuple[int, int] | None:
    """(events a warp's buffer held, most events a warp wrote) from Proton's "events are
    dropped" messages among `lines`, or None when no event was lost."""
    found = [(int(m[2]), int(m[3])) for m in map(_DROPPED.search, lines) if m]
    return (min(c for c, _ in found), max(n for _, n in found)) if found else None


def buffer_for(dropped: tuple[int, int], warps: int, ctas: int) -> int | None:
    """Bytes of profile buffer per CTA for `warps` sampled warps (Proton splits it into one
    segment a warp, each a power of two): room for every event the busiest warp wrote, as far as
    one CTA's events stay under MAX_TRACE_BYTES in the written trace (JSON_EVENT_BYTES an event)
    and the grid's `ctas` buffers under MAX_PROFILE_BYTES. None when that holds no more than the
    buffer that lost them (`dropped`: (held, written) events a warp)."""
    held, written = dropped
    cap = MAX_TRACE_BYTES // (JSON_EVENT_BYTES * warps)  # events a warp of one kept CTA
    per_warp = 1 << (min(written, cap) * EVENT_BYTES - 1).bit_length()
    if written > cap:  # the largest power of two under the cap
        per_warp //= 2
    while per_warp * warps * ctas > MAX_PROFILE_BYTES:
        per_warp //= 2
    return per_warp * warps if per_warp // EVENT_BYTES > held else None


def pass_inputs(pass_: str, s, seed: int, family: str) -> tuple:
    """One call's arguments of pass `pass_` on shape `s`, on the GPU (the family's make_inputs)."""
    return registry.get_family(family).make_inputs(s, pass_, seed=seed, device="cuda")


def run_pass(pass_: str, variant: str, inputs, family: str,
             profile: bool | str = False) -> tuple:
    """One call of `variant` of (family, pass_) on `inputs` (launcher.run)."""
    return launcher.run(family, pass_, *inputs, variant=variant, profile=profile)


def sampled_warps(variant: str, s, pass_: str = "fwd", warps: str | None = None, *,
                  family: str) -> list[tuple[bool | str, int, list[int]]]:
    """(launch's `profile` argument, warps per CTA, warps to sample) per capture session of
    `variant` on `s`: one per scoped kernel (registry.Variant.profiled_kernels), each sampling
    `warps` (parse_warps), default the first warp of every warp group of that kernel. ValueError
    when `warps` names a warp that one of the kernels lacks (Proton would refuse it)."""
    _check_pass(pass_)
    out = []
    for profile, total in registry.get(variant, pass_, family).profiled_kernels(s.spec()).items():
        try:
            sampled = parse_warps(warps, total) if warps else default_sampled_warps(total)
        except ValueError as e:
            kernel = "" if profile is True else f"its kernel {profile!r}: "
            raise ValueError(f"{variant} ({pass_}): {kernel}{e}") from None
        out.append((profile, total, sampled))
    return out


def _session(path: str, sampled: list[int], buffer_size: int, run) -> list[str]:
    """One Proton instrumentation session around `run()`, sampling warps `sampled` with
    `buffer_size` bytes of profile buffer per CTA (0: Proton's default); returns the stderr
    lines written meanwhile."""
    import torch
    import triton.profiler as proton
    from triton.profiler import mode

    lines: list[str] = []
    with stderr_lines(lines, os.path.dirname(path) + ".stderr"):  # beside the session's folder
        proton.start(path, data="trace", backend="instrumentation",
                     mode=mode.Default(metric_type="cycle", optimizations="clock32,time_shift",
                                       sampling_strategy="selective",
                                       sampling_options=", ".join(map(str, sampled)),
                                       buffer_type="global", buffer_size=buffer_size))
        try:
            with one_buffer_per_kernel():
                run()
                torch.cuda.synchronize()
        finally:
            proton.finalize()
    return lines


def capture(variant: str, s, out_dir: str, ctas: int = DEFAULT_CTAS,
            warps: str | None = None, seed: int = 0, keep_full: bool = False,
            log=print, pass_: str = "fwd", *, family: str, buffer_size: int | None = None) -> str:
    """Capture one trace of `variant` (of pass `pass_`) on shape `s` and write
    OUT/<trace_name>.chrome_trace, trimmed to `ctas` CTAs per kernel (fewer if it would pass
    MAX_TRACE_BYTES). One Proton session per scoped kernel (sampled_warps: its own warps); their
    events are merged into one file, a kernel per "cat". buffer_size: bytes of profile buffer
    per CTA; None: Proton's default, and a session whose warps lost events is captured again
    with a buffer that holds them all (buffer_for), or says why it was not. Returns the path."""
    import torch

    sessions = sampled_warps(variant, s, pass_, warps, family=family)
    name = trace_name(variant, pass_)
    inputs = pass_inputs(pass_, s, seed, family)
    run_pass(pass_, variant, inputs, family)  # compile and warm the plain kernels
    torch.cuda.synchronize()
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    raw_dir = tempfile.mkdtemp(prefix=f"raw-{name}-", dir=out_dir)
    merged: dict | None = None
    try:
        for i, (profile, total, sampled) in enumerate(sessions):
            def run(profile=profile) -> None:
                run_pass(pass_, variant, inputs, family, profile=profile)

            session_dir = os.path.join(raw_dir, str(i))
            os.makedirs(session_dir)
            lost = dropped_events(_session(os.path.join(session_dir, name), sampled,
                                           buffer_size or 0, run))
            trace = read_trace_file(_written_file(session_dir, ".chrome_trace"))
            if lost and buffer_size is None:
                n_ctas = max(map(len, ctas_per_kernel(trace["traceEvents"]).values()), default=1)
                bigger = buffer_for(lost, len(sampled), n_ctas)
                if bigger is None:
                    log(f"{name}: a warp wrote {lost[1]} events, its buffer held {lost[0]}; a "
                        f"bigger one would pass a trace file's {MAX_TRACE_BYTES // 10**6} MB or "
                        f"the grid's {MAX_PROFILE_BYTES >> 30} GiB (--buffer-size BYTES sets it)")
                else:
                    log(f"{name}: a warp wrote {lost[1]} events, its buffer held {lost[0]}: "
                        f"captured again with {bigger} bytes per CTA")
                    shutil.rmtree(session_dir)
                    os.makedirs(session_dir)
                    lost = dropped_events(_session(os.path.join(session_dir, name), sampled,
                                                   bigger, run))
                    trace = read_trace_file(_written_file(session_dir, ".chrome_trace"))
            if lost:
                log(f"warning: {name}: events lost (a warp wrote {lost[1]}, its buffer held "
                    f"{lost[0]}); the trace holds each warp's last ones")
            raw_path = _written_file(session_dir, ".chrome_trace")
            size = os.path.getsize(raw_path)
            for kernel, pids in ctas_per_kernel(trace["traceEvents"]).items():
                log(f"{name}: {kernel} on {s.short()}, {total} warps/CTA, sampled "
                    f"{', '.join(map(str, sampled))}; full trace {len(pids)} CTAs "
                    f"{size / 1e6:.1f} MB")
            if keep_full:
                kernel = "" if profile is True else f".{profile}"
                kept = os.path.join(out_dir, f"{name}{kernel}.full.chrome_trace")
                shutil.move(raw_path, kept)
                log(f"{name}: full trace kept as {kept}")
            if merged is None:
                merged = trace
            else:
                merged["traceEvents"] += trace["traceEvents"]
        path = os.path.join(out_dir, f"{name}.chrome_trace")
        n = write_trimmed(merged, ctas, path)
        log(f"{name}: kept {n} CTAs per kernel ({os.path.getsize(path) / 1e6:.2f} MB): {path}")
        n_all = max(map(len, ctas_per_kernel(merged["traceEvents"]).values()), default=0)
        if n < ctas and n < n_all:
            log(f"{name}: kept {n} of the {ctas} CTAs asked for, to stay under "
                f"{MAX_TRACE_BYTES / 1e6:.0f} MB")
    finally:
        shutil.rmtree(raw_dir, ignore_errors=True)
    return path


def kernel_level(names: Sequence[str], s, out_dir: str, reps: int = 5, seed: int = 0,
                 pass_: str = "fwd", *, family: str
                 ) -> tuple[list[dict], list[dict]]:
    """CUPTI kernel times of each variant (of pass `pass_`) on `s`: `reps` calls per variant,
    each in its own proton scope "<variant>#<i>" with the call's useful FLOPs (Family.flops), L2
    flushed before each call (as profiling.timing.median_ms does). Returns the rows of
    kernel_table and of kernel_breakdown (time per kernel of a call) of OUT/kernels.hatchet."""
    import torch
    import triton.profiler as proton

    _check_pass(pass_)
    inputs = pass_inputs(pass_, s, seed, family)
    for name in names:  # compile outside the session
        run_pass(pass_, name, inputs, family)
    torch.cuda.synchronize()
    flops = registry.get_family(family).flops(s, pass_)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    raw_dir = tempfile.mkdtemp(prefix="raw-kernels-", dir=out_dir)
    try:
        proton.start(os.path.join(raw_dir, "kernels"), backend="cupti")
        try:
            for name in names:
                for i in range(reps):
                    flush.zero_()
                    with proton.scope(f"{name}#{i}", metrics={"flops": flops}):
                        run_pass(pass_, name, inputs, family)
            torch.cuda.synchronize()
        finally:
            proton.finalize()
        path = os.path.join(out_dir, "kernels.hatchet")
        shutil.move(_written_file(raw_dir, ".hatchet"), path)
    finally:
        shutil.rmtree(raw_dir, ignore_errors=True)
    with open(path) as f:
        hatchet = json.load(f)
    rows = kernel_table(hatchet)
    for r in rows:
        r.update({"pass": pass_, "shape": s.short()})
    return rows, kernel_breakdown(hatchet)
