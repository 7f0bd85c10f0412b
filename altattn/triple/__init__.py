"""Triple attention (FAMILIES.md §2): a third-order linear-time state read by two queries. So far
its fp64 reference (`reference`, `reference_backward`); the op, kernels and family record follow."""
from .reference import reference, reference_backward

__all__ = ["reference", "reference_backward"]
