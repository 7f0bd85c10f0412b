"""Shared test machinery: markers, per-test seeds, random inputs.

Markers
    gpu   needs a CUDA device; skipped cleanly (with a reason) when there is none.
    slow  takes more than ~20 s on a 2-core CPU machine; deselect with -m "not slow".

Seeds
    Every test that draws random numbers gets its own seed, derived from its test id (so two tests
    never share a stream and a rerun of one test reproduces it exactly). Set ALTATTN_TEST_SALT to
    any string to draw a different set of inputs for the whole run. The seed is printed in the
    report of every failing test that used it.
"""
from __future__ import annotations

import functools
import os
import sys
import zlib
from typing import NamedTuple
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # plain `pytest` from anywhere, not only `python -m pytest` at the root
    sys.path.insert(0, str(ROOT))

HAS_CUDA = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (none found)")


def no_gpu_env(**extra: str) -> dict:
    """Environment for a child process that must find no GPU, on any machine: with
    CUDA_VISIBLE_DEVICES empty, torch.cuda.is_available() is False there. CPU tests of "no GPU"
    paths use it, so the CPU suite is the same on a GPU machine (never skipped there)."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", **extra}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped when none is present")
    config.addinivalue_line("markers", "slow: takes more than ~20 s on the 2-core CI machine")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(requires_gpu)


@pytest.fixture(autouse=True)
def _checked_launches(request, monkeypatch):
    """GPU tests check every thin launch against the JIT's own lookup (kernels_triton/launch.py:
    a later call of a plan must specialize like its first)."""
    if request.node.get_closest_marker("gpu") is not None:
        from kernels_triton import launch
        monkeypatch.setattr(launch, "CHECK", True)


@pytest.fixture
def stand_in_launches(monkeypatch):
    """stand_in_launches(family) -> {pass: [(spec, kernel arguments), ...]}: every variant of
    `family` replaced by a stand-in module whose `launch` records what it is handed (what the
    passes give a kernel module), the device check passed (CPU tensors)."""
    import contextlib
    import types

    from altattn import launcher, registry

    def install(family: str) -> dict:
        seen: dict = {}
        stand_ins = {v: types.SimpleNamespace(
            supports=lambda s: None,
            launch=lambda s, *a, profile=False, p=v.pass_: seen.setdefault(p, []).append((s, a)))
            for v in registry.get_family(family).variants}
        load = registry.Variant.load
        monkeypatch.setattr(registry.Variant, "load", lambda v: stand_ins.get(v) or load(v))
        monkeypatch.setattr(launcher, "check_device", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        return seen
    return install


def seed_for(nodeid: str) -> int:
    """A 31-bit seed from the test id (and the optional salt): stable across runs and machines."""
    salt = os.environ.get("ALTATTN_TEST_SALT", "")
    return zlib.crc32(f"{salt}|{nodeid}".encode()) & 0x7FFFFFFF


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "_simplicial_seed", None)
    if report.failed and seed is not None:
        salt = os.environ.get("ALTATTN_TEST_SALT", "")
        report.sections.append(("random inputs", f"seed = {seed} (ALTATTN_TEST_SALT={salt!r})"))


@pytest.fixture
def seed(request) -> int:
    s = seed_for(request.node.nodeid)
    request.node._simplicial_seed = s
    return s


@pytest.fixture
def gen(seed) -> torch.Generator:
    """CPU generator seeded from the test id; successive draws give fresh inputs per check."""
    return torch.Generator().manual_seed(seed)


def rand_inputs(B: int, N: int, Hq: int, Hk: int, D: int, device="cpu",
                generator: torch.Generator | None = None, scale: float = 1.0):
    """Fresh random bf16 inputs (q [B,N,Hq,D]; k1, k2, v1, v2 [B,N,Hk,D]), standard normal * scale.

    Drawn with `generator` on the generator's own device and moved to `device`, so one CPU
    generator gives the same numbers whatever device the test runs on."""
    gdev = generator.device if generator is not None else torch.device("cpu")

    def draw(h):
        x = torch.randn(B, N, h, D, generator=generator, device=gdev, dtype=torch.float32)
        return (x * scale).to(torch.bfloat16).to(device)

    q = draw(Hq)
    k1, k2, v1, v2 = (draw(Hk) for _ in range(4))
    return q, k1, k2, v1, v2


@pytest.fixture
def any_head_dim(monkeypatch):
    """The reference's math takes any D; `validate` allows only the kernels' D in {64, 128} (D mod 3
    = 1 and 2 for form "det"). Widened in a test that takes this fixture to D mod 3 = 0 (6, 9),
    D < 3 (no 3-chunk) and D = 8: cheap shapes for the reference and the op on the CPU."""
    from altattn.simplicial import spec
    monkeypatch.setattr(spec, "SUPPORTED_HEAD_DIMS", (*spec.SUPPORTED_HEAD_DIMS, 2, 6, 8, 9))


@pytest.fixture
def tiny_dims(monkeypatch):
    """Triple attention's validate takes only the kernels' Dq, Dv in {32, 64, 128}; widened here
    to 2 and 3, so that gradcheck's Jacobians (the state has B H Dq^2 Dv entries) stay small."""
    from altattn.triple import spec
    monkeypatch.setattr(spec, "SUPPORTED_DIMS", (*spec.SUPPORTED_DIMS, 2, 3))


