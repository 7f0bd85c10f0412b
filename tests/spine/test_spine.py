"""The family spine, on the CPU: a second family is its own file plus one registry line, and the
generic layers (registry, launcher) then serve it without knowing its name (tests/spine/toy_family.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from altattn import launcher, registry


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry.FAMILIES, "toy", "toy_family")  # the one registry line
    monkeypatch.setattr(launcher, "check_device", lambda *a, **k: None)  # its kernel runs on CPU
    yield registry.get_family("toy")
    registry._LOADED.pop("toy", None)


def test_a_family_is_one_line(toy):
    assert [f.name for f in registry.families()] == [*registry.FAMILIES]
    assert registry.all_variants("fwd", "toy") == list(toy.variants)
    assert toy.variants[0] in registry.all_variants(None, None)
    assert registry.variants("fwd", "toy") == {"torch": "D <= 256"}
    assert registry.get("torch", "fwd", "toy") is toy.variants[0]


def test_the_launcher_runs_it(toy, gen):
    q, k, v = (torch.randn(2, 8, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    (out,) = launcher.run("toy", "fwd", q, k, v)
    assert torch.allclose(out, toy.reference(q, k, v)[0])
    given = torch.full_like(q, float("nan"))
    (out,) = launcher.run("toy", "fwd", q, k, v, outputs={"out": given})
    assert out is given and not out.isnan().any()


def test_its_errors_name_the_family_and_argument(toy):
    x = torch.zeros(1, 4, 1, 512)
    with pytest.raises(ValueError, match="variant 'torch' cannot take B=1 N=4 H=1 D=512: D = 512"):
        launcher.run("toy", "fwd", x, x, x, variant="torch")
    with pytest.raises(ValueError, match="unknown variant 'nope' of family 'toy'; known: torch"):
        launcher.run("toy", "fwd", x, x, x, variant="nope")
    with pytest.raises(ValueError, match="has no pass 'bwd'"):
        launcher.run("toy", "bwd", x, x, x)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        launcher.run("toy", "fwd", x, [1], x)
    with pytest.raises(ValueError, match="unknown family 'nope'; families: simplicial"):
        launcher.run("nope", "fwd", x, x, x)


def test_a_record_that_breaks_the_vocabulary_is_refused(toy):
    bad = dataclasses.replace(toy.variants[0], scopes=("qk", "softmax"))
    with pytest.raises(ValueError, match=r"scopes \['softmax'\] not in toy's scopes"):
        registry._check_family(dataclasses.replace(toy, variants=(bad,)), "toy")
    bad = dataclasses.replace(toy, scopes={"qk": "thinking"})
    with pytest.raises(ValueError, match="scope roles"):
        registry._check_family(bad, "toy")
