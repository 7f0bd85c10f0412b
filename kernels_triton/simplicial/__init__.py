"""2-simplicial attention kernels (docs/DESIGN.md: the kernel conventions)."""
