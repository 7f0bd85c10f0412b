"""The variant registry and the launcher's choice of variant (CPU only: nothing is launched)."""
from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from altattn import launcher, registry
from altattn.registry import CompileConfig, Variant
from altattn.simplicial import variants
from altattn.simplicial.family import TRITON_SCOPES
from altattn.simplicial.spec import FORMS, ProblemSpec

FAM = "simplicial"  # the family these tests are about
ALL = registry.all_variants("fwd", FAM)
IDS = [v.name for v in ALL]


def spec(B=1, N=4096, Hq=128, Hk=1, D=128, w1=32, w2=512):
    return ProblemSpec(B, N, Hq, Hk, D, min(w1, w2), max(w1, w2), D ** -0.5, w1 > w2)


SPECS = {
    "S*": spec(),
    "G64": spec(Hq=64),
    "G16_D64": spec(Hq=16, D=64),
    "G8_Hk2": spec(Hq=16, Hk=2, N=1000),
    "G32_Hk4": spec(Hq=128, Hk=4, N=7, w1=1, w2=1),
    "G1": spec(Hq=4, Hk=4, N=65, w1=64, w2=64),
    "N1": spec(N=1, B=3),
    "swapped": spec(w1=512, w2=32),
}


def test_at_least_one_variant():
    assert ALL, "no variant registered"


def test_variants_match_registry():
    assert list(variants()) == [v.name for v in ALL]
    for v in ALL:
        assert variants()[v.name] == v.supports
        assert isinstance(v.supports, str) and v.supports.strip(), f"{v.name}: empty supports text"
        assert "\n" not in v.supports, f"{v.name}: supports text is not one line"


def test_names_unique_and_get():
    assert len(set(IDS)) == len(IDS)
    for v in ALL:
        assert registry.get(v.name, "fwd", FAM) is v
        assert registry.get(v.name, v.pass_, FAM) is v


@pytest.mark.parametrize("v", registry.all_variants(None, FAM),
                         ids=lambda v: f"{v.pass_}-{v.name}")
def test_record_fields(v):
    """What the code reads from a record is there and well-formed (the warp count is checked
    against the compiled kernels in test_resources.py)."""
    assert v.pass_ in registry.PASSES
    assert v in registry.all_variants(v.pass_, FAM) and v in registry.all_variants(None, FAM)
    assert v.warps >= 4 and v.warps % 4 == 0, f"{v.name}: {v.warps} warps is not whole warp groups"
    assert v.scopes and set(v.scopes) <= set(registry.get_family(v.family).scopes), v
    assert len(set(v.scopes)) == len(v.scopes), (v.name, v.scopes)
    assert {"qk_gemm", "softmax", "pv_gemm", "epilogue"} <= set(v.scopes), v.name
    for flag in ("rounds_keys_side" in v.traits, "rounds_values_side" in v.traits, v.pipelined, v.needs_hopper):
        assert isinstance(flag, bool), v
    assert v.accepted("form") and set(v.accepted("form")) <= set(FORMS), (v.name, v.accepted("form"))


@pytest.mark.parametrize("v", registry.all_variants(None, FAM),
                         ids=lambda v: f"{v.pass_}-{v.name}")
def test_variant_refuses_a_form_it_does_not_compute(v):
    for form in set(FORMS) - set(v.accepted("form")):
        why = v.cannot_take(dataclasses.replace(spec(), form=form))
        assert why is not None and f"not {form!r}" in why, (v.name, form, why)


def test_passes():
    assert set(registry.all_variants(None, FAM)) == {v for p in registry.PASSES
                                                    for v in registry.all_variants(p, FAM)}
    with pytest.raises(ValueError, match="unknown pass 'sideways'"):
        registry.all_variants("sideways", FAM)
    if not registry.all_variants("bwd", FAM):  # (until a backward variant is registered)
        with pytest.raises(ValueError, match="unknown variant 'triton' of pass 'bwd'.*; known: none"):
            registry.get("triton", "bwd", FAM)
    pairs = registry.compile_configs(None, FAM)
    assert {v for v, _ in pairs} == set(registry.all_variants(None, FAM))


def test_register_twice_rejected():
    fam = registry.get_family(FAM)
    twice = dataclasses.replace(fam, variants=(*fam.variants, ALL[0]))
    with pytest.raises(ValueError, match="registered twice"):
        registry._check_family(twice, fam.name)


def test_sanitizer_allowance_must_name_a_variant_of_the_family():
    """An allowance's (tool, pass, variant) names a variant of its family's pass."""
    fam = registry.get_family(FAM)
    # tlx_ws_kv is a forward only; tlx is triple attention's
    for key in (("racecheck", "bwd", "tlx_ws_kv"), ("racecheck", "fwd", "tlx")):
        stray = dataclasses.replace(fam, sanitizer_allowed={
            **fam.sanitizer_allowed, key: registry.SanitizerAllowance(registry.DISPATCH_DOC, 1)})
        with pytest.raises(ValueError, match=rf"sanitizer allowance \({', '.join(key)}\)"):
            registry._check_family(stray, fam.name)


