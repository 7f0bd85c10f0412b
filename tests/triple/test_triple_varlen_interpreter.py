"""The packed triple-attention kernels' logic in Triton's CPU interpreter (no GPU): the device maps,
`scan_kernel` (sums, prefixes, suffixes), `partials` over splits and `apply` / the intra
kernels over tiles (the Triton variant's kernels), and the TLX kernel's padded copy of X1,
against the fp64 reference of each sequence alone. Small shapes, causal chunks of 128 tokens (so
that sequences span several). The GPU runs them for real: test_gpu_triple_varlen.py.

fbtriton 3.7.4's interpreter needs two patches here (PATCH): its `create_dot` lacks the fork's
extra argument, and it does bf16 arithmetic on the raw uint16 words; both are redone in fp32
with bf16 rounding, as the GPU does.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

PATCH = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
import numpy as np
import triton.language as tl
from triton.runtime import interpreter as I
B = I.InterpreterBuilder
def f32(h):
    if h.dtype.scalar == tl.bfloat16:
        return I._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
    return h.data
def bf16(a):
    return I.TensorHandle(I._convert_float(a.astype(np.float32), tl.float32, tl.bfloat16,
                                           None).view(np.uint16), tl.bfloat16)
def dot(self, a, b, d, ip, mnia, *rest):
    out = np.matmul(f32(a).astype(np.float32), f32(b).astype(np.float32)) + f32(d)
    if d.dtype.scalar == tl.bfloat16:
        return bf16(out)
    return I.TensorHandle(out.astype(d.data.dtype), d.dtype.scalar)
B.create_dot = dot
binary = B.binary_op
def binary_op(self, lhs, rhs, op):
    if lhs.dtype.scalar == tl.bfloat16 and op in (np.add, np.multiply, np.subtract, np.divide):
        return bf16(op(f32(lhs), f32(rhs)))
    return binary(self, lhs, rhs, op)
B.binary_op = binary_op
for name, op in (("create_fadd", np.add), ("create_fmul", np.multiply),
                 ("create_fsub", np.subtract), ("create_fdiv", np.divide)):
    setattr(B, name, (lambda o: lambda self, l, r: self.binary_op(l, r, o))(op))
store = B.create_descriptor_store
B.create_descriptor_store = lambda self, desc, value, idx, *rest: store(self, desc, value, idx)
from kernels_triton import launch
launch._THREAD.ready = True
launch._dispatcher = lambda compiled: None
launch._sm_count = lambda i=None: 4
"""

PROBE = """
import torch
from altattn.triple.reference import reference, reference_backward
from kernels_triton.triple import host, varlen as kv
kv.CHUNK = 128  # causal chunks of 128 tokens: several a sequence at small T
torch.manual_seed(0)
H, Dq, Dv = 1, 32, 32
lengths = [150, 0, 1, 129]
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
T, n = int(cu[-1]), len(lengths)
x = [torch.randn(1, T, H, d).bfloat16() for d in (Dq, Dq, Dq, Dq, Dv)]
init = 0.1 * torch.randn(n, H, Dq, Dv, Dq)
dout = torch.randn(1, T, H, Dv).bfloat16()
dstate = 0.1 * torch.randn(n, H, Dq, Dv, Dq)
worst = 0.0
for causal, scale, S0 in ((False, None, None), (True, 0.01, init)):
    plan = kv.Plan(T, n, H, Dq, Dv, causal, host)
    maps = plan.maps(cu, scale)
    out, state = plan.forward(*x, maps, S0)
    got = (out, state, *plan.backward(*x, maps, state, dout, dstate, S0))
    for s, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        xs = [t[:, a:b] for t in x]
        i0 = None if S0 is None else S0[s:s + 1]
        want = (*reference(*xs, scale, causal, i0),
                *reference_backward(*xs, dout[:, a:b], dstate[s:s + 1], scale, causal, i0))
        for g, w in zip(got, want):
            g = g[:, a:b] if g.dim() == 4 else g[s:s + 1]
            if w.norm() > 0 and b - a == 1:  # one token: no rounding averages away
                assert float((g.double() - w).norm() / w.norm()) < 0.15
            elif w.norm() > 0:
                worst = max(worst, float((g.double() - w).norm() / w.norm()))
            else:
                assert float(g.abs().sum()) == 0.0
print("worst", worst)
assert worst < 3e-2, worst
print("ok")
"""


@pytest.mark.slow
def test_packed_kernels_in_the_interpreter():
    """Non-causal with scale None and causal with a scale, an initial state and a dstate: out,
    states, the five gradients and initial_state's, per sequence (empty, one token, several
    chunks), within bf16 rounding of the fp64 reference."""
    p = subprocess.run([sys.executable, "-c", PATCH.format(root=str(ROOT)) + PROBE],
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr[-3000:]
