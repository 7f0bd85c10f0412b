"""A thin launch: a kernel whose grid and constexprs a launch plan fixed, called with its runtime
arguments only, and TMA descriptors whose layout was checked once.

`Kernel(fn, grid, **options)` is `fn[grid](*args, **kw, **options)`, where `options` are the
kernel's constexprs and num_warps / num_stages, and `kw` the runtime arguments a kernel takes after
its constexprs (a packed launch's token maps and split count), the same names at every call.
Its first call goes through Triton's JIT (specialize, find or compile, launch) and keeps the
compiled kernel; every later call hands the runtime arguments straight to the compiled kernel's
C dispatcher (fbtriton's `_TritonDispatcher`: cuLaunchKernelEx, TMA descriptors encoded in C),
skipping the JIT's binder, cache key and Python launcher (what each costs a launch, measured:
docs/perf-call.md). A kernel of more than MAX_TMA_DESCS descriptors or MAX_PARAMS parameters
gets no dispatcher (below).

What makes this exact: Triton specializes a launch on each argument's type, on integers equal to 1
or divisible by 16, and on pointers 16-byte aligned. A plan is made per problem spec, so every
integer a kernel gets is a function of the spec; tensors reach kernels dense and 16-byte aligned
(the launcher's `dense_aligned`, `output`); an argument that may be None (an unused incoming
gradient) is part of the plan's key. So the first call's compiled kernel is every later call's.
`ALTATTN_CHECK_LAUNCH=1` checks that on every call (the GPU tests set it): the JIT's own lookup
must find the kept kernel, else AssertionError; and that every kernel's first call found its C
dispatcher (no hook set), else AssertionError saying why (e.g. over MAX_TMA_DESCS descriptors).

Launch hooks (Proton's, a debugger's) see only launches through the JIT: while one is set, and for
Proton-scoped kernels (`PROFILE`), every call takes the JIT path. A thread's first launch makes
the device's CUDA context current there (`_context_current`).

One declaration of a kernel's arguments: the launch call. `recorded(run, *args)` runs a prepared
launch with its Kernels' calls recorded instead of made (`Launch`: the function, each runtime
argument's Triton type as the JIT derives it from the value, the constexprs, warps and stages);
on meta tensors (`meta`) it needs no GPU. The compile configs tools.resources compiles for
sm_90a are made that way (`Launch.config`), so they cannot drift from what a launch passes.
"""
from __future__ import annotations

import functools
import json
import os
import threading
from typing import NamedTuple

import torch
import triton
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

CHECK = os.environ.get("ALTATTN_CHECK_LAUNCH", "0") == "1"
# fbtriton 3.7.4's C dispatcher takes at most this many TMA descriptors a kernel (driver.c,
# TD_MAX_TMA_DESCS): a kernel with more gets none and runs through the JIT's launcher at every
# call (measured: ~40 µs of host a launch more). Every compile config stays within it
# (tests/spine/test_compile.py); a kernel with more takes some tensors by pointer.
MAX_TMA_DESCS = 8
# ... and at most this many parameters (TD_MAX_KERNEL_ARGS 64 less the two scratch pointers),
# counted flat: a runtime scalar or pointer is 1, an n-D TMA descriptor 1 + 2n (its map, shapes
# and strides), constexprs 0
MAX_PARAMS = 62
_RUNTIME = triton.knobs.runtime
# the current device and its current stream (what Triton launches on); absent from CPU builds of
# torch, where no kernel launches
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_THREAD = threading.local()  # .ready: this thread has a current CUDA context


def _context_current() -> None:
    """Make the current device's primary CUDA context current on this thread (once a thread).
    Triton's launches call the driver API, which needs one, and a thread that has made no CUDA
    runtime call has none (a fresh thread, possibly the autograd engine's): the TMA descriptor
    encoding fails there with "invalid device context". cuCtxSetCurrent is legal while a stream
    captures a graph."""
    triton.runtime.driver.active.utils.set_current_device(_get_device())
    _THREAD.ready = True


def _dispatcher(compiled):
    """(dispatcher, indices of the runtime arguments among the kernel's parameters), or None
    where this Triton has no C dispatcher for the kernel."""
    try:
        from triton.backends.nvidia.triton_dispatcher_factory import make_triton_dispatcher
        schema = json.loads(compiled.asm["launch_metadata"])
        compiled._init_handles()
        disp = make_triton_dispatcher(schema, compiled.function)
    except (ImportError, KeyError, TypeError, ValueError, RuntimeError):
        return None
    if disp is None or schema.get("profile_scratch_size", 0):
        return None
    return disp, tuple(a["index"] for a in schema["args"])


