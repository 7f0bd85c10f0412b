"""tools/gpu_tests.py (the GPU tests in many processes) on the CPU: its slicing and log reading,
and a whole run over a small test directory (one failing test) with the processes it spawns."""
from __future__ import annotations

import os
import subprocess
import sys

from tools import gpu_tests

REPO = __file__.rsplit("/tests/", 1)[0]


def test_slices_are_contiguous_near_equal_and_never_empty():
    ids = [f"t{i}" for i in range(10)]
    parts = gpu_tests.slices(ids, 4)
    assert [p for part in parts for p in part] == ids
    assert sorted(len(p) for p in parts) == [2, 2, 3, 3]
    assert gpu_tests.slices(ids[:3], 8) == [["t0"], ["t1"], ["t2"]]
    assert gpu_tests.slices([], 4) == []


def test_counts_reads_the_closing_tally_and_none_when_cut():
    log = "....F\nFAILED a.py::t - boom\n3 passed, 1 failed, 2 skipped, 1 error in 9.12s\n"
    assert gpu_tests.counts(log) == {"passed": 3, "failed": 1, "skipped": 2, "error": 1}
    assert gpu_tests.counts("....\n") == {}
    assert gpu_tests.problems(log) == ["FAILED a.py::t - boom"]


def test_a_run_reports_the_failure_and_exits_1(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    (d / "conftest.py").write_text(
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'gpu: test')\n")
    (d / "test_a.py").write_text(
        "import pytest\n"
        "@pytest.mark.gpu\n@pytest.mark.parametrize('x', [1, 2, 3])\n"
        "def test_ok(x):\n    assert x > 0\n"
        "@pytest.mark.gpu\ndef test_bad():\n    assert 1 == 2\n"
        "def test_not_gpu():\n    assert False  # not collected: no gpu marker\n")
    # run where the test ids are rooted (as in the repository: its root)
    env = {**os.environ, "PYTHONPATH": REPO}
    r = subprocess.run([sys.executable, "-m", "tools.gpu_tests", ".", "--per-gpu", "2",
                        "--log", str(tmp_path / "logs"), "--timeout", "120"],
                       cwd=d, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "4 GPU tests (0 multi-GPU) in 2 processes" in r.stdout
    assert "FAILED" in r.stdout and "test_bad" in r.stdout
    assert "1 failed, 3 passed; 0 process(es) cut" in r.stdout


def test_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert gpu_tests.gpus() == ["2", "3"]


def test_two_gpu_tests_get_disjoint_pairs():
    assert gpu_tests.gpu_pairs(["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert gpu_tests.gpu_pairs(["4", "5", "6"]) == ["4,5"]
    assert gpu_tests.gpu_pairs(["0"]) == ["0"]
