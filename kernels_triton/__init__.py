"""Plain Triton kernels (no TLX) for Hopper (sm_90): they read K2/V2 through TMA tensor descriptors,
which older GPUs lack, so the `triton` variant is registered with needs_hopper=True."""