def _no_dispatcher(name: str, compiled, found) -> str:
    """Why a kernel's later calls would go through the JIT's launcher (~40 µs of host each)."""
    if found is not None:
        return (f"{name}: its C dispatcher takes a parameter that is neither a positional "
                f"argument nor a keyword of the launch call")
    try:
        types = [a["type"] for a in json.loads(compiled.asm["launch_metadata"])["args"]]
    except (KeyError, TypeError, ValueError):
        return f"{name}: this Triton gives it no C dispatcher (no launch metadata)"
    descs, params = sum(t.startswith("tensordesc") for t in types), flat_params(types)
    if descs > MAX_TMA_DESCS or params > MAX_PARAMS:
        return (f"{name}: no C dispatcher for its {descs} TMA descriptors and {params} "
                f"parameters (at most {MAX_TMA_DESCS} and {MAX_PARAMS}: take some tensors by "
                f"pointer)")
    return f"{name}: this Triton gives it no C dispatcher"


def flat_params(types) -> int:
    """The parameters the C dispatcher passes for a kernel's runtime argument types (Triton's
    type strings: "*bf16", "i32", "tensordesc<bf16[1,64,32]>"; "constexpr" takes none)."""
    return sum(0 if t == "constexpr" else
               1 + 2 * (t.split("[", 1)[1].count(",") + 1) if t.startswith("tensordesc") else 1
               for t in map(str, types))


class Kernel:
    """`fn[grid](*args, **kw, **options)`, args positional and in the kernel's parameter order, kw
    the runtime arguments after its constexprs; the grid and options fixed (module docstring)."""

    __slots__ = ("fn", "grid", "options", "compiled", "_disp", "_idx", "_kw", "_all", "_g")

    def __init__(self, fn, grid, **options):
        self.fn, self.grid, self.options = fn, tuple(grid), options
        self._g = (*self.grid, 1, 1)[:3]
        self.compiled = self._disp = self._idx = None
        self._kw: tuple = ()
        self._all = False

    def __call__(self, *args, **kw) -> None:
        if not getattr(_THREAD, "ready", False):
            _context_current()
        disp = self._disp
        if disp is None or _RUNTIME.launch_enter_hook or _RUNTIME.launch_exit_hook:
            self._jit(args, kw)
            return
        if CHECK:
            self._check(args, kw)
        if kw:
            args = (*args, *[kw[n] for n in self._kw])
        g0, g1, g2 = self._g
        stream = _get_stream(_get_device())
        if self._all:
            disp(g0, g1, g2, stream, *args)
        else:
            disp(g0, g1, g2, stream, *[args[i] for i in self._idx])

    def _jit(self, args, kw) -> None:
        """The JIT's launch; the first one keeps the compiled kernel and its dispatcher."""
        compiled = self.fn[self.grid](*args, **kw, **self.options)
        if self.compiled is None and not self.options.get("PROFILE"):
            self.compiled = compiled
            found = _dispatcher(compiled)
            if found is not None:
                self._bind(found, len(args), kw)
            if CHECK and self._disp is None and not (_RUNTIME.launch_enter_hook
                                                     or _RUNTIME.launch_exit_hook):
                raise AssertionError(_no_dispatcher(self.fn.__name__, compiled, found))

    def _bind(self, found, n_args: int, kw: dict) -> None:
        """Keep the dispatcher where every runtime parameter it takes is one of the call's
        arguments: positions into (*args, *kw's values in parameter order)."""
        disp, index = found
        names = self.fn.arg_names
        self._kw = tuple(sorted(kw, key=names.index))
        at = {**{i: i for i in range(n_args)},
              **{names.index(n): n_args + j for j, n in enumerate(self._kw)}}
        if all(i in at for i in index):
            self._disp, self._idx = disp, tuple(at[i] for i in index)
            self._all = self._idx == tuple(range(n_args + len(self._kw)))

    def _check(self, args, kw) -> None:
        found = self.fn.warmup(*args, grid=self.grid, **kw, **self.options)
        assert found is self.compiled, (
            f"{self.fn.__name__}: these arguments specialize another compiled kernel than the "
            f"plan's first call (an integer or a pointer's alignment changed within one plan)")


