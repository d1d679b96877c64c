"""Slurm sweeps: Hydra's submitit launcher, one Slurm job per sweep point, sized from its ranks.

``bfexp -m hydra/launcher=slurm ranks=8,16 algorithm=dsgd,exact_diffusion`` picks
conf/hydra/launcher/slurm.yaml, whose ``_target_`` is the launcher plugin in
hydra_plugins/bfexp_slurm_launcher (Hydra takes plugins from there only), which
calls ``launch`` (driver side) and ``run_in_job`` (in each Slurm job) here. Stock
hydra-submitit-launcher submits one job array with one set of resources for every
point; here each point gets its own (``nodes: ${bfexp_nodes:${ranks},...}`` resolves
per point), and three pitfalls are taken out of the way:

* the config is composed once, by the driver; the job gets the composed config and
  runs bfexp's job function on it (no Hydra composition in the job, none in the ranks);
* the job function runs once per job (the batch script runs it directly, not through
  an ``srun`` of one task per rank), and starts the job's ranks itself with
  ``srun --mpi=pmix`` inside the allocation (launcher=local becomes launcher=srun);
* a job that dies (a crash, a cancelled or timed-out Slurm job) leaves a failed
  summary.json naming the error, so the sweep's other jobs and its report stand.

Ranks write into the job's run folder as locally; Slurm's stdout/stderr of each job
are in <run folder>/slurm/, the ranks' logs in <run folder>/logs/.
"""

from __future__ import annotations

import getpass
import logging
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

from bfexp import results
from bfexp.errors import LaunchError
from bfexp.launchers.sweep import statuses  # each job's status, where the driver reads them for its exit status

log = logging.getLogger(__name__)

# Keys of the preset that configure submitit's executor itself, not the sbatch script.
EXECUTOR_KEYS = ("submitit_folder", "max_num_timeout")


def job_parameters(params: dict) -> dict:
    """Hydra's launcher keys as submitit's: the shared ones as they are, the rest ``slurm_``-prefixed."""
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    out = {k if k in shared else f"slurm_{k}": v for k, v in params.items()
           if k not in EXECUTOR_KEYS and k != "_target_"}
    # The job function runs once, in the batch script (no srun of one task per rank), and starts
    # the ranks with srun itself. submitit would wait for a result from every task it counts
    # (nodes x tasks_per_node), so it is told of one; sbatch gets the real figures.
    out["slurm_use_srun"] = False
    out["slurm_additional_parameters"] = {**(out.get("slurm_additional_parameters") or {}),
                                          "nodes": out["nodes"], "ntasks_per_node": out["tasks_per_node"]}
    out["nodes"], out["tasks_per_node"] = 1, 1
    return out


def ranks_on_srun(config: DictConfig) -> DictConfig:
    """A job's config with its ranks started by srun in the allocation (launcher=local becomes
    conf/launcher/srun.yaml)."""
    from importlib import resources

    from bfexp.config import launcher_of

    if launcher_of(config.get("launcher")).on_this_machine:
        with resources.as_file(resources.files("bfexp.conf").joinpath("launcher", "srun.yaml")) as path:
            srun = OmegaConf.load(path)
        with open_dict(config):
            config.launcher = srun
    return config


def run_dir_of(config: DictConfig) -> Path:
    """A sweep job's run folder, as Hydra names it."""
    return Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)


def failed_return(config: DictConfig, error: str) -> JobReturn:
    """A job that did not come back: a failed summary.json in its folder (the report shows it)."""
    run_dir = run_dir_of(config)
    summary = results.read_json(run_dir / results.SUMMARY) or {}
    if summary.get("status") not in (results.FAILED, results.DIVERGED):
        from bfexp.summary import job_identity

        summary = {**job_identity(config), **summary, "status": results.FAILED, "error": error}
        run_dir.mkdir(parents=True, exist_ok=True)
        results.write_json_atomic(run_dir / results.SUMMARY, summary)
    ret = JobReturn(overrides=list(config.hydra.overrides.task), cfg=config, hydra_cfg=config, working_dir=str(run_dir))
    ret.status = JobStatus.COMPLETED  # the sweep goes on: the failure is in the job's summary
    ret.return_value = results.FAILED
    return ret


