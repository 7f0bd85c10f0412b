"""Tools of the repository that are not installed with the package: compute-sanitizer runs
(`sanitize.py`, its report reader `sanitize_report.py`) and the proofs of compiler facts the
TLX kernels rely on (`ws_dispatch.py`, `ws_probe.py`). Run them from a checkout:
`python -m tools.sanitize --dry-run`, `python -m tools.ws_dispatch`."""
