"""Dev, one GPU run (about a minute): the TLX row-owner (kernels_tlx/bwd_dq_ws.py) against
triton's `_dq_kernel` (kernels_triton/bwd.py launch_dq) at S* (B4 N16384 Hq128 Hk1 D128, 32 x 512):
  - dq, dk1, dv1 of both: max |new - triton| / max |triton| and the norm-relative difference;
  - the new kernel run twice: bitwise equal, every element written (the outputs start as NaN);
  - the median time of each (dq, dk1, dv1 with Delta computed once, as in the backward).
    python3 dev/dq_check.py [star|n2048|d64|star64|odd64]"""
import sys
import torch
import simplicial_attn as sa
from simplicial_attn.spec import ProblemSpec
from profiling.common import make_inputs
from profiling.timing import median_ms, tflops
from kernels_tlx import bwd_dq_ws
from kernels_triton import bwd as tb

SHAPES = {"star": (4, 16384, 128, 1, 128, 32, 512), "n2048": (4, 2048, 128, 1, 128, 32, 512),
          "d64": (4, 16384, 128, 1, 64, 32, 512), "star64": (4, 16384, 64, 1, 128, 32, 512),
          "odd64": (2, 333, 64, 1, 128, 32, 96)}
name = sys.argv[1] if len(sys.argv) > 1 else "star"
B, N, Hq, Hk, D, w1, w2 = SHAPES[name]
x = make_inputs(B, N, Hq, Hk, D, seed=1)
out, lse = sa.attention(*x, w1, w2)
dout = torch.randn_like(out)
spec = ProblemSpec(B=B, N=N, Hq=Hq, Hk=Hk, D=D, w1=w1, w2=w2, sm_scale=D ** -0.5)
q, k1, k2, v1, v2 = x
delta = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
rows = B * N * Hq
tb._delta_kernel[((rows + tb.DELTA_ROWS - 1) // tb.DELTA_ROWS,)](
    out, dout, delta, delta, N, rows, HQ=Hq, D=D, ROWS=tb.DELTA_ROWS, HAS_DLSE=False,
    num_warps=4)
del out


def run(fn):
    g = [torch.full_like(t, float("nan")) for t in (q, k1, v1)]
    fn(spec, q, k1, k2, v1, v2, dout, lse, delta, *g)
    torch.cuda.synchronize()
    return g


ref = run(tb.launch_dq)
new = run(bwd_dq_ws.launch_dq)
again = run(bwd_dq_ws.launch_dq)
ok = True
for n, a, b in zip(("dq", "dk1", "dv1"), new, ref):
    a, b = a.float(), b.float()
    rel_max = ((a - b).abs().max() / b.abs().max()).item()
    rel_norm = ((a - b).norm() / b.norm()).item()
    finite = torch.isfinite(a).all().item()
    print(f"{name} {n}: max|new-triton|/max|triton| {rel_max:.3e}  norm-relative {rel_norm:.3e}"
          f"  finite {finite}", flush=True)
    ok &= finite and rel_norm < 2e-2
same = all(torch.equal(a, b) for a, b in zip(new, again))
print(f"{name} new kernel bitwise repeatable: {same}", flush=True)
ok &= same
del ref, again
f = sa.flops(B, N, Hq, D, w1, w2)
g = [torch.empty_like(t) for t in (q, k1, v1)]
for label, fn in (("dq_triton", tb.launch_dq), ("dq_tlx", bwd_dq_ws.launch_dq)):
    ms = median_ms(lambda: fn(spec, q, k1, k2, v1, v2, dout, lse, delta, *g))
    print(f"| {name} | {label} | {ms:.1f} ms | {tflops(2 * f, ms):.1f} executed TFLOPS |",
          flush=True)
print("CHECK", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