def job_error(run_dir: Path) -> str | None:
    summary = results.read_json(run_dir / results.SUMMARY) or {}
    return summary.get("error") if summary.get("status") == results.FAILED else None


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
    """Driver side: compose each point's config, submit it as its own Slurm job with the resources
    its ranks need, wait for every job, and hand Hydra one return per job (failed ones included)."""
    import submitit

    assert launcher.config is not None and launcher.hydra_context is not None
    if shutil.which("sbatch") is None:
        raise LaunchError("hydra/launcher=slurm needs Slurm: no sbatch on PATH; allowed: a machine with Slurm's "
                          "client commands (or a local sweep: leave hydra/launcher out)")
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    log.info(f"Slurm sweep output dir : {sweep_dir}")
    submitted = []
    for idx, overrides in enumerate(job_overrides, initial_job_idx):
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        with open_dict(config.hydra.job):
            config.hydra.job.num = idx
        config = ranks_on_srun(config)
        params = OmegaConf.to_container(config.hydra.launcher, resolve=True)
        assert isinstance(params, dict)
        folder = run_dir_of(config) / str(params["submitit_folder"])  # an absolute folder stays as it is
        made = not run_dir_of(config).exists()  # by this submission: removed again if sbatch refuses it
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm",
                                         slurm_max_num_timeout=params.get("max_num_timeout", 0))
        executor.update_parameters(**job_parameters(params))
        try:
            job = executor.submit(launcher, config, Singleton.get_state())
        except (submitit.core.utils.FailedJobError, OSError, subprocess.SubprocessError) as e:
            if made:
                shutil.rmtree(run_dir_of(config), ignore_errors=True)
            lines = [line for line in str(e).strip().splitlines() if line.strip()]
            raise LaunchError(f"hydra/launcher=slurm: sbatch refused job #{idx}: "
                              f"{lines[-1] if lines else type(e).__name__}; allowed: a reachable Slurm "
                              "controller and resources it grants") from None
        log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}  (Slurm job {job.job_id}: "
                 f"{params['nodes']} node(s) x {params['tasks_per_node']} rank(s))")
        submitted.append((config, job))
    gone = wait_for([job for _, job in submitted])
    returns = []
    for config, job in submitted:
        try:
            if job.job_id in gone:
                raise RuntimeError(f"it ended without a result (cancelled, out of time or killed); "
                                   f"see {job.paths.stderr}")
            ret = job.results()[0]
        except Exception as e:  # the Slurm job died: crashed, cancelled, out of time
            lines = [line for line in str(e).strip().splitlines() if line.strip()]
            ret = failed_return(config, f"Slurm job {job.job_id}: {lines[-1] if lines else type(e).__name__}")
        if ret.status == JobStatus.FAILED:
            ret = failed_return(config, f"{type(ret._return_value).__name__}: {ret._return_value}")
        status = ret.return_value if isinstance(ret.return_value, str) else results.COMPLETED
        statuses.append(status)
        if status == results.FAILED:
            run_dir = run_dir_of(config)
            print(f"bfexp: job #{config.hydra.job.num} ({' '.join(filter_overrides(ret.overrides or []))}) "
                  f"failed: {job_error(run_dir) or 'see ' + str(run_dir)}", flush=True)
        returns.append(ret)
    return returns


# Seconds between looks at the sweep's jobs, and how many looks a job may be missing from
# squeue without a result before it counts as gone (squeue can lag a finished job's result file).
POLL_S = 2.0
MISSING_LOOKS = 3


def queued_jobs() -> set[str] | None:
    """Job ids Slurm still knows as pending or running (squeue); None when squeue does not answer."""
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%i", "-u", getpass.getuser()], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {line.split("_")[0].strip() for line in out.stdout.splitlines()} if out.returncode == 0 else None


def wait_for(jobs: list[Any]) -> set[str]:
    """Wait until every job has left its result or left the queue without one; returns the latter.

    submitit asks sacct, which a cluster without accounting (like scripts/slurm_local.sh's)
    does not answer: it would wait forever on a job that died. Result files and squeue suffice.
    """
    missing: dict[str, int] = {}
    while True:
        pending = [job for job in jobs if not job.paths.result_pickle.exists()]
        queued = queued_jobs() if pending else set()
        for job in pending:
            if queued is not None and job.job_id not in queued:
                missing[job.job_id] = missing.get(job.job_id, 0) + 1
        gone = {job.job_id for job in pending if missing.get(job.job_id, 0) >= MISSING_LOOKS}
        if len(gone) == len(pending):
            return gone
        time.sleep(POLL_S)


def run_in_job(launcher: Any, config: DictConfig, singleton_state: dict[Any, Any]) -> JobReturn:
    """In the Slurm job: run bfexp's job function on the config the driver composed."""
    import submitit

    assert launcher.hydra_context is not None and launcher.task_function is not None
    Singleton.set_state(singleton_state)
    setup_globals()
    with open_dict(config.hydra.job):
        config.hydra.job.id = submitit.JobEnvironment().job_id
    return run_job(hydra_context=launcher.hydra_context, task_function=launcher.task_function, config=config,
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
