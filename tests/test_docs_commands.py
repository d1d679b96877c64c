"""Every command the documentation shows parses; the ones marked as runnable examples run.

Pages: README.md, docs/**/*.md and recipes/**/README.md (the studies pages include those). A command is
a line of a code block (fenced or indented; `$ ` and `.venv/bin/` prefixes dropped, `\\` continues it, a
`cmd && cmd` chain gives each part) or an inline code span of the prose that starts with `bfexp`,
`bfexp-run`, `bfexp-report` or `bfexp-topology`. The marks (docs/contributing.md) are an HTML comment
before a code block:

    <!-- docs-test: run [OVERRIDES] -->     the block's commands also run (bfexp: with OVERRIDES appended)
    <!-- docs-test: parse-only: WHY -->     they cannot run here (a cluster, GPUs, hours): parsed only

Unmarked commands are parsed. A command holding a placeholder (`<run folder>`, `...`) cannot be parsed as
written; it is counted and listed, never silently dropped.

Parsing: `bfexp` lines go through the CLI's own entry (`bfexp.cli.command`) in ONE interpreter with the job
function replaced by one that records each composed job, so Hydra parses the line and composes every job of
a sweep and nothing trains (`--cfg job` cannot check a sweep: Hydra refuses `-m` with `--cfg`). The other
commands' argument parsers read their lines (`bfexp-run`: its `parse`, range checks included; `bfexp-report`
and `bfexp-topology`: their argparse, stopped before any work). `run`-marked `bfexp-topology` commands run
there too (cheap); `run`-marked `bfexp` commands run through the CLI's entry, each in a folder of its own, one
after another in one fresh interpreter (tests/cli_in_process.calls; their ranks are their engine's), marked
`large` (.ci/run runs them). The headline sweep runs for real in make test in tests/test_cli_args.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli_in_process import calls
from tests.conftest import REPO

PROGRAMS = ("bfexp", "bfexp-run", "bfexp-report", "bfexp-topology")
HEADLINE = "bfexp algorithm=exact_diffusion topology=exp2 -m ranks=8,32,128"
MARK = re.compile(r"\s*<!--\s*docs-test:\s*(run|parse-only)\b:?\s*(.*?)\s*-->\s*$")
PLACEHOLDER = re.compile(r"<[^<>]*>|(?:^|\s)\.\.\.(?:\s|$)")
SPAN = re.compile(r"`((?:\.venv/bin/)?bfexp(?:-run|-report|-topology)?(?:\s[^`]*)?)`")
# Files the user's own components and data the pages name (`--config-dir myconf dataset=blobs`, ...): each
# parse runs in a folder holding these, as a reader's folder would.
FILES = {"myconf/dataset/blobs.yaml": "_target_: mylab.Blobs\ncenters: 3\n",
         "myconf/launcher/pbs.yaml": "_target_: mysite.launch.Pbs\nqueue: batch\n",
         "myconf/algorithm/compressor/strided.yaml": "_target_: mylab.Strided\nstride: 2\n",
         "myconf/engine/noting_mpi.yaml": "defaults:\n  - mpi\n  - _self_\n_target_: mylab.NotingMPI\nnote: engine\n"}


@dataclass(frozen=True)
class Command:
    page: str  # relative to the repository
    line: int
    text: str  # as a shell reads it, prefixes dropped
    mark: str  # parse, run or parse-only
    note: str  # run: the overrides appended; parse-only: why

    @property
    def program(self) -> str:
        return self.text.split()[0]

    @property
    def args(self) -> list[str]:
        return shlex.split(self.text)[1:]

    @property
    def placeholder(self) -> bool:
        return bool(PLACEHOLDER.search(self.text))

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{self.text}"


def doc_pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md")), *sorted((root / "recipes").rglob("README.md"))]


def commands_in_line(text: str) -> list[str]:
    """The documented commands of one shell line: each `&&` part that starts with one of PROGRAMS."""
    found = []
    for part in text.split("&&"):
        part = part.strip().removeprefix("$ ").removeprefix(".venv/bin/")
        try:
            words = shlex.split(part, comments=True)
        except ValueError:
            continue
        if words and words[0] in PROGRAMS:
            found.append(shlex.join(words))
    return found


def extract(path: Path, root: Path = REPO) -> list[Command]:
    """Every command of one page with its mark (module doc)."""
    page = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
    lines = path.read_text().splitlines()
    found: list[Command] = []
    prose: list[str] = []
    fenced, pending, block = False, ("parse", ""), ("parse", "")
    i = 0
    while i < len(lines):
        line, i = lines[i], i + 1
        mark = MARK.match(line)
        if mark and not fenced:
            pending = (mark.group(1), mark.group(2))
            prose.append("")
            continue
        if line.lstrip().startswith("```"):
            if not fenced:
                block, pending = pending, ("parse", "")
            fenced = not fenced
            prose.append("")
            continue
        if not fenced and not line.startswith("    "):
            prose.append(line)
            if line.strip():  # prose ends a block and what was marked for the next one
                pending, block = ("parse", ""), ("parse", "")
            continue
        if not fenced and pending != ("parse", ""):  # an indented block's first line
            block, pending = pending, ("parse", "")
        prose.append("")  # code: not prose, the line numbers stay
        number, command = i, line.strip()
        while command.endswith("\\") and i < len(lines):
            command, i = command[:-1] + " " + lines[i].strip(), i + 1
            prose.append("")
        for text in commands_in_line(command):
            found.append(Command(page, number, text, *block))
    text = "\n".join(prose)
    for m in SPAN.finditer(text):
        span = " ".join(m.group(1).split()).removeprefix(".venv/bin/")
        if span in PROGRAMS:  # the program's name in a sentence, not a command line
            continue
        found.append(Command(page, text.count("\n", 0, m.start()) + 1, span, "parse", ""))
    return found


def all_commands(root: Path = REPO) -> list[Command]:
    return [c for page in doc_pages(root) for c in extract(page, root)]


# One interpreter parses every command (and runs the cheap `run` ones that need no ranks).
DRIVER = textwrap.dedent("""
    import argparse, importlib, json, os, sys, time
    from pathlib import Path
    from tests.cli_in_process import call, call_main, captured, compose_only

    jobs = compose_only()
    # No job ran: the sweep's report (tables, plots) has nothing to read.
    import bfexp.report
    bfexp.report.MultirunReport.on_multirun_end = lambda self, config, **kwargs: None

    # make test composes a sweep of more than 3 points at its first and last (each point costs 0.5 s of CPU,
    # a study has up to 16); the `large` test composes every point.
    from hydra.core.plugins import Plugins
    Plugins.instance()  # Hydra executes its plugin modules again when it first scans them: patch what it uses
    BasicSweeper = sys.modules["hydra._internal.core_plugins.basic_sweeper"].BasicSweeper
    split = BasicSweeper.split_arguments
    most = int(os.environ.get("DOCS_SWEEP_POINTS", "0"))

    def fewer_points(overrides, max_batch_size):
        points = [p for batch in split(overrides, None) for p in batch]
        return [[points[0], points[-1]]] if most and len(points) > most else [points]

    BasicSweeper.split_arguments = staticmethod(fewer_points)

    class Parsed(Exception):
        pass

    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *args, **kwargs):
        parse_args(self, *args, **kwargs)
        raise Parsed

    def parse_main(program, args):
        if program == "bfexp-run":
            import bfexp.run
            return captured(bfexp.run.parse, args)
        argparse.ArgumentParser.parse_args = parse_then_stop
        try:
            got = call_main(program, args)
        finally:
            argparse.ArgumentParser.parse_args = parse_args
        parsed = got["escaped"] is not None and "Parsed" in got["escaped"].strip().splitlines()[-1]
        return {**got, "escaped": None if parsed else got["escaped"], "code": 0 if parsed else (got["code"] or 1)}

    out = {}
    for case in json.loads(sys.argv[1]):
        folder = Path(case["folder"])
        for path, text in case["files"].items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(text)
        os.chdir(folder)
        jobs.clear()
        started = time.process_time()
        if case["program"] == "bfexp":
            got = call(case["args"])
        elif case["run"]:
            got = call_main(case["program"], case["args"])
        else:
            got = parse_main(case["program"], case["args"])
        out[case["id"]] = {**got, "stdout": got["stdout"][:2000], "jobs": list(jobs),
                           "cpu_s": time.process_time() - started}
    print(json.dumps(out, default=str))
