"""The run folder's format, both ways: file names, the summary's fields, atomic writes, reading back.

summary.json is replaced in one rename; metrics.jsonl grows one whole line
per write, and readers skip a torn last line. The summary's identity and its
one list of figures (with units in their names) live here; the report, the
console table and the driver's progress read them from here. A run folder
in use has one live driver, which holds its lock (``lock_folder``).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterator

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
# In a sweep folder: the points a sweep with skip_invalid=true left out, each with its overrides and reason.
REFUSED = "refused.json"
ERRORS_DIR = "errors"
LOGS_DIR = "logs"
# In LOGS_DIR: where rank 0's start-up and wall time went (``Phases``; `bfexp --verbose` prints it).
TIMING = "timing.json"

# What a job is: every summary carries these, also one written for a job no rank finished.
IDENTITY = ("algorithm", "topology", "ranks", "engine", "seed", "model", "dataset", "batch_size", "lr")
# A job's status, said in these words only (summary.json's "status"). A job that ran ends completed,
# failed, diverged (its loss blew up) or interrupted (a signal stopped it, resumable); a sweep also
# counts the jobs it skipped (finished in an earlier run) and those it did not run (fail_fast).
COMPLETED, FAILED, DIVERGED, INTERRUPTED = "completed", "failed", "diverged", "interrupted"
SKIPPED, NOT_RUN = "skipped", "not run"
STATUSES = (COMPLETED, FAILED, DIVERGED, INTERRUPTED)
FINISHED = (COMPLETED, DIVERGED)  # done: never rerun, never touched (a sweep run again skips them)


@dataclass(frozen=True)
class Field:
    """One figure of a summary: its key (unit in the name), a short header, a label, where it shows."""

    key: str
    short: str
    label: str
    console: bool = True  # in the sweep's console table (width is scarce)
    job_table: bool = True  # in the table printed at the end of one job
    # A scaling figure: the summary's top level takes it from the measured or the modeled set, as time_source says.
    headline: bool = False
    # Set on the two ends of a figure's interval: the figure they bound (tables fold them into its cell).
    bound_of: str | None = None


LOW, HIGH = "_low", "_high"


def low_key(key: str) -> str:
    return key + LOW


def high_key(key: str) -> str:
    return key + HIGH


def spread(figure: Field) -> tuple[Field, Field, Field]:
    """A figure and the two ends of its interval, ``<key>_low`` and ``<key>_high``, defined beside it.

    The interval is what the figure's per-step samples allow (bfexp.scaling):
    the point lies inside it; a modeled figure's comes from its inputs'.
    """
    ends = [
        Field(name(figure.key), f"{figure.short} {end}", f"{figure.label}, {end} end", console=False, job_table=False,
              headline=figure.headline, bound_of=figure.key)
        for name, end in ((low_key, "low"), (high_key, "high"))
    ]
    return (figure, *ends)


# The summary's figures, in the order tables show them; each timing figure carries its interval.
FIELDS = (
    Field("status", "status", "status"),
    Field("final_loss", "loss", "loss"),
    Field("final_accuracy", "acc", "accuracy"),
    # A language model's (dataset=text): exp of the mean held-out token cross-entropy; accuracy is next-token.
    Field("final_perplexity", "ppl", "held-out perplexity"),
    Field("consensus_distance", "consensus", "consensus distance"),
    # Mean over ranks of the bytes one training step put on the wire, compressed as sent (Engine.bytes_sent).
    Field("bytes_sent_per_step", "bytes/step", "bytes sent per step (per rank)"),
    *spread(Field("step_time_s", "step s", "step time (s, median)", console=False, headline=True)),
    *spread(Field("throughput_samples_per_s", "samples/s", "throughput (samples/s)", headline=True)),
    *spread(Field("single_rank_throughput_samples_per_s", "1-rank samples/s", "single-rank throughput (samples/s)",
                  False, False, headline=True)),
    *spread(Field("scaling_efficiency", "efficiency", "scaling efficiency", headline=True)),
    *spread(Field("baseline_throughput_samples_per_s", "base samples/s", "baseline throughput (samples/s)", False, False,
                  headline=True)),
    *spread(Field("baseline_scaling_efficiency", "base eff", "baseline scaling efficiency", False, False, headline=True)),
    *spread(Field("speedup_vs_baseline", "speedup", "speedup vs allreduce", headline=True)),
    *spread(Field("comm_time_s", "comm s", "communication (s/step)", False, False, headline=True)),
    *spread(Field("compute_time_s", "compute s", "compute (s/step)", False, False, headline=True)),
    *spread(Field("wait_time_s", "wait s", "waiting for peers (s/step)", False, False, headline=True)),
    *spread(Field("framework_overhead_fraction", "overhead", "framework overhead (1 rank)", console=False)),
    Field("reference_source", "reference", "single-rank reference", console=False),
    Field("time_source", "time", "scaling figures"),
    # Time to accuracy: the training time the job's metrics.jsonl records carry (time_s: simulated on virtual
    # ranks, measured on real ones), and the report's time to reach a target (config, else the allreduce job's).
    Field("train_time_s", "train s", "training time (s)", console=False),
    # The same steps priced on the scaling config's cluster (bfexp.ledger), where its compute speed is known.
    Field("modeled_train_time_s", "modeled s", "modeled training time (s)", console=False),
    Field("modeled_cluster", "cluster", "cluster modeled", console=False),
    # Seconds a rank spent evaluating the held-out set (mean over ranks), apart from training time.
    Field("eval_time_s", "eval s", "evaluation time (s)", console=False),
    # Ranks whose held-out figures final_accuracy and final_eval_loss average: every rank, or on
    # engine=stacked above 512 ranks a sample of evenly spaced ones.
    Field("eval_ranks", "eval ranks", "ranks evaluated", console=False),
    Field("target_accuracy", "target acc", "target accuracy", console=False, job_table=False),
    Field("time_to_target_accuracy_s", "t->acc s", "time to target accuracy (s)", job_table=False),
    # Under budget_s: the same for the ranks' average model and for the worst rank (metrics.jsonl's
    # average_model_accuracy and worst_accuracy).
    Field("time_to_target_accuracy_average_model_s", "t->acc avg s", "time to target accuracy, average model (s)",
          job_table=False),
    Field("time_to_target_accuracy_worst_rank_s", "t->acc worst s", "time to target accuracy, worst rank (s)",
          job_table=False),
    Field("target_eval_loss", "target loss", "target held-out loss", console=False, job_table=False),
    Field("time_to_target_eval_loss_s", "t->loss s", "time to target held-out loss (s)", console=False,
          job_table=False),
    Field("wall_time_s", "wall s", "wall time (s)", console=False),
    # The largest resident memory of the process that ran rank 0 (virtual ranks: every rank's, one process).
    Field("peak_memory_bytes", "peak B", "peak memory (bytes)", console=False),
)
FIELD = {f.key: f for f in FIELDS}
# The scaling figures a summary headlines, with their intervals; `time_source` says whether they are measured or modeled.
HEADLINE = tuple(f.key for f in FIELDS if f.headline)
# figure -> (low key, high key), for every figure with an interval.
INTERVALS = {key: (low_key(key), high_key(key)) for key in dict.fromkeys(f.bound_of for f in FIELDS if f.bound_of)}


def identity(**values: Any) -> dict:
    """A summary's identity block, in IDENTITY's order; every key must be given."""
    missing = [k for k in IDENTITY if k not in values]
    if missing:
        raise TypeError(f"identity() lacks {missing}")
    return {k: values[k] for k in IDENTITY}


def clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every reader can parse the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def _umask() -> int:
    """This process's umask, read without changing it (Linux's /proc: os.umask can only be read by setting
    it, which another thread's file creation could see); the set-and-restore fallback runs once, at import."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _umask()  # a results file is made as open() would make it: 0o666 less the user's umask


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """``text`` into ``path`` whole or not at all (a temporary file beside it, renamed over it), with the mode
    a plain open() would give it under the user's umask (mkstemp's 0600 would hide it from collaborators)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~UMASK)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(clean(obj), indent=2, sort_keys=True) + "\n")


# The largest results files bfexp reads back: a summary.json is kilobytes, a metrics.jsonl of a million
# logged steps under a gigabyte; a path to something larger (or to /dev/zero) is not one of them.
JSON_LIMIT = 256 * 2**20
JSONL_LIMIT = 4 * 2**30


def read_json(path: str | os.PathLike) -> dict | None:
    """A JSON object from a file; None when there is none or it is not one (``read_json_checked`` says why)."""
    return read_json_checked(path)[0]


def read_json_checked(path: str | os.PathLike) -> tuple[dict | None, str | None]:
    """(the JSON object in a file, None); (None, None) when there is no file; (None, what is wrong) when it is
    damaged: undecodable bytes, truncated or not JSON, or JSON that is not an object."""
    from bfexp.files import NotARegularFile, TooLarge, read_file

    try:
        data = json.loads(read_file(path, JSON_LIMIT))
    except FileNotFoundError:
        return None, None
    except IsADirectoryError:
        return None, f"{path} is a folder"
    except (NotARegularFile, TooLarge) as e:  # /dev/zero, a FIFO (not opened to block), a file of gigabytes
        return None, f"{path} is {e.strerror}"
    except UnicodeDecodeError as e:
        return None, f"{path} holds undecodable bytes ({e.reason} at byte {e.start})"
    except json.JSONDecodeError as e:
        end = "truncated" if e.pos >= len(e.doc.rstrip()) or e.msg.startswith("Unterminated") else "not JSON"
        return None, f"{path} is {end} ({e.msg} at line {e.lineno} column {e.colno})"
    if not isinstance(data, dict):
        return None, f"{path} holds a JSON {type(data).__name__}, not an object"
    return data, None


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """One os.write of one whole line: a reader never sees a record split across writes."""
    line = (json.dumps(clean(record), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return list(iter_jsonl(path))


def read_jsonl_checked(path: str | os.PathLike) -> tuple[list[dict], str | None]:
    """(the records of a JSON-lines file, None), or the records before its first damaged line and what is
    wrong there (undecodable bytes, a line that is not a JSON object)."""
    from bfexp.files import read_file

    records: list[dict] = []
    try:
        lines = read_file(path, JSONL_LIMIT).split(b"\n")
    except FileNotFoundError:
        return records, None
    except OSError as e:
        return records, f"{path} cannot be read ({e.strerror or e})"
    for number, line in enumerate(lines[:-1], 1):  # the last piece: empty, or a torn line still being written
        try:
            record = json.loads(line) if line.strip() else {}
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError both
            return records, f"{path} line {number} is not a JSON record ({type(e).__name__})"
        if not isinstance(record, dict):
            return records, f"{path} line {number} holds a JSON {type(record).__name__}, not an object"
        if record:
            records.append(record)
    return records, None


def iter_jsonl(path: str | os.PathLike, start: int = 0) -> Iterator[dict]:
    try:
        with open(path) as f:
            f.seek(start)
            for line in f:
                if not line.endswith("\n"):
                    return  # torn last line: still being written
                line = line.strip()
                if line:
                    yield json.loads(line)
    except FileNotFoundError:
        return


def process_started_at() -> float | None:
    """When this process started (seconds since the epoch), from /proc; None where there is none."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


