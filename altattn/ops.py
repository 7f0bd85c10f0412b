"""Every family's differentiable op, generated from one declaration (`OpDecl`): its torch.library ops
`altattn::<family>_fwd` / `_bwd` with fake implementations and autograd, and an eager path.

A family declares its forward pass's arguments (the differentiable `inputs`, then `params`, then
the `optional` differentiable tensors that may be None, in the order of the pass's `validate`),
its `outputs`, the outputs its backward reads (`saved`), and on the CPU the fp64 reference
(`cpu_forward`, `cpu_backward`) and the outputs' shapes (`fake`). The backward pass then takes
(one incoming gradient per output, *inputs, *saved, *params, *optional): the order of every
family's `Backward.validate`; it returns one gradient per input, then one per optional tensor
given (not None). The backward op returns one per input and per optional tensor (None for one
not given), as autograd wants them.

`Op.__call__(spec, *args, variant=, bwd_variant=, deterministic=)` with a spec the caller
validated:
- CUDA tensors, eager: the launch plans directly (altattn.launcher.plan; no torch.library round
  trip). Without grad, the forward plan only; with grad, a torch.autograd.Function whose backward
  runs the backward plan (picked when the backward runs; `bwd_variant` is checked at the forward,
  cached). Unused outputs' gradients stay None (not materialised as zeros).
- each family's `attention` is `launcher.remembered`, and so is the eager backward
  (`_backward_plan`): a call signature seen before replays the plan's launch, through
  `_Eager.apply` where it takes grad.
- under torch.compile, and on CPU tensors: the torch.library op (fake implementations let
  `torch.compile(fullgraph=True)` trace it; `torch.library.opcheck` checks it). On the CPU it runs
  the fp64 reference and its closed-form backward, cast to the inputs' dtype.
"""
from __future__ import annotations

import functools
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
    fake: Callable                         # (*inputs, *rest) -> outputs, empty, right dtypes
    cpu_forward: Callable                  # (*inputs, *rest) -> outputs (fp64 reference)
    cpu_backward: Callable                 # (grads, inputs, rest) -> input gradients
    optional: tuple[str, ...] = ()         # differentiable tensors that may be None, after params
    # (rest: the params, then the optional tensors; what the gradients are: module docstring)
    # the ops' names, altattn::<name>_fwd / _bwd (default the family's), and the pass records
    # the eager and GPU paths run (default the family's "fwd" and "bwd"; another calling
    # convention of the same kernels, e.g. packed sequences, brings its own)
    name: str = ""
    passes: tuple | None = None            # (forward's record, backward's record)


def _schema(decl: OpDecl) -> tuple[str, str]:
    """The forward's and the backward's torch.library schemas."""
    ins = ", ".join(f"Tensor {n}" for n in decl.inputs)
    rest = ", ".join([f"{t} {n}" for n, t in decl.params]
                     + [f"Tensor? {n}" for n in decl.optional])
    outs = ", ".join("Tensor" for _ in decl.outputs)
    grads = ", ".join(f"Tensor? d{n}" for n in decl.outputs)
    saved = ", ".join(f"Tensor {n}" for n in decl.saved)
    in_grads = ", ".join(["Tensor" for _ in decl.inputs] + ["Tensor?" for _ in decl.optional])
    return (f"({ins}, {rest}, {CONTROL}) -> ({outs})",
            f"({grads}, {ins}, {saved}, {rest}, str variant, bool deterministic) "
            f"-> ({in_grads})")