""")


def parse_commands(commands: list[Command], folder: Path, sweep_points: int = 3) -> dict[str, dict]:
    """Every command (but those with placeholders) through DRIVER, each in a fresh folder holding FILES:
    {id: exit code, stderr, stdout, escaped traceback, composed jobs}. A sweep of more than ``sweep_points``
    points composes its first and last (0: all)."""
    unique = {(c.text, c.mark == "run"): c for c in commands if not c.placeholder}  # a line on several pages: once
    payload = [{"id": c.id, "program": c.program, "args": c.args, "files": FILES,
                "run": c.mark == "run" and c.program == "bfexp-topology", "folder": str(folder / f"case{n}")}
               for n, c in enumerate(unique.values())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("BFEXP_DEBUG", None)
    env["DOCS_SWEEP_POINTS"] = str(sweep_points)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(payload)], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {c.id: got[unique[(c.text, c.mark == "run")].id] for c in commands if not c.placeholder}


def check_parsed(got: dict, command: Command) -> None:
    """What a command that parses shows: exit 0, no traceback, and for `bfexp` the jobs its line composes."""
    assert got["escaped"] is None, got["escaped"]
    assert got["code"] in (0, None), f"exit {got['code']}: {got['stderr'].strip()[-2000:]}"
    if command.program != "bfexp":
        return
    args = command.args
    overrides = [t for t in args if "=" in t and not t.startswith("-") or t.startswith("~")]
    task = [o for o in overrides if not o.startswith("hydra")]  # hydra/launcher=..., hydra.x=...: Hydra's own
    if any(a in ("-m", "--multirun") for a in args):
        assert got["jobs"] and {j["mode"] for j in got["jobs"]} == {"MULTIRUN"}, got
        fixed = [o for o in overrides if "," not in re.sub(r"\[[^]]*\]", "", o)]
        for job in got["jobs"]:  # (Hydra's sweeper spells a sweep's fixed booleans True and False)
            said = {re.sub(r"=(True|False)$", lambda m: "=" + m.group(1).lower(), o) for o in job["task"] + job["hydra"]}
            assert set(fixed) <= said, (fixed, job["task"], job["hydra"])
        assert len(got["jobs"]) >= (2 if len(fixed) < len(overrides) else 1)
    elif any(a in ("--help", "-h", "--cfg", "-c", "--shell-completion", "--hydra-help") for a in args):
        assert got["jobs"] == [] and got["stdout"].strip(), got
    elif any(a.startswith("resume=") for a in args):
        return  # resume= rebuilds the command from the folder's saved one
    else:
        assert [j["mode"] for j in got["jobs"]] == ["RUN"], got
        assert got["jobs"][0]["task"] == task


COMMANDS = all_commands()
PARSED = [c for c in COMMANDS if not c.placeholder]


@pytest.fixture(scope="module")
def parsed(tmp_path_factory) -> dict[str, dict]:
    return parse_commands(COMMANDS, tmp_path_factory.mktemp("docs"))


def test_commands_are_found():
    """The extraction itself: every program and both marks are met, the headline among them."""
    texts = [c.text for c in COMMANDS]
    assert len(COMMANDS) >= 60, texts
    assert HEADLINE in texts
    assert {c.program for c in COMMANDS} == set(PROGRAMS)
    assert {c.mark for c in COMMANDS} == {"parse", "run", "parse-only"}
    assert any("hydra/launcher=slurm" in t and "hydra.launcher.timeout_min=120" in t for t in texts)  # 4 lines
    assert all(c.note for c in COMMANDS if c.mark == "parse-only"), "parse-only needs a reason"
    placeholders = sorted({c.text for c in COMMANDS if c.placeholder})
    assert len(placeholders) <= 8, placeholders  # a few prose mentions, never a block of examples


@pytest.mark.parametrize("command", PARSED, ids=[c.id for c in PARSED])
def test_command_parses(parsed, command):
    check_parsed(parsed[command.id], command)


def test_headline_composes_three_jobs(parsed):
    command = next(c for c in PARSED if c.text == HEADLINE)
    jobs = parsed[command.id]["jobs"]
    assert [j["config"]["ranks"] for j in jobs] == [8, 32, 128]
    assert all(j["choices"]["algorithm"] == "exact_diffusion" and j["choices"]["topology"] == "exp2" for j in jobs)


def test_run_marked_topology_commands_printed_their_properties(parsed):
    ran = [c for c in PARSED if c.mark == "run" and c.program == "bfexp-topology"]
    assert ran
    for c in ran:
        assert "spectral" in parsed[c.id]["stdout"].lower() or c.args.count("--json"), (c.id, parsed[c.id])


def test_a_command_that_no_longer_parses_fails_here(tmp_path):
    """The check is not vacuous: a page with `launcher.hosts=hostA:2,hostB:2` (Hydra reads a sweep there;
    the documented form is a list) and a flag bfexp does not know fail it, the documented forms pass."""
    page = tmp_path / "page.md"
    page.write_text("Bad:\n\n    bfexp launcher=mpirun launcher.hosts=hostA:2,hostB:2\n"
                    "    bfexp --no-such-flag ranks=2\n\nGood:\n\n"
                    "    bfexp launcher=mpirun launcher.hosts=[hostA:2,hostB:2]\n")
    commands = extract(page, tmp_path)
    got = parse_commands(commands, tmp_path / "cases")
    outcomes = []
    for c in commands:
        try:
            check_parsed(got[c.id], c)
            outcomes.append(True)
        except AssertionError:
            outcomes.append(False)
    assert outcomes == [False, False, True], [got[c.id]["stderr"] for c in commands]
    assert "is ambiguous" in got[commands[0].id]["stderr"]


# Each runnable example once: the same command shown on two pages (the README's first sweep, say) runs once.
RUN = list({tuple(c.args): c for c in reversed([c for c in PARSED if c.mark == "run" and c.program == "bfexp"])}
           .values())[::-1]


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory) -> dict[str, dict]:
    """The runnable examples this session selected, each through the CLI's own entry (``bfexp.cli.command``,
    as the `bfexp` script calls it) in a folder of its own, one after another in ONE fresh interpreter
    (tests/cli_in_process.calls): one interpreter's start and torch import instead of one per example; a
    job's ranks are still its engine's (MPI ranks are processes of their own). {id: exit code, stderr,
    escaped traceback, ...}."""
    selected = {item.callspec.params["command"].id for item in request.session.items
                if item.originalname == "test_run_marked_command_runs" and hasattr(item, "callspec")}
    folder = tmp_path_factory.mktemp("run")
    cases = [{"id": c.id, "folder": str(folder / f"case{n}"), "args": [*c.args, *shlex.split(c.note)]}
             for n, c in enumerate(RUN) if c.id in selected]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("BFEXP_DEBUG", None)
    return calls(cases, timeout=1800, env=env)


@pytest.mark.large
@pytest.mark.parametrize("command", RUN, ids=[c.id for c in RUN])
def test_run_marked_command_runs(ran, command):
    """A runnable example as written (its mark's overrides appended, at a small size), by the CLI as a user
    runs it, in a folder of its own."""
    got = ran[command.id]
    assert got["escaped"] is None, got["escaped"]
    assert got["code"] in (0, None), f"exit {got['code']}: {got['stderr'][-3000:]}"


@pytest.mark.large
def test_every_point_of_every_sweep_composes(tmp_path):
    """make test composes a long sweep at its ends; here every point of every documented sweep."""
    sweeps = [c for c in PARSED if any(a in ("-m", "--multirun") for a in c.args)]
    got = parse_commands(sweeps, tmp_path, sweep_points=0)
    for c in sweeps:
        check_parsed(got[c.id], c)
