"""TLX (Triton with warp specialization) kernels for Hopper, one variant per file."""