def test_get_unknown_lists_known():
    with pytest.raises(ValueError) as info:
        registry.get("nope", "fwd", FAM)
    for name in IDS:
        assert name in str(info.value)


@pytest.mark.parametrize("v", ALL, ids=IDS)
def test_module_interface(v):
    m = v.load()
    for attr in ("supports", "launch", "compile_configs"):
        assert callable(getattr(m, attr, None)), f"{v.module} has no callable {attr}"
    configs = m.compile_configs()
    assert configs, f"{v.name}: no compile configs"
    names = [c.name for c in configs]
    assert len(set(names)) == len(names), f"{v.name}: duplicate config names {names}"
    for c in configs:
        assert isinstance(c, CompileConfig)
        assert c.num_warps in (1, 2, 4, 8, 16, 32) and c.num_stages >= 1, c
        params = getattr(c.fn, "params", None)
        if params is not None:  # a @triton.jit function: the signature names only its arguments,
            names = {p.name for p in params}  # and every one without a default value
            required = {p.name for p in params if not p.has_default}
            assert set(c.signature) <= names, (c.name, set(c.signature) - names)
            assert required <= set(c.signature), (c.name, required - set(c.signature))
        for k in c.constexprs:
            assert c.signature.get(k) == "constexpr", (c.name, k)


@pytest.mark.parametrize("v", ALL, ids=IDS)
def test_supports_returns_none_or_reason(v):
    m = v.load()
    for s in SPECS.values():
        why = m.supports(s)
        assert why is None or (isinstance(why, str) and why), (v.name, s, why)
    odd = spec(Hq=12)  # G = 12: no variant is expected to take a non-power-of-two group
    why = m.supports(odd)
    assert why is None or "12" in why, f"{v.name}: reason {why!r} does not name G=12"


@pytest.mark.parametrize("s", SPECS.values(), ids=SPECS.keys())
@pytest.mark.parametrize("hopper", [True, False], ids=["sm90", "sm80"])
def test_auto_picks_a_variant_that_supports(s, hopper):
    able = [o for o in ALL if o.cannot_take(s) is None and (hopper or not o.needs_hopper)]
    if not able:  # e.g. every variant is Hopper-only: "auto" on sm_80 must say so
        with pytest.raises(ValueError, match="no variant can take") as info:
            launcher.pick(s, "auto", hopper, family=FAM)
        if not hopper:
            assert "needs sm_90" in str(info.value)
        return
    v = launcher.pick(s, "auto", hopper, family=FAM)
    assert v.cannot_take(s) is None
    if not hopper:
        assert not v.needs_hopper
    assert v.rank_for(s) == max(o.rank_for(s) for o in able), \
        "auto did not take the highest-ranked variant"


# The fastest variant at shapes timed on the lent H100 and H200 (docs/perf.md; measured in
# docs/history/perf-notes.md, session 11): the registry's ranks must keep "auto" on it.
MEASURED_FASTEST = {
    "S*": (spec(), "tlx_pipelined_kv"),
    "G64": (spec(Hq=64), "tlx_ws"),                # 588.7 vs triton 536.8 (H100, N = 16384)
    "G128_D64": (spec(D=64), "tlx_ws"),            # 449.9 vs tlx_pipelined_kv 417.4 (N = 8192)
    "G64_D64": (spec(Hq=64, D=64), "tlx_ws"),      # 430.1 vs triton 410.2
    "G8": (spec(Hq=8), "triton"),                  # the only taker
}


@pytest.mark.parametrize("s, name", MEASURED_FASTEST.values(), ids=MEASURED_FASTEST.keys())
def test_auto_takes_the_measured_fastest(s, name):
    assert launcher.pick(s, "auto", family=FAM).name == name


def test_auto_takes_every_headline_shape_on_hopper():
    """At least one registered variant runs each of SPECS on an sm_90 GPU."""
    for name, s in SPECS.items():
        assert launcher.pick(s, "auto", True, family=FAM).cannot_take(s) is None, name


def test_auto_with_no_taker_explains_each_variant():
    with pytest.raises(ValueError) as info:
        launcher.pick(spec(Hq=12), "auto", family=FAM)
    msg = str(info.value)
    assert "no variant can take" in msg
    for v in ALL:
        assert f"{v.name}:" in msg, msg


@pytest.mark.parametrize("v", ALL, ids=IDS)
def test_named_variant_that_supports(v):
    for s in SPECS.values():
        if v.cannot_take(s) is None:
            assert launcher.pick(s, v.name, family=FAM) is v


