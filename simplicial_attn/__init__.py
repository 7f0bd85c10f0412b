"""2-simplicial attention forward kernels (Triton and TLX) for NVIDIA Hopper.

Public API: forward, reference, variants, flops. See README.md and docs/DESIGN.md.
"""
from .flops import flops
from .launcher import forward
from .reference import reference
from .registry import variants
from .spec import ProblemSpec

__all__ = ["forward", "reference", "variants", "flops", "ProblemSpec"]
