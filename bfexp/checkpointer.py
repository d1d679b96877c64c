"""One rank's checkpoints: its state at a step boundary, written atomically, read back bit for bit.

The run folder's layout, its manifest and the stop requests are bfexp.checkpoint's;
this module is the ranks' side of it (torch, the engine): each rank writes its
own file under a temporary name and renames it; the ranks agree, in one small
allreduce, that every file is there, and only then rank 0 replaces latest.json
and removes the older step folder. A rank file holds everything the next step
depends on (bfexp.checkpoint says what); ``check_state`` checks one before
anything is loaded from it.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

from bfexp import results
from bfexp.checkpoint import CHECKPOINT_DIR, FORMAT, LATEST, STOP, latest
from bfexp.errors import ConfigError

__all__ = ["Checkpointer", "check_state"]


def check_state(path: Path, state: Any, model: Any, rank: int) -> None:
    """A rank file checked before anything is loaded from it: this format, this rank, and a model state with
    this model's keys and shapes (torch's own message ends at "Error(s) in loading state_dict for LogReg:")."""
    keys = ("step", "model", "algorithm", "sampler", "loop")
    if not isinstance(state, dict) or any(k not in state for k in keys):
        raise ConfigError(f"checkpoint file {path} is not a bfexp checkpoint (it lacks "
                          f"{', '.join(k for k in keys if not isinstance(state, dict) or k not in state)})")
    if state.get("format", 1) != FORMAT or state.get("rank", rank) != rank:
        raise ConfigError(f"checkpoint file {path} has format {state.get('format', 1)!r} and rank "
                          f"{state.get('rank')!r}; allowed: format {FORMAT}, rank {rank}")
    saved = {k: tuple(v.shape) for k, v in state["model"].items()}
    here = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    differ = [f"missing {k}" for k in here if k not in saved] + [f"unexpected {k}" for k in saved if k not in here]
    differ += [f"{k} is {saved[k]} in the checkpoint, {here[k]} here" for k in here if k in saved and saved[k] != here[k]]
    if differ:
        raise ConfigError(f"checkpoint file {path} is of another model ({type(model).__name__}): "
                          f"{'; '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}; "
                          "allowed: the model the checkpoint was written for")


class Checkpointer:
    """One rank's checkpoints in the training loop: restore at the start, write at step boundaries.

    ``boundary`` is collective whenever it writes (every rank knows when: a
    checkpoint step, or a stop the ranks agreed on), and returns whether the
    ranks stop here.
    """

    def __init__(self, every: int, experiment: dict, engine: Any, run_dir: Path) -> None:
        """A checkpoint ``every`` steps (0: only when the ranks stop), each marked with the job's ``experiment``
        (bfexp.checkpoint.experiment of its config)."""
        self.engine = engine
        self.run_dir = Path(run_dir)
        self.every = int(every or 0)
        self.experiment = experiment
        self.step = 0  # the step of the checkpoint this run resumed from (0: none)

    def stop_requested(self) -> float:
        """1.0 when the driver asked this job to stop (this rank's view; ranks agree through a mean)."""
        return 1.0 if (self.run_dir / STOP).exists() else 0.0

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def restore(self, model: Any, optimizer: Any, sampler: Any) -> dict:
        """Load this rank's state from the folder's checkpoint, if it has one; returns the loop's state
        (``step`` 0 and nothing else without one)."""
        import torch

        manifest = latest(self.run_dir, strict=True)
        if manifest is None:
            return {"step": 0}
        path = self.run_dir / CHECKPOINT_DIR / manifest["folder"] / f"rank{self.engine.rank}.pt"
        device = getattr(self.engine, "device", None) or "cpu"
        try:
            state = torch.load(path, map_location=device, weights_only=True)
        except pickle.UnpicklingError:  # torch's own words advise loading it unsafely: not ours to repeat
            raise ConfigError(f"checkpoint file {path} cannot be read: it is damaged or not a bfexp checkpoint (it "
                              "holds objects other than tensors and plain data, which bfexp does not load); allowed: "
                              f"remove {path.parent} to resume from an earlier checkpoint, or rerun from the start "
                              "in a new folder") from None
        except (RuntimeError, OSError, EOFError, ValueError) as e:
            raise ConfigError(f"checkpoint file {path} cannot be read ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
        check_state(path, state, model, self.engine.rank)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["algorithm"])
        sampler.load_state_dict(state["sampler"])
        if state.get("rng") is not None and self.engine.processes:
            torch.set_rng_state(state["rng"])
        self.step = int(state["step"])
        return dict(state["loop"], step=self.step)

    def boundary(self, step: int, model: Any, optimizer: Any, sampler: Any, loop: dict,
                 stop: bool | None = None) -> bool:
        """After ``step``: write a checkpoint if one is due or the ranks stop here; True when they stop.

        ``stop`` is the ranks' agreed answer at a logging step; None between
        logging steps, where this rank's own request is agreed on here.
        """
        wanted = self.stop_requested() if stop is None else float(stop)
        if not (self.due(step) or (stop is not None and stop)):
            return False
        optimizer.finish()  # nothing in flight: the state is the step's end
        problem = self._write(step, model, optimizer, sampler, loop)
        stops = self._agree(step, problem, wanted)
        return any(s > 0 for s in stops)

    def write_unlocked(self, step: int, model: Any, optimizer: Any, sampler: Any, loop: dict) -> int:
        """Collective, after an asynchronous budget run stopped: every rank writes ITS step's state
        (the ranks stopped at different steps) into one checkpoint, named after the largest step;
        returns that step (0: no rank had trained a step, so no checkpoint is written). The rule's state_dict
        waits for what is in flight, and keeps what landed unsettled (push-sum's slots) as it is."""
        from bfexp.metrics import gather_floats

        [steps] = gather_floats(self.engine, float(step))
        label = int(max(steps))
        if label < 1:
            return 0
        problem = self._write(label, model, optimizer, sampler, loop, own_step=step)
        self._agree(label, problem, 1.0)
        return label

    def _agree(self, step: int, problem: str | None, wanted: float) -> list[float]:
        """Every rank's file written (else OSError, and the step's files go): rank 0 commits; returns the
        ranks' stop flags."""
        from bfexp.metrics import gather_floats

        written, stops = gather_floats(self.engine, 0.0 if problem else 1.0, wanted)
        missing = [r for r, ok in enumerate(written) if ok != 1.0]
        if missing:
            if self.engine.rank == 0:  # every rank is past its write: the uncommitted step's files go
                shutil.rmtree(self._folder(step), ignore_errors=True)
            raise OSError(f"checkpoint at step {step} not written on rank(s) {', '.join(map(str, missing))}"
                          + (f": {problem}" if problem else ""))
        if self.engine.rank == 0:
            self._commit(step)
        # No rank goes on (and can fail, ending the job) before the checkpoint is committed.
        self.engine.barrier()
        return stops

    def _folder(self, step: int) -> Path:
        return self.run_dir / CHECKPOINT_DIR / f"step{step}"

    def _write(self, step: int, model: Any, optimizer: Any, sampler: Any, loop: dict,
               own_step: int | None = None) -> str | None:
        """This rank's file in the folder of ``step``, atomically (``own_step``: the step this rank is at,
        where ranks stopped at different ones); returns the problem (e.g. a full disk) or None."""
        import torch

        state = {
            "format": FORMAT,
            "step": step if own_step is None else own_step,
            "rank": self.engine.rank,
            "model": model.state_dict(),
            "algorithm": optimizer.state_dict(),
            "sampler": sampler.state_dict(),
            "rng": torch.get_rng_state() if self.engine.processes else None,
            "loop": loop,
        }
        folder = self._folder(step)
        path = folder / f"rank{self.engine.rank}.pt"
        tmp = folder / f".rank{self.engine.rank}.pt.tmp"
        # Serialized in memory first: torch's writer turns a full disk into "unexpected pos ..." (a
        # RuntimeError), while a plain write says ENOSPC/EFBIG as an OSError that names the file.
        buffer = io.BytesIO()
        torch.save(state, buffer)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(buffer.getbuffer())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)  # no partial file stays behind
            return f"{e.strerror or type(e).__name__} writing {path.relative_to(self.run_dir)} ({len(buffer.getbuffer())} bytes)"
        return None

    def _commit(self, step: int) -> None:
        """Rank 0, once every rank's file is there: point latest.json at this step, drop the older ones."""
        root = self.run_dir / CHECKPOINT_DIR
        results.write_json_atomic(root / LATEST, {"format": FORMAT, "step": step, "ranks": self.engine.size,
                                                  "folder": f"step{step}", "experiment": self.experiment})
        for old in root.glob("step*"):
            if old.name != f"step{step}":
                shutil.rmtree(old, ignore_errors=True)
