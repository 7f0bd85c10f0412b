"""tools/sanitize.py's command line on the CPU: the dry run, running children in parallel
(--jobs, with a stand-in sanitizer script: order, timeouts, interrupts), its refusals, and
finding compute-sanitizer."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import ROOT, no_gpu_env

from altattn import registry
from tools import sanitize
from tools.sanitize import Run
from test_sanitize import FAM, SMALL

REPO_ROOT = str(ROOT)  # the checkout (conftest puts it on sys.path)



# ---------------------------------------------------------------------------------------------
# Command line


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join("tools", "sanitize.py"), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_dry_run_needs_no_gpu():
    r = run_cli("--dry-run", "--tool", "memcheck", "--pass", "bwd", env=no_gpu_env())
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 * sum(len(v.accepted("form"))
                                 for v in registry.all_variants("bwd", FAM))
    assert all("--tool memcheck" in line and "--worker --pass bwd" in line for line in lines)
    assert sum(line.endswith("--form det") for line in lines) == 4  # triton's, tlx_pairs's
    r = run_cli("--dry-run", "--tool", "racecheck", "--pass", "probe", "--racecheck-report",
                "hazard", env=no_gpu_env())
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.strip().splitlines()
    assert line.startswith("[1/1] racecheck probe ws_probe probe launch: ")
    assert "--racecheck-report hazard" in line and line.endswith("--worker --pass probe")


# ---------------------------------------------------------------------------------------------
# Running children in parallel (a stand-in sanitizer: a script that sleeps, then prints a report)

FAKE_SANITIZER = textwrap.dedent("""\
    #!/bin/sh
    # stand-in compute-sanitizer: --tool T ... --variant V ...; sleeps per variant, then reports
    tool=""; variant=""; prev=""
    for a in "$@"; do
      [ "$prev" = "--tool" ] && tool="$a"
      [ "$prev" = "--variant" ] && variant="$a"
      prev="$a"
    done
    case "$variant" in
      triton) sleep 1.5 ;;
      tlx_ws) sleep 0.2 ;;
      *) sleep 30 ;;
    esac
    echo "========= COMPUTE-SANITIZER"
    echo "{done}: $variant"
    if [ "$tool" = racecheck ]; then
      echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    else
      echo "========= ERROR SUMMARY: 0 errors"
    fi
    """).format(done=sanitize.WORKER_DONE)


@pytest.fixture
def fake_sanitizer(tmp_path):
    path = tmp_path / "compute-sanitizer"
    path.write_text(FAKE_SANITIZER)
    path.chmod(0o755)
    return str(path)


def _run(tool: str, variant: str) -> Run:
    """A run of the forward `variant` on the small shape."""
    return Run(tool, "fwd", variant, SMALL, family=FAM)


def test_jobs_run_children_at_once_and_keep_the_order(fake_sanitizer, tmp_path):
    runs = [_run(t, v) for v in ("triton", "tlx_ws") for t in sanitize.TOOLS]
    seen = []
    t0 = time.monotonic()
    rows = sanitize.run_all(runs, fake_sanitizer, str(tmp_path), timeout=60, jobs=6,
                            report=lambda i, row: seen.append((i, row["tool"], row["variant"])))
    wall = time.monotonic() - t0
    assert seen == [(i, r.tool, r.variant) for i, r in enumerate(runs, 1)]
    assert [(r["tool"], r["variant"]) for r in rows] == [(r.tool, r.variant) for r in runs]
    assert all(r["ok"] and r["verdict"] == "ok: clean" and r["findings"] == 0 for r in rows)
    assert wall < 4.5, wall  # 3 x 1.5 s + 3 x 0.2 s one after another would be 5.1 s
    for r in runs:  # each log starts with its command
        with open(tmp_path / f"{r.tag()}.log") as f:
            assert f.readline().startswith(f"$ {fake_sanitizer} --tool {r.tool}")


def test_jobs_keep_the_per_run_timeout(fake_sanitizer, tmp_path):
    runs = [_run("memcheck", "tlx_ws_kv"),  # sleeps 30 s: killed after 1 s
            _run("memcheck", "tlx_ws")]
    t0 = time.monotonic()
    rows = sanitize.run_all(runs, fake_sanitizer, str(tmp_path), timeout=1, jobs=2)
    assert time.monotonic() - t0 < 10
    assert [r["verdict"] for r in rows] == ["FAIL: timed out", "ok: clean"]
    assert not sanitize._LIVE  # every child is gone


def test_an_interrupt_kills_the_running_children(fake_sanitizer, tmp_path):
    runs = [_run("memcheck", "tlx_ws"), _run("memcheck", "tlx_ws_kv"),
            _run("synccheck", "tlx_ws_kv"), _run("racecheck", "tlx_ws_kv")]

    def interrupt(i, row):
        raise KeyboardInterrupt

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        sanitize.run_all(runs, fake_sanitizer, str(tmp_path), timeout=60, jobs=2,
                         report=interrupt)
    assert time.monotonic() - t0 < 10  # not the 30 s the children sleep
    assert not sanitize._LIVE
    assert not (tmp_path / f"{runs[3].tag()}.log").exists()  # never started


def test_one_job_runs_one_child_at_a_time(fake_sanitizer, tmp_path):
    runs = [_run("memcheck", "tlx_ws"), _run("synccheck", "tlx_ws")]
    t0 = time.monotonic()
    rows = sanitize.run_all(runs, fake_sanitizer, str(tmp_path), timeout=60)
    assert time.monotonic() - t0 >= 0.4 and all(r["ok"] for r in rows)


@pytest.mark.parametrize(("args", "needle"), [
    (["--tool", "initcheck"], "invalid choice: 'initcheck'"),
    (["--pass", "sideways"], "invalid choice: 'sideways'"),
    (["--variant", "nope"], "invalid choice: 'nope'"),
    (["--pass", "bwd", "--variant", "tlx_ws_kv"], "tlx_ws_kv: not a variant of pass bwd"),
    (["--timeout", "0"], "--timeout"),
    (["--jobs", "0"], "--jobs"),
    (["--shapes", "huge"], "--shapes"),
    (["--shapes", "3"], "has 2 shape groups"),
    (["--racecheck-report", "some"], "invalid choice: 'some'"),
    (["--pass", "probe", "--variant", "tlx_ws"], "tlx_ws: not a variant of pass probe"),
    (["--worker", "--pass", "fwd", "--variant", "triton"], "--worker needs --shape"),
])
def test_bad_arguments_exit_2(args, needle):
    r = run_cli(*args, env=no_gpu_env())
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_no_compute_sanitizer_exits_2_with_one_line(tmp_path):
    r = run_cli("--tool", "memcheck", "--out", str(tmp_path / "o"),
                env=no_gpu_env(COMPUTE_SANITIZER=str(tmp_path / "missing")))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "compute-sanitizer not found" in r.stderr
    assert not (tmp_path / "o").exists()


def test_no_gpu_exits_2_with_one_line(tmp_path):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    r = run_cli("--out", str(tmp_path / "o"), env=no_gpu_env(COMPUTE_SANITIZER=str(fake)))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "GPU" in r.stderr and not (tmp_path / "o").exists()
    r = run_cli("--worker", "--pass", "fwd", "--variant", "triton", "--shape",
                *map(str, SMALL.fields().values()), env=no_gpu_env())
    assert r.returncode == 2 and "GPU" in r.stderr and sanitize.WORKER_DONE not in r.stdout
    r = run_cli("--worker", "--pass", "probe", env=no_gpu_env())
    assert r.returncode == 2 and "GPU" in r.stderr and sanitize.WORKER_DONE not in r.stdout


def test_find_sanitizer(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "compute-sanitizer"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("COMPUTE_SANITIZER", str(fake))
    assert sanitize.find_sanitizer() == str(fake)
    monkeypatch.setenv("COMPUTE_SANITIZER", str(tmp_path / "nope"))
    assert sanitize.find_sanitizer() is None
    monkeypatch.delenv("COMPUTE_SANITIZER")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert sanitize.find_sanitizer() == str(fake)
