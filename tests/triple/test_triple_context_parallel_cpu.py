"""Triple attention's context parallelism on the CPU: P = 2, 3, 4 processes joined by gloo
(torch.multiprocessing), each holding a shard of one sequence, against the one-process
`attention` on the whole sequence in fp64: out, the final state (the same on every rank) and the
gradients of q1, q2, k1, k2, v and initial_state, causal and not; unequal and empty shards, B = 0,
Dq != Dv, scale None (1/N of the whole sequence) and given, an initial state, deterministic=True;
the layer's `cp_group` (outputs, state and weight gradients); errors raised on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import run_gloo_world

from altattn.triple import TripleAttention, attention, context_parallel_attention
from altattn.triple import spec as triple_spec
from altattn.triple.context_parallel import sharded
from altattn.triple.spec import default_scale

NAMES = ("q1", "q2", "k1", "k2", "v")
TOL = 1e-12  # fp64 against fp64: the same sums, grouped by shard


def _max_rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item() if b.numel() else 0.0


# (lens, B, H, Dq, Dv, causal, scale, with S0, deterministic) by world size
CASES = {
    2: [([5, 7], 2, 2, 2, 3, False, None, False, False),
        ([5, 7], 1, 2, 3, 2, True, None, False, False),
        ([6, 0], 1, 1, 32, 64, True, 0.05, True, False),   # an empty last shard, kernel dims
        ([0, 6], 1, 2, 2, 3, False, 0.3, True, True)],     # an empty first shard
    3: [([3, 0, 4], 2, 1, 2, 3, False, 0.3, True, True),
        ([2, 5, 1], 1, 2, 2, 2, True, 0.3, True, False),
        ([0, 3, 0], 1, 1, 3, 2, True, None, False, True),
        ([0, 0, 0], 1, 1, 2, 3, False, 0.3, True, False)],  # no tokens at all: S0 passes through
    4: [([1, 2, 0, 3], 1, 2, 2, 3, True, None, False, True),
        ([4, 4, 4, 4], 1, 1, 3, 2, False, None, False, False),
        ([3, 1, 4, 1], 2, 1, 2, 3, True, 0.2, True, False),
        ([2, 3, 2, 3], 0, 2, 2, 3, True, 0.3, True, False)],  # B = 0
}


def _shard(lens, rank, *tensors):
    a = sum(lens[:rank])
    return [t.narrow(1, a, lens[rank]) for t in tensors]


def _call(x, lens, causal, scale, s0, deterministic, composed):
    """The public call, or (composed) the first version: the op called twice."""
    if not composed:
        return context_parallel_attention(*x, scale=scale, causal=causal, initial_state=s0,
                                          deterministic=deterministic)
    c = default_scale(sum(lens)) if scale is None else scale
    opts = {"scale": c, "variant": "auto", "bwd_variant": "auto", "deterministic": deterministic}
    return sharded(x, dist.group.WORLD, causal, s0, opts, composed=True)


def _check_case(rank, world, lens, B, H, Dq, Dv, causal, scale, with_state, deterministic,
                seed):
    for composed in (False, True) if B else (False,):
        _check_one(rank, world, lens, B, H, Dq, Dv, causal, scale, with_state, deterministic,
                   seed, composed)


def _check_one(rank, world, lens, B, H, Dq, Dv, causal, scale, with_state, deterministic, seed,
               composed):
    g = torch.Generator().manual_seed(seed)  # the same whole sequence on every rank
    N = sum(lens)
    full = [torch.randn(B, N, H, d, generator=g, dtype=torch.float64)
            for d in (Dq, Dq, Dq, Dq, Dv)]
    s0 = torch.randn(B, H, Dq, Dv, Dq, generator=g, dtype=torch.float64) if with_state else None
    dout = torch.randn(B, N, H, Dv, generator=g, dtype=torch.float64)
    # each rank's loss reads its copy of the final state with its own weights
    dstates = torch.randn(world, B, H, Dq, Dv, Dq, generator=g, dtype=torch.float64)
    mine = [t.clone().requires_grad_() for t in _shard(lens, rank, *full)]
    s0_mine = s0.clone().requires_grad_() if with_state else None
    out, state = _call(mine, lens, causal, scale, s0_mine, deterministic, composed)
    # half the cases' losses read out alone: every rank's backward must still take part in the
    # collectives' (rank 0's causal out reads no other rank's state)
    with_dstate = seed % 2 == 0
    dstates *= with_dstate
    ((out * _shard(lens, rank, dout)[0]).sum()
     + with_dstate * (state * dstates[rank]).sum()).backward()
    whole = [t.clone().requires_grad_() for t in full]
    s0_whole = s0.clone().requires_grad_() if with_state else None
    ro, rs = attention(*whole, scale=scale, causal=causal, initial_state=s0_whole)
    ((ro * dout).sum() + (rs * dstates.sum(0)).sum()).backward()
    case = (lens, B, H, Dq, Dv, causal, scale, with_state, deterministic, composed, rank)
    assert out.shape == (B, lens[rank], H, Dv) and state.shape == (B, H, Dq, Dv, Dq), case
    assert out.dtype == ro.dtype and state.dtype == rs.dtype, case
    assert _max_rel(out, _shard(lens, rank, ro)[0]) <= TOL, case
    assert _max_rel(state, rs) <= TOL, case
    every = [torch.empty_like(state) for _ in range(world)]
    dist.all_gather(every, state.detach().contiguous())
    assert all(torch.equal(s, every[0]) for s in every), ("state differs by rank", *case)
    for name, m, w in zip(NAMES, mine, whole):
        assert _max_rel(m.grad, _shard(lens, rank, w.grad)[0]) <= TOL, (name, *case)
    if with_state:  # each rank's share; their sum is the whole loss's gradient
        share = s0_mine.grad.clone()
        dist.all_reduce(share)
        assert _max_rel(share, s0_whole.grad) <= TOL, ("initial_state", *case)
    if composed:
        return
    with torch.no_grad():  # the lengths given: no all-gather of the arguments, the same call
        trusted = context_parallel_attention(*mine, scale=scale, causal=causal,
                                             initial_state=s0_mine, deterministic=deterministic,
                                             shard_lens=lens)
    assert torch.equal(trusted[0], out) and torch.equal(trusted[1], state), case


def _layer_case(rank, world, seed):
    """The layer on shards against the layer on the whole sequence: causal with scale None (1/N
    of the whole sequence), the loss reading its output alone; then fed an initial state and
    returning the final one, causal and not. Its rows, its state, and its weights' gradients
    summed over the ranks (each rank's part of the whole loss)."""
    lens, dim = [5, 3, 6, 2][:world], 16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, sum(lens), dim, generator=g, dtype=torch.float64)
    gy = torch.randn(2, sum(lens), dim, generator=g, dtype=torch.float64)
    for causal, scale in ((True, None), (False, 0.1), (True, 0.1)):
        s0 = torch.randn(2, 2, 32, 64, 32, generator=g, dtype=torch.float64) if scale else None

        def make(cp_group, causal=causal, scale=scale):
            torch.manual_seed(seed)
            return TripleAttention(dim, 2, 32, 64, causal=causal, scale=scale,
                                   cp_group=cp_group).double()

        whole, sharded = make(None), make(dist.group.WORLD)
        y, state = whole(x, s0, return_state=True)
        ((y * gy).sum() + (s0 is not None) * state.sum()).backward()
        if s0 is None:  # the layer as a model calls it: the output alone
            ys = sharded(_shard(lens, rank, x)[0])
            (ys * _shard(lens, rank, gy)[0]).sum().backward()
        else:
            ys, ss = sharded(_shard(lens, rank, x)[0], s0, return_state=True)
            ((ys * _shard(lens, rank, gy)[0]).sum() + ss.sum() / world).backward()
            assert _max_rel(ss, state) <= TOL, (causal, rank)
        assert _max_rel(ys, _shard(lens, rank, y)[0]) <= TOL, (causal, rank)
        for (name, p), w in zip(sharded.named_parameters(), whole.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            assert _max_rel(grad, w.grad) <= 1e-11, (name, causal, rank)


def _error_cases(rank):
    """Bad input on one rank, or ranks that disagree: every rank raises (none hangs)."""
    x = [torch.randn(1, 4, 2, d, dtype=torch.float64) for d in (32, 32, 32, 32, 64)]
    s0 = torch.randn(1, 2, 32, 64, 32, dtype=torch.float64)
    bad = torch.randn(1, 4, 2, 33, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"got \(1, 4, 2, 33\)" if rank == 1 else
                       "rank.*1.*refused"):
        context_parallel_attention(*x[:2], bad if rank == 1 else x[2], *x[3:])
    with pytest.raises(ValueError, match=r"same scale; by rank: \[0.5, 0.25, 0.125\]"):
        context_parallel_attention(*x, scale=0.5 ** (rank + 1))
    with pytest.raises(ValueError, match=r"same scale; by rank: \[-1.0, 0.5, 0.5\]"):
        context_parallel_attention(*x, scale=None if rank == 0 else 0.5)
    with pytest.raises(ValueError, match="same causal"):
        context_parallel_attention(*x, causal=rank == 2)
    with pytest.raises(ValueError, match="same H"):
        context_parallel_attention(*(t[:, :, :1 + rank % 2] for t in x))
    with pytest.raises(ValueError, match="same Dv"):
        context_parallel_attention(*x[:4], x[4][..., :32 * (1 + rank % 2)])
    with pytest.raises(ValueError, match="requires_grad"):  # a backward one rank would skip
        context_parallel_attention(x[0].clone().requires_grad_(rank == 0), *x[1:])
    with pytest.raises(ValueError, match=r"same initial_state \(None or not\)"):
        context_parallel_attention(*x, scale=0.5, initial_state=s0 if rank else None)
    with pytest.raises(ValueError, match=r"same initial_state \(its values\)"):
        context_parallel_attention(*x, scale=0.5, initial_state=s0 + rank)
    with pytest.raises(ValueError, match="scale=None"):  # 1/N cannot go with a state: all raise
        context_parallel_attention(*x, initial_state=s0)
    with pytest.raises(ValueError, match=r"shard_lens\[\d\] = 5 but"):
        context_parallel_attention(*x, shard_lens=[5, 5, 5])
    with pytest.raises(ValueError, match="3 lengths"):
        context_parallel_attention(*x, shard_lens=[4, 4])
    with pytest.raises(TypeError, match="group must be"):
        context_parallel_attention(*x, group="world")
    layer = TripleAttention(16, 2, 32, causal=True, scale=0.5, cp_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="cp_group is set"):
        layer.step(torch.randn(1, 1, 16), torch.zeros(1, 2, 32, 32, 32))
    # after all that, the group still works: a good call on every rank
    out, _ = context_parallel_attention(*x, causal=True)
    assert out.shape == (1, 4, 2, 64)


def _rank(rank, world, seed):
    triple_spec.SUPPORTED_DIMS = (*triple_spec.SUPPORTED_DIMS, 2, 3)  # cheap shapes, as tiny_dims
    for i, case in enumerate(CASES[world]):
        _check_case(rank, world, *case, seed=seed + i)
    _layer_case(rank, world, seed)
    if world == 3:
        _error_cases(rank)


@pytest.mark.parametrize("world", sorted(CASES))
def test_shards_equal_one_process(world, seed):
    """Every case of CASES[world], then the layer, and (P = 3) the errors: a failure on any rank
    fails the test with that rank's traceback."""
    run_gloo_world(_rank, world, seed)


def test_needs_an_initialized_process_group():
    x = [torch.randn(1, 4, 1, 32) for _ in range(5)]
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(*x)


def test_pieces_are_the_non_causal_op(gen, tiny_dims):
    """read_state(q1, q2, shard_state(k1, k2, v, c)) is `attention` (non-causal, no initial
    state) in fp64: out, state and the five gradients; an empty sequence gives a zero state."""
    from altattn.triple.pieces import read_state, shard_state
    x = [torch.randn(2, 7, 2, d, generator=gen, dtype=torch.float64, requires_grad=True)
         for d in (2, 2, 2, 2, 3)]
    dout = torch.randn(2, 7, 2, 3, generator=gen, dtype=torch.float64)
    dstate = torch.randn(2, 2, 2, 3, 2, generator=gen, dtype=torch.float64)
    state = shard_state(x[2], x[3], x[4], 0.3)
    out = read_state(x[0], x[1], state)
    got = [out, state, *torch.autograd.grad((out, state), x, (dout, dstate))]
    ro, rs = attention(*x, scale=0.3)
    want = [ro, rs, *torch.autograd.grad((ro, rs), x, (dout, dstate))]
    for name, a, b in zip(("out", "state", *NAMES), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    empty = shard_state(*(t[:, :0] for t in x[2:]), 0.3)
    assert empty.shape == (2, 2, 2, 3, 2) and not empty.any()
