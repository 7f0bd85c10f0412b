"""CPU tests of the benchmarks' interleaved timing, on a fake clock that the stand-in calls advance
(no GPU): `balanced_order`'s balance; bench.everyday's `interleaved_ms` (each way's own time, the
balanced order of its windows, a drift reaching all alike) and `time_family` (each time in its own
column); bench.overhead's `interleaved` and `main` (each call's host and queued time in its own
row, the grad mode of each call while timed)."""
from __future__ import annotations

import itertools
import types

import pytest
import torch

from bench import everyday, overhead


class Clock:
    """Fake time: calls advance `now`; CUDA events and perf_counter read it; `log` holds the
    calls' names and "[" / "]" where a timed window starts and ends."""

    def __init__(self):
        self.now = 0.0
        self.log: list[str] = []

    def call(self, name: str, cost: float, grad_seen: dict | None = None):
        def fn(*args, **kwargs):
            self.now += cost
            self.log.append(name)
            if grad_seen is not None:
                grad_seen.setdefault(name, set()).add(torch.is_grad_enabled())
            return args[0] * 1.0 if args else None
        return fn

    def windows(self) -> list[list[str]]:
        """The calls of each timed window, in order."""
        out, cur = [], None
        for x in self.log:
            if x == "[":
                cur = []
            elif x == "]":
                out.append(cur)
                cur = None
            elif cur is not None:
                cur.append(x)
        return out


