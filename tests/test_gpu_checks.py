"""scripts/gpu_checks.sh on a machine without a GPU: every step listed with its status and reason.

On a GPU machine the script itself is the check (it runs the GPU tests); here it must still run end
to end, report each GPU step as skipped with the reason bfexp gives (no CuPy, no GPU, ...), fail
nothing, and write its summary atomically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bfexp.comm.nccl import nccl_available

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_checks.sh"
STEPS = ["install", "gpu", "kernel-compile", "gpu-tests", "kernel-bench", "nccl-200-steps", "resnet50-b32", "resnet50-b64"]
GPU_STEPS = ["gpu", "gpu-tests", "kernel-bench", "nccl-200-steps", "resnet50-b32", "resnet50-b64"]
GPU_OK, GPU_REASON = nccl_available(1)


def gpu_checks(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run([str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(GPU_OK, reason="a GPU is here: run scripts/gpu_checks.sh itself, which runs the GPU tests")
def test_without_a_gpu_every_gpu_step_is_skipped_with_its_reason(tmp_path):
    proc = gpu_checks("--out", str(tmp_path / "checks"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "checks" / "summary.json").read_text())
    steps = {s["step"]: s for s in summary["steps"]}
    assert list(steps) == STEPS
    for name in GPU_STEPS:
        assert steps[name]["status"] == "skip" and steps[name]["reason"] == GPU_REASON, steps[name]
    assert steps["install"]["status"] == "pass" and steps["install"]["figures"]["imports_missing"] == []
    assert steps["kernel-compile"]["status"] in ("pass", "skip")  # skip only where nvcc is absent
    if steps["kernel-compile"]["status"] == "skip":
        assert "nvcc" in steps["kernel-compile"]["reason"]
    else:
        assert steps["kernel-compile"]["figures"]["failures"] == 0 and steps["kernel-compile"]["figures"]["passed"] > 0
    assert summary["counts"] == {"pass": sum(s["status"] == "pass" for s in steps.values()), "fail": 0,
                                 "skip": sum(s["status"] == "skip" for s in steps.values())}
    assert summary["kernel_fraction_of_copy_bandwidth"] == {} and summary["resnet50_images_per_s"] == {}
    assert not list((tmp_path / "checks").glob("*.tmp"))
    for name in STEPS:  # each step that ran left its log
        if steps[name]["seconds"] > 0.5:
            assert (tmp_path / "checks" / "logs" / f"{name}.log").exists(), name
    assert f"{summary['counts']['pass']} passed, 0 failed" in proc.stdout


def test_bad_arguments_are_refused_in_one_line(tmp_path):
    proc = gpu_checks(str(tmp_path / "no-such-folder"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"gpu_checks: wheels={tmp_path / 'no-such-folder'} is not a folder; allowed: a folder of .whl files, or none"
    proc = gpu_checks("--only", "kernel-bench,bogus", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("gpu_checks: --only bogus; allowed: install, gpu,")
    assert not (tmp_path / "gpu-checks").exists()