class Launch(NamedTuple):
    """One recorded Kernel call (module docstring): what decides the compiled kernel."""

    fn: object
    signature: dict     # every argument passed, in parameter order -> Triton type or "constexpr"
    constexprs: dict    # constexpr arguments (and runtime ones passed None) -> value
    num_warps: int
    num_stages: int

    @classmethod
    def of(cls, kernel: Kernel, args: tuple, kw: dict) -> Launch:
        given = {**dict(zip(kernel.fn.arg_names, args)), **kw}
        options = {k: v for k, v in kernel.options.items() if k not in _LAUNCH_OPTIONS}
        sig, consts = {}, {}
        for p in kernel.fn.params:
            name = p.name
            if name in options or (name in given and given[name] is None):
                sig[name], consts[name] = "constexpr", options.get(name)
            elif name in given:  # the type the JIT specializes on ("tensordesc<bf16[1,128,64]>")
                sig[name] = mangle_type(given[name]).replace(" ", "")
            elif p.has_default and (p.is_constexpr or p.default is None):
                # a default the JIT binds (a compile config without it is compiled otherwise:
                # ASTSource applies no defaults)
                sig[name], consts[name] = "constexpr", p.default
        return cls(kernel.fn, sig, consts, kernel.options.get("num_warps", 4),
                   kernel.options.get("num_stages", 3))

    def config(self, name: str):
        """This launch as a compile config named `name` (altattn.registry.CompileConfig)."""
        from altattn.registry import CompileConfig
        return CompileConfig(name, self.fn, self.signature, self.constexprs, self.num_warps,
                             self.num_stages)


_LAUNCH_OPTIONS = ("num_warps", "num_stages")


def recorded(run, *args, **kw) -> list[Launch]:
    """The Kernel calls `run(*args, **kw)` makes, recorded, none made (module docstring); while
    it runs, `sm_count()` is RECORD_SMS (no GPU needed). Swaps Kernel's call for the duration (the
    launch path checks nothing per call), so no other thread may launch meanwhile: for compile
    configs and tests, never on a hot path."""
    global _recording
    launches: list[Launch] = []
    call = Kernel.__call__
    Kernel.__call__ = lambda self, *a, **k: launches.append(Launch.of(self, a, k))
    _recording = True
    try:
        run(*args, **kw)
    finally:
        Kernel.__call__, _recording = call, False
    return launches


def compile_configs(prepare, args: tuple, name) -> list:
    """The compile configs of the launches `prepare()(*args)` makes (`recorded`, prepare too:
    it may ask sm_count): each named `name(launch)`, left out where that is None (a helper
    kernel the caller does not report)."""
    out = []
    for launch in recorded(lambda: prepare()(*args)):
        n = name(launch)
        if n is not None:
            out.append(launch.config(n))
    return out


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A tensor of this shape and dtype with no storage (what `recorded` runs take)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def constexprs(cfg: dict) -> dict:
    """A config's constexprs: everything but num_warps / num_stages (the launch options)."""
    return {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}


RECORD_SMS = 132  # an H100 SXM's multiprocessors: what a recorded run sees (no GPU there)
_recording = False


def sm_count(device_index: int | None = None) -> int:
    """Multiprocessors of the GPU `device_index` (None: the current one); RECORD_SMS within
    `recorded`."""
    return RECORD_SMS if _recording else _sm_count(device_index)


@functools.cache
def _sm_count(device_index: int | None) -> int:
    if device_index is None:
        device_index = torch.cuda.current_device()
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class Desc:
    """The TMA layout of a tensor (shape, strides, block shape), checked by Triton's
    TensorDescriptor on the first call; `desc(t)` is a descriptor of `t` in that layout (t of
    the first call's dtype, contiguous, 16-byte aligned: what the launcher hands kernels)."""

    __slots__ = ("shape", "strides", "block_shape", "_checked")

    def __init__(self, shape, strides, block_shape):
        self.shape, self.strides = [int(s) for s in shape], [int(s) for s in strides]
        self.block_shape = [int(b) for b in block_shape]
        self._checked = False

    def __call__(self, t: torch.Tensor) -> TensorDescriptor:
        if not self._checked:
            self._checked = True
            return TensorDescriptor(t, self.shape, self.strides, self.block_shape)
        return _Checked(t, self.shape, self.strides, self.block_shape)


class _Checked(TensorDescriptor):
    """A TensorDescriptor whose layout Desc checked before (no __post_init__ checks)."""

    def __init__(self, base, shape, strides, block_shape):  # noqa: D107 (dataclass fields)
        self.base, self.shape, self.strides, self.block_shape = base, shape, strides, block_shape
        self.padding, self.round_f32_to_tf32 = "zero", False
