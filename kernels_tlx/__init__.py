"""TLX (Triton with warp specialization) kernels for Hopper, one variant per file."""
from altattn.triton_env import require_tlx

require_tlx()  # a `triton` without TLX fails here, once, naming the fix (not deep in `import tlx`)
