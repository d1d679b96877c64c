"""A PBS-style site's launcher, a user's own (not bfexp's): ranks start through the site's ``mpiexec`` wrapper
(``pbs_mpiexec`` beside this file, which notes each start in ``record`` and runs Open MPI's mpiexec), inside
the job PBS gave (``PBS_JOBID``, set by qsub). One class and one YAML (conf/launcher/pbs.yaml); bfexp's cli.py
and config.py know nothing of it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import ClassVar, Sequence

from bfexp.errors import ConfigError
from bfexp.launchers import Launcher, find_mpiexec

WRAPPER = Path(__file__).resolve().parent / "pbs_mpiexec"
# What PBS writes into a job's output when it ends the job: "=>> PBS: job killed: walltime 65 exceeded limit 60".
KILLED = re.compile(r"=>> PBS: job killed: (.+)")


class Pbs(Launcher):
    """Ranks through the site's mpiexec wrapper. ``queue``: batch or debug; ``record``: where the wrapper notes
    each start (the job, the queue, its arguments)."""

    name: ClassVar[str] = "pbs"

    def __init__(self, queue: str = "batch", record: str = "pbs_record.txt") -> None:
        if queue not in ("batch", "debug"):
            raise ConfigError(f"launcher.queue={queue}; allowed: batch, debug")
        self.queue, self.record = queue, str(record)

    def command(self, ranks: int, program: Sequence[str], mpiexec_args: Sequence[str] = ()) -> list[str]:
        return [str(WRAPPER), "--oversubscribe", "-n", str(ranks), *map(str, mpiexec_args), *program]

    def environment(self, ranks: int, env: dict[str, str]) -> dict[str, str]:
        env.update(PBS_QUEUE=self.queue, PBS_RECORD=str(Path(self.record).resolve()), PBS_MPIEXEC=find_mpiexec())
        return env

    def check(self, ranks: int) -> None:
        find_mpiexec()
        if not os.access(WRAPPER, os.X_OK):
            raise ConfigError(f"{WRAPPER} is not executable")

    def diagnose(self, log: str, hosts: dict[int, str | None]) -> str | None:
        """PBS's own word first (a job it killed), then Open MPI's (bfexp's default)."""
        killed = KILLED.search(log)
        if killed:
            return f"PBS ended the job: {killed.group(1).strip()}"
        return super().diagnose(log, hosts)