@pytest.fixture
def clock(monkeypatch):
    c = Clock()

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None
            self.start = None

        def record(self):
            self.t = c.now
            c.log.append("[" if self.start is None else "]")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    def make_event(enable_timing=False):  # every first event a window's start, second its end
        ev = Event()
        make_event.n += 1
        ev.start = None if make_event.n % 2 else True
        return ev
    make_event.n = 0
    monkeypatch.setattr(everyday.torch.cuda, "Event", make_event)
    monkeypatch.setattr(overhead.time, "perf_counter", lambda: c.now)
    monkeypatch.setattr(overhead.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(overhead.torch.cuda, "_sleep", lambda cycles: None, raising=False)
    return c


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_balanced_order(n):
    orders = [everyday.balanced_order(n, r) for r in range(2 * n)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    firsts = [o[0] for o in orders]
    assert all(firsts.count(i) == 2 for i in range(n))  # each first equally often
    pairs = [(a, b) for o in orders for a, b in zip(o, o[1:])]
    counts = {p: pairs.count(p) for p in itertools.permutations(range(n), 2)}
    assert len(set(counts.values())) == 1  # each follows each other equally often


def test_interleaved_ms_times_each_way_in_balanced_windows(clock):
    costs = {"op": 0.5, "graph": 0.4, "sdpa": 0.6}
    fns = [clock.call(n, ms) for n, ms in costs.items()]
    assert everyday.interleaved_ms(fns, rounds=6, min_ms=5.0) == pytest.approx(list(costs.values()))
    timed = clock.windows()[-6 * 3:]  # the rounds' windows (the first ones size k)
    assert all(len(set(w)) == 1 and len(w) >= 5 for w in timed)
    names = list(costs)
    order = [names.index(w[0]) for w in timed]
    assert [order[i:i + 3] for i in range(0, 18, 3)] == [
        everyday.balanced_order(3, r) for r in range(6)]


def test_interleaved_ms_drift_reaches_all_alike(clock):
    """A clock that slows as it runs: the ratio of the medians stays the ratio of the costs."""
    state = {"slow": 1.0}

    def make(ms):
        def fn():
            clock.now += ms * state["slow"]
            state["slow"] *= 1.002
        return fn

    op, sdpa = everyday.interleaved_ms([make(1.0), make(2.0)], rounds=6, min_ms=10.0)
    assert sdpa / op == pytest.approx(2.0, rel=0.02)


def test_time_family_puts_each_time_in_its_column(clock, monkeypatch):
    x = [torch.ones(1, 4, 1, 2, requires_grad=True) for _ in range(3)]
    op = clock.call("op", 1.0)
    sdpa = clock.call("sdpa", 3.0)

    def problems(family, gen, causal=False):
        yield (dict(B=1, N=4, H=1, D=2), 1e9, 2.5, lambda: op(x[0]) * x[1].sum() * x[2].sum(), x,
               [t.detach().transpose(1, 2).requires_grad_() for t in x], 1e9)
    monkeypatch.setattr(everyday, "problems", problems)
    monkeypatch.setattr(everyday, "graphed", lambda fn: clock.call("graph", 0.5))
    monkeypatch.setattr(everyday, "F", types.SimpleNamespace(
        scaled_dot_product_attention=lambda q, k, v, is_causal=False: sdpa(q) * k.sum() * v.sum()))
    rows = everyday.time_family("spherical", None)
    assert [r["pass"] for r in rows] == ["fwd", "fwd+bwd"]
    for r in rows:
        assert (r["op_ms"], r["graph_ms"], r["sdpa_ms"]) == pytest.approx((1.0, 0.5, 3.0))
        assert r["op_vs_sdpa"] == pytest.approx(3.0) and r["op_vs_graph"] == pytest.approx(0.5)


def test_interleaved_jobs_take_balanced_turns():
    seen = []

    def job(i, values):
        it = iter(values)

        def run():
            seen.append(i)
            return next(it)
        return run

    jobs = [job(0, [5.0, 3.0, 4.0, 6.0]), job(1, [2.0, 9.0, 1.0, 7.0])]
    assert overhead.interleaved(jobs, rounds=4) == [3.0, 1.0]
    assert seen == [i for r in range(4) for i in everyday.balanced_order(2, r)]


def test_overhead_main_rows_get_their_own_times(clock, monkeypatch):
    """bench.overhead's main on stand-ins: each call's host and queued µs (its own cost) land in
    its row, and each call runs in its grad mode while timed."""
    import profiling.common
    import profiling.timing
    grads: dict = {}
    costs = {("sdpa", "op fwd"): 20e-6, ("fam", "op fwd"): 30e-6, ("fam", "op fwd+bwd"): 70e-6}
    calls = {}
    for (fam, call), cost in costs.items():
        calls.setdefault(fam, {})[call] = clock.call(f"{fam}/{call}", cost, grads)
    monkeypatch.setattr(overhead, "family_calls", lambda gen: calls)
    monkeypatch.setattr(overhead, "launches_per_call", lambda fn: 1)
    monkeypatch.setattr(overhead, "synced_us", lambda fn, n: 0.0)
    monkeypatch.setattr(overhead, "decode_rows", lambda gen: [])
    monkeypatch.setattr(overhead.torch, "Generator",
                        lambda device=None: types.SimpleNamespace(manual_seed=lambda s: None))
    monkeypatch.setattr(overhead.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profiling.timing, "graphed", lambda fn: clock.call("graph", 5e-6))
    got = {}
    monkeypatch.setattr(profiling.common, "report",
                        lambda rows, cols, path, header: got.setdefault("rows", rows))
    assert overhead.main(["--calls", "3", "--rounds", "2"]) == 0
    rows = {(r["family"], r["call"]): r for r in got["rows"]}
    for key, cost in costs.items():
        assert rows[key]["host_us"] == pytest.approx(cost * 1e6, abs=0.05)
        assert rows[key]["queued_us"] == pytest.approx(cost * 1e6, abs=0.05)
    assert rows[("fam", "op fwd")]["host_vs_sdpa"] == 1.5
    assert rows[("fam", "op fwd")]["gpu_us"] == 5.0
    assert rows[("fam", "op fwd+bwd")]["gpu_us"] is None  # no graph of a backward
    assert grads == {"sdpa/op fwd": {False}, "fam/op fwd": {False}, "fam/op fwd+bwd": {True}}