class Phases:
    """Where a process's wall time went: ``mark(name)`` ends the phase that began at the previous
    mark (the first at ``start``, e.g. the process's start). Cheap enough to run always."""

    def __init__(self, who: str, start: float | None = None) -> None:
        self.who = who
        self.last = start if start is not None else time.time()
        self.spans: list[dict] = []

    def mark(self, name: str) -> None:
        now = time.time()
        self.spans.append({"who": self.who, "phase": name, "start": self.last, "seconds": now - self.last})
        self.last = now


class JsonlTail:
    """Follows a growing jsonl file, returning only whole new records."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.offset = 0

    def read_new(self) -> list[dict]:
        return [json.loads(line) for line in self.new_lines()]

    def new_lines(self) -> list[bytes]:
        """The whole lines written since the last call, unparsed (a reader that wants only the latest of
        them parses that one: a fast writer's thousands of records cost a slow reader nothing)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        return [line for line in data[:end].split(b"\n") if line.strip()]


# ---------------------------------------------------------------- failure records: a rank writes, the driver reads


def record_failure(run_dir: str | os.PathLike, rank: int, exc: BaseException) -> None:
    """A rank leaves the reason it fails (errors/rank<N>.json) before MPI tears the job down; call it in the
    ``except`` block (the traceback is the one being handled)."""
    import traceback

    write_json_atomic(Path(run_dir) / ERRORS_DIR / f"rank{rank}.json", {
        "rank": rank,
        "host": socket.gethostname(),
        "type": type(exc).__name__,
        "message": str(exc).splitlines()[0] if str(exc) else "",
        "traceback": traceback.format_exc(),
        "time": time.time(),
    })


def rank_errors(run_dir: str | os.PathLike) -> list[dict]:
    """The failures the ranks recorded, earliest first."""
    found = [r for r in map(read_json, sorted((Path(run_dir) / ERRORS_DIR).glob("rank*.json"))) if r]
    return sorted(found, key=lambda r: r.get("time", 0.0))


def describe_errors(errors: list[dict]) -> str:
    """One line: the first failure (with its host when that is not this machine), and which other ranks failed."""
    first = errors[0]
    host = first.get("host")
    where = f" on {host}" if host and host != socket.gethostname() else ""
    text = f"rank {first['rank']}{where}: {first['type']}: {first['message']}"
    others = sorted({e["rank"] for e in errors[1:]})
    if others:
        text += f" (also failed: ranks {', '.join(map(str, others))})"
    return text


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.*)$")


