"""Smoke-run the examples people copy, at small scale, as subprocesses (fresh Ray each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _start(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip


def _output(proc: subprocess.Popen[str], timeout: float) -> str:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    return stdout


def _run(*args: str, timeout: float) -> str:
    return _output(_start(*args), timeout)


@pytest.mark.timeout(240)
def test_quickstart_trains_with_raydl_and_matches_torch() -> None:
    args = ("examples/quickstart.py", "--epochs", "2", "--samples", "3000", "--batch-size", "128")
    # Both at once: torch's run needs no Ray and mostly imports.
    torch_run = _start(*args, "--torch")
    try:
        ours = _run(*args, timeout=200)
        theirs = _output(torch_run, timeout=200)
    finally:
        torch_run.kill()
    assert "raydl.RayDataLoader: 24 batches per epoch" in ours
    # Same data order as torch under torch.manual_seed: the same losses per epoch.
    losses = [line.split("loss ")[1] for line in ours.splitlines() if "loss " in line]
    torch_losses = [line.split("loss ")[1] for line in theirs.splitlines() if "loss " in line]
    assert len(losses) == 2
    assert losses == torch_losses


@pytest.mark.timeout(120)
def test_ruff_and_mypy_are_clean() -> None:
    pytest.importorskip("mypy")
    ruff = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "raydl"], cwd=REPO, capture_output=True, text=True
    )
    assert ruff.returncode == 0, ruff.stdout[-3000:]
    mypy = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True)
    assert mypy.returncode == 0, mypy.stdout[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.s3
def test_s3_images_example_trains_from_a_real_s3_server() -> None:
    out = _run("examples/s3_images.py", "--small", timeout=280)
    assert "epoch" in out


@pytest.mark.timeout(300)
def test_last_mile_tabular_example_trains() -> None:
    out = _run("examples/last_mile_tabular.py", "--small", timeout=280)
    assert "epoch" in out


@pytest.mark.timeout(180)
def test_the_gpu_framework_check_passes_on_the_cpu() -> None:
    """benchmarks/gpu_frameworks.py (run on a GPU by hand) kept working: its CPU dry run."""
    out = _run("benchmarks/gpu_frameworks.py", timeout=160)
    results = json.loads(out.strip().splitlines()[-1])
    runs = {name: r for name, r in results.items() if name != "cuda"}
    assert len(runs) == 3 and all(r["ok"] for r in runs.values()), results
