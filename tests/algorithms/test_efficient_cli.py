"""The communication-efficient options through the real CLI: bytes on the wire as the engine
counted them, how compressors are picked and swept, and one-line refusals before any rank starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bfexp.results import read_jsonl
from tests.cli_in_process import calls, ran

D = 4810  # parameters of the MLP on digits (64 -> 64 -> 10), float32
# A one-round single-rank reference: no figure here reads it.
SMALL = ["engine=threads", "ranks=4", "steps=6", "log_every=3", "model=mlp", "dataset=digits",
         "baseline_steps=0", "scaling.reference_steps=1", "report=false"]

BAD_INPUT = [
    (["algorithm=choco_sgd", "algorithm.compressor=top_kk"], "algorithm.compressor=top_kk; allowed: cast, identity"),
    (["algorithm=choco_sgd", "+algorithm/compressor=top_k", "algorithm.compressor.ratio=2"],
     "algorithm.compressor.ratio=2"),
    (["algorithm=choco_sgd", "topology=one_peer_exp2"], "algorithm=choco_sgd needs a static topology"),
    (["algorithm=choco_sgd", "algorithm.gamma=0"], "algorithm.gamma=0; allowed"),
    (["algorithm=choco_sgd", "algorithm.overlap=true"], "algorithm.overlap=true; allowed: false"),
    (["algorithm=allreduce", "algorithm.global_average_every=2"], "algorithm.global_average_every=2; allowed: 0"),
    (["algorithm=dsgd", "algorithm.global_average_every=-1"], "algorithm.global_average_every=-1; allowed"),
    (["algorithm=diloco", "algorithm.average=allreduce", "algorithm.global_average_every=2"],
     "algorithm.global_average_every=2; allowed: 0"),
    (["algorithm=diloco", "algorithm.average=ring"], "algorithm.average='ring'; allowed: topology, allreduce"),
    (["algorithm=diloco", "algorithm.outer_momentum=1"], "algorithm.outer_momentum=1; allowed"),
    (["algorithm=qg_dsgdm", "algorithm.momentum=1.5"], "algorithm.momentum=1.5; allowed"),
    (["topology=base_graph", "topology.k=0"], "topology.k=0; allowed: an integer >= 1"),
]


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> dict[str, dict]:
    """Every command line of this file through the real CLI, one after another in one interpreter
    (tests/cli_in_process.py), each in a folder of its own: {case id: exit code, output, summaries, folder}."""
    root = tmp_path_factory.mktemp("efficient_cli")
    cases = [
        # choco_sgd and compressed_allreduce with three compressors, plus dsgd and allreduce: 8 jobs
        {"id": "bytes", "args": ["-m", *SMALL, "algorithm=choco_sgd,compressed_allreduce",
                                 "algorithm.compressor=identity,top_k,qsgd", "hydra.sweep.dir=sweep"]},
        {"id": "plain", "args": ["-m", *SMALL, "algorithm=dsgd,allreduce", "hydra.sweep.dir=sweep"]},
        {"id": "qsgd", "args": [*SMALL, "algorithm=choco_sgd", "+algorithm/compressor=qsgd",
                                "algorithm.compressor.bits=2", "hydra.run.dir=run"]},
        {"id": "diloco", "args": [*SMALL, "algorithm=diloco", "topology=one_peer_exp2",
                                  "algorithm.communication_period=3", "hydra.run.dir=run"]},
        *({"id": f"bad{i}", "args": [*args, "engine=threads", "ranks=4", "hydra.run.dir=run"]}
          for i, (args, _) in enumerate(BAD_INPUT)),
    ]
    for case in cases:
        case["folder"] = str(root / case["id"])
    env = {k: v for k, v in os.environ.items() if k != "BFEXP_DEBUG"}
    got = calls(cases, timeout=900, env=env)
    return {case["id"]: {**got[case["id"]], "folder": Path(case["folder"])} for case in cases}


def sweep(job: dict) -> dict[str, dict]:
    """A `bfexp -m` sweep's jobs: {job folder name: summary} with the metrics records under "records"."""
    out = {}
    for folder in sorted((ran(job)["folder"] / "sweep").glob("*/")):
        summary = json.loads((folder / "summary.json").read_text())
        summary["records"] = read_jsonl(folder / "metrics.jsonl")
        out[folder.name] = summary
    return out