@pytest.fixture
def fake_variants(monkeypatch):
    """Two extra registry entries backed by in-memory modules: 'narrow' (only G = 1, highest
    rank) and 'hopper-only' (anything, needs sm_90, ranked above the real ones)."""
    def module(name, rule):
        m = types.ModuleType(name)
        m.supports = rule
        m.launch = lambda *a: None
        m.compile_configs = lambda: []
        monkeypatch.setitem(sys.modules, name, m)
        return name

    top = max(v.rank_for(spec(D=d)) for v in ALL for d in (64, 128))
    fields = {"family": FAM, "pass_": "fwd", "warps": 4, "scopes": TRITON_SCOPES}
    narrow = Variant(name="narrow", module=module("_fake_narrow", lambda s: None if s.G == 1 else
                                                  f"G = {s.G}: narrow takes G = 1 only"),
                     needs_hopper=False, rank=top + 2, supports="G = 1 only", **fields)
    hop = Variant(name="hopper-only", module=module("_fake_hopper", lambda s: None),
                  needs_hopper=True, rank=top + 1, supports="any shape", **fields)
    fam = registry.get_family(FAM)
    monkeypatch.setitem(registry._LOADED, fam.name,
                        dataclasses.replace(fam, variants=(*fam.variants, narrow, hop)))
    return narrow, hop


def test_unsupported_named_variant_names_one_that_can(fake_variants):
    narrow, hop = fake_variants
    s = spec(Hq=16)  # G = 16
    with pytest.raises(ValueError) as info:
        launcher.pick(s, "narrow", family=FAM)
    msg = str(info.value)
    assert "variant 'narrow' cannot take" in msg and "narrow takes G = 1 only" in msg, msg
    assert "variants that can:" in msg and "hopper-only" in msg, msg
    for v in ALL:  # the real variants that take it are offered too
        if v.cannot_take(s) is None:
            assert v.name in msg, msg


def test_real_variant_refusal_names_fake_taker(fake_variants):
    """A real variant that refuses G = 12 points at the (fake) variant that takes anything."""
    s = spec(Hq=12)
    for v in ALL:
        if v.cannot_take(s) is not None:
            with pytest.raises(ValueError, match="variants that can: .*hopper-only"):
                launcher.pick(s, v.name, family=FAM)


def test_auto_rank_order_and_hopper_filter(fake_variants):
    narrow, hop = fake_variants
    assert launcher.pick(spec(Hq=1), "auto", family=FAM) is narrow  # highest rank taking G = 1
    assert launcher.pick(spec(Hq=16), "auto", family=FAM) is hop    # narrow refuses; hop next
    real_sm80 = [v for v in ALL if not v.needs_hopper and v.cannot_take(spec(Hq=16)) is None]
    if real_sm80:  # sm_80: hop skipped, a real non-Hopper variant taken
        not_hop = launcher.pick(spec(Hq=16), "auto", hopper=False, family=FAM)
        assert not not_hop.needs_hopper and not_hop.name not in ("narrow", "hopper-only")
    else:
        with pytest.raises(ValueError, match="hopper-only: needs sm_90"):
            launcher.pick(spec(Hq=16), "auto", hopper=False, family=FAM)
    assert variants()["narrow"] == "G = 1 only"


def test_deterministic_backward_selection():
    """"auto" takes the reduce-adding `tlx_pairs` at G >= 16 (D 64 and 128); deterministic=True
    takes a bitwise-repeatable variant there (`tlx_pairs_ordered` at G >= 128, D 128, Hk = 1,
    `tlx_ws` at G >= 64 and D 128 otherwise, else `triton`), and refuses `tlx_pairs` by name."""
    for G, D in [(G, D) for G in (16, 32, 64, 128) for D in (64, 128)]:
        s = spec(Hq=G, Hk=1, D=D)
        assert launcher.pick(s, "auto", True, "bwd", family=FAM).name == "tlx_pairs"
        v = launcher.pick(s, "auto", True, "bwd", deterministic=True, family=FAM)
        assert v.deterministic and v.name == ("triton" if G < 64 or D == 64 else
                                              "tlx_pairs_ordered" if G >= 128 else "tlx_ws")
        with pytest.raises(ValueError, match="'tlx_pairs' is not deterministic"):
            launcher.pick(s, "tlx_pairs", True, "bwd", deterministic=True, family=FAM)
    gqa = launcher.pick(spec(Hq=256, Hk=2, D=128), "auto", True, "bwd", deterministic=True,
                        family=FAM)
    assert gqa.name == "tlx_ws"
    assert [v.name for v in registry.all_variants("bwd", FAM)
            if not v.deterministic] == ["tlx_pairs"]
    huge = spec(B=2 ** 31 // (4096 * 128) + 1)  # B*N*Hq >= 2**31: tlx_pairs's int32 TMA rows
    assert "int32" in registry.get("tlx_pairs", "bwd", FAM).cannot_take(huge)
    assert launcher.pick(huge, "auto", True, "bwd", family=FAM).name == "tlx_ws"
    assert all(v.deterministic for v in registry.all_variants("fwd", FAM))
