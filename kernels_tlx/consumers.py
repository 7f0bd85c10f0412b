"""What every family's TLX kernels with two consumer warp groups share: their count, the thread
count of a named barrier between them, and pingpong's turns (the consumers take turns issuing
wgmma, each waiting on its own named barrier that the other arrives on)."""
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

# NUM_CONSUMERS consumer warp groups (4 warps each) beside the producer(s); CONSUMER_THREADS is
# their thread count, the count of every named barrier between them.
NUM_CONSUMERS = tl.constexpr(2)
CONSUMER_THREADS = tl.constexpr(NUM_CONSUMERS * 4 * 32)
# Named barriers (the compiler emits ids 0-3 for its own partition syncs; fbtriton's tutorials
# reserve 0-6; tools.resources lists the ids each kernel uses):
TURN_BARRIER = tl.constexpr(11)  # 11 + c: consumer c's turn on the tensor cores (pingpong)


@triton.jit
def take_turn(cid, PINGPONG: tl.constexpr):
    """Pingpong: wait until it is consumer `cid`'s turn to issue a wgmma, i.e. the other consumer
    has issued its own (named barrier TURN_BARRIER + cid, both consumers' threads). No-op
    otherwise."""
    if PINGPONG:
        tlx.named_barrier_wait(TURN_BARRIER + cid, CONSUMER_THREADS)


@triton.jit
def pass_turn(cid, PINGPONG: tl.constexpr):
    """Pingpong: hand the tensor cores to the other consumer (arrive on its turn barrier)."""
    if PINGPONG:
        tlx.named_barrier_arrive(TURN_BARRIER + 1 - cid, CONSUMER_THREADS)