@pytest.fixture(scope="module")
def compressed(cli):
    """choco_sgd and compressed_allreduce with three compressors, plus dsgd and allreduce: 8 jobs."""
    jobs = sweep(cli["bytes"])
    jobs.update(sweep(cli["plain"]))

    def find(algorithm: str, compressor: str | None = None) -> dict:
        [job] = [s for name, s in jobs.items() if s["algorithm"] == algorithm
                 and (compressor is None or f"compressor={compressor}" in name)]
        return job

    return find


def test_every_job_reports_the_bytes_its_steps_sent(compressed):
    job = compressed("choco_sgd", "top_k")
    assert job["status"] == "completed" and job["steps"] == 6
    # cumulative per-rank bytes in every record, the summary's figure per step
    records = job["records"]
    assert [r["step"] for r in records] == [3, 6]
    assert records[-1]["bytes_sent"] == pytest.approx(6 * job["bytes_sent_per_step"])


def test_uncompressed_figures_are_the_messages_the_engine_moved(compressed):
    # exp2 over 4 ranks: each rank sends its model to 2 peers; float32
    assert compressed("dsgd")["bytes_sent_per_step"] == 2 * D * 4
    assert compressed("choco_sgd", "identity")["bytes_sent_per_step"] == 2 * D * 4
    # allreduce is counted at the ring's 2(n-1)/n of the gradient; the compressed one gathers n-1 payloads
    assert compressed("allreduce")["bytes_sent_per_step"] == 2 * 3 * D * 4 // 4
    assert compressed("compressed_allreduce", "identity")["bytes_sent_per_step"] == 3 * D * 4


@pytest.mark.parametrize("algorithm", ["choco_sgd", "compressed_allreduce"])
def test_top_k_at_1_percent_sends_at_most_2_5_percent_indices_included(algorithm, compressed):
    full = compressed(algorithm, "identity")["bytes_sent_per_step"]
    top_k = compressed(algorithm, "top_k")["bytes_sent_per_step"]
    assert top_k <= 0.025 * full
    k = 49  # ceil(0.01 * 4810): float32 values and int32 indices
    assert top_k == full * (k * 8) / (D * 4)


@pytest.mark.parametrize("algorithm", ["choco_sgd", "compressed_allreduce"])
def test_qsgd_at_4_bits_sends_at_most_a_seventh_of_float32(algorithm, compressed):
    full = compressed(algorithm, "identity")["bytes_sent_per_step"]
    qsgd = compressed(algorithm, "qsgd")["bytes_sent_per_step"]
    assert qsgd <= full / 7
    assert qsgd == full * (4 + D * 4 // 8) / (D * 4)  # the norm, then 4 bits per entry


def test_a_compressor_group_with_options_and_diloco_over_one_peer_exp2(cli):
    def run(name: str) -> dict:
        return json.loads((ran(cli[name])["folder"] / "run" / "summary.json").read_text())

    job = run("qsgd")  # algorithm=choco_sgd +algorithm/compressor=qsgd algorithm.compressor.bits=2
    assert job["status"] == "completed"
    assert job["bytes_sent_per_step"] == 2 * (4 + (D * 2 + 7) // 8)
    summary = run("diloco")  # algorithm=diloco topology=one_peer_exp2 algorithm.communication_period=3
    assert summary["status"] == "completed" and summary["topology_used"] == "one_peer_exp2"
    # one model to one peer every third step
    assert summary["bytes_sent_per_step"] == pytest.approx(D * 4 * 2 / 6)


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2_before_any_rank(cli, case):
    words = BAD_INPUT[case][1]
    got = cli[f"bad{case}"]
    assert got["code"] == 2 and got["escaped"] is None, (got["escaped"] or "") + got["stderr"] + got["stdout"]
    err = got["stderr"].strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not (got["folder"] / "run" / "summary.json").exists()
