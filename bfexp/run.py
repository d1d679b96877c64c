"""`bfexp-run`: launch a user's own training script on ranks, as the runner launches its jobs.

    bfexp-run -n 4 python train.py --epochs 3
    bfexp-run -n 8 --hosts n1:4,n2:4 python train.py
    bfexp-run -n 8 --engine threads python train.py      # virtual ranks in this process
    python -m bfexp.run -n 4 python train.py

The script uses the library (``import bfexp as bf``, bfexp.api), which
finds its engine from the environment this launcher gives it.

engine=mpi (default): the runner's launch code (bfexp.launch) builds the
mpiexec command for the placement (``--oversubscribe`` here, ``--host``/
``--hostfile`` over machines), the ranks' environment (thread limits, the
UCX one-sided probe silenced, Open MPI's run-as-root flags) and checks
hosts, slots and memory before any rank starts. Every rank runs
``python -m mpi4py -m bfexp.run --rank SCRIPT ARGS``: mpi4py's runner aborts
every rank when one raises, and the rank part here records the failure
(rank, exception) as the runner's worker does, so the launcher names it.
mpiexec runs in a session of its own, ended whole (also on Ctrl-C) so no
rank outlives the launch. Output: live, each line tagged ``[rank N]``, or
with ``--log-dir DIR`` one file per rank (DIR/rank<N>.log).

engine=threads: the script runs N times as threads of this process
(bfexp.api.spawn: one rank at a time between communication calls, each
with its own global RNGs, so the same seed gives MPI's numbers).

Nothing hangs, nothing leaks, as in the runner (bfexp.launch, bfexp.watchdog):
every rank has a heartbeat (the communication call it is in, once the
script's first bf call started its engine); a rank blocked in one call for
``--timeout-s`` seconds (default: the runner's ``timeout_s``; 0: no bound)
ends the launch, naming the rank and the call. Ranks whose bfexp-run is
gone (SIGKILL) end themselves, and remove its temporary folder. A failing
rank prints its traceback from the script's first frame on; bfexp-run then
ends every rank (no MPI_Abort and its banner).

Exit status: the script's (0 when every rank finished), 1 when a rank
failed or hung (the rank and its exception or call named on stderr), 128 +
signal when interrupted, 2 for bad input (one line).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn, TextIO

# The rank part finds its failure record folder here (set by the launcher).
RUN_DIR_VARIABLE = "BFEXP_RUN_DIR"
LOG_DIR_VARIABLE = "BFEXP_RUN_LOGS"
HANG_VARIABLE = "BFEXP_RUN_TIMEOUT_S"  # the ranks beat their hearts often enough for it
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
# How long a failed rank waits for bfexp-run to end the launch before mpi4py's MPI_Abort does.
FAILED_RANK_WAIT_S = 30.0
# How long bfexp-run lets a failed rank's traceback reach the terminal before it ends the ranks.
FAILURE_FLUSH_S = 0.5
# The frames of the launch itself, above the script's first frame: not the user's to read.
PLUMBING = (str(Path(__file__).resolve().parent) + os.sep, "<frozen runpy>", "runpy.py", f"{os.sep}mpi4py{os.sep}",
            f"{os.sep}threading.py")


# ------------------------------------------------------------------ the command line


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bfexp-run",
        description="Run your own training script on N ranks (MPI processes, or virtual ranks with "
                    "--engine threads) with bfexp's environment and failure handling.",
        epilog="example: bfexp-run -n 4 python train.py --epochs 3",
    )
    from bfexp.config import Config

    parser.add_argument("-n", "-np", "--np", dest="ranks", type=int, required=True, help="number of ranks")
    parser.add_argument("--timeout-s", type=float, default=Config.timeout_s,
                        help="end the launch when a rank waits in one communication call this long "
                             f"(seconds; default {Config.timeout_s:g}, the runner's timeout_s; 0: no bound)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", help="machines and their slots, e.g. n1:4,n2:4 (mpirun over ssh)")
    where.add_argument("--hostfile", help="Open MPI hostfile: `host slots=N` a line")
    where.add_argument("--srun", action="store_true",
                       help="start the ranks with srun inside a Slurm allocation (salloc, sbatch), as launcher=srun")
    parser.add_argument("--engine", default="mpi",
                        help="mpi: one process a rank (default); threads: virtual ranks in this process; or an "
                             "engine class's path (mylab.engines.MyEngine): its ranks processes or threads as it says")
    parser.add_argument("--network-interface", help="interface the ranks talk over (with --hosts/--hostfile/--srun)")
    parser.add_argument("--log-dir", help="write each rank's output to LOG_DIR/rank<N>.log instead of the terminal")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="python SCRIPT ARGS (or SCRIPT ARGS, or python -m MODULE ARGS)")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        bad(f"-n {args.ranks}; allowed: an integer >= 1")
    if not args.timeout_s >= 0 or args.timeout_s == float("inf"):
        bad(f"--timeout-s {args.timeout_s:g}; allowed: a number of seconds >= 0 (0: no bound)")
    if not args.command:
        bad("no command; allowed: python SCRIPT ARGS, e.g. bfexp-run -n 4 python train.py")
    args.engine_facts = engine_facts_of(args.engine)
    if not args.engine_facts.processes and (args.hosts or args.hostfile or args.srun):
        bad(f"--hosts/--hostfile/--srun with --engine {args.engine}, whose ranks are threads of this process; "
            "allowed: --engine mpi across machines")
    if args.log_dir and Path(args.log_dir).exists() and not Path(args.log_dir).is_dir():
        bad(f"--log-dir {args.log_dir} is a file; allowed: a folder (made if missing) for the ranks' logs")
    if args.network_interface and not (args.hosts or args.hostfile or args.srun):
        bad(f"--network-interface {args.network_interface} without --hosts, --hostfile or --srun: the ranks of one "
            "machine talk through shared memory; allowed: it beside one of them")
    return args


def engine_facts_of(engine: str) -> Any:
    """The facts of ``--engine`` (bfexp.comm.engine_facts: a shipped engine or a class's path), or exit 2: a
    script runs on ranks that are processes or threads, not on one batched program of them all."""
    from bfexp.comm import engine_facts, engine_options
    from bfexp.errors import ConfigError

    try:
        facts = engine_facts(engine)
    except ConfigError as e:
        bad(str(e).replace(f"engine={engine}", f"--engine {engine}", 1))
    if facts.stacked:
        runnable = [o for o in engine_options() if not engine_facts(o).stacked]
        bad(f"--engine {engine} (every rank in one batched program) runs bfexp's own jobs, not a script; allowed: "
            f"{', '.join(runnable)} or an engine class's path")
    return facts


def bad(message: str) -> NoReturn:
    """Bad input: one line, exit status 2 (as the runner's ConfigError)."""
    print(f"bfexp-run: {message}", file=sys.stderr)
    raise SystemExit(2)


def split_command(command: list[str]) -> tuple[str, list[str], list[str]]:
    """(python, what to run: [script] or ['-m', module], its arguments) from ``python train.py ARGS``.

    A bare ``python`` (``python3``, ``python3.11``) means the interpreter bfexp-run runs under: the
    ranks need bfexp and mpi4py, which a different ``python`` on PATH may lack.
    """
    python, rest = sys.executable, list(command)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if rest and re.fullmatch(r"python[0-9.]*", rest[0]):
        rest = rest[1:]  # plain `python`: this interpreter, the one bfexp (and mpi4py) is installed in
    elif rest and not rest[0].endswith(".py") and Path(rest[0]).name.startswith("python"):
        found = shutil.which(rest[0])  # an interpreter named by its path is the user's choice
        if found is None:
            bad(f"{rest[0]} not found; allowed: a python interpreter, e.g. python")
        python, rest = found, rest[1:]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return python, rest[:2], rest[2:]
    if not rest or not rest[0].endswith(".py"):
        bad(f"{' '.join(command)}; allowed: python SCRIPT.py ARGS or python -m MODULE ARGS")
    if not Path(rest[0]).is_file():
        bad(f"script {rest[0]} does not exist; allowed: a path to a Python file")
    return python, rest[:1], rest[1:]


# ------------------------------------------------------------------ engine=mpi: the launcher


def launcher_for(args: argparse.Namespace) -> Any:
    """The launcher the runner's options name: srun in the allocation (--srun), mpirun over --hosts/--hostfile,
    else this machine's mpiexec."""
    from bfexp.launchers import Local, Mpirun, Srun

    if args.srun:
        return Srun(network_interface=args.network_interface)
    if args.hosts or args.hostfile:
        return Mpirun(hosts=args.hosts, hostfile=args.hostfile, network_interface=args.network_interface)
    return Local()


def launch_mpi(args: argparse.Namespace, python: str, target: list[str], script_args: list[str]) -> int:
    from bfexp import results
    from bfexp.api import ENGINE_VARIABLE
    from bfexp.comm import engine_class
    from bfexp.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, ConfigError, LaunchError
    from bfexp.launch import ProcessRanks
    from bfexp.preflight import memory_fits, preflight
    from bfexp.sessions import launcher_environment, start_process_ranks
    from bfexp.signals import SIGNALS
    from bfexp.watchdog import read_heartbeats

    try:
        launcher = launcher_for(args)
        preflight(args.engine, args.ranks, launcher)  # mpi4py here; hosts resolve and answer ssh, enough slots
        memory_fits(engine_class(args.engine), args.ranks, launcher.ranks_per_host(args.ranks), 0)
    except (ConfigError, LaunchError) as e:
        print(f"bfexp-run: {e}", file=sys.stderr)
        return EXIT_ENVIRONMENT if isinstance(e, LaunchError) else EXIT_BAD_INPUT
    # The ranks' failure records and heartbeats: ranks on other machines reach this folder only where they
    # share it, so across machines it lives in the working directory, which they must see (the script is there).
    scratch = None if launcher.on_this_machine else Path.cwd()
    run_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bfexp-run-", dir=scratch))
    for folder in (results.ERRORS_DIR, watchdog_folder()):  # a rerun into the same folder starts clean
        shutil.rmtree(run_dir / folder, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    program = [python, "-m", "mpi4py", "-m", "bfexp.run", "--rank", *target, *script_args]
    env = launcher_environment(launcher, args.ranks, args.timeout_s) | driver_environment(args, run_dir)
    env[ENGINE_VARIABLE] = args.engine  # what each rank's bf.init() starts
    with SIGNALS.job() as signals:
        start = len(signals.received)
        # With --log-dir, mpiexec's own words (a rank killed by a signal, MPI_Abort) go beside the ranks' logs.
        log = open(run_dir / "mpiexec.log", "wb") if args.log_dir else None
        ranks = ProcessRanks(start_process_ranks(launcher, args.ranks, program, env, log, log), run_dir)
        try:
            reason = supervise(ranks, args, signals, lambda: read_heartbeats(run_dir), processes=True)
        finally:
            ranks.end("the launch is over")  # mpiexec's whole session: no rank outlives the launch
            if log is not None:
                log.close()
        if reason is not None or ranks.proc.returncode != 0:
            launcher.clean_up(args.ranks)
    errors = results.rank_errors(run_dir)
    shutil.rmtree(run_dir / watchdog_folder(), ignore_errors=True)
    if not args.log_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    return verdict(args, signals.since(start), errors, reason, ranks.proc.returncode)


def watchdog_folder() -> str:
    from bfexp.watchdog import HEARTBEAT_DIR

    return HEARTBEAT_DIR


def driver_environment(args: argparse.Namespace, run_dir: Path) -> dict[str, str]:
    """What every rank needs of bfexp-run: where to record a failure and beat its heart, and who its driver is
    (ranks whose bfexp-run is gone end themselves, and remove its temporary folder)."""
    from bfexp import watchdog

    env = {RUN_DIR_VARIABLE: str(run_dir.resolve()), watchdog.DRIVER_PID: str(os.getpid()),
           watchdog.DRIVER_HOST: socket.gethostname(), HANG_VARIABLE: str(args.timeout_s)}
    if args.log_dir:
        env[LOG_DIR_VARIABLE] = str(Path(args.log_dir).resolve())
    else:
        env[watchdog.DRIVER_SCRATCH] = str(run_dir.resolve())
    return env


def supervise(ranks: Any, args: argparse.Namespace, signals: Any, read: Any, processes: bool) -> str | None:
    """The runner's watch loop and stop rules (bfexp.launch.Supervisor) over the ranks, until they end or a
    reason to end them (returned): a stop signal (``signals``; None: the caller's, virtual ranks), a rank that
    failed (once its traceback had time to reach the terminal), or a hang (heartbeats from ``read``: process
    ranks' files, or virtual ranks' threads; process ranks dump their stacks into their output first)."""
    from bfexp.launch import Supervisor
    from bfexp.watchdog import Watchdog

    hangs = Watchdog(args.timeout_s, args.ranks, read, processes=processes)
    where = f"{args.log_dir}/rank<N>.log" if args.log_dir else "the ranks' output above"
    supervisor = Supervisor(hangs, signals, failure_grace_s=FAILURE_FLUSH_S, end_failed=True, dump=processes,
                            stacks=where if processes else None)
    return supervisor.watch(ranks)


def verdict(args: argparse.Namespace, sig: int | None, errors: list[dict], reason: str | None,
            returncode: int | None) -> int:
    """bfexp-run's exit status, and its one line on stderr: a signal, a rank's failure, a hang, an exit code."""
    from bfexp import results

    if sig:
        print(f"bfexp-run: interrupted by {signal.Signals(sig).name}; the ranks were ended", file=sys.stderr)
        return 128 + sig
    if errors:
        print(f"bfexp-run: {results.describe_errors(errors)}", file=sys.stderr)
        return 1
    if reason and reason.startswith("hung"):
        print(f"bfexp-run: {reason}", file=sys.stderr)
        return 1
    if returncode:
        where = f"; the ranks' output is in {args.log_dir}" if args.log_dir else ""
        print(f"bfexp-run: the ranks exited with code {returncode}{where}", file=sys.stderr)
        return returncode if returncode > 0 else 1
    return 0


# ------------------------------------------------------------------ engine=mpi: what each rank runs


def rank_main(argv: list[str]) -> None:
    """One MPI rank (under ``python -m mpi4py``): run the script as ``__main__``; record a failure, re-raise it."""
    import runpy

    rank = next((int(os.environ[v]) for v in RANK_VARIABLES if v in os.environ), 0)
    log_dir = os.environ.get(LOG_DIR_VARIABLE)
    if log_dir:
        from bfexp.results import output_to

        output_to(Path(log_dir) / f"rank{rank}.log")
    if os.environ.get(RUN_DIR_VARIABLE):  # under bfexp-run: its watchdog reads this rank's heartbeat
        from bfexp import watchdog

        timeout = float(os.environ.get(HANG_VARIABLE) or 0)
        watchdog.enable_stack_dumps()
        watchdog.Heartbeat(watchdog.NoEngine(rank), Path(os.environ[RUN_DIR_VARIABLE]),
                           period_s=min(1.0, timeout / 4) if timeout else 1.0, step=None, timeout_s=timeout)
    if not log_dir:
        sys.stdout, sys.stderr = _Tagged(sys.stdout, rank), _Tagged(sys.stderr, rank)
    sys.argv = [argv[1] if argv[0] == "-m" else argv[0], *argv[(2 if argv[0] == "-m" else 1):]]
    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            _failed(rank, stop)
        raise
    except BaseException as exc:
        _failed(rank, exc)
        raise  # mpi4py's runner turns this into MPI_Abort: every rank ends
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _failed(rank: int, exc: BaseException) -> None:
    """Under bfexp-run (in the ``except`` block): the traceback from the script's first frame on, the record
    bfexp-run reads back (the runner's), then wait for bfexp-run to end every rank (quietly, unlike MPI_Abort).
    Under a plain mpiexec: nothing (mpi4py's runner prints the traceback and aborts)."""
    run_dir = os.environ.get(RUN_DIR_VARIABLE)
    if not run_dir:
        return
    from bfexp.results import record_failure

    if not isinstance(exc, SystemExit):
        sys.stderr.write(user_traceback(exc))
    sys.stderr.flush()
    try:
        record_failure(Path(run_dir), rank, exc)
    except OSError:
        return
    time.sleep(FAILED_RANK_WAIT_S)


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback from the script's first frame on: the launch's own frames above it (runpy, mpi4py,
    bfexp-run, the virtual ranks' threads) are not the user's to read."""
    def plumbing(filename: str) -> bool:
        return filename.startswith(PLUMBING[0]) or any(p in filename for p in PLUMBING[1:])

    tb = traceback.TracebackException.from_exception(exc)
    frames = list(tb.stack)
    first = next((i for i, f in enumerate(frames) if not plumbing(f.filename)), 0)
    tb.stack = traceback.StackSummary.from_list(frames[first:])
    return "".join(tb.format())


class _Tagged:
    """A stream whose every line starts with ``[rank N]`` (the terminal is shared by all ranks)."""

    def __init__(self, original: TextIO, rank: int) -> None:
        self._original = original
        self._tag = f"[rank {rank}] "
        self._partial = ""

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        if lines:
            self._original.write("".join(f"{self._tag}{line}\n" for line in lines))
            self._original.flush()
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self._original.write(f"{self._tag}{self._partial}\n")
            self._partial = ""
        self._original.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


# ------------------------------------------------------------------ engine=threads


def launch_threads(args: argparse.Namespace, target: list[str], script_args: list[str]) -> int:
    import contextlib
    import runpy

    from bfexp import api
    from bfexp.comm.threads import routed_output
    from bfexp.errors import Hung

    saved_argv = sys.argv
    if target[0] == "-m":
        def run_module() -> dict:
            return runpy.run_module(target[1], run_name="__main__", alter_sys=False)

        sys.argv = [target[1], *script_args]  # process-wide: the same for every virtual rank
        job: Any = run_module
    else:
        job = target[0]  # bf.spawn runs the script as __main__ (and sets sys.argv)
    output = routed_output(Path(args.log_dir)) if args.log_dir else contextlib.nullcontext()

    def watched(world: Any, key: str) -> None:  # the runner's watch loop, with its hang watchdog
        from bfexp.launchers.virtual import ThreadRanks
        from bfexp.watchdog import live_heartbeats

        reason = supervise(ThreadRanks(world, Path(key)), args, None, lambda: live_heartbeats(key), processes=False)
        if reason and reason.startswith("hung"):
            raise Hung(reason)

    try:
        with output:
            api.spawn(job, args.ranks, script_args if target[0] != "-m" else (), prefix_output=not args.log_dir,
                      supervise=watched, engine=args.engine)
    except KeyboardInterrupt:
        print("bfexp-run: interrupted; the virtual ranks were ended", file=sys.stderr)
        return 128 + signal.SIGINT
    except Hung as hung:
        print(f"bfexp-run: {hung}", file=sys.stderr)
        return 1
    except BaseException as exc:  # noqa: BLE001 - a rank's failure, whatever it is
        sys.stderr.write(user_traceback(exc))
        rank = getattr(exc, "bfexp_rank", "?")
        message = str(exc).splitlines()[0] if str(exc) else ""
        print(f"bfexp-run: rank {rank}: {type(exc).__name__}: {message}", file=sys.stderr)
        return 1
    finally:
        sys.argv = saved_argv
    return 0


# ------------------------------------------------------------------ entry points


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:  # inside an MPI rank (see launch_mpi)
        rank_main(argv[1:])
        return
    # A user's own engine class (--engine mylab.MyEngine) in the working folder imports as under `python -m`
    # (as the ranks, started with `python -m`, see it).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = parse(argv)
    python, target, script_args = split_command(args.command)
    if not args.engine_facts.processes:
        from bfexp.errors import ConfigError
        from bfexp.preflight import memory_fits

        try:  # -n 100000 --engine threads: refused here, not by the machine running out of memory
            memory_fits(args.engine_facts, args.ranks, args.ranks, 0)
        except ConfigError as e:
            bad(str(e).replace(f"ranks={args.ranks}", f"-n {args.ranks}", 1).replace("ranks <=", "-n <="))
        sys.exit(launch_threads(args, target, script_args))
    sys.exit(launch_mpi(args, python, target, script_args))


if __name__ == "__main__":
    main()
