"""The registry: one record per attention family, one per kernel variant, keyed by
(family, pass, name). Families and kernel modules are imported only when used.

A family is added by its own files plus one line in FAMILIES; a variant by its kernel file plus one
`Variant(...)` line in its family's record (docs/DESIGN.md). Everything the generic layers (the
launcher, bench, profiling, the contract tests) know about a family or a variant is a field of
its record, or a function of its kernel module read through the record. A variant module defines:
    supports(spec) -> str | None             # None when it can run the shape, else the reason
    prepare(spec, profile=False) -> run      # the spec's launch made once (configs, grids,
                                             # kernels: kernels_triton/launch.py); run(*kernel_args)
                                             # takes the pass's kernel arguments (Family.passes);
                                             # profile=True: the Proton-scoped copy
    launch(spec, *kernel_args, profile=False)  # prepare(spec, profile)(*kernel_args); a module
                                             # without `prepare` is launched through it
    compile_configs() -> list[CompileConfig] # default configs, compiled by tools.resources
and, where its launch runs several Proton-scoped kernels (a backward, triple's forward),
    profiled_kernels(spec) -> dict[str, int] # their names for launch(..., profile=name) and
                                             # their warps per CTA (Variant.profiled_kernels)
A module whose one kernel body serves several variants defines instead (or as well)
    variant(**switches) -> dict              # those names for one choice of its switches
                                             # (Variant.switches, e.g. pipeline, pingpong)
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace

# one line per family: its name -> the module that defines its record as FAMILY
FAMILIES = {
    "simplicial": "altattn.simplicial.family",
    "spherical": "altattn.spherical.family",
    "triple": "altattn.triple.family",
}
PASSES = ("fwd", "bwd")        # forward, backward
# the roles a Proton scope can play (Family.scopes); profiling/trace_summary.py reads them:
# a warp group that runs a "gemm" scope is a consumer, one that only "load"s is a producer
SCOPE_ROLES = ("load", "build", "wait", "gemm", "softmax", "scale", "epilogue")
# The sections of docs/sanitizers.md that explain a compute-sanitizer finding (the `doc` of a
# SanitizerAllowance)
SANITIZER_DOC = "docs/sanitizers.md"
DISPATCH_DOC = f"{SANITIZER_DOC}#the-warp-specialization-dispatch"
TMA_INIT_DOC = f"{SANITIZER_DOC}#plain-triton-tma-loads-mbarrier-init-then-arrive-in-one-warp"
TRIPLE_TLX_DOC = f"{SANITIZER_DOC}#triple-attention"
RELEASE_DOC = f"{SANITIZER_DOC}#a-warp-groups-reads-released-by-one-threads-mbarrier-arrive"


@dataclass(frozen=True, kw_only=True)
class Variant:
    name: str
    pass_: str           # which pass it implements: "fwd" or "bwd" (PASSES)
    module: str          # import path of the kernel module
    # the module's switches for this variant: one kernel body serves several variants. Empty: the
    # module is the variant; else `load` is `module.variant(**dict(switches))`
    switches: tuple[tuple[str, object], ...] = ()
    needs_hopper: bool   # uses TMA descriptors / wgmma / setmaxnreg: sm_90 only
    # "auto" tries variants from the highest rank down (measured speed order); a function of the
    # spec where that order changes with it
    rank: int | Callable[[object], int]
    supports: str        # one line: which shapes it takes (the module's `supports` decides)
    # warps per CTA, every warp group counted (threads per CTA = 32 * warps); a pass of several
    # kernels (a backward) records its widest kernel's
    warps: int
    scopes: tuple[str, ...]  # Proton scopes of its profile=True kernel (names of Family.scopes)
    family: str          # the family whose record lists it (Family.name)
    # waits for one wgmma while another is in flight and runs its exp2 under it (profiling.
    # resources: its "ex2 under wgmma" is a number)
    pipelined: bool = False
    # bitwise-identical results from run to run (every sum in a fixed order); a variant with
    # unordered reduce-adds says False, and `deterministic=True` makes "auto" skip it
    deterministic: bool = True
    # spec field -> the values it computes, where they differ from its family's `accepts`
    # ("auto" and a named variant both refuse others)
    accepts: Mapping[str, tuple] = field(default_factory=dict)
    # facts of the family's vocabulary (Family.traits), e.g. which products it rounds to bf16
    traits: frozenset[str] = frozenset()

    def __hash__(self) -> int:  # the key; `accepts` is a dict
        return hash((self.family, self.pass_, self.name))

    def load(self) -> ModuleType | SimpleNamespace:
        """What runs the variant: its module, or (switches) the module's `variant(**switches)`,
        a mapping of the same names (`supports`, `prepare`, `launch`, `compile_configs`, ...)
        made once."""
        module = importlib.import_module(self.module)
        return _switched(module, self.switches) if self.switches else module

    def rank_for(self, spec) -> int:
        return self.rank(spec) if callable(self.rank) else self.rank

    def accepted(self, key: str) -> tuple:
        """The values of spec field `key` this variant computes (its own, else its family's)."""
        return self.accepts.get(key, get_family(self.family).accepts[key])

    def cannot_take(self, spec) -> str | None:
        """None when the variant runs `spec`, else why not (`accepts`, then its module's
        `supports`)."""
        for key in get_family(self.family).accepts:
            have = self.accepted(key)
            if getattr(spec, key) not in have:
                return (f"computes {key} {' / '.join(map(str, have))} only, not "
                        f"{getattr(spec, key)!r}")
        return self.load().supports(spec)

    def compile_configs(self) -> list[CompileConfig]:
        return self.load().compile_configs()

    def profiled_kernels(self, spec) -> dict[str | bool, int]:
        """What a trace of `spec` captures, one Proton session each: {launch's `profile`
        argument: warps per CTA of the kernel it scopes}. Proton samples one warp list per
        session, and a kernel must have every warp named. The module's `profiled_kernels` where
        it has one (several scoped kernels, of different widths), else {True: warps}."""
        kernels = getattr(self.load(), "profiled_kernels", None)
        return kernels(spec) if kernels else {True: self.warps}


@functools.cache
def _switched(module: ModuleType, switches: tuple) -> SimpleNamespace:
    return SimpleNamespace(**module.variant(**dict(switches)))


@dataclass(frozen=True, kw_only=True)
class Peer:
    """A kernel timed beside a family's variants in the same run (bench --peers): softmax
    attention on the work its equal-work rule gives."""

    name: str   # e.g. "cudnn_sdpa" (bench/peers.py runs it)
    rule: str   # the equal-work rule in words, e.g. "dense attention, Lkv = w1*w2 keys per query"
    # shape -> {"B", "H", "Nq", "Nk", "D"} (and "causal", default False) of the softmax attention
    # cuDNN SDPA times (bench/peers.py); None for a peer that `runs` its own kernel
    dense: Callable | None = None
    # "module:function" of a peer of its own (altattn/<family>/peers.py), run on the family's
    # shape: function(shape, passes, seed) -> {pass: setup() -> the call bench/peers.py times, or
    # a note saying why that pass is not timed; "note": a remark for the timed rows}; None: cuDNN
    # SDPA on `dense`
    runs: str | None = None


@dataclass(frozen=True)
class SanitizerAllowance:
    """Findings of one (tool, pass, variant) of a family explained in the docs
    (Family.sanitizer_allowed; tools/sanitize_report.py judges a run by it): at most `count` per
    run (None: any number); with `kernel` and `kind`, only racecheck findings whose two accesses
    are in that kernel (its name in the report) and are a race of that kind (a name of
    sanitize_report.RACE_KINDS, a fact of the two accesses; a tuple of kinds: any of them); with
    `pattern`, only findings whose report line matches it (re.search)."""

    doc: str                    # where the explanation is, e.g. DISPATCH_DOC
    count: int | None = None
    kernel: str | None = None
    kind: str | tuple[str, ...] | None = None
    pattern: str | None = None


@dataclass(frozen=True, kw_only=True)
class Family:
    """Everything generic code needs to know about one attention family."""

    name: str
    title: str                       # e.g. "2-simplicial attention"
    shape_type: type                 # the tools' shape record (fields, .short(), .spec())
    spec_type: type                  # what validate returns and kernels take
    # pass -> its calling convention: validate(*args, **options) -> Call; then allocate,
    # kernel_args and result (launcher.run's steps)
    passes: Mapping[str, object]
    reference: Callable              # plain PyTorch, fp64: the forward
    reference_backward: Callable     # ... and its gradients
    flops: Callable                  # (shape, pass_) -> useful FLOPs of one call
    make_inputs: Callable            # (shape, pass_, device, seed, ...) -> one call's args
    presets: Mapping[str, object]    # name -> shape (bench, trace)
    default_preset: str
    sweep: Mapping[str, tuple]       # shape field -> values of a bench --sweep
    peers: tuple[Peer, ...]          # bench --peers, each with its equal-work rule
    scopes: Mapping[str, str]        # Proton scope name -> role (SCOPE_ROLES), in kernel order
    sanitizer_shapes: tuple          # small shapes compute-sanitizer runs every variant on
    # (tool, pass, variant) -> the findings of its runs that docs/sanitizers.md explains (every
    # form of the variant); tools/sanitize.py fails any other finding
    sanitizer_allowed: Mapping[tuple[str, str, str], SanitizerAllowance] = field(
        default_factory=dict)
    # named once; bench's and the tests' checks read them. bench checks each output of a pass by
    # its name: "<output>_rel" (relative Frobenius error), "<output>_abs" (max abs error), else,
    # for a backward's gradients, "grad_rel"
    tolerances: Mapping[str, float]
    accepts: Mapping[str, tuple]     # spec field -> values every variant takes unless it says
    traits: frozenset[str]           # the words a Variant.traits may hold
    variants: tuple[Variant, ...]    # one line each, in registration order
    # (shape, dim, bwd_variant, **options) -> an nn.Module of width `dim` on the shape's heads
    # (bench/bwd.py --layer: a training step); None when the family has no layer
    layer: Callable | None = None

    def variant(self, name: str, pass_: str = "fwd") -> Variant:
        """The record of variant `name` of pass `pass_`; ValueError naming the known ones."""
        _check_pass(pass_)
        for v in self.variants:
            if v.pass_ == pass_ and v.name == name:
                return v
        where = ("" if pass_ == "fwd" else f" of pass {pass_!r}") + f" of family {self.name!r}"
        others = [p for p in PASSES if p != pass_ and any(
            v.name == name and v.pass_ == p for v in self.variants)]
        hint = (f" ({name!r} is a {others[0]} variant: ask for pass {others[0]!r}; --pass "
                f"{others[0]} in profiling/, bench/{others[0]}.py)" if others else "")
        known = ", ".join(v.name for v in self.variants if v.pass_ == pass_) or "none"
        raise ValueError(f"unknown variant {name!r}{where}{hint}; known: {known} (or 'auto')")


_LOADED: dict[str, Family] = {}


def _check_pass(pass_: str) -> None:
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}; passes: {', '.join(PASSES)}")


