"""altattn/compile_workers.py on the CPU: the default it changes, and only that (the GPU test that
compiles a whole model is tests/spine/test_gpu_compile.py)."""
from __future__ import annotations

import pytest

from altattn import compile_workers

sp = pytest.importorskip("torch._inductor.compile_worker.subproc_pool")


@pytest.fixture
def fake_pool(monkeypatch):
    """SubprocPool with an __init__ that records its `kind` instead of starting processes."""
    seen = []

    def init(self, nprocs, pickler=None, kind=sp.SubprocKind.FORK, quiesce=False):
        seen.append(kind)

    monkeypatch.setattr(sp.SubprocPool, "__init__", init)
    monkeypatch.setattr(sp.SubprocPool, "_altattn_spawn", False, raising=False)
    return seen


def test_spawn_becomes_the_default_kind(fake_pool):
    assert compile_workers.spawn_compile_workers()
    assert not compile_workers.spawn_compile_workers()  # once
    sp.SubprocPool(2)
    sp.SubprocPool(2, quiesce=True)
    assert fake_pool == [sp.SubprocKind.SPAWN] * 2


def test_a_kind_given_is_kept(fake_pool):
    compile_workers.spawn_compile_workers()
    sp.SubprocPool(2, None, sp.SubprocKind.FORK)
    sp.SubprocPool(2, kind=sp.SubprocKind.FORK)
    assert fake_pool == [sp.SubprocKind.FORK] * 2


@pytest.mark.parametrize("env", [{"ALTATTN_FORK_COMPILE_WORKERS": "1"},
                                 {"TORCHINDUCTOR_WORKER_START": "fork"}])
def test_not_needed_when_the_user_chose(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert not compile_workers.needed()


def test_not_needed_without_a_gpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert not compile_workers.needed()
