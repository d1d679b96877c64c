"""Your own graph through the real CLI: swept from the command line, named in the report, refused
in one line (exit 2, before any rank starts) when it cannot run, and shown by bfexp-topology.

Jobs run on virtual ranks (engine=threads): the same worker, algorithm and
topology code as MPI ranks, without a process launch per job.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from bfexp.topology.cli import main as topology_tool
from tests.cli_in_process import ran

RANKS = 6
# A one-round single-rank reference: no figure here reads it.
SMALL = ["engine=threads", f"ranks={RANKS}", "steps=4", "log_every=2", "baseline_steps=0", "scaling.reference_steps=1"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row_stochastic(n: int, seed: int = 0) -> np.ndarray:
    """A directed W (W[i, j]: i receives from j) whose rows sum to 1 and columns do not."""
    rng = np.random.default_rng(seed)
    w = rng.random((n, n)) * (rng.random((n, n)) < 0.4) + np.eye(n) + np.roll(np.eye(n), -1, axis=1)
    return w / w.sum(axis=1, keepdims=True)


def graphs(folder: Path) -> None:
    """a.edges: a weighted one-way ring with self weights; b.npy: a mixing matrix; rgg.yaml: a generated graph."""
    lines = ["# direction: out"] + [f"{i} {(i + 1) % RANKS} 0.5\n{i} {i} 0.5" for i in range(RANKS)]
    (folder / "a.edges").write_text("\n".join(lines) + "\n")
    np.save(folder / "b.npy", row_stochastic(RANKS))
    (folder / "rgg.yaml").write_text("_target_: bfexp.topology.GeneratedTopology\n"
                                     "graph: {_target_: networkx.random_geometric_graph, radius: 0.6, seed: 3}\n")


def sweep_rows(folder: Path) -> tuple[list[dict], list[dict]]:
    (sweep,) = [p for p in (folder / "multirun").glob("*/*") if (p / "report.csv").exists()]
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    return rows, summaries


REFUSALS = [
    # a mixing matrix read as an adjacency: its rows no longer sum to 1, and the message says why
    (["topology.path=w.npy", "topology.direction=out"],
     ["algorithm=dsgd needs a row stochastic", "rows of W sum to", "columns sum to 1",
      "topology.direction=in reads it transposed"]),
    # no direction on a matrix that is not symmetric
    (["topology.path=w.npy"], ["topology.direction=null", "not symmetric", "direction=out"]),
    # a W that mixes nothing: neither rows nor columns sum to 1
    (["topology.path=off.npy", "topology.direction=in"],
     ["neither row nor column stochastic", "rows of W sum to 0.97..1.2", "topology.weights=uniform"]),
    # push-sum needs column sums 1: the fix is named
    (["topology.path=w.npy", "topology.direction=in", "algorithm=push_sum"],
     ["algorithm=push_sum needs a column stochastic", "columns of W sum to", "allowed: topology.weights=column"]),
    (["topology.path=missing.edges"], ["topology.path=missing.edges does not exist"]),
    ([], ["topology.path is not set"]),
]


def refusal_files(folder: Path) -> None:
    """w.npy: a row-stochastic W that is not symmetric; off.npy: one whose rows sum to 0.97 and 1.2."""
    np.save(folder / "w.npy", row_stochastic(RANKS))
    off = np.eye(RANKS) * 0.5 + np.roll(np.eye(RANKS), 1, axis=1) * 0.5
    off[0, 0], off[1, 1] = 0.47, 0.7  # rows sum to 0.97 and 1.2
    np.save(folder / "off.npy", off)


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> dict:
    """Every command line of this file through the real CLI, one after another in one interpreter
    (tests/cli_in_process.py), each in a folder of its own: {case id: exit code, output, "cwd": its folder}."""
    import os

    from tests.cli_in_process import calls

    root = tmp_path_factory.mktemp("own_graph_cli")
    cases = [{"id": "files", "args": ["-m", "topology=file", "topology.path=a.edges,b.npy,rgg.yaml",
                                      "topology.direction=in", *SMALL]},
             {"id": "generated", "args": ["-m", "topology=generated", "topology.graph.seed=3,4", *SMALL]}]
    cases += [{"id": f"refusal{i}", "args": ["topology=file", *args, "ranks=6", "hydra.run.dir=run"]}
              for i, (args, _) in enumerate(REFUSALS)]
    for case in cases:
        folder = root / case["id"]
        folder.mkdir()
        if case["id"] == "files":
            graphs(folder)
        elif case["id"].startswith("refusal"):
            refusal_files(folder)
        case["folder"] = str(folder)
    env = {k: v for k, v in os.environ.items() if k != "BFEXP_DEBUG"}
    got = calls(cases, timeout=600, env=env)
    return {case["id"]: {**got[case["id"]], "cwd": Path(case["folder"])} for case in cases}


def swept(got: dict) -> tuple[list[dict], list[dict]]:
    ran(got)
    return sweep_rows(got["cwd"])


def test_a_sweep_over_graph_files_and_a_generated_graph_names_them(cli):
    rows, summaries = swept(cli["files"])
    assert [r["topology.path"] for r in rows] == ["a.edges", "b.npy", "rgg.yaml"]
    assert all(r["status"] == "completed" and r["topology"] == "file" for r in rows)
    assert [s["topology_used"] for s in summaries] == ["file(a.edges)", "file(b.npy)", "file(rgg.yaml)"]


def test_a_generated_graph_is_swept_by_its_parameters(cli):
    rows, summaries = swept(cli["generated"])
    assert [r["topology.graph.seed"] for r in rows] == ["3", "4"]
    assert [s["topology_used"] for s in summaries] == [
        f"generated(random_geometric_graph, radius=0.6, seed={seed})" for seed in (3, 4)]
    assert all(s["status"] == "completed" and s["topology_weights"] == "metropolis" for s in summaries)


@pytest.mark.parametrize("case", range(len(REFUSALS)), ids=[" ".join(a) or "no-path" for a, _ in REFUSALS])
def test_what_cannot_run_is_refused_in_one_line_before_any_rank(cli, case):
    got, needles = cli[f"refusal{case}"], REFUSALS[case][1]
    assert got["code"] == 2 and got["escaped"] is None, (got["escaped"] or "") + got["stderr"] + got["stdout"]
    lines = got["stderr"].strip().splitlines()
    assert len(lines) == 1, got["stderr"]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not (got["cwd"] / "run" / "logs").exists(), "no rank may start"


def test_topology_tool_prints_and_draws_a_file_and_a_generated_graph(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "seq"
    folder.mkdir()
    for t in range(3):
        np.save(folder / f"W{t}.npy", row_stochastic(RANKS, seed=t))
    topology_tool(["file", "--ranks", str(RANKS), "--path", "seq", "--direction", "in", "--json", "--out", "seq.png"])
    facts = json.loads(capsys.readouterr().out)
    assert facts["params"] == {"path": "seq", "direction": "in"}
    assert facts["period"] == 3 and facts["dynamic"] and facts["row_stochastic"] and not facts["column_stochastic"]
    assert (tmp_path / "seq.png").read_bytes()[:8] == PNG_MAGIC
    topology_tool(["generated", "--ranks", "12", "--graph", "{seed: 5, radius: 0.7}", "--out", "rgg.png"])
    out = capsys.readouterr().out
    assert "generated" in out and "radius=0.7" in out and "seed=5" in out and "spectral_gap" in out
    assert (tmp_path / "rgg.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(SystemExit) as exc:
        topology_tool(["file", "--ranks", "4"])
    assert exc.value.code == 2 and "--path" in capsys.readouterr().err
