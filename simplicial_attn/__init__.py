"""2-simplicial attention forward kernels (Triton and TLX) for NVIDIA Hopper.

Public API: attention (differentiable), SimplicialAttention (a layer), forward (forward only),
reference, det_rotary (rotary embeddings for form="det"), variants, flops. See README.md and
docs/DESIGN.md.
"""
from .autograd import attention
from .flops import flops
from .launcher import forward
from .layer import SimplicialAttention
from .reference import brute_force, reference, reference_backward
from .registry import variants
from .rotary import det_rotary
from .spec import ProblemSpec

__all__ = ["attention", "SimplicialAttention", "forward", "reference", "reference_backward",
           "brute_force", "det_rotary", "variants",
           "flops", "ProblemSpec"]
