"""CPU tests of the benchmarks' interleaved timing: bench.everyday's `interleaved_ms` with CUDA
events stood in by a clock (each function's median, the order of a round rotating so that no
function always follows the same other one, a drift reaching all alike) and bench.overhead's
`interleaved` (best of the rounds, the same rotation)."""
from __future__ import annotations

import pytest

from bench import everyday, overhead


class _Clock:
    """A fake GPU clock: functions advance it; events record it."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = c.now

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(everyday.torch.cuda, "Event", Event)
    return c


def _fn(clock, name, ms):
    def fn():
        clock.now += ms
        clock.calls.append(name)
    return fn


def test_medians_and_rotation(clock):
    costs = {"op": 0.5, "graph": 0.4, "sdpa": 0.6}
    fns = [_fn(clock, n, ms) for n, ms in costs.items()]
    got = everyday.interleaved_ms(fns, rounds=6, min_ms=5.0)
    assert got == pytest.approx(list(costs.values()))
    # the timed rounds: each function runs k back-to-back calls, k = 5 ms / its cost (>= 5)
    warm = 4 * len(fns)  # three warm-up calls and one to size k, per function
    order = []
    for name in clock.calls[warm:]:
        if not order or order[-1] != name:
            order.append(name)
    rounds = [order[i:i + 3] for i in range(0, len(order), 3)]
    assert len(rounds) == 6
    assert [r[0] for r in rounds[:3]] == ["op", "graph", "sdpa"]  # each first in turn
    assert all(sorted(r) == sorted(costs) for r in rounds)


def test_drift_reaches_all_alike(clock):
    """A clock that slows each round: every function's median moves by the same factor."""
    base = {"op": 1.0, "sdpa": 2.0}
    state = {"slow": 1.0}

    def make(name, ms):
        def fn():
            clock.now += ms * state["slow"]
            clock.calls.append(name)
            if name == "sdpa":
                state["slow"] *= 1.01
        return fn

    op, sdpa = everyday.interleaved_ms([make(n, ms) for n, ms in base.items()], rounds=7,
                                       min_ms=10.0)
    assert sdpa / op == pytest.approx(2.0, rel=0.03)


def test_overhead_rounds_take_turns():
    seen = []

    def job(name, values):
        it = iter(values)

        def run():
            seen.append(name)
            return next(it)
        return run

    best = overhead.interleaved([job("a", [5.0, 3.0, 4.0]), job("b", [2.0, 9.0, 1.0])], rounds=3)
    assert best == [3.0, 1.0]
    assert seen == ["a", "b", "b", "a", "a", "b"]


def test_overhead_main_times_every_call(monkeypatch):
    """bench.overhead's main on CPU stand-ins (no GPU work): every call gets a host and a queued
    time from its turns, the SDPA ratios come from them, and the calls take turns."""
    import profiling.common
    import profiling.timing
    log = []

    def fake(name):
        def fn():
            log.append(name)
        return fn

    calls = {"sdpa": {"op fwd": fake("sdpa")},
             "fam": {"op fwd": fake("fam"), "op fwd+bwd": fake("fb")}}
    monkeypatch.setattr(overhead, "family_calls", lambda gen: calls)
    monkeypatch.setattr(overhead, "launches_per_call", lambda fn: 1)
    monkeypatch.setattr(overhead, "decode_rows", lambda gen: [])
    monkeypatch.setattr(overhead.torch, "Generator",
                        lambda device=None: type("G", (), {"manual_seed": lambda self, s: self})())
    monkeypatch.setattr(overhead.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(overhead.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(overhead.torch.cuda, "_sleep", lambda cycles: None, raising=False)
    monkeypatch.setattr(profiling.timing, "graphed", lambda fn: fn)
    got = {}
    monkeypatch.setattr(profiling.common, "report",
                        lambda rows, cols, path, header: got.setdefault("rows", rows))
    assert overhead.main(["--calls", "2", "--rounds", "3"]) == 0
    rows = {(r["family"], r["call"]): r for r in got["rows"]}
    assert set(rows) == {("sdpa", "op fwd"), ("fam", "op fwd"), ("fam", "op fwd+bwd")}
    for r in rows.values():
        assert r["host_us"] >= 0 and r["queued_us"] >= 0 and r["synced_us"] >= 0
    assert rows[("fam", "op fwd")]["host_vs_sdpa"] == pytest.approx(
        rows[("fam", "op fwd")]["host_us"] / rows[("sdpa", "op fwd")]["host_us"], abs=0.01)
    assert rows[("fam", "op fwd+bwd")]["gpu_us"] is None  # no graph of a backward
    # the timed phase: host rounds then queued rounds, 2 calls a turn, the turns rotating
    timed = log[-2 * 3 * 3 * 2:]
    turns = [timed[i] for i in range(0, len(timed), 2)]
    assert turns[:9] == ["sdpa", "fam", "fb", "fam", "fb", "sdpa", "fb", "sdpa", "fam"]
