"""Spherical attention (FlashSign) kernels in plain Triton: forward, backward and the host side they share with kernels_tlx/spherical."""