def fp64_inputs(gen: torch.Generator, B: int, N: int, Hq: int, Hk: int, D: int,
                requires_grad: bool = True) -> list[torch.Tensor]:
    """Fresh standard normal fp64 inputs [q, k1, k2, v1, v2] (CPU), leaves that require grad
    unless told otherwise: for exact fp64 comparisons and gradchecks."""
    return [torch.randn(B, N, h, D, generator=gen, dtype=torch.float64)
            .requires_grad_(requires_grad) for h in (Hq, Hk, Hk, Hk, Hk)]


@pytest.fixture
def rand(gen):
    """rand(B, N, Hq, Hk, D, device="cpu", scale=1.0) -> (q, k1, k2, v1, v2), from this test's seed."""
    def make(B, N, Hq, Hk, D, device="cpu", scale=1.0):
        return rand_inputs(B, N, Hq, Hk, D, device, gen, scale)
    return make


def hq_taken_by(variant: str, B: int, N: int, Hq: int, Hk: int, D: int, w1: int, w2: int) -> int:
    """Hq itself when `variant` takes the shape, else 128 * Hk when it takes that twin (a
    G = 128-only kernel still runs the shape-generic tests), else Hq (the test skips)."""
    from altattn import registry
    from altattn.simplicial.spec import validate_shape
    mod = registry.get(variant, "fwd", "simplicial").load()
    if mod.supports(validate_shape(B, N, Hq, Hk, D, w1, w2)) is None:
        return Hq
    return 128 * Hk if mod.supports(validate_shape(B, N, 128 * Hk, Hk, D, w1, w2)) is None else Hq


