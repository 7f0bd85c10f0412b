"""The GPU tests on a lent machine, in minutes: many pytest processes per GPU.

    python -m tools.gpu_tests [--per-gpu 12] [--timeout 420] [--log DIR] [-k EXPR] [PATH ...]

A cold machine is bound by compilation, not by the GPU: each test's first call of a kernel
config compiles it (Triton and ptxas, one core each), so one pytest process per GPU leaves the
host's other cores idle (measured: about 30% of a 250-test shard in 330 s on a 4 × H200 host).
This runs `--per-gpu` processes on each visible GPU, each pinned to its own core, over
contiguous slices of the collected `gpu` tests (neighbouring tests share kernel configs, and the
processes share Triton's on-disk cache); CUDA_VISIBLE_DEVICES, where set, says which GPUs. The
tests that need two GPUs (`context_parallel` in the file name) run in more processes, one per
pair of GPUs, each seeing its pair. Each process's log is kept under `--log`; the summary lists
every failure and error by test id and ends with one line of totals.
Run it in the repository root (the test ids are relative to it). Exit status: 0 when every
process passed (or skipped), else 1.
(On 4 × H200, 2026-11-28: the 996 single-GPU tests in 36 processes on 3 GPUs: 4 min 41 s.)
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

MULTI_GPU = "context_parallel"  # test files whose tests need more than one GPU
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors|xfailed|xpassed|deselected)")


def collect(paths: list[str], k: str | None) -> list[str]:
    """The `gpu`-marked test ids under `paths`, in collection order."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
           "-p", "no:cacheprovider", *paths]
    if k:
        cmd += ["-k", k]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def slices(ids: list[str], n: int) -> list[list[str]]:
    """`ids` in n contiguous slices of near-equal length (no empty slice: none for no ids)."""
    if not ids:
        return []
    n = max(1, min(n, len(ids)))
    return [ids[i * len(ids) // n:(i + 1) * len(ids) // n] for i in range(n)]


def counts(log: str) -> dict[str, int]:
    """pytest's closing tally in `log` ("3 passed, 1 failed, 2 skipped in 9.1s"), by outcome
    ("errors" counted as "error"); {} when the log has none (a process killed by the timeout)."""
    lines = [ln for ln in log.splitlines() if " in " in ln and SUMMARY.search(ln)]
    if not lines:
        return {}
    out: dict[str, int] = {}
    for num, what in SUMMARY.findall(lines[-1]):
        what = "error" if what == "errors" else what
        out[what] = out.get(what, 0) + int(num)
    return out


def problems(log: str) -> list[str]:
    """The FAILED / ERROR lines of pytest's short summary in `log`."""
    return [ln for ln in log.splitlines() if ln.startswith(("FAILED ", "ERROR "))]


def gpu_pairs(devs: list[str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES values of disjoint GPU pairs for the two-GPU tests ("0,1", "2,3",
    ...); one value of every GPU where there are fewer than two."""
    if len(devs) < 2:
        return [",".join(devs)]
    return [f"{devs[i]},{devs[i + 1]}" for i in range(0, len(devs) - 1, 2)]


def gpus() -> list[str]:
    """The GPUs to use: CUDA_VISIBLE_DEVICES' entries where it is set, else every GPU
    `nvidia-smi -L` lists (["0"] where there is none: the tests then skip themselves)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given:
        return [g.strip() for g in given.split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except OSError:
        return ["0"]
    return [str(i) for i in range(max(1, sum(ln.startswith("GPU ") for ln in out.splitlines())))]


def launch(ids: list[str], log: str, gpus: str, cores: set[int] | None) -> subprocess.Popen:
    """One pytest process over `ids` on the GPUs `gpus`, pinned to `cores`, output in `log`."""
    with open(log + ".ids", "w") as f:
        f.write("\n".join(ids))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "ALTATTN_CHECK_LAUNCH": "1"}
    code = ("import sys, pytest; ids = open(sys.argv[1]).read().split('\\n'); "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-rfE', *ids]))")
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    return subprocess.Popen([sys.executable, "-c", code, log + ".ids"], env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, preexec_fn=pin)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_tests", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("paths", nargs="*", default=["tests"])
    p.add_argument("--per-gpu", type=int, default=12, help="pytest processes per GPU (12)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds for all (420)")
    p.add_argument("--log", default="gpu-test-logs", help="directory of the processes' logs")
    p.add_argument("-k", default=None, help="pytest -k expression")
    a = p.parse_args(argv)
    if a.per_gpu < 1:
        p.error(f"--per-gpu must be >= 1, got {a.per_gpu}")
    os.makedirs(a.log, exist_ok=True)
    t0 = time.time()
    ids = collect(a.paths, a.k)
    multi = [i for i in ids if MULTI_GPU in i.split("::")[0]]
    single = [i for i in ids if MULTI_GPU not in i.split("::")[0]]
    devs = gpus()
    n_gpu = len(devs)
    cores = sorted(os.sched_getaffinity(0))
    jobs = []
    for j, part in enumerate(slices(single, n_gpu * a.per_gpu)):
        pin = {cores[j % len(cores)]} if len(cores) > n_gpu * a.per_gpu else None
        jobs.append((f"{a.log}/p{j}.log", launch(part, f"{a.log}/p{j}.log", devs[j % n_gpu], pin)))
    for j, (part, pair) in enumerate(zip(slices(multi, max(1, n_gpu // 2)), gpu_pairs(devs))):
        log = f"{a.log}/multi{j}.log"
        jobs.append((log, launch(part, log, pair, None)))
    print(f"{len(ids)} GPU tests ({len(multi)} multi-GPU) in {len(jobs)} processes on {n_gpu} "
          f"GPU(s)", flush=True)
    deadline = t0 + a.timeout
    for _, proc in jobs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    total: dict[str, int] = {}
    bad, cut = [], 0
    for log, proc in jobs:
        text = open(log).read()
        c = counts(text)
        cut += not c
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
        bad += problems(text)
        if not c:
            bad.append(f"CUT {log}: no pytest summary (timed out or crashed, rc {proc.returncode})")
    for line in bad:
        print(line[:300])
    tally = ", ".join(f"{v} {k}" for k, v in sorted(total.items()))
    print(f"{tally or 'nothing ran'}; {cut} process(es) cut; {time.time() - t0:.0f} s", flush=True)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