class Op:
    """One family's op (module docstring)."""

    def __init__(self, decl: OpDecl):
        self.decl = decl
        self.n_in, self.n_out = len(decl.inputs), len(decl.outputs)
        self.n_params, self.n_opt = len(decl.params), len(decl.optional)
        self.saved_idx = tuple(decl.outputs.index(n) for n in decl.saved)
        fam = registry.get_family(decl.family)
        self.fwd_io, self.bwd_io = decl.passes or (fam.passes["fwd"], fam.passes["bwd"])
        self._checked: set = set()
        self._backward_plan = launcher.remembered(self._run_backward)
        fwd_schema, bwd_schema = _schema(decl)
        name = f"altattn::{decl.name or decl.family}_"
        self.fwd_op = torch.library.custom_op(name + "fwd", self._fwd_impl, mutates_args=(),
                                              schema=fwd_schema)
        self.fwd_op.register_fake(lambda *a: decl.fake(*a[:-3]))
        self.bwd_op = torch.library.custom_op(name + "bwd", self._bwd_impl, mutates_args=(),
                                              schema=bwd_schema)
        self.bwd_op.register_fake(self._bwd_fake)
        self.fwd_op.register_autograd(self._op_backward, setup_context=self._op_setup)

    def _split(self, args) -> tuple[tuple, tuple, tuple]:
        """The forward's arguments as (inputs, params, optional)."""
        n = self.n_in + self.n_params
        return tuple(args[:self.n_in]), tuple(args[self.n_in:n]), tuple(args[n:])

    def _input_grads(self, dx, optional) -> tuple:
        """A pass's or cpu_backward's gradients (one per input, then one per optional tensor
        given) as the backward op returns them: one per input and per optional tensor, None for
        an optional tensor not given."""
        dx = iter(dx)
        grads = [next(dx) for _ in range(self.n_in)]
        return (*grads, *(None if t is None else next(dx) for t in optional))

    # ---- the torch.library ops (compile, CPU) ----------------------------------------------

    def _fwd_impl(self, *args):
        args, (variant, _bwd, _det) = args[:-3], args[-3:]
        if args[0].device.type == "cpu":
            outs = self.decl.cpu_forward(*args)
            return tuple(o.to(f.dtype).contiguous() for o, f in zip(outs, self.decl.fake(*args)))
        with torch.no_grad():
            return launcher.run_call(self.decl.family, "fwd", self.fwd_io.validate(*args),
                                     variant, io=self.fwd_io)

    def _bwd_parts(self, args) -> tuple[tuple, tuple, tuple, tuple]:
        """The backward's arguments (without the two controls) as (grads, inputs, rest,
        optional): rest is the params and the optional tensors."""
        grads, inputs = args[:self.n_out], args[self.n_out:self.n_out + self.n_in]
        rest = args[self.n_out + self.n_in + len(self.decl.saved):]
        return grads, inputs, rest, rest[self.n_params:]

    def _bwd_impl(self, *args):
        (variant, deterministic), args = args[-2:], args[:-2]
        grads, inputs, rest, optional = self._bwd_parts(args)
        if inputs[0].device.type == "cpu":
            dx = self._input_grads(self.decl.cpu_backward(grads, inputs, rest), optional)
            return tuple(None if g is None else g.to(t.dtype).contiguous()
                         for g, t in zip(dx, (*inputs, *optional)))
        call = self.bwd_io.validate(*args)
        return self._input_grads(launcher.run_call(self.decl.family, "bwd", call, variant,
                                                   deterministic, io=self.bwd_io), optional)

    def _bwd_fake(self, *args):
        _, inputs, _, optional = self._bwd_parts(args[:-2])
        dense = torch.contiguous_format
        return tuple(None if t is None else torch.empty_like(t, memory_format=dense)
                     for t in (*inputs, *optional))

    def _op_setup(self, ctx, inputs, output):
        args, ctx.control = inputs[:-3], inputs[-2:]
        x, ctx.params, optional = self._split(args)
        ctx.save_for_backward(*x, *optional, *(output[i] for i in self.saved_idx))

    def _op_backward(self, ctx, *grads):
        bwd_variant, deterministic = ctx.control
        saved, n = ctx.saved_tensors, self.n_in + self.n_opt
        x, optional = saved[:self.n_in], saved[self.n_in:n]
        dx = self.bwd_op(*grads, *x, *saved[n:], *ctx.params, *optional, bwd_variant,
                         deterministic)
        return (*dx[:self.n_in], *(None for _ in ctx.params), *dx[self.n_in:], None, None, None)

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
        inputs, _, optional = self._split(args)
        grad = torch.is_grad_enabled() and torch._C._any_requires_grad(
            *inputs, *(t for t in optional if t is not None))
        if grad:  # a backward variant that cannot take the spec: an error now, not at backward
            launcher.choose(spec, bwd_variant, x.device, "bwd", deterministic, family=fam)
        if type(x) is not torch.Tensor:  # fake tensors (shape propagation): the op's fake
            return self.fwd_op(*args, variant, bwd_variant, deterministic)
        call = self.fwd_io.bind(spec, *args)
        plan = launcher.plan(fam, "fwd", spec, variant, False, x.device,
                             launcher.missing(self.fwd_io, call), io=self.fwd_io)
        if not grad:
            return plan.execute(call)
        control = (bwd_variant, deterministic)
        if launcher._REC.on is not None:  # remembered: later calls replay the plan in _Eager
            launcher._REC.on.through(
                lambda run, *a: _Eager.apply(self, run, spec, control, *a), args)
        return _Eager.apply(self, functools.partial(plan.execute, call), spec, control, *args)

    def backward(self, spec, control, grads, inputs, saved, rest) -> tuple:
        """The input gradients (eager): the backward plan of `spec` on the incoming `grads`
        (None where an output was unused; the first output's then counts as zeros), one per
        input and per optional tensor of `rest` (the params, then the optional tensors)."""
        if grads[0] is None:
            grads = (torch.zeros_like(self.decl.fake(*inputs, *rest)[0]), *grads[1:])
        dx = self._backward_plan(spec, *control, *grads, *inputs, *saved, *rest)
        return self._input_grads(dx, rest[self.n_params:])

    def _run_backward(self, spec, bwd_variant, deterministic, *args) -> tuple:
        """The backward plan of `spec` on the backward pass's arguments `args` (remembered by
        signature: `_backward_plan`)."""
        call = self.bwd_io.bind(spec, *args)
        return launcher.run_call(self.decl.family, "bwd", call, bwd_variant, deterministic,
                                 io=self.bwd_io)


class _Eager(torch.autograd.Function):
    """The eager op with grad: the forward plan, and the backward plan at backward time."""

    @staticmethod
    def forward(ctx, op: Op, run, spec, control, *args):
        outs = run()  # the forward plan's outputs (Plan.execute, or a remembered call's Replay)
        ctx.set_materialize_grads(False)
        x, params, optional = op._split(args)
        ctx.save_for_backward(*x, *optional, *(outs[i] for i in op.saved_idx))
        ctx.op, ctx.spec, ctx.control, ctx.params = op, spec, control, params
        return outs

    @staticmethod
    def backward(ctx, *grads):
        op = ctx.op
        saved, n = ctx.saved_tensors, op.n_in + op.n_opt
        x, optional = saved[:op.n_in], saved[op.n_in:n]
        dx = op.backward(ctx.spec, ctx.control, grads, x, saved[n:], (*ctx.params, *optional))
        return (None, None, None, None, *dx[:op.n_in], *(None for _ in ctx.params),
                *dx[op.n_in:])


def make_op(decl: OpDecl) -> Op:
    """The op of a family's declaration (module docstring)."""
    return Op(decl)
