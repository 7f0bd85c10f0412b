"""Fast kernels for attention beyond softmax's pairwise form, for NVIDIA Hopper (Triton and TLX).

Families (each a subpackage with its op, layer, reference and kernels; `families()` lists them):
    altattn.simplicial   2-simplicial attention: simplicial_attention, SimplicialAttention,
                         simplicial_attention_varlen, simplicial_attention_with_kvcache,
                         simplicial_context_parallel_attention
    altattn.spherical    spherical attention (FlashSign): spherical_attention, SphericalAttention
    altattn.triple       triple attention: triple_attention, TripleAttention,
                         triple_attention_varlen, triple_context_parallel_attention

`variants(family, pass_)` names the registered kernels. See README.md and docs/DESIGN.md.
"""
from . import compile_workers, simplicial, spherical, triple
from .simplicial import SimplicialAttention
from .simplicial import attention as simplicial_attention
from .simplicial import attention_varlen as simplicial_attention_varlen
from .simplicial import attention_with_kvcache as simplicial_attention_with_kvcache
from .simplicial import context_parallel_attention as simplicial_context_parallel_attention
from .spherical import SphericalAttention
from .spherical import attention as spherical_attention
from .triple import TripleAttention
from .triple import attention as triple_attention
from .triple import attention_varlen as triple_attention_varlen
from .triple import context_parallel_attention as triple_context_parallel_attention


def families() -> dict[str, str]:
    """Registered family names, each with its title."""
    from . import registry
    return {f.name: f.title for f in registry.families()}


def variants(family: str, pass_: str = "fwd") -> dict[str, str]:
    """Registered variant names of a family's pass, each with the shapes it supports."""
    from . import registry
    return registry.variants(pass_, family)


compile_workers.configure()  # torch.compile of a model on the GPU: see compile_workers.py

__all__ = ["simplicial", "simplicial_attention", "SimplicialAttention",
           "simplicial_attention_varlen", "simplicial_attention_with_kvcache",
           "simplicial_context_parallel_attention", "spherical",
           "spherical_attention", "SphericalAttention", "triple", "triple_attention",
           "triple_attention_varlen", "triple_context_parallel_attention", "TripleAttention",
           "families", "variants"]
