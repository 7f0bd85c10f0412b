"""TLX triple-attention kernels (Hopper): the state's partial sums (partials.py) and the variants
that use them (fwd.py, bwd.py)."""