def get_family(name: str) -> Family:
    """The record of family `name`; ValueError naming the known ones."""
    if name not in _LOADED:
        if not isinstance(name, str) or name not in FAMILIES:
            raise ValueError(f"unknown family {name!r}; families: {', '.join(FAMILIES)}")
        fam = importlib.import_module(FAMILIES[name]).FAMILY
        _check_family(fam, name)
        _LOADED[name] = fam
    return _LOADED[name]


def _check_family(fam: Family, name: str) -> None:
    """The record's own consistency: names, passes, scopes, traits, accepts; once, at load."""
    if fam.name != name:
        raise ValueError(f"family module {FAMILIES[name]} defines {fam.name!r}, not {name!r}")
    seen = set()
    for v in fam.variants:
        key = (v.pass_, v.name)
        _check_pass(v.pass_)
        if key in seen:
            raise ValueError(f"variant {v.name!r} ({v.pass_}) registered twice in {name}")
        seen.add(key)
        if v.family != name:
            raise ValueError(f"variant {v.name!r} says family {v.family!r} but is in {name!r}")
        if bad := set(v.scopes) - set(fam.scopes):
            raise ValueError(f"variant {v.name!r}: scopes {sorted(bad)} not in {name}'s scopes")
        if bad := set(v.traits) - fam.traits:
            raise ValueError(f"variant {v.name!r}: traits {sorted(bad)} not in {name}'s traits")
        if bad := set(v.accepts) - set(fam.accepts):
            raise ValueError(f"variant {v.name!r}: accepts {sorted(bad)} not in {name}'s accepts")
    if bad := set(fam.scopes.values()) - set(SCOPE_ROLES):
        raise ValueError(f"family {name}: scope roles {sorted(bad)} not in {SCOPE_ROLES}")
    for tool, pass_, variant in fam.sanitizer_allowed:
        if (pass_, variant) not in seen:
            raise ValueError(f"family {name}: sanitizer allowance ({tool}, {pass_}, {variant}) "
                             f"names no {pass_} variant of {name}")


