"""The call path's Python glue alone, on any machine (no GPU): microseconds per call of every
family's op and `forward` with CPU tensors that pretend to be on cuda:0, the kernels' launches
replaced by a no-op and `torch.empty` by a lookup of one preallocated tensor per shape.

    python -m bench.glue [--calls 1000] [--rounds 20] [--profile 20]

Two columns: "replayed", a signature seen before (launcher.remembered: one key, one lookup, the
allocations, the launch, the result), and "whole", every call run through all of the path (the
remembered lookup switched off: what every call was before it), alternating round by round.
What it leaves out is what bench.overhead adds on a GPU host: the launches (the C dispatcher,
the TMA descriptors), the allocations, and the CUDA runtime's own calls. The pretence costs a
little itself (a Python property for `Tensor.device` and `is_cuda`, the `torch.empty` stub), in
both columns: compare this module's numbers only with each other, on one host.
docs/perf-call.md has what each piece costs on a GPU host.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

from bench.overhead import N, print_profile

CUDA = torch.device("cuda", 0)


@contextlib.contextmanager
def pretend_cuda(stub: bool = True):
    """CPU tensors that say they are on cuda:0 (an sm_90 GPU). stub: launches are no-ops and
    `torch.empty` hands out one preallocated tensor per (shape, dtype) (the glue alone); else
    the plans' launches run (a CPU family's, tests) and `torch.empty` allocates on the CPU."""
    from altattn import launcher
    from kernels_triton import launch

    made: dict = {}
    real_empty = torch.empty

    def empty(*shape, dtype=None, device=None, **kw):
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        if not stub:
            return real_empty(shape, dtype=dtype, **kw)
        key = (shape, dtype)
        if key not in made:
            made[key] = real_empty(shape, dtype=dtype, **kw)
        return made[key]

    def no_op(*args, **kwargs):
        return None

    with patching() as patch:
        patch(torch.Tensor, "device", property(lambda self: CUDA))
        patch(torch.Tensor, "is_cuda", property(lambda self: True))
        patch(torch, "empty", empty)
        patch(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        patch(torch.cuda, "device", lambda device: contextlib.nullcontext())
        patch(launcher, "_current_device", lambda: 0)
        if hasattr(launcher, "_raw_device"):  # a remembered call's device check
            patch(launcher, "_raw_device", lambda: 0)
        if stub:
            patch(launcher, "_prepared", lambda module, spec, profile: no_op)
        patch(launch, "_get_device", lambda: 0)
        launcher.clear_plans()
        try:
            yield
        finally:
            launcher.clear_plans()


@contextlib.contextmanager
def patching():
    """patch(owner, name, value): setattr now, the old value back on exit."""
    undo = []

    def patch(owner, name, value):
        undo.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, value)
    try:
        yield patch
    finally:
        for owner, name, old in reversed(undo):
            if old is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


_ABSENT = object()


def calls() -> dict[str, callable]:
    """{name: fn}: each family's op (no grad; with grad: the forward, and spherical's forward
    and backward) and `forward`."""
    import altattn
    from altattn import simplicial, spherical, triple

    def x(*shape, grad=False):
        return torch.randn(*shape).to(torch.bfloat16).requires_grad_(grad)
    q, k, v = (x(1, N, 2, 64) for _ in range(3))
    qg, kg, vg = (x(1, N, 2, 64, grad=True) for _ in range(3))
    do = x(1, N, 2, 64)
    q5, kv = x(1, N, 64, 128), [x(1, N, 1, 128) for _ in range(4)]
    t5, t5g = [x(1, N, 2, 64) for _ in range(5)], [x(1, N, 2, 64, grad=True) for _ in range(5)]
    return {
        "spherical op fwd": lambda: altattn.spherical_attention(q, k, v),
        "spherical op fwd (grad)": lambda: altattn.spherical_attention(qg, kg, vg),
        "spherical forward": lambda: spherical.forward(q, k, v),
        "spherical op fwd+bwd (grad)":
            lambda: altattn.spherical_attention(qg, kg, vg)[0].backward(do),
        "2-simplicial op fwd": lambda: altattn.simplicial_attention(q5, *kv, 32, 256),
        "2-simplicial forward": lambda: simplicial.forward(q5, *kv, 32, 256),
        "triple op fwd": lambda: altattn.triple_attention(*t5),
        "triple op fwd (grad)": lambda: altattn.triple_attention(*t5g),
        "triple forward": lambda: triple.forward(*t5),
    }


def glue_us(fn, calls: int, rounds: int = 20) -> tuple[float, float]:
    """Microseconds of this process's CPU time per call (CPU time, not wall time: other
    processes on a shared host stretch the wall time), the best of `rounds` rounds of `calls`
    calls: (remembered calls replayed, every call run whole). The two alternate round by
    round, so a busy spell of the host weighs on both."""
    from altattn import launcher

    signature = launcher.signature
    best = [float("inf"), float("inf")]
    for r in range(2 * rounds + 2):
        whole = r % 2
        launcher.signature = (lambda args, kwargs: None) if whole else signature
        try:
            t0 = time.process_time()
            for _ in range(calls):
                fn()
            if r >= 2:  # the first two: warm-up
                best[whole] = min(best[whole], (time.process_time() - t0) / calls * 1e6)
        finally:
            launcher.signature = signature
    return best[0], best[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.glue", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=1000, help="calls per round (default: 1000)")
    p.add_argument("--rounds", type=int, default=20, help="rounds of each (default: 20)")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="also print the K functions with the most own time of each call")
    a = p.parse_args(argv)
    print(f"{'call':28s} {'replayed':>9s} {'whole':>9s}  (us of glue a call, best of "
          f"{a.rounds} rounds of {a.calls})")
    with pretend_cuda():
        for name, fn in calls().items():
            grad = "(grad)" in name
            with torch.enable_grad() if grad else torch.no_grad():
                fast, whole = glue_us(fn, a.calls, a.rounds)
                print(f"{name:28s} {fast:9.2f} {whole:9.2f}")
                if a.profile:
                    print_profile(name, fn, a.calls, a.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