def bench_script(name: str):
    """bench/<name>.py as a module (bench's scripts are not a package the tests import)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=None)
def gpu_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if HAS_CUDA else None


class Shape(NamedTuple):
    """A test shape: q [B, N, Hq, D], k1..v2 [B, N, Hk, D], windows w1, w2 (GPU tests)."""

    B: int
    N: int
    Hq: int
    Hk: int
    D: int
    w1: int
    w2: int
    sm_scale: float | None = None

    def __str__(self):
        s = (f"B={self.B} N={self.N} Hq={self.Hq} Hk={self.Hk} (G={self.Hq // self.Hk}) "
             f"D={self.D} w1={self.w1} w2={self.w2}")
        return s + (f" sm_scale={self.sm_scale}" if self.sm_scale is not None else "")


@pytest.fixture(scope="module")
def exact_fp32_matmul():
    """fp32 references on the GPU must not silently use TF32 (GPU test modules use it)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def previous_token_losses(model, x: torch.Tensor, steps: int, lr: float) -> list[float]:
    """MSE losses of `steps` Adam steps training `model` to output the previous token's features
    (x [B, N, dim]): attention must carry them. Used by the layer's CPU and GPU tests."""
    target = x.roll(1, dims=1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def compiled_grads_differ(model, loss_of_output) -> list[str]:
    """Names of the parameters whose gradient of loss_of_output(model(.)) differs bitwise between
    eager and torch.compile(fullgraph=True)."""
    grads = []
    for m in (model, torch.compile(model, fullgraph=True)):
        model.zero_grad()
        loss_of_output(m).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return [name for (name, _), a, b in zip(model.named_parameters(), *grads)
            if not torch.equal(a, b)]


# ------------------------------------------------------------------------------------------------
# Contract tests (tests/spine/test_contract.py, tests/spine/test_gpu_contract.py): generated from the registry,
# family-agnostic (only the Family record and the launcher).

def contract_params(per_form: bool = False) -> list:
    """One pytest.param(variant, form) per registered (family, pass, variant), id
    "family-pass-name": form is the variant's first accepted one (None for a family whose
    `accepts` has no "form"); per_form=True gives one param per accepted form, id "...-form"."""
    from altattn import registry
    params = []
    for v in registry.all_variants(None, None):
        fam = registry.get_family(v.family)
        forms = tuple(v.accepted("form")) if "form" in fam.accepts else (None,)
        for form in forms if per_form else forms[:1]:
            tail = f"-{form}" if per_form and form is not None else ""
            params.append(pytest.param(v, form, id=f"{v.family}-{v.pass_}-{v.name}{tail}"))
    return params


def contract_shape(v, form=None, batch: int | None = None):
    """(shape, None): the first of the family's sanitizer shapes (group by group) that variant `v`
    takes in `form`, with its field B set to `batch` where given; (None, why) when it takes none
    (or the shape record has no field B to set)."""
    import dataclasses
    from altattn import registry
    fam = registry.get_family(v.family)
    reasons = []
    for group in fam.sanitizer_shapes:
        for shape in group:
            if batch is not None:
                if "B" not in shape.fields():
                    return None, f"{fam.name}'s shape record has no batch field B"
                shape = dataclasses.replace(shape, B=batch)
            spec = shape.spec(form) if form is not None else shape.spec()
            why = v.cannot_take(spec)
            if why is None:
                return shape, None
            reasons.append(f"{shape.short()}: {why}")
    return None, (f"{v.family} {v.pass_} variant {v.name!r} takes none of the sanitizer shapes"
                  f"{f' in form {form!r}' if form else ''}: " + "; ".join(reasons))


def contract_inputs(fam, pass_: str, shape, form, seed: int, device) -> tuple:
    """fam.make_inputs for one call of `pass_` (form passed only where the family has one)."""
    kw = {} if form is None else {"form": form}
    return tuple(fam.make_inputs(shape, pass_, seed=seed, device=device, **kw))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads included: torch.equal says NaN != NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().contiguous().flatten().view(torch.uint8),
                       b.detach().contiguous().flatten().view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# Context parallelism on the CPU: one test's ranks as spawned processes joined by gloo.

def run_gloo_world(body, world: int, *args) -> None:
    """body(rank, world, *args) in `world` spawned processes joined by gloo (a file rendezvous,
    removed after): a failure on any rank fails the caller with that rank's traceback. body must
    be a module-level function (spawn pickles it by name)."""
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.NamedTemporaryFile() as f:
        mp.start_processes(_gloo_rank, args=(body, world, f.name + ".store", args),
                           nprocs=world, start_method="spawn")


def _gloo_rank(rank: int, body, world: int, path: str, args: tuple) -> None:
    """One rank: one thread, the group, body, the group destroyed; a rank that succeeded leaves by
    os._exit(0). Without it, gloo's threads at interpreter shutdown aborted a process ("terminate
    called without an active exception", SIGABRT) in about one run of two (torch 2.13, CPU build);
    an exception still reaches the parent through torch.multiprocessing's error file."""
    import datetime

    import torch.distributed as dist
    torch.set_num_threads(1)
    # a rank waiting for a peer that died raises after 5 minutes instead of hanging the test
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))
    try:
        body(rank, world, *args)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