def exception_in_logs(run_dir: str | os.PathLike) -> str | None:
    """The last Python exception line a rank printed (for ranks that died
    before they could record their failure, e.g. on an import error)."""
    logs = Path(run_dir) / LOGS_DIR
    for path in sorted(logs.glob("rank*.log")) + [logs / "mpiexec.log"]:
        if not path.exists():
            continue
        for line in reversed(path.read_text(errors="replace").splitlines()):
            m = _EXCEPTION_LINE.match(line.strip())
            if m:
                rank = path.stem[4:] if path.stem.startswith("rank") else "?"
                return f"rank {rank}: {m.group(1)}: {m.group(2)}"
    return None


def launcher_reason(run_dir: str | os.PathLike) -> str | None:
    """mpiexec's own reason, when it refused to start the ranks (a bad engine.mpiexec_args, a host it cannot
    reach): the first message of logs/mpiexec.log (Open MPI frames each between lines of dashes) in one
    line, e.g. "An unrecognized option was included on the mpiexec command line: Option: --bogus-flag"."""
    try:
        text = (Path(run_dir) / LOGS_DIR / "mpiexec.log").read_text(errors="replace")
    except OSError:
        return None
    blocks = [b for b in re.split(r"^-{20,}\s*$", text, flags=re.M) if b.strip()]
    if not blocks:
        return None
    lines = [line.strip() for line in blocks[0].strip().splitlines()]
    end = lines.index("") if "" in lines else len(lines)
    head = " ".join(lines[:end])  # its first paragraph, and what it introduces with a colon
    rest = next((line for line in lines[end:] if line), "")
    said = f"{head}{' ' + rest if rest and head.endswith(':') else ''}"
    return (said if said.startswith("srun:") else f"mpiexec: {said}")[:300]