def families() -> list[Family]:
    """Every family's record, in FAMILIES order."""
    return [get_family(n) for n in FAMILIES]


def get(name: str, pass_: str, family: str) -> Variant:
    """The record of variant `name` of (family, pass_); ValueError naming the known ones."""
    return get_family(family).variant(name, pass_)


def all_variants(pass_: str | None, family: str | None) -> list[Variant]:
    """The records of pass `pass_` of family `family` (None: every pass / every family), in
    registration order."""
    if pass_ is not None:
        _check_pass(pass_)
    fams = families() if family is None else [get_family(family)]
    return [v for f in fams for v in f.variants if pass_ is None or v.pass_ == pass_]


def variants(pass_: str, family: str) -> dict[str, str]:
    """Registered variant names of a pass, each with the shapes it supports."""
    return {v.name: v.supports for v in all_variants(pass_, family)}


def refuse_nondeterministic(v: Variant, arg: str = "variant") -> None:
    """ValueError when `deterministic=True` names (as argument `arg`) a variant that is not
    bitwise repeatable, listing the ones that are."""
    if not v.deterministic:
        able = ", ".join(o.name for o in all_variants(v.pass_, v.family) if o.deterministic)
        raise ValueError(f"{arg} {v.name!r} is not deterministic (its sums are reduce-adds in the "
                         f"hardware's order); with deterministic=True use 'auto' or one of: {able}")


