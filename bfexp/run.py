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

Exit status: the script's (0 when every rank finished), 1 when a rank
failed (the rank and its exception named on stderr), 128 + signal when
interrupted, 2 for bad input (one line).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, NoReturn, TextIO

# The rank part finds its failure record folder here (set by the launcher).
RUN_DIR_VARIABLE = "BFEXP_RUN_DIR"
LOG_DIR_VARIABLE = "BFEXP_RUN_LOGS"
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


# ------------------------------------------------------------------ the command line


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bfexp-run",
        description="Run your own training script on N ranks (MPI processes, or virtual ranks with "
                    "--engine threads) with bfexp's environment and failure handling.",
        epilog="example: bfexp-run -n 4 python train.py --epochs 3",
    )
    parser.add_argument("-n", "--np", dest="ranks", type=int, required=True, help="number of ranks")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", help="machines and their slots, e.g. n1:4,n2:4 (mpirun over ssh)")
    where.add_argument("--hostfile", help="Open MPI hostfile: `host slots=N` a line")
    parser.add_argument("--engine", choices=("mpi", "threads"), default="mpi",
                        help="mpi: one process a rank (default); threads: virtual ranks in this process")
    parser.add_argument("--network-interface", help="interface the ranks talk over (with --hosts/--hostfile)")
    parser.add_argument("--log-dir", help="write each rank's output to LOG_DIR/rank<N>.log instead of the terminal")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="python SCRIPT ARGS (or SCRIPT ARGS, or python -m MODULE ARGS)")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        bad(f"-n {args.ranks}; allowed: an integer >= 1")
    if not args.command:
        bad("no command; allowed: python SCRIPT ARGS, e.g. bfexp-run -n 4 python train.py")
    if args.engine == "threads" and (args.hosts or args.hostfile):
        bad("--hosts/--hostfile with --engine threads; allowed: --engine mpi across machines")
    return args


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
    """The launcher the runner's options name: mpirun over --hosts/--hostfile, else this machine's mpiexec."""
    from bfexp.launchers import Local, Mpirun

    if args.hosts or args.hostfile:
        return Mpirun(hosts=args.hosts, hostfile=args.hostfile, network_interface=args.network_interface)
    return Local()


def launch_mpi(args: argparse.Namespace, python: str, target: list[str], script_args: list[str]) -> int:
    from bfexp import results
    from bfexp.comm import engine_class
    from bfexp.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, ConfigError, LaunchError
    from bfexp.launch import ProcessRanks, watch
    from bfexp.preflight import memory_fits, preflight
    from bfexp.sessions import launcher_environment
    from bfexp.signals import SIGNALS

    try:
        launcher = launcher_for(args)
        preflight("mpi", args.ranks, launcher)  # mpi4py here; hosts resolve and answer ssh, enough slots
        memory_fits(engine_class("mpi"), args.ranks, launcher.ranks_per_host(args.ranks), 0)
    except (ConfigError, LaunchError) as e:
        print(f"bfexp-run: {e}", file=sys.stderr)
        return EXIT_ENVIRONMENT if isinstance(e, LaunchError) else EXIT_BAD_INPUT
    run_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bfexp-run-"))
    shutil.rmtree(run_dir / results.ERRORS_DIR, ignore_errors=True)  # a rerun into the same folder starts clean
    run_dir.mkdir(parents=True, exist_ok=True)
    program = [python, "-m", "mpi4py", "-m", "bfexp.run", "--rank", *target, *script_args]
    env = launcher_environment(launcher, args.ranks)
    env[RUN_DIR_VARIABLE] = str(run_dir)
    if args.log_dir:
        env[LOG_DIR_VARIABLE] = str(Path(args.log_dir).resolve())
    with SIGNALS.job() as signals:
        start = len(signals.received)
        # With --log-dir, mpiexec's own words (a rank killed by a signal, MPI_Abort) go beside the ranks' logs.
        log = open(run_dir / "mpiexec.log", "wb") if args.log_dir else None
        ranks = ProcessRanks(subprocess.Popen(launcher.command(args.ranks, program), stdin=subprocess.DEVNULL,
                                              stdout=log, stderr=log, env=env, start_new_session=True), run_dir)
        try:
            watch(ranks, lambda: "a signal" if signals.since(start) else None)  # a signal ends the ranks at once
        finally:
            ranks.end("the launch is over")  # mpiexec's whole session: no rank outlives the launch
            if log is not None:
                log.close()
    errors = results.rank_errors(run_dir)
    if not args.log_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    sig = signals.since(start)
    if sig:
        print(f"bfexp-run: interrupted by {signal.Signals(sig).name}; the ranks were ended", file=sys.stderr)
        return 128 + sig
    if errors:
        print(f"bfexp-run: {results.describe_errors(errors)}", file=sys.stderr)
        return 1
    returncode = ranks.proc.returncode
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
    else:
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
            _record(rank, stop)
        raise
    except BaseException as exc:
        _record(rank, exc)
        raise  # mpi4py's runner turns this into MPI_Abort: every rank ends
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _record(rank: int, exc: BaseException) -> None:
    run_dir = os.environ.get(RUN_DIR_VARIABLE)
    if not run_dir:
        return
    from bfexp.results import record_failure  # the runner's record, which bfexp-run reads back

    try:
        record_failure(Path(run_dir), rank, exc)
    except OSError:
        pass


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

    saved_argv = sys.argv
    if target[0] == "-m":
        def run_module() -> dict:
            return runpy.run_module(target[1], run_name="__main__", alter_sys=False)

        sys.argv = [target[1], *script_args]  # process-wide: the same for every virtual rank
        job: Any = run_module
    else:
        job = target[0]  # bf.spawn runs the script as __main__ (and sets sys.argv)
    output = routed_output(Path(args.log_dir)) if args.log_dir else contextlib.nullcontext()
    try:
        with output:
            api.spawn(job, args.ranks, script_args if target[0] != "-m" else (), prefix_output=not args.log_dir)
    except KeyboardInterrupt:
        print("bfexp-run: interrupted; the virtual ranks were ended", file=sys.stderr)
        return 128 + signal.SIGINT
    except BaseException as exc:  # noqa: BLE001 - a rank's failure, whatever it is
        traceback.print_exception(exc)
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
    args = parse(argv)
    python, target, script_args = split_command(args.command)
    if args.engine == "threads":
        sys.exit(launch_threads(args, target, script_args))
    sys.exit(launch_mpi(args, python, target, script_args))


if __name__ == "__main__":
    main()