# ---------------------------------------------------------------- room for the summary on a full disk

# Disk held in the run folder while ranks run, given back to write the summary when the disk fills up.
RESERVE = ".space_reserve"
RESERVE_BYTES = 64 * 1024


def reserve_space(run_dir: str | os.PathLike) -> None:
    """Hold a little disk in the run folder, so a full disk still leaves room for the summary."""
    try:
        with open(Path(run_dir) / RESERVE, "wb") as f:
            f.write(b"\0" * RESERVE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        (Path(run_dir) / RESERVE).unlink(missing_ok=True)


def release_space(run_dir: str | os.PathLike) -> None:
    (Path(run_dir) / RESERVE).unlink(missing_ok=True)


def disk_full(run_dir: str | os.PathLike) -> str | None:
    """A sentence when the run folder's disk has (almost) no room left."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return None
    if free > RESERVE_BYTES:
        return None
    return f"no space left on the run folder's disk ({free} bytes free in {run_dir})"


# ---------------------------------------------------------------- one live driver per run folder

# In a run folder (a sweep's job folder) while a driver runs its job: an flock held for the driver's life, and
# "pid N on HOST" in the file. The kernel drops the lock when its holder dies, so a lock a killed driver
# left is free to take.
LOCK = ".lock"
_held: dict[str, int] = {}  # folder -> the open file that holds its lock (this process's)


def lock_folder(folder: str | os.PathLike) -> str | None:
    """Hold ``folder``'s lock (making the folder) until ``unlock_folder`` or this process ends. None once
    held; who holds it (``pid N on HOST``) when another live process does. A file system without locks
    (some network mounts) runs unguarded."""
    folder = Path(folder)
    key = str(folder.resolve())
    if key in _held:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    while True:
        fd = _open_lock(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            return holder
        except OSError:
            os.close(fd)
            return None
        try:  # the holder removed the file between our open and our lock: lock the one there now
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    _held[key] = fd
    try:  # who holds it, for the refusal's message (a full disk: held all the same)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except OSError:
        pass
    return None


def _open_lock(path: Path, flags: int) -> int:
    """The lock file's descriptor; never through a symbolic link (a link to another file would have it
    truncated) nor of a folder, FIFO or device: ConfigError (one line) naming the path instead."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if path.is_symlink() or (os.path.lexists(path) and not path.is_file()):
            from bfexp.errors import ConfigError

            what = "a symbolic link" if path.is_symlink() else "not a file"
            raise ConfigError(f"{path} is {what}, and bfexp keeps its folder lock there; allowed: a folder whose "
                              f"{LOCK} is bfexp's own file (or none)") from None
        raise e
    import stat

    if not stat.S_ISREG(os.fstat(fd).st_mode):  # e.g. a FIFO: opened without blocking, refused all the same
        os.close(fd)
        from bfexp.errors import ConfigError

        raise ConfigError(f"{path} is not a file, and bfexp keeps its folder lock there; allowed: a folder whose "
                          f"{LOCK} is bfexp's own file (or none)")
    return fd


def folder_holder(folder: str | os.PathLike) -> str | None:
    """Who holds ``folder``'s lock (``pid N on HOST``) when another live process does, else None."""
    path = Path(folder) / LOCK
    if str(Path(folder).resolve()) in _held:
        return None
    try:
        fd = _open_lock(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def unlock_folder(folder: str | os.PathLike) -> None:
    """Give ``folder``'s lock back: its file goes first (whoever opened it meanwhile sees it gone)."""
    fd = _held.pop(str(Path(folder).resolve()), None)
    if fd is None:
        return
    try:
        (Path(folder) / LOCK).unlink(missing_ok=True)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    return text if text.startswith("pid ") else "another process"


def output_to(path: str | os.PathLike) -> None:
    """This process's stdout and stderr (Python's and C's) into ``path``: a rank's log (logs/rank<N>.log)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
