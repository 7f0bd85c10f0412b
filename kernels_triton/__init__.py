"""Plain Triton kernels (no TLX) for Hopper (sm_90): they read K2/V2 through TMA tensor descriptors,
which older GPUs lack, so the `triton` variant is registered with needs_hopper=True. They are built
and tested with fbtriton's `triton` only (tiling.py uses its Proton language): see require_tlx."""
from altattn.triton_env import require_tlx

require_tlx()
