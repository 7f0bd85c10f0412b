"""Is the installed `triton` fbtriton's (Triton with TLX)? Every kernel needs it.

fbtriton installs the module `triton`, the same name as PyPI's `triton`, which torch's CUDA wheels
depend on: a later `pip install` of anything that depends on torch can bring PyPI's `triton` back
over it, and TLX (`triton.language.extra.tlx`) is gone. `require_tlx()` turns that state into one
error that names the fix; the kernel packages (`kernels_tlx`, `kernels_triton`) call it before
anything else and `bench/fwd.py` before it starts. The rest of `altattn` (the references,
the checks, the FLOP models) needs no `triton` at all and never calls it.
"""
from __future__ import annotations

import importlib
import importlib.metadata

FBTRITON = "fbtriton==3.7.4"
FIX = (f"pip uninstall -y triton && pip install --force-reinstall --no-deps {FBTRITON} "
       "(or, in the repository root: bash .ci/install)")


class TritonWithoutTLX(ImportError):
    """The module `triton` is missing, or is not fbtriton's (no TLX)."""


def _dist_version(name: str) -> str | None:
    """Version of the installed distribution `name` ("triton", "fbtriton"), None if absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def tlx_problem() -> str | None:
    """None when `triton` is fbtriton's alone, else what is wrong with it (one sentence)."""
    try:
        tlx = importlib.import_module("triton.language.extra.tlx")
    except ModuleNotFoundError as e:
        if e.name == "triton":
            return "no module `triton` is installed"
        if not (e.name or "").startswith("triton.language.extra"):
            raise  # something else is missing: its own error says what
        triton = importlib.import_module("triton")
        return (f"the installed `triton` ({getattr(triton, '__version__', 'unknown version')}) "
                "has no TLX (triton.language.extra.tlx): it is not fbtriton's")
    if not hasattr(tlx, "async_tasks"):
        return "triton.language.extra.tlx has no async_tasks: not the TLX these kernels use"
    pypi, fb = _dist_version("triton"), _dist_version("fbtriton")
    if pypi is not None and fb is not None and _owns("triton") and _owns("fbtriton"):
        # both wrote into the one `triton` folder that is imported: mixed files (a PyPI triton
        # elsewhere on the path, shadowed by fbtriton's, as on the device machines, is fine)
        return (f"both PyPI triton {pypi} and fbtriton {fb} are installed, into the one module "
                "`triton`")
    return None


def _owns(dist: str) -> bool:
    """Whether distribution `dist` installed the `triton` folder that is imported."""
    from pathlib import Path
    triton = importlib.import_module("triton")
    try:
        where = Path(importlib.metadata.distribution(dist).locate_file("triton")).resolve()
    except importlib.metadata.PackageNotFoundError:
        return False
    return where == Path(triton.__file__).parent.resolve()


def require_tlx() -> None:
    """Raise TritonWithoutTLX, naming the fix, unless `triton` is fbtriton's (with TLX)."""
    problem = tlx_problem()
    if problem is not None:
        raise TritonWithoutTLX(f"{problem}; the kernels need fbtriton's `triton` (Triton with "
                               f"TLX). Fix: {FIX}")
