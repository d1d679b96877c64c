"""Modeled time for every step on a named cluster (issue 48): rank 0's ledger of what each training step sent
(bfexp.ledger), priced by the cost model as the job runs (metrics.jsonl's modeled_time_s) and again by
``bfexp-report --cluster`` on any shipped cluster without rerunning.

References: the cost model's own functions on graphs built here by hand (ring, exp2), the summary's modeled
block (priced from the algorithm's stated traffic, not from the ledger), and the run-time figures against the
report's repricing.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from bfexp import costmodel, scaling
from bfexp.ledger import Ledger, Prices
from tests.cli_in_process import calls, ran
from tests.conftest import run_bfexp

CLUSTER = costmodel.Cluster("two-by-four", 4, costmodel.Link(2e-6, 100e9), costmodel.Link(3e-5, 1.25e9),
                            reduce_bytes_per_s=300e9)


class Ring:
    """The undirected ring as bfexp's topologies answer ``weights(rank, t)`` (only the senders are read)."""

    period = 1

    def __init__(self, n: int) -> None:
        self.size = n

    def weights(self, rank: int, t: int = 0):
        from types import SimpleNamespace

        return SimpleNamespace(src_weights={(rank - 1) % self.size: 1 / 3, (rank + 1) % self.size: 1 / 3})


def test_a_ledger_prices_each_step_as_the_cost_model_prices_its_operations():
    """Three kinds of step (a ring exchange of 4 KB, an allreduce of 1 KB, nothing), in an order the
    run-length code has to follow; each step is compute plus the exchange backward leaves exposed."""
    n, ring = 8, Ring(8)
    ledger = Ledger(n)
    kinds = ["mix", "mix", "reduce", "none", "mix", "reduce", "reduce"]
    for kind in kinds:
        ledger.begin()
        if kind == "mix":
            ledger.add("neighbor_allreduce", 2 * 4096, ("graph", ring, 0, False))  # rank 0 sends 2 messages
        elif kind == "reduce":
            ledger.add("allreduce", 1024)
        ledger.end()
    ledger.add("allreduce", 1 << 20)  # outside a step (a logging step's collective): not the step's
    assert ledger.steps == len(kinds) and len(ledger.signatures) == 3

    edges = [((r - 1) % n, r) for r in range(n)] + [((r + 1) % n, r) for r in range(n)]
    compute = 0.002
    by_hand = {"mix": costmodel.exchange_s(CLUSTER, n, edges, 4096),
               "reduce": costmodel.ring_allreduce_s(CLUSTER, n, 1024), "none": 0.0}
    prices = Prices(CLUSTER, compute, backward_fraction=0.5, overlap=True)
    expected, now = [], 0.0
    for kind in kinds:
        now += compute + max(0.0, by_hand[kind] - 0.5 * compute)
        expected.append(now)
    assert prices.cumulative(ledger) == pytest.approx(expected, rel=1e-12)
    again = Ledger.from_json(json.loads(json.dumps(ledger.to_json())))  # operations.json's round trip
    assert Prices(CLUSTER, compute, backward_fraction=0.5).cumulative(again) == prices.cumulative(ledger)


def test_a_ranks_own_destinations_stand_for_every_ranks_at_the_same_offsets():
    """An exchange by explicit weights names only rank 0's peers: exp2's at 8 ranks (1, 2, 4 ahead) give
    every rank's edges, as the graph itself lists them."""
    from bfexp.topology import Exp2

    n = 8
    ledger = Ledger(n)
    ledger.begin()
    ledger.add("neighbor_allreduce", 3 * 100.0, ("dst", [1, 2, 4]))
    ledger.end()
    [[(op, message, graph)]] = ledger.signatures
    assert (op, message) == ("neighbor_allreduce", 100.0)
    assert sorted(ledger.graphs[graph]) == sorted(costmodel.topology_edges(Exp2(n), 0))


