"""Plain Triton kernels (no TLX): run on any GPU Triton supports, sm_80 and newer."""
