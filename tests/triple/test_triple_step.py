"""Triple attention's decoding step (altattn.triple.step) on the CPU: steps of any sizes give the
rows and the final state of one causal call from the same initial state; bad input is refused
naming the argument; the kernel (kernels_triton/triple/step.py, no tensor cores) runs in Triton's
CPU interpreter against the same math."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from altattn.triple import attention, step
from conftest import ROOT

SCALE = 0.05
pytestmark = pytest.mark.usefixtures("tiny_dims")  # Dq, Dv of 2 and 3 on the CPU path


def _tokens(gen, B, N, H, Dq, Dv, dtype=torch.float64):
    return [torch.randn(B, N, H, d, generator=gen, dtype=torch.float64).to(dtype)
            for d in (Dq, Dq, Dq, Dq, Dv)]


@pytest.mark.parametrize("cuts", [(1,) * 7, (3, 4), (7,), (2, 0, 5)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_steps_equal_one_causal_call(cuts, dtype, gen):
    """Token by token, or T at a time (T = 0 a no-op): out rows and final state as one causal
    call from the same initial state (fp64 math either way; bf16 rounds only the outputs)."""
    B, H, Dq, Dv = 2, 3, 2, 3
    x = _tokens(gen, B, sum(cuts), H, Dq, Dv, dtype)
    s0 = torch.randn(B, H, Dq, Dv, Dq, generator=gen, dtype=torch.float64)
    want, want_state = attention(*x, scale=SCALE, causal=True, initial_state=s0.clone())
    state, outs, a = s0.clone(), [], 0
    for n in cuts:
        out = step(*(t[:, a:a + n] for t in x), state, scale=SCALE)
        assert out.shape == (B, n, H, Dv) and out.dtype == dtype
        outs.append(out)
        a += n
    torch.testing.assert_close(torch.cat(outs, 1).double(), want.double(), rtol=1e-12,
                               atol=1e-12 if dtype == torch.float64 else 0.02 * want.abs().max())
    tol = 1e-12 if want_state.dtype == torch.float64 else 1e-6  # the op's fp32 state for bf16
    torch.testing.assert_close(state, want_state.double(), rtol=tol, atol=tol)


def test_state_is_updated_in_place_in_its_dtype(gen):
    """In place, in its dtype, and its version counter moves (a graph that saved the state,
    e.g. a differentiable call's returned one, then refuses a backward through it)."""
    x = _tokens(gen, 1, 2, 2, 3, 2)
    state = torch.zeros(1, 2, 3, 2, 3)  # fp32 on the CPU too
    ptr, version = state.data_ptr(), state._version
    step(*x, state, scale=1.0)
    _, want = attention(*x, scale=1.0, causal=True)
    assert state.data_ptr() == ptr and state.dtype == torch.float32
    assert state._version > version
    torch.testing.assert_close(state, want.float())


@pytest.mark.parametrize("change,kind,words", [
    ({"scale": None}, ValueError, "step needs scale explicitly"),
    ({"state": torch.zeros(1, 2, 3, 3, 2)}, ValueError, "state must have shape (1, 2, 3, 3, 3)"),
    ({"state": torch.zeros(1, 2, 3, 3, 3, dtype=torch.float16)}, TypeError, "state must have a "
     "dtype"),
    ({"state": torch.zeros(1, 2, 3, 3, 6)[..., ::2]}, ValueError, "state must be contiguous"),
    ({"state": [0.0]}, TypeError, "state must be a torch.Tensor"),
    ({"state": None}, TypeError, "state must be a torch.Tensor"),
    ({"k1": torch.zeros(1, 3, 2, 3)}, ValueError, "k1 must have q1's shape"),
    ({"scale": -1.0}, ValueError, "scale"),
])
def test_bad_input_is_refused_naming_it(change, kind, words):
    args = dict(zip(("q1", "q2", "k1", "k2", "v"), [torch.zeros(1, 2, 2, 3)] * 5),
                state=torch.zeros(1, 2, 3, 3, 3), scale=1.0)
    args.update(change)
    with pytest.raises(kind, match=words.replace("(", r"\(").replace(")", r"\)")):
        step(args.pop("q1"), args.pop("q2"), args.pop("k1"), args.pop("k2"), args.pop("v"),
             args.pop("state"), **args)


def test_inputs_that_require_grad_are_refused():
    x = [torch.zeros(1, 1, 1, 2, requires_grad=True)] + [torch.zeros(1, 1, 1, 2)] * 4
    with pytest.raises(ValueError, match="inference path"):
        step(*x, torch.zeros(1, 1, 2, 2, 2), scale=1.0)
    with torch.no_grad():
        step(*x, torch.zeros(1, 1, 2, 2, 2), scale=1.0)


STEP_PROBE = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
import torch, triton
from altattn.triple.decode import _step_reference
from kernels_triton.triple import step as st
torch.manual_seed(0)
for B, T, H, Dq, Dv in [(2, 1, 3, 32, 64), (1, 11, 2, 32, 32), (2, 3, 1, 64, 32)]:
    x = [torch.randn(B, T, H, d).to(torch.bfloat16) for d in (Dq, Dq, Dq, Dq, Dv)]
    state = torch.randn(B, H, Dq, Dv, Dq)
    want_state = state.clone()
    want = _step_reference(*x, want_state, 0.25).float()
    out = torch.full((B, T, H, Dv), float("nan"), dtype=torch.bfloat16)
    for t0 in range(0, T, st.MAX_T):  # prepare_step's launches, through the JIT directly
        n = min(st.MAX_T, T - t0)
        st.step_kernel[(B * H, triton.cdiv(Dv, st.BLOCK_J))](
            *x, state, out, n, t0, T, 0.25, H=H, DQ=Dq, DV=Dv, BJ=st.BLOCK_J, BT=st.block_t(n))
    # fp32 sums against fp64: the state to fp32 rounding, out to one bf16 step
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max())
print("ok")
"""


def test_step_kernel_in_the_interpreter():
    """The kernel in Triton's CPU interpreter: one token, more tokens than one launch takes
    (MAX_T), Dv wider than a program's block of j, Dq != Dv; out poisoned with NaN first."""
    p = subprocess.run([sys.executable, "-c", STEP_PROBE.format(root=str(ROOT))],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_launches_are_made_per_device():
    """prepare_step is remembered per shape and device (a Kernel keeps one device's compiled
    kernel), and chains ceil(T / MAX_T) launches."""
    from kernels_triton.triple import step as st
    assert st.prepare_step(1, 3, 2, 32, 32, 0) is st.prepare_step(1, 3, 2, 32, 32, 0)
    assert st.prepare_step(1, 3, 2, 32, 32, 0) is not st.prepare_step(1, 3, 2, 32, 32, 1)
    assert [st.block_t(t) for t in (1, 3, 8, 11)] == [1, 4, 8, 8]


def test_the_layer_prefills_then_decodes(gen):
    """TripleAttention.step after a prefill: the rows of one forward over all the tokens, the
    state advanced to that forward's; a non-causal layer, or one with scale None, refuses."""
    import altattn
    layer = altattn.TripleAttention(48, 2, 32, 32, causal=True, scale=SCALE).double()
    x = torch.randn(2, 7, 48, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        want, want_state = layer(x, return_state=True)
        _, state = layer(x[:, :4], return_state=True)
        got = [layer.step(x[:, t:t + 1], state) for t in range(4, 6)] + [layer.step(x[:, 6:],
                                                                                    state)]
    torch.testing.assert_close(torch.cat(got, 1), want[:, 4:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, want_state, rtol=1e-12, atol=1e-12)
    for kwargs, words in (({"causal": False, "scale": SCALE}, "causal layer"),
                          ({"causal": True}, "needs the layer's scale")):
        with pytest.raises(ValueError, match=words):
            altattn.TripleAttention(48, 2, 32, 32, **kwargs).double().step(x[:, :1], state)
