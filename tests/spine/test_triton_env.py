"""A `triton` that is not fbtriton's (no TLX), or none at all: one clear error that names the fix,
from every path that loads a kernel and from bench/fwd.py; the reference still works (CPU).

The wrong `triton` is simulated in a child process: a stub package `triton` (as PyPI's, without
`triton.language.extra.tlx`) put first on PYTHONPATH, or an import hook that hides `triton`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, no_gpu_env
from altattn import triton_env

FIX_PARTS = ("pip uninstall -y triton", "pip install --force-reinstall --no-deps fbtriton==",
             "bash .ci/install")

# Runs in the child: the reference on CPU, then each kernel path; prints one JSON line.
PROBE = """
import importlib, json, sys
import torch
from altattn import simplicial as sa
from altattn import registry, triton_env

res = {}
g = torch.Generator().manual_seed(0)
x = [torch.randn(1, 6, h, 64, generator=g).bfloat16() for h in (2, 1, 1, 1, 1)]
out, lse = sa.reference(*x, 2, 3)
res["reference"] = bool(torch.isfinite(out).all() and torch.isfinite(lse).all())

def attempt(name, fn):
    try:
        fn()
        res[name] = "ok"
    except triton_env.TritonWithoutTLX as e:
        res[name] = "TritonWithoutTLX: " + str(e)
    except Exception as e:  # noqa: BLE001 - reported to the test
        res[name] = type(e).__name__ + ": " + str(e)

attempt("import kernels_tlx.simplicial.ws", lambda: importlib.import_module("kernels_tlx.simplicial.ws"))
attempt("import kernels_triton.simplicial.fwd", lambda: importlib.import_module("kernels_triton.simplicial.fwd"))
attempt("load every variant",
        lambda: [v.load() for v in registry.all_variants("fwd", "simplicial")])
attempt("forward auto", lambda: sa.forward(*x, 2, 3))
attempt("forward triton", lambda: sa.forward(*x, 2, 3, variant="triton"))
print(json.dumps(res))
"""

# Hides the module `triton` (and its submodules) as if it were not installed.
NO_TRITON = """
import sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoTriton())
"""


@pytest.fixture(scope="module")
def pypi_like_triton(tmp_path_factory) -> str:
    """A folder holding a stub `triton` 3.5.0 with `triton.language.extra` but no TLX."""
    root = tmp_path_factory.mktemp("pypi_triton")
    for sub in ("triton", "triton/language", "triton/language/extra"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "triton" / "__init__.py").write_text('__version__ = "3.5.0"\n')
    return str(root)


def child(code: str, *args: str, path_first: str | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (path_first, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = no_gpu_env(PYTHONPATH=path)  # the same on a GPU machine
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_names_fix(msg: str) -> None:
    for part in FIX_PARTS:
        assert part in msg, f"{part!r} missing from {msg!r}"


def test_this_triton_is_fbtriton():
    """The suite runs on what .ci/install sets up: fbtriton alone, the version the fix names."""
    assert triton_env.tlx_problem() is None
    triton_env.require_tlx()
    installed = triton_env._dist_version("fbtriton")
    if installed is not None:  # (a source build of TLX has no fbtriton distribution)
        assert triton_env.FBTRITON == f"fbtriton=={installed}"


@pytest.mark.parametrize("setup", ["pypi_triton", "no_triton"])
def test_every_kernel_path_names_the_fix(setup, pypi_like_triton):
    if setup == "pypi_triton":
        p = child(PROBE, path_first=pypi_like_triton)
        why = "the installed `triton` (3.5.0) has no TLX"
    else:
        p = child(NO_TRITON + PROBE)
        why = "no module `triton` is installed"
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res.pop("reference") is True  # the reference needs no triton
    for path, got in res.items():
        assert got.startswith("TritonWithoutTLX: "), f"{path}: {got}"
        assert why in got, f"{path}: {got}"
        assert_names_fix(got)


def test_bench_cli_one_line_naming_the_fix(pypi_like_triton):
    code = ("import runpy, sys; sys.argv = ['bench/fwd.py'] + sys.argv[1:]; "
            "runpy.run_path('bench/fwd.py', run_name='__main__')")
    for args in ([], ["--variant", "triton", "--preset", "small"]):
        p = child(code, *args, path_first=pypi_like_triton)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1, p.stderr
        assert lines[0].startswith("bench/fwd.py: ") and "has no TLX" in lines[0], lines[0]
        assert_names_fix(lines[0])
        assert p.stdout == ""


def test_bench_cli_argument_errors_come_first(pypi_like_triton):
    code = ("import runpy, sys; sys.argv = ['bench/fwd.py'] + sys.argv[1:]; "
            "runpy.run_path('bench/fwd.py', run_name='__main__')")
    p = child(code, "--d", "96", path_first=pypi_like_triton)
    assert p.returncode == 2 and "--d 96" in p.stderr and "TLX" not in p.stderr, p.stderr


def test_both_distributions_installed(monkeypatch):
    """PyPI triton installed over fbtriton: TLX may still import, from mixed files."""
    versions = {"triton": "3.5.0", "fbtriton": "3.7.4"}
    monkeypatch.setattr(triton_env, "_dist_version", versions.get)
    monkeypatch.setattr(triton_env, "_owns", lambda dist: True)  # both in the imported folder
    problem = triton_env.tlx_problem()
    assert problem is not None and "3.5.0" in problem and "fbtriton 3.7.4" in problem, problem
    with pytest.raises(triton_env.TritonWithoutTLX) as info:
        triton_env.require_tlx()
    assert_names_fix(str(info.value))
    monkeypatch.setattr(triton_env, "_dist_version", {"fbtriton": "3.7.4"}.get)
    assert triton_env.tlx_problem() is None
    # a PyPI triton elsewhere on the path, shadowed by fbtriton's folder (the device machines)
    monkeypatch.setattr(triton_env, "_dist_version", versions.get)
    monkeypatch.setattr(triton_env, "_owns", lambda dist: dist == "fbtriton")
    assert triton_env.tlx_problem() is None


def test_simplicial_attn_imports_without_triton():
    """Importing the package touches no `triton`: the hook would raise if it did."""
    code = NO_TRITON + textwrap.dedent("""
        import sys
        import altattn, altattn.triton_env
        assert not [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
        print("ok")
    """)
    p = child(code)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
