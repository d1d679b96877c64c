"""Checkpoints' folder and stop requests: what a run folder's checkpoint is, read by the driver and the ranks.

``checkpoint_every=K`` makes the ranks write a checkpoint at every K-th
step; a stop request (the driver got SIGTERM, SIGINT or SIGUSR1: it creates
RUN_DIR/stop) makes them write one where they stop. A run folder holds at
most one complete checkpoint:

    checkpoint/step<S>/rank<N>.pt   one file per rank (torch.save; read back with weights_only=True)
    checkpoint/latest.json          {"step": S, "ranks": R, "folder": "step<S>", "experiment": {...}}

Every rank writes its file under a temporary name and renames it; the ranks
then agree, in one small allreduce, that every file is there, and only then
rank 0 replaces latest.json and removes the older step folder. A crash at
any moment leaves latest.json naming a complete checkpoint, or none.

A rank file holds everything the next step depends on: the model
(state_dict, buffers included); the algorithm's state_dict, which is the
local optimizer's state, the iteration (also the topology's position in its
period) and the rule's own buffers (exact diffusion's psi and last x,
gradient tracking's tracker, push-sum's numerator and weight); the data
sampler (its generator, epoch, order and position); torch's global
generator (process ranks; virtual ranks share one process); and the loop's
own sums (the logging window's loss, the last record, the time so far).

Ranks agree on stopping where they already meet: the mean of the stop flag
travels with the metrics of each logging step, and with the checkpoint's
agreement at a checkpoint step, so stopping adds no collective to a step.
A run resumes only the experiment its checkpoint was written for: the keys
in EXPERIMENT must match; the rest (steps, timeouts, logging) may change.

Sweeps resume by folder: ``job_folder`` (the ``bfexp_job`` resolver of
hydra.sweep.subdir) keys a job's folder by its overrides, so a sweep run
again into its folder finds each job's earlier attempt: a finished one is
skipped untouched, an unfinished one reruns there, from its checkpoint.

This module is the driver's side and the format both sides read (no torch):
the driver's stop requests, a run folder readied for an attempt (``prepare``),
sweep folders (``job_folder``), ``latest``. What a rank writes and reads back
(its file, the ranks' agreement that a checkpoint is complete) is
bfexp.checkpointer's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from bfexp import results
from bfexp.errors import ConfigError

__all__ = ["EXPERIMENT", "job_folder", "latest", "prepare", "request_stop", "stop_reason"]

CHECKPOINT_DIR = "checkpoint"
LATEST = "latest.json"
STOP = "stop"
STOP_AT = "stop_at"  # where virtual ranks of an asynchronous budget run cut (bfexp.budget)
# The checkpoint's format (latest.json's "format", every rank file's): bumped when what a rank file holds changes.
FORMAT = 1
SKIPPED = ".skipped"  # in a sweep folder: where a finished job's scratch folder goes (the CLI removes it)
# What a trajectory depends on: a checkpoint resumes only a config that agrees on these.
EXPERIMENT = ("ranks", "seed", "batch_size", "lr", "dtype", "algorithm", "topology", "model", "dataset", "optimizer",
              "engine.ranks_per_machine")


# ---------------------------------------------------------------- stop requests (driver -> ranks)


def request_stop(run_dir: Path, why: str) -> None:
    """Ask the ranks to stop at their next logging or checkpoint step and write a checkpoint there."""
    results.write_text_atomic(Path(run_dir) / STOP, why + "\n")


def stop_reason(run_dir: Path) -> str | None:
    """Why the ranks were asked to stop, or None."""
    try:
        return (Path(run_dir) / STOP).read_text().strip() or "stop requested"
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------- the folder


def experiment(cfg: Any) -> dict:
    """The config values a checkpoint is only valid for (EXPERIMENT), as plain data."""
    out = {}
    for key in EXPERIMENT:
        value = OmegaConf.select(cfg, key, default=None)
        out[key] = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
    return out


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out
    return {prefix: value}


def differences(saved: dict, now: dict) -> list[str]:
    """Dotted keys whose values differ, as `key=now (checkpoint: saved)`."""
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    for key in EXPERIMENT:
        a.update(_flat(saved.get(key), key))
        b.update(_flat(now.get(key), key))
    return [f"{k}={b.get(k)!r} (checkpoint: {a.get(k)!r})" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def read_manifest(path: Path) -> dict | None:
    """latest.json checked: None when there is none; ConfigError (one line naming the file) when it cannot be
    read or is not a manifest of this format, instead of a resume silently starting over from step 0."""
    manifest, damaged = results.read_json_checked(path)
    if manifest is None and damaged is None:
        return None
    problem = damaged.replace(f"{path} ", "", 1) if damaged else manifest_problem(manifest)
    if problem:
        raise ConfigError(f"checkpoint manifest {path} is damaged ({problem}); allowed: a manifest bfexp wrote "
                          f"(format {FORMAT}); remove {path.parent} to start the run over")
    return manifest


def manifest_problem(manifest: Any) -> str | None:
    """What is wrong with a parsed latest.json, or None."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    version = manifest.get("format", 1)  # checkpoints from before the version was written are format 1
    if version != FORMAT:
        return f"format {version!r}; this bfexp reads format {FORMAT}"
    for key, kind in (("step", int), ("ranks", int), ("folder", str), ("experiment", dict)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            return f"{key}={manifest.get(key)!r}"
    if manifest["folder"] != f"step{manifest['step']}" or manifest["step"] < 1 or manifest["ranks"] < 1:
        return f"step={manifest['step']}, ranks={manifest['ranks']}, folder={manifest['folder']!r}"
    return None


def latest(run_dir: Path, strict: bool = False) -> dict | None:
    """The run folder's complete checkpoint (latest.json, every rank's file present), or None. ``strict``:
    a damaged latest.json is a ConfigError (``read_manifest``), not None."""
    root = Path(run_dir) / CHECKPOINT_DIR
    try:
        manifest = read_manifest(root / LATEST)
    except ConfigError:
        if strict:
            raise
        return None
    if not manifest:
        return None
    folder = root / str(manifest.get("folder", ""))
    if not all((folder / f"rank{r}.pt").is_file() for r in range(int(manifest.get("ranks", 0)))):
        return None
    return manifest


def prepare(now: dict, run_dir: Path, total_steps: int | None = None) -> dict | None:
    """Ready a run folder for an attempt (a first run, a rerun or a resume); returns the checkpoint it resumes.

    A folder whose last attempt did not finish, with a checkpoint: refuse
    (ConfigError, one line) a job whose EXPERIMENT (``now``: ``experiment`` of its config) differs, keep the
    metrics up to its step. Otherwise start clean (a finished run run again
    into its own folder starts over). Either way the last attempt's summary,
    failures, heartbeats and stop request go.
    """
    run_dir = Path(run_dir)
    last = results.read_json(run_dir / results.SUMMARY) or {}
    if last.get("status") in results.FINISHED:
        shutil.rmtree(run_dir / CHECKPOINT_DIR, ignore_errors=True)
    manifest = latest(run_dir, strict=True)
    step = 0
    if manifest is not None:
        changed = differences(manifest.get("experiment", {}), now)
        if changed:
            raise ConfigError(f"{run_dir} has a checkpoint of another experiment: {'; '.join(changed[:3])}; "
                              f"allowed: the same {', '.join(EXPERIMENT)} (steps, timeouts and logging may change)")
        step = int(manifest["step"])
        if total_steps is not None and total_steps < step:
            raise ConfigError(f"steps={total_steps}; allowed: >= {step}, the step of the checkpoint in {run_dir}")
    metrics = run_dir / results.METRICS
    if metrics.exists():
        kept = [r for r in results.read_jsonl(metrics) if int(r.get("step", 0)) <= step]
        if kept:
            results.write_text_atomic(metrics, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        else:
            metrics.unlink()
    for name in (results.SUMMARY, STOP, STOP_AT):
        (run_dir / name).unlink(missing_ok=True)
    for name in (results.ERRORS_DIR, "heartbeat"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    return manifest


# ---------------------------------------------------------------- resumable sweeps

# A folder name's longest form (file systems take 255 bytes; the job number and a hash go beside it).
NAME_BYTES = 200


def folder_name(key: str) -> str:
    """A job's overrides as ONE folder name: ``/`` (a swept path, ``topology.path=g/a.edges``) would nest
    folders and ``..`` climb out of the sweep, so ``%`` and ``/`` are percent-encoded (``g%2Fa.edges``);
    a name too long for a file system keeps its start and a hash of the whole."""
    import hashlib

    name = key.replace("%", "%25").replace("/", "%2F").replace("\0", "%00")
    if len(name.encode()) > NAME_BYTES:
        digest = hashlib.sha1(name.encode()).hexdigest()[:12]
        name = name.encode()[:NAME_BYTES - 13].decode(errors="ignore") + "~" + digest
    return name


def job_folder(sweep_dir: Any, num: Any, key: Any) -> str:
    """A sweep job's folder (hydra.sweep.subdir), keyed by its overrides: ``<num>_<overrides>``.

    A job that already has a folder in the sweep, from an earlier run of the
    same sweep whatever its number was then, runs in that folder again: a
    failed or interrupted one reruns (from its checkpoint, if it has one). A
    finished one (completed or diverged) is left untouched: the job gets a
    scratch folder under .skipped/ named after it, which the CLI removes.
    """
    import glob
    import re

    root, key = Path(str(sweep_dir)), folder_name(str(key))
    pattern = re.compile(r"\d+_" + re.escape(key))
    earlier = sorted((p for p in root.glob("*_" + glob.escape(key)) if p.is_dir()
                      and pattern.fullmatch(p.relative_to(root).as_posix())), key=lambda p: int(p.name.split("_")[0]))
    for folder in earlier:
        summary = results.read_json(folder / results.SUMMARY)
        if summary and summary.get("status") in results.FINISHED:
            return f"{SKIPPED}/{folder.relative_to(root).as_posix()}"
    return earlier[0].relative_to(root).as_posix() if earlier else f"{num}_{key}"