def test_an_unknown_cluster_is_refused_in_one_line(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "bfexp.report", str(tmp_path), "--cluster", "ethernet_1t"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "scaling=ethernet_1t; allowed: " in proc.stderr and "h100_cluster" in proc.stderr


JOB = ["ranks=8", "steps=24", "log_every=4", "baseline_steps=0", "report=false", "logger=jsonl",
       "scaling.reference_steps=1"]


def read_job(folder) -> tuple[dict, list[dict]]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return json.loads((folder / "summary.json").read_text()), records


def job(tmp_path, name: str, *args: str) -> tuple[dict, list[dict]]:
    proc = run_bfexp([*JOB, f"hydra.run.dir={name}", *args], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_job(tmp_path / name)


RECORDED = ("engine=stacked", "topology=one_peer_exp2")  # test_a_recorded_run_repriced_on_a_cluster_gives_...
# The jobs on virtual or stacked ranks below, each in a folder (named by its key) of its own: one interpreter runs
# them all, one after another (tests/cli_in_process.py), and the tests read their folders. {folder: job's args}
IN_PROCESS: dict[str, list[str]] = {
    **{f"every_step/{engine}-{algorithm}": [f"engine={engine}", f"algorithm={algorithm}", "scaling=ethernet_10g",
                                            "topology=exp2"]
       for engine, algorithm in (("threads", "dsgd"), ("stacked", "dsgd"), ("stacked", "gradient_tracking"))},
    "compressed": ["engine=threads", "algorithm=choco_sgd", "scaling=ethernet_10g", "topology=exp2"],
    **{f"recorded/{cluster}/{algorithm}": [*RECORDED, f"algorithm={algorithm}", f"scaling={cluster}"]
       for cluster in ("ethernet_10g", "h100_cluster") for algorithm in ("allreduce", "dsgd")},
    **{f"same_steps/{engine}": [f"engine={engine}", "topology=one_peer_exp2", "scaling=ethernet_10g"]
       for engine in ("threads", "stacked")},
    "network": ["engine=threads", "algorithm=dsgd", "topology=exp2", "scaling.straggler_wait=true",
                "scaling.ranks_per_machine=4", "scaling.reference_steps=8", "scaling.reference=fresh"],
}


# test_a_resumed_job_prices_on_from_its_checkpoint's two command lines, in turn in one folder ("resume")
RESUME = ["scaling=ethernet_10g", "ranks=4", "engine=threads", "steps=40", "checkpoint_every=20", "baseline_steps=0",
          "report=false", "logger=jsonl", "scaling.reference_steps=1"]
RESUMED = {"resume/failed": [*RESUME, "fail_rank=1", "fail_step=30", "hydra.run.dir=run"],
           "resume/resumed": ["resume=run", "fail_rank=null"]}


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    """{IN_PROCESS's folder name: the job's folder}, every job finished; and under "resume" the folder RESUMED's
    command lines ran in, under RESUMED's names what calls gave for each."""
    root = tmp_path_factory.mktemp("ledger")
    cases = [{"id": name, "folder": str(root / name), "args": [*JOB, "hydra.run.dir=.", *args]}
             for name, args in IN_PROCESS.items()]
    cases += [{"id": name, "folder": str(root / "resume"), "args": args} for name, args in RESUMED.items()]
    got = calls(cases, timeout=900)
    for name in IN_PROCESS:
        g = got[name]
        ran(g, name)
    return {**{name: root / name for name in IN_PROCESS}, "resume": root / "resume",
            **{name: got[name] for name in RESUMED}}


@pytest.mark.parametrize("engine, algorithm", [("threads", "dsgd"), ("stacked", "dsgd"),
                                               ("stacked", "gradient_tracking"), ("mpi", "exact_diffusion")])
def test_every_step_is_priced_as_the_summary_prices_the_job(tmp_path, engine, algorithm, request):
    """On ethernet_10g (every rank its own machine) a synchronous rule's records carry modeled time that grows
    by the summary's modeled step time each step, that figure priced from the algorithm's stated traffic
    (Traffic: a model's vectors) and the ledger's from the bytes the engine was handed: two routes to one
    number. The virtual and stacked ranks' jobs are IN_PROCESS's; the MPI job runs on 4 process ranks (each a
    process to start; the pricing is the same at any ranks)."""
    if engine == "mpi":
        summary, records = job(tmp_path, "run", f"engine={engine}", f"algorithm={algorithm}",
                               "scaling=ethernet_10g", "topology=exp2", "ranks=4")
        assert summary["ranks"] == 4
    else:
        summary, records = read_job(request.getfixturevalue("in_process")[f"every_step/{engine}-{algorithm}"])
        assert summary["engine"] == engine and summary["algorithm"] == algorithm and summary["ranks"] == 8
    step_s = summary["modeled"]["step_time_s"]
    assert summary["modeled_cluster"] == "ethernet_10g"
    assert [r["modeled_time_s"] for r in records] == pytest.approx([r["step"] * step_s for r in records], rel=1e-9)
    assert summary["modeled_train_time_s"] == pytest.approx(24 * step_s, rel=1e-9)


def test_a_compressed_exchange_is_priced_on_the_payload_that_travelled(in_process):
    """CHOCO-SGD with top-k at 1% of logistic regression's 66 parameters sends one element (k rounds up: 4
    bytes of value, 4 of index) to each of exp2's 3 peers, and each receiver rebuilds the dense 264 bytes
    before adding them: the step is that exchange priced by hand (no overlap: CHOCO's exchange waits for
    the update). The summary's traffic prices 0.66 of an element (the ratio, not the payload)."""
    from bfexp.topology import Exp2

    summary, records = read_job(in_process["compressed"])  # choco_sgd on 8 virtual ranks over exp2
    ledger = Ledger.load(in_process["compressed"])
    assert [[op[:2] for op in sig] for sig in ledger.signatures] == [[("neighbor_allgather", 8.0)]]
    node = scaling_node("ethernet_10g")
    compute = 32 / scaling.rank_speed(node, "logreg", ledger.facts["forward_flop_per_sample"])[0]
    exchange = costmodel.exchange_s(scaling.cluster(node), 8, costmodel.topology_edges(Exp2(8), 0), 8.0, 264.0)
    assert [r["modeled_time_s"] for r in records] == pytest.approx([r["step"] * (compute + exchange) for r in records],
                                                                   rel=1e-12)
    assert records[-1]["modeled_time_s"] / 24 != pytest.approx(summary["modeled"]["step_time_s"], rel=1e-6)


def test_a_recorded_run_repriced_on_a_cluster_gives_what_running_there_gives(in_process):
    """A sweep of allreduce and one-peer DSGD recorded on ethernet_10g, repriced by ``bfexp-report --cluster``
    on h100_cluster and on ethernet_10g itself: the same numbers as the run's own records (1e-9), and as the
    same jobs run with scaling=h100_cluster. Time to the allreduce job's final accuracy and the speedup there
    are figures of the repriced times."""
    runs = {(cluster, algorithm): read_job(in_process[f"recorded/{cluster}/{algorithm}"])  # RECORDED's jobs
            for cluster in ("ethernet_10g", "h100_cluster") for algorithm in ("allreduce", "dsgd")}
    recorded = in_process["recorded/ethernet_10g/dsgd"].parent
    proc = subprocess.run([sys.executable, "-m", "bfexp.report", "ethernet_10g", "--cluster",
                           "h100_cluster,ethernet_10g", "--no-plots"], cwd=recorded.parent, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    rows = {r["algorithm"]: r for r in csv.DictReader((recorded / "report.csv").open())}
    for algorithm in ("allreduce", "dsgd"):
        own, there = runs["ethernet_10g", algorithm][0], runs["h100_cluster", algorithm][0]
        repriced = {c: float(rows[algorithm][f"modeled_train_time_s@{c}"]) for c in ("ethernet_10g", "h100_cluster")}
        assert repriced["ethernet_10g"] == pytest.approx(own["modeled_train_time_s"], rel=1e-9, abs=0)
        assert repriced["h100_cluster"] == pytest.approx(there["modeled_train_time_s"], rel=1e-9, abs=0)
        assert repriced["h100_cluster"] < repriced["ethernet_10g"]  # faster links and a faster device
    # time to the allreduce job's final accuracy, on the allreduce job itself: the modeled time of its first record
    # at that accuracy (the same step in the run on h100_cluster, which trained the same)
    base = rows["allreduce"]
    summary, records = runs["ethernet_10g", "allreduce"]
    first = next(i for i, r in enumerate(records)
                 if r.get("accuracy") is not None and r["accuracy"] >= summary["final_accuracy"])
    there = runs["h100_cluster", "allreduce"][1]
    assert [r["step"] for r in there] == [r["step"] for r in records]
    assert float(base["time_to_target_accuracy_s@h100_cluster"]) == pytest.approx(there[first]["modeled_time_s"],
                                                                                   rel=1e-9)
    assert float(base["speedup_at_target_accuracy@h100_cluster"]) == 1.0
    assert (recorded / "allreduce" / "operations.json").is_file()


def test_the_stacked_and_the_threads_engines_record_the_same_steps(in_process):
    """Two engines, one job (one-peer exp2 changes its graph every step): the same ledger up to the graphs'
    order of discovery, so the same modeled time."""
    ledgers = {}
    for engine in ("threads", "stacked"):  # IN_PROCESS's same_steps/ jobs
        ledgers[engine] = Ledger.load(in_process[f"same_steps/{engine}"])
    node = {**json.loads(json.dumps(scaling_node("ethernet_10g")))}
    times = [Prices.on(node, ledgers[e].facts).cumulative(ledgers[e]) for e in ("threads", "stacked")]
    assert len(ledgers["threads"].signatures) == 3  # log2(8) rounds of one peer each
    assert times[0] == pytest.approx(times[1], rel=1e-12)


def scaling_node(name: str) -> dict:
    from bfexp.components import option_node

    return option_node("scaling", name)


def test_a_resumed_job_prices_on_from_its_checkpoint(in_process):
    """A job that failed at step 30 of 40 (checkpoint at 20) and was resumed: its ledger comes back from the
    checkpoint, so the records price all 40 steps as one uninterrupted job does, in one run of one signature."""
    failed, resumed = in_process["resume/failed"], in_process["resume/resumed"]  # RESUMED's, in turn
    assert failed["code"] != 0 and failed["escaped"] is None, failed
    ran(resumed)
    run = in_process["resume"] / "run"
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step_s = summary["modeled"]["step_time_s"]
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    assert [r["modeled_time_s"] for r in records] == pytest.approx([r["step"] * step_s for r in records], rel=1e-9)
    assert Ledger.load(run).runs == [[0, 40]]


@pytest.mark.parametrize("args, says", [(["--cluster", "ethernet_10g", "--bandwidths", "ten"], "--bandwidths ten; allowed: "),
                                        (["--cluster", "ethernet_10g", "--bandwidths", "1,-3"], "bandwidth -3 Gbit/s; allowed: "),
                                        (["--bandwidths", "1,10"], "--bandwidths without --cluster; allowed: ")])
def test_bad_bandwidths_are_refused_in_one_line(tmp_path, args, says):
    (tmp_path / "summary.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "bfexp.report", str(tmp_path), *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "report.csv").exists()


def test_an_operations_file_is_priced_no_further_than_its_records_and_checked_before(tmp_path):
    """operations.json is data a folder carries: a run of 10**12 steps is priced only as far as metrics.jsonl's
    records go (at once, not for hours), and one that names a signature, a graph or a rank it does not hold is
    refused (the job is reported without its repriced columns), each by the report without a traceback."""
    from bfexp.report import cluster_node, collect, modeled_times

    facts = {"model": "logreg", "batch_size": 32, "forward_flop_per_sample": 128, "overlap": True, "buckets": 0}
    good = {"format": 1, "ranks": 4, "facts": facts, "signatures": [[["allreduce", 264.0, -1]]], "graphs": [],
            "runs": [[0, 10**12]]}
    bad = [{**good, "runs": [[3, 5]]}, {**good, "signatures": [[["neighbor_allreduce", 264.0, 2]]]},
           {**good, "graphs": [[[0, 9]]], "signatures": [[["neighbor_allreduce", 264.0, 0]]]}]
    for i, data in enumerate([good, *bad]):
        job = tmp_path / f"{i}_job"
        job.mkdir()
        (job / "summary.json").write_text(json.dumps({"status": "completed", "ranks": 4}))
        (job / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (10, 20)))
        (job / "operations.json").write_text(json.dumps(data))
    node = cluster_node("ethernet_10g")
    priced = [modeled_times(job, node) for job in collect(tmp_path)]
    step_s = Prices.on(node, facts).step_s(Ledger.from_json(good), 0)
    assert priced[0] == pytest.approx([10 * step_s, 20 * step_s], rel=1e-12)
    assert priced[1:] == [None, None, None]
    for data in bad:
        with pytest.raises(ValueError, match="operation ledger"):
            Ledger.from_json(data)


def test_a_job_over_a_network_is_priced_on_its_own_cluster_as_its_summary_prices_it(in_process):
    """A job that ran between machines with its compute measured (the emulated cluster's, a Slurm
    allocation's: no declared speed, so its records carry no modeled time) is priced by the report on the
    cluster it ran on: the measured compute, the exchanges its ledger recorded and the wait for the slowest
    rank, step by step, equal to the summary's modeled step (from the algorithm's stated traffic) times the
    step. Its folder is a real run's; only summary.json's run_machines is set to what two machines give
    (this machine has one). On one machine nothing is added."""
    from bfexp import report

    run = in_process["network"]  # dsgd over exp2 on virtual ranks, straggler_wait, 4 ranks a machine, fresh reference
    summary, records = read_job(run)
    assert "modeled_time_s" not in records[0] and summary["modeled"]["compute_source"] == "measured here"
    assert report.collect(run)[0].modeled == {}  # one machine: its measured time is the answer
    summary["run_machines"] = 2
    (run / "summary.json").write_text(json.dumps(summary))
    [repriced] = report.collect(run)
    step_s = summary["modeled"]["step_time_s"]
    assert summary["modeled"]["wait_time_s"] > 0 and summary["modeled"]["machines"] == 2
    assert repriced.modeled["local"] == pytest.approx([r["step"] * step_s for r in records], rel=1e-9)
    row = report.build_table([repriced]).rows[0]
    assert row["modeled_train_time_s@local"] == pytest.approx(24 * step_s, rel=1e-9)
