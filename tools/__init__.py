"""Tools of the repository that are not installed with the package: compute-sanitizer runs
(`sanitize.py`, its report reader `sanitize_report.py`), the compiler's resources per compile
config (`resources.py`, `resource_parsers.py`: registers, spills, shared memory, wgmma, no GPU
needed), the proofs of compiler facts the TLX kernels rely on (`ws_dispatch.py`, `ws_probe.py`)
and the L2 bandwidth probe (`l2_bandwidth.py`). Run them from a checkout:
`python -m tools.resources`, `python -m tools.sanitize --dry-run`, `python -m tools.ws_dispatch`."""
