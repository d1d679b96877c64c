"""A PBS sweep (``-m hydra/launcher=pbs`` with conf/hydra/launcher/pbs.yaml): one qsub job per sweep point, each
running ``bfexp`` on its point's overrides in the sweep's job folder. A user's own Hydra launcher plugin (Hydra
instantiates launchers from ``hydra_plugins`` packages only); bfexp asks it one thing, ``runs_here``
(bfexp.launchers.sweep), and reads each job's summary.json for the sweep's exit status.

qsub here is tests/pbs/qsub, a stand-in that runs the job at once; a real PBS sweep would then wait for its
jobs (qstat) before reading their summaries.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict

from bfexp import results
from bfexp.errors import LaunchError
from bfexp.launchers.sweep import record


class PbsSweep(Launcher):
    """One qsub job per sweep point (``qsub``: PBS's qsub, or a stand-in)."""

    runs_here = False  # each job on the machines PBS gives it: the driver does not hold it to this one's memory

    def __init__(self, qsub: str = "qsub") -> None:
        self.qsub = qsub
        self.config: DictConfig | None = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def job_script(self, config: DictConfig, overrides: Sequence[str], run_dir: Path) -> Path:
        """The batch script of one point: bfexp on its overrides, in its job folder, with the driver's config
        folders (--config-dir)."""
        dirs = [s.path for s in self.config.hydra.runtime.config_sources
                if s.provider == "command-line" and s.schema == "file"]
        argv = [sys.executable, "-m", "bfexp.cli", *(a for d in dirs for a in ("--config-dir", d)), *overrides,
                f"hydra.run.dir='{run_dir}'"]  # quoted: the job folder's name holds = and ,
        script = run_dir.parent / f"pbs_job_{config.hydra.job.num}.sh"
        script.write_text(f"cd {shlex.quote(os.getcwd())} && exec {shlex.join(argv)}\n")
        return script

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        returns = []
        for idx, overrides in enumerate(job_overrides, initial_job_idx):
            config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(config.hydra.job):
                config.hydra.job.num = idx
            run_dir = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
            script = self.job_script(config, list(overrides), run_dir.resolve())
            done = subprocess.run([self.qsub, str(script)], capture_output=True, text=True)
            if done.returncode != 0:
                raise LaunchError(f"hydra/launcher=pbs: qsub refused job #{idx}: {done.stderr.strip()}")
            summary = results.read_json(run_dir / results.SUMMARY) or {}
            status = summary.get("status", results.FAILED)
            record(status)
            if status == results.FAILED:
                print(f"bfexp: job #{idx} ({' '.join(filter_overrides(overrides))}) failed: "
                      f"{summary.get('error') or 'see ' + str(script) + '.o*'}", flush=True)
            ret = JobReturn(overrides=list(overrides), cfg=config, hydra_cfg=config, working_dir=str(run_dir))
            ret.status, ret.return_value = JobStatus.COMPLETED, status  # the failure is in the job's summary
            returns.append(ret)
        return returns
