"""Triple attention kernels in plain Triton: the two contractions (core.py), their host side
(host.py), the forward and backward passes, and the causal chunked form."""
