"""Every family's differentiable op, generated from one declaration (`OpDecl`): its torch.library ops
`altattn::<family>_fwd` / `_bwd` with fake implementations and autograd, and an eager path.

A family declares its forward pass's arguments (the differentiable `inputs`, then `params`, in the
order of the pass's `validate`), its `outputs`, the outputs its backward reads (`saved`), and on
the CPU the fp64 reference (`cpu_forward`, `cpu_backward`) and the outputs' shapes (`fake`). The
backward pass then takes (one incoming gradient per output, *inputs, *saved, *params): the order
of every family's `Backward.validate`.

`Op.__call__(spec, *args, variant=, bwd_variant=, deterministic=)` with a spec the caller
validated:
- CUDA tensors, eager: the launch plans directly (altattn.launcher.plan; no torch.library round
  trip). Without grad, the forward plan only; with grad, a torch.autograd.Function whose backward
  runs the backward plan (picked when the backward runs; `bwd_variant` is checked at the forward,
  cached). Unused outputs' gradients stay None (not materialised as zeros).
- under torch.compile, and on CPU tensors: the torch.library op (fake implementations let
  `torch.compile(fullgraph=True)` trace it; `torch.library.opcheck` checks it). On the CPU it runs
  the fp64 reference and its closed-form backward, cast to the inputs' dtype.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import launcher, registry

Tensor = torch.Tensor
CONTROL = "str variant, str bwd_variant, bool deterministic"


@dataclass(frozen=True)
class OpDecl:
    family: str
    inputs: tuple[str, ...]                # differentiable tensors (the pass's first arguments)
    params: tuple[tuple[str, str], ...]    # (name, schema type) of the rest, e.g. ("eps", "float")
    outputs: tuple[str, ...]               # the forward's outputs
    saved: tuple[str, ...]                 # outputs the backward pass reads after the inputs
    fake: Callable                         # (*inputs, *params) -> outputs, empty, right dtypes
    cpu_forward: Callable                  # (*inputs, *params) -> outputs (fp64 reference)
    cpu_backward: Callable                 # (grads, inputs, params) -> input gradients


def _schema(decl: OpDecl) -> tuple[str, str]:
    """The forward's and the backward's torch.library schemas."""
    ins = ", ".join(f"Tensor {n}" for n in decl.inputs)
    params = ", ".join(f"{t} {n}" for n, t in decl.params)
    outs = ", ".join("Tensor" for _ in decl.outputs)
    grads = ", ".join(f"Tensor? d{n}" for n in decl.outputs)
    saved = ", ".join(f"Tensor {n}" for n in decl.saved)
    in_grads = ", ".join("Tensor" for _ in decl.inputs)
    return (f"({ins}, {params}, {CONTROL}) -> ({outs})",
            f"({grads}, {ins}, {saved}, {params}, str variant, bool deterministic) "
            f"-> ({in_grads})")


class Op:
    """One family's op (module docstring)."""

    def __init__(self, decl: OpDecl):
        self.decl = decl
        self.n_in, self.n_out = len(decl.inputs), len(decl.outputs)
        self.saved_idx = tuple(decl.outputs.index(n) for n in decl.saved)
        fam = registry.get_family(decl.family)
        self.fwd_io, self.bwd_io = fam.passes["fwd"], fam.passes["bwd"]
        self._checked: set = set()
        fwd_schema, bwd_schema = _schema(decl)
        name = f"altattn::{decl.family}_"
        self.fwd_op = torch.library.custom_op(name + "fwd", self._fwd_impl, mutates_args=(),
                                              schema=fwd_schema)
        self.fwd_op.register_fake(lambda *a: decl.fake(*a[:-3]))
        self.bwd_op = torch.library.custom_op(name + "bwd", self._bwd_impl, mutates_args=(),
                                              schema=bwd_schema)
        self.bwd_op.register_fake(self._bwd_fake)
        self.fwd_op.register_autograd(self._op_backward, setup_context=self._op_setup)

    # ---- the torch.library ops (compile, CPU) ----------------------------------------------

    def _fwd_impl(self, *args):
        args, (variant, _bwd, _det) = args[:-3], args[-3:]
        if args[0].device.type == "cpu":
            outs = self.decl.cpu_forward(*args)
            return tuple(o.to(f.dtype).contiguous() for o, f in zip(outs, self.decl.fake(*args)))
        with torch.no_grad():
            return launcher.run(self.decl.family, "fwd", *args, variant=variant)

    def _bwd_impl(self, *args):
        (variant, deterministic), args = args[-2:], args[:-2]
        grads, inputs = args[:self.n_out], args[self.n_out:self.n_out + self.n_in]
        params = args[self.n_out + self.n_in + len(self.decl.saved):]
        if inputs[0].device.type == "cpu":
            dx = self.decl.cpu_backward(grads, inputs, params)
            return tuple(g.to(t.dtype).contiguous() for g, t in zip(dx, inputs))
        return launcher.run(self.decl.family, "bwd", *args, variant=variant,
                            deterministic=deterministic)

    def _bwd_fake(self, *args):
        inputs = args[self.n_out:self.n_out + self.n_in]
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs)

    def _op_setup(self, ctx, inputs, output):
        args, ctx.control = inputs[:-3], inputs[-2:]
        ctx.save_for_backward(*args[:self.n_in], *(output[i] for i in self.saved_idx))
        ctx.params = args[self.n_in:]

    def _op_backward(self, ctx, *grads):
        bwd_variant, deterministic = ctx.control
        dx = self.bwd_op(*grads, *ctx.saved_tensors, *ctx.params, bwd_variant, deterministic)
        return (*dx, *(None for _ in range(len(ctx.params) + 3)))

    # ---- the call --------------------------------------------------------------------------

    def check_names(self, variant, bwd_variant, deterministic) -> None:
        """launcher.check_variant_names for this family, once per combination."""
        key = (variant, bwd_variant, deterministic)
        if key not in self._checked:
            launcher.check_variant_names(self.decl.family, variant, bwd_variant, deterministic)
            self._checked.add(key)

    def __call__(self, spec, *args, variant: str = "auto", bwd_variant: str = "auto",
                 deterministic: bool = False) -> tuple:
        """The outputs of the forward on `args` (the pass's arguments, `spec` their validated
        spec, the names checked by `check_names`), differentiable."""
        x = args[0]
        if torch.compiler.is_compiling() or x.device.type != "cuda":
            return self.fwd_op(*args, variant, bwd_variant, deterministic)
        fam = self.decl.family
        grad = torch.is_grad_enabled() and torch._C._any_requires_grad(*args[:self.n_in])
        if grad:  # a backward variant that cannot take the spec: an error now, not at backward
            launcher.choose(spec, bwd_variant, x.device, "bwd", deterministic, family=fam)
        if type(x) is not torch.Tensor:  # fake tensors (shape propagation): the op's fake
            return self.fwd_op(*args, variant, bwd_variant, deterministic)
        plan = launcher.plan(fam, "fwd", spec, variant, False, x.device)
        if not grad:
            return plan.execute(self.fwd_io.bind(spec, *args))
        return _Eager.apply(self, plan, spec, (bwd_variant, deterministic), *args)

    def backward(self, spec, control, grads, inputs, saved, params) -> tuple:
        """The input gradients (eager): the backward plan of `spec` on the incoming `grads`
        (None where an output was unused; the first output's then counts as zeros)."""
        bwd_variant, deterministic = control
        if grads[0] is None:
            grads = (torch.zeros_like(self.decl.fake(*inputs, *params)[0]), *grads[1:])
        call = self.bwd_io.bind(spec, *grads, *inputs, *saved, *params)
        return launcher.run_call(self.decl.family, "bwd", call, bwd_variant, deterministic,
                                 io=self.bwd_io)


class _Eager(torch.autograd.Function):
    """The eager op with grad: the forward plan, and the backward plan at backward time."""

    @staticmethod
    def forward(ctx, op: Op, plan, spec, control, *args):
        outs = plan.execute(op.fwd_io.bind(spec, *args))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*args[:op.n_in], *(outs[i] for i in op.saved_idx))
        ctx.op, ctx.spec, ctx.control, ctx.params = op, spec, control, args[op.n_in:]
        return outs

    @staticmethod
    def backward(ctx, *grads):
        op = ctx.op
        saved = ctx.saved_tensors
        dx = op.backward(ctx.spec, ctx.control, grads, saved[:op.n_in], saved[op.n_in:],
                         ctx.params)
        return (None, None, None, None, *dx, *(None for _ in ctx.params))


def make_op(decl: OpDecl) -> Op:
    """The op of a family's declaration (module docstring)."""
    return Op(decl)
