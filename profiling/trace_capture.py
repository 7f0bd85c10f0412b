"""Proton traces of the forward kernels captured on a GPU: one instrumented launch per variant,
trimmed to a few CTAs from the middle of the launch and written as a Chrome trace; and the
kernel-level (CUPTI) times. Every launch goes through `simplicial_attn.launcher.run`; what a trace
of a variant holds (warps per CTA, scopes) comes from its registry record."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence

from profiling.common import Shape, make_inputs
from profiling.timing import L2_FLUSH_BYTES
from profiling.trace_summary import (MAX_TRACE_BYTES, WARPS_PER_GROUP, cta_order, kernel_table,
                                     read_trace_file, write_trimmed)
from simplicial_attn import launcher, registry

DEFAULT_CTAS = 8
PASSES = ("fwd",)  # the passes whose variants can be captured (launcher.run: the forward)


def _check_pass(pass_: str) -> None:
    if pass_ not in PASSES:
        raise ValueError(f"only {', '.join(PASSES)} variants can be captured so far, not {pass_}")


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


def _inputs(s: Shape, seed: int) -> tuple:
    """Random inputs of shape `s` on the GPU (profiling.common.make_inputs)."""
    return make_inputs(s.B, s.N, s.Hq, s.Hk, s.D, device="cuda", seed=seed)


def _written_file(folder: str, ext: str) -> str:
    """The file proton wrote into `folder` (a fresh directory): the one ending in `ext`, else the
    only file there."""
    files = sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f)))
    named = [f for f in files if f.endswith(ext)]
    if named or len(files) == 1:
        return os.path.join(folder, (named or files)[0])
    raise RuntimeError(f"proton wrote no {ext} file in {folder} (found: {files})")


def capture(variant: str, s: Shape, out_dir: str, ctas: int = DEFAULT_CTAS,
            warps: str | None = None, seed: int = 0, keep_full: bool = False,
            log=print, pass_: str = "fwd") -> str:
    """Capture one trace of `variant` (of pass `pass_`) on shape `s` and write
    OUT/<variant>.chrome_trace, trimmed to `ctas` CTAs (fewer if it would pass MAX_TRACE_BYTES).
    `warps`: the warps to sample (parse_warps), default the first of every warp group. Returns
    the path."""
    import torch
    import triton.profiler as proton
    from triton.profiler import mode

    _check_pass(pass_)
    total = registry.get(variant, pass_).warps
    inputs = _inputs(s, seed)
    out, lse = launcher.run(*inputs, s.w1, s.w2, variant=variant)  # compile, warm the plain kernel
    torch.cuda.synchronize()
    sampled = parse_warps(warps, total) if warps else default_sampled_warps(total)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    raw_dir = tempfile.mkdtemp(prefix=f"raw-{variant}-", dir=out_dir)
    try:
        proton.start(os.path.join(raw_dir, variant), data="trace", backend="instrumentation",
                     mode=mode.Default(metric_type="cycle", optimizations="clock32,time_shift",
                                       sampling_strategy="selective",
                                       sampling_options=", ".join(map(str, sampled)),
                                       buffer_type="global"))
        try:
            launcher.run(*inputs, s.w1, s.w2, variant=variant, out=out, lse=lse, profile=True)
            torch.cuda.synchronize()
        finally:
            proton.finalize()
        raw_path = _written_file(raw_dir, ".chrome_trace")
        size = os.path.getsize(raw_path)
        trace = read_trace_file(raw_path)
        n_all = len(cta_order(trace["traceEvents"]))
        path = os.path.join(out_dir, f"{variant}.chrome_trace")
        n = write_trimmed(trace, ctas, path)
        log(f"{variant}: {s.short()}, {total} warps/CTA, sampled {', '.join(map(str, sampled))}; "
            f"full trace {n_all} CTAs {size / 1e6:.1f} MB -> kept {n} CTAs "
            f"({os.path.getsize(path) / 1e6:.2f} MB): {path}")
        if n < ctas and n < n_all:
            log(f"{variant}: kept {n} of the {ctas} CTAs asked for, to stay under "
                f"{MAX_TRACE_BYTES / 1e6:.0f} MB")
        if keep_full:
            kept = os.path.join(out_dir, f"{variant}.full.chrome_trace")
            shutil.move(raw_path, kept)
            log(f"{variant}: full trace kept as {kept}")
    finally:
        shutil.rmtree(raw_dir, ignore_errors=True)
    return path


def kernel_level(names: Sequence[str], s: Shape, out_dir: str, reps: int = 5,
                 seed: int = 0, pass_: str = "fwd") -> list[dict]:
    """CUPTI kernel times of each variant (of pass `pass_`) on `s`: `reps` launches per variant,
    each in its own proton scope "<variant>#<i>" with the FLOP count, L2 flushed before each
    launch (as profiling.timing.median_ms does); rows from kernel_table of OUT/kernels.hatchet."""
    import torch
    import triton.profiler as proton

    import simplicial_attn
    _check_pass(pass_)
    inputs = _inputs(s, seed)
    out = lse = None
    for name in names:  # compile outside the session
        out, lse = launcher.run(*inputs, s.w1, s.w2, variant=name, out=out, lse=lse)
    torch.cuda.synchronize()
    flops = float(simplicial_attn.flops(s.B, s.N, s.Hq, s.D, s.w1, s.w2))
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
                        launcher.run(*inputs, s.w1, s.w2, variant=name, out=out, lse=lse)
            torch.cuda.synchronize()
        finally:
            proton.finalize()
        path = os.path.join(out_dir, "kernels.hatchet")
        shutil.move(_written_file(raw_dir, ".hatchet"), path)
    finally:
        shutil.rmtree(raw_dir, ignore_errors=True)
    with open(path) as f:
        rows = kernel_table(json.load(f))
    for r in rows:
        r.update({"pass": pass_, "shape": s.short()})
    return rows
