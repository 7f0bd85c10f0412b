"""TLX (warp-specialized, Hopper) spherical-attention kernels: fwd_common.py holds the forward's one
kernel body, whose switches make its three variants (`variant`)."""
