"""The call path on the GPU, every family: the eager op (plans, no torch.library round trip), CUDA
graphs, and the gradients of unused outputs.

  * the op's forward and backward captured in a CUDA graph and replayed on new inputs (copied
    into the captured ones) give what the eager op gives on them: bitwise, deterministic variants;
  * the op without grad (the forward plan alone) equals the op with grad (the autograd.Function);
  * an unused output's gradient (None, never materialised) gives the gradients that an explicit
    zero gradient gives;
  * a plan's later calls go through the compiled kernel's dispatcher (Kernel.compiled is set) and
    give the first call's results (launch.CHECK, on in every GPU test, checks their
    specialization);
  * a signature's later calls replay its first (launcher.remembered), bitwise alike.
Shapes are small and ragged (N = 333); each family's grid of variants is tested in
test_gpu_contract.py, its numbers against the reference in its own GPU tests.
"""
from __future__ import annotations

import pytest
import torch
from conftest import bitwise_equal

import altattn
from altattn import launcher
from profiling.timing import captured

pytestmark = pytest.mark.gpu


def _x(gen, *shapes, grad=False):
    return [torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(grad)
            for s in shapes]


CASES = {
    "spherical": (lambda *x, **kw: altattn.spherical_attention(*x, causal=True, **kw),
                  [(2, 333, 8, 64), (2, 333, 2, 64), (2, 333, 2, 64)]),
    "simplicial": (lambda *x, **kw: altattn.simplicial_attention(*x, 16, 64, **kw),
                   [(2, 333, 64, 128)] + [(2, 333, 1, 128)] * 4),
    # G = 128: deterministic=True takes tlx_pairs_ordered (its counters, tables and scale)
    "simplicial_g128": (lambda *x, **kw: altattn.simplicial_attention(*x, 16, 64, **kw),
                        [(2, 333, 128, 128)] + [(2, 333, 1, 128)] * 4),
    "triple": (lambda *x, **kw: altattn.triple_attention(*x, causal=True, scale=0.01, **kw),
               [(2, 333, 2, 64)] * 5),
}


@pytest.fixture
def cuda_gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("family", CASES)
def test_graph_replay_equals_eager(family, cuda_gen):
    op, shapes = CASES[family]
    static = _x(cuda_gen, *shapes, grad=True)
    dout = _x(cuda_gen, shapes[0][:3] + (static[-1].shape[-1],))[0]

    def step():
        out = op(*static, deterministic=True)[0]
        return (out, *torch.autograd.grad(out, static, dout))
    graph, outs = captured(step)
    for _ in range(2):  # new inputs each replay
        fresh = _x(cuda_gen, *shapes)
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
        graph.replay()
        want = step()
        for name, a, b in zip(("out", *(f"d{i}" for i in range(len(shapes)))), outs, want):
            assert bitwise_equal(a, b), f"{family}: {name} of the replayed graph differs"


@pytest.mark.parametrize("family", CASES)
def test_without_grad_equals_with_grad(family, cuda_gen):
    op, shapes = CASES[family]
    x = _x(cuda_gen, *shapes, grad=True)
    with torch.no_grad():
        plain = op(*x)
    graded = op(*x)
    assert all(t.requires_grad for t in graded)
    for a, b in zip(plain, graded):
        assert bitwise_equal(a, b), family


@pytest.mark.parametrize("family", CASES)
@pytest.mark.parametrize("used", [0, 1], ids=["only-out", "only-second"])
def test_an_unused_output_counts_as_zero_gradient(family, used, cuda_gen):
    op, shapes = CASES[family]
    x = _x(cuda_gen, *shapes, grad=True)
    outs = op(*x, deterministic=True)
    g = torch.randn_like(outs[used])
    skipped = torch.autograd.grad(outs[used], x, g, retain_graph=True)
    zeros = [torch.zeros_like(o) for o in outs]
    zeros[used] = g
    explicit = torch.autograd.grad(outs, x, zeros)
    for a, b in zip(skipped, explicit):
        assert bitwise_equal(a, b), family


@pytest.mark.parametrize("family", CASES)
def test_later_calls_use_the_dispatcher(family, cuda_gen):
    op, shapes = CASES[family]
    x = _x(cuda_gen, *shapes)
    launcher.clear_plans()
    with torch.no_grad():
        first = op(*x)
        second = op(*x)
    for a, b in zip(first, second):
        assert bitwise_equal(a, b), family
    plans = [p for key, p in launcher._PLANS.items() if key[0] == family]
    assert plans, f"{family}: the op made no plan"
    # the kernels that ran (a plan may hold some that this call does not run: a form it falls
    # back to, a variant with an initial state)
    ran = [k for p in plans for k in _kernels_of(p.launch) if k.compiled is not None]
    assert ran, f"{family}: no kernel of its plans ran"
    assert all(k._disp is not None for k in ran), (
        f"{family}: {[k.fn.__name__ for k in ran if k._disp is None]} without the C dispatcher")


def _kernels_of(run) -> list:
    """The Kernel objects a prepared launch closes over (directly or one closure down)."""
    from kernels_triton.launch import Kernel
    found, todo, seen = [], [run], set()
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        for cell in getattr(f, "__closure__", None) or ():
            v = cell.cell_contents
            if isinstance(v, Kernel):
                found.append(v)
            elif isinstance(v, dict):
                found += [k for k in v.values() if isinstance(k, Kernel)]
            elif callable(v):
                todo.append(v)
    return found


@pytest.mark.parametrize("family", CASES)
def test_a_thread_without_a_cuda_context_can_launch(family, cuda_gen):
    """A plan made and used on this thread, then called on a fresh thread (as the autograd
    engine's thread runs a backward): the thread's first launch makes its CUDA context."""
    import threading
    op, shapes = CASES[family]
    x = _x(cuda_gen, *shapes, grad=True)
    g = None
    for _ in range(2):  # the plans' kernels compiled and dispatched here
        outs = op(*x)
        g = torch.randn_like(outs[0]) if g is None else g
        want = torch.autograd.grad(outs[0], x, g)
    got, errors = [], []

    def on_a_thread():
        try:
            o = op(*x)
            got.extend(torch.autograd.grad(o[0], x, g))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
    t = threading.Thread(target=on_a_thread)
    t.start()
    t.join()
    assert not errors, f"{family}: {errors[0]!r}"
    torch.testing.assert_close(got, list(want), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("family", CASES)
def test_a_replayed_call_equals_a_whole_one(family, cuda_gen):
    """launcher.remembered: the first call of a signature runs whole and is recorded; later
    ones replay it (with and without grad, and the backward). Outputs and gradients bitwise
    the first call's, and every remembered signature replays (none left to run whole)."""
    op, shapes = CASES[family]
    x = _x(cuda_gen, *shapes, grad=True)
    launcher.clear_plans()
    results = []
    for _ in range(3):  # whole (recorded), replayed, replayed
        with torch.no_grad():
            plain = op(*x, deterministic=True)
        outs = op(*x, deterministic=True)
        g = torch.ones_like(outs[0])
        results.append((*plain, *outs, *torch.autograd.grad(outs[0], x, g)))
    for later in results[1:]:
        for i, (a, b) in enumerate(zip(results[0], later)):
            assert bitwise_equal(a, b), f"{family}: tensor {i} of a replayed call differs"
    kinds = [v for e in launcher._REMEMBERED for v in e.values()]
    assert len(kinds) == 3 and launcher._WHOLE not in kinds, f"{family}: {kinds}"