def compile_configs(pass_: str | None, family: str | None
                    ) -> list[tuple[Variant, CompileConfig]]:
    """(variant, config) for every default config of pass `pass_` (None: every pass) of
    `family` (None: every family)."""
    return [(v, c) for v in all_variants(pass_, family) for c in v.compile_configs()]


@dataclass(frozen=True)
class CompileConfig:
    """One default config of a variant, compilable for sm_90a without a GPU
    (tools.resources): a launch recorded on meta tensors (kernels_triton/launch.py's
    `Launch.config`)."""

    name: str
    fn: object            # the @triton.jit kernel
    signature: dict       # argument name -> Triton type ("*bf16", "i32", "fp32", "constexpr")
    constexprs: dict      # argument name -> value
    num_warps: int
    num_stages: int

    def key(self) -> tuple:
        """Everything that decides the compiled kernel (a config compiles once per process)."""
        return (self.fn, tuple(self.signature.items()), tuple(self.constexprs.items()),
                self.num_warps, self.num_stages)

    def source(self):
        """The kernel as Triton compiles it at launch: every pointer argument 16-byte aligned (the
        launcher guarantees it, and Triton specializes on it), so vector widths and registers match
        the running kernel."""
        import triton

        names = list(self.fn.arg_names)
        attrs = {(names.index(n),): [["tt.divisibility", 16]]
                 for n, t in self.signature.items() if t.startswith("*")}
        return triton.compiler.ASTSource(fn=self.fn, signature=self.signature,
                                         constexprs=self.constexprs, attrs=attrs)
