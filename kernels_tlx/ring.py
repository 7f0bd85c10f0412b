"""A ring of N shared-memory buffers, each with a "full" and an "empty" mbarrier, as every TLX
kernel here pipelines its loads: use number c (counted from 0 by producer and consumer alike)
sits in slot c % N, in round c // N. A consumer waits on the slot's full barrier for the round's
parity; a producer waits on its empty barrier for the parity of the round before, so that its
first round passes at once (a fresh mbarrier reads as having completed phase 1)."""
import triton
import triton.language as tl


@triton.jit
def full_phase(c, N: tl.constexpr):
    """The phase a consumer of use c waits for on its slot's full barrier."""
    return (c // N) & 1


@triton.jit
def empty_phase(c, N: tl.constexpr):
    """The phase the producer of use c waits for on its slot's empty barrier."""
    return ((c // N) & 1) ^ 1
