"""TLX (warp-specialized, Hopper) spherical-attention kernels: fwd_common.py holds the forward's one
kernel body; ws.py, pipelined.py, pingpong.py pick its switches."""
