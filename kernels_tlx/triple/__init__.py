"""TLX triple-attention kernels (Hopper): `partials` warp-specialized (partials.py; Y 32 wide:
partials_pairs.py), `apply` with the state resident at D 32 (apply.py), how the `tlx` variants
combine them with the Triton kernels (contractions.py), and the variants (fwd.py, bwd.py)."""
