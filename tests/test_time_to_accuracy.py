"""Time to accuracy (issue 16): metrics.jsonl's time_s, the report's "time to reach target" columns
(target from the config, else the sweep's allreduce job's final value) and its time axis.

Small hand-written run folders; every expected time is worked out by hand in the comments.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from bfexp import report, results

# time_s (simulated), accuracy and held-out loss of a small run
RECORDS = [
    {"step": 10, "time_s": 0.5, "time_source": "simulated", "loss": 1.9, "eval_loss": 1.8, "accuracy": 0.40},
    {"step": 20, "time_s": 1.25, "time_source": "simulated", "loss": 1.2, "eval_loss": 1.1, "accuracy": 0.70},
    {"step": 30, "time_s": 2.0, "time_source": "simulated", "loss": 0.9, "eval_loss": None, "accuracy": None},
    {"step": 40, "time_s": 3.5, "time_source": "simulated", "loss": 0.6, "eval_loss": 0.55, "accuracy": 0.86},
]


def test_time_to_target_is_the_first_record_that_reaches_it():
    # accuracy >= 0.7 first at step 20 (time 1.25); >= 0.8 skips the unevaluated step 30: step 40 (3.5)
    assert report.time_to_target(RECORDS, "accuracy", 0.7, True) == 1.25
    assert report.time_to_target(RECORDS, "accuracy", 0.8, True) == 3.5
    assert report.time_to_target(RECORDS, "accuracy", 0.9, True) is None
    # held-out loss <= 1.5: step 20 (1.25); <= 0.55 (equal counts): step 40 (3.5)
    assert report.time_to_target(RECORDS, "eval_loss", 1.5, False) == 1.25
    assert report.time_to_target(RECORDS, "eval_loss", 0.55, False) == 3.5


def test_older_records_without_time_s_use_the_sum_of_step_times():
    old = [{"step": 10, "step_time_s": 0.1, "accuracy": 0.5}, {"step": 30, "step_time_s": 0.2, "accuracy": 0.8}]
    # 10 x 0.1 = 1.0 at step 10; + 20 x 0.2 = 5.0 at step 30
    assert report.time_axis(old) == pytest.approx([1.0, 5.0])
    assert report.time_to_target(old, "accuracy", 0.75, True) == pytest.approx(5.0)
    assert report.time_axis_label(old) == "training time (s): sum of measured step times"
    assert report.time_axis_label(RECORDS) == "training time (s, simulated)"


def write_job(root: Path, name: str, algorithm: str, records: list[dict], engine: str = "threads",
              config: dict | None = None) -> None:
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- algorithm={algorithm}\n- engine={engine}\n")
    last = [r for r in records if r.get("accuracy") is not None][-1]
    results.write_json_atomic(job / results.SUMMARY, {
        **results.identity(algorithm=algorithm, topology="exp2", ranks=8, engine=engine, seed=0, model="mlp",
                           dataset="digits", batch_size=32, lr=0.1),
        "status": "completed", "final_accuracy": last["accuracy"], "final_eval_loss": last["eval_loss"]})
    for record in records:
        results.append_jsonl(job / results.METRICS, record)
    (job / results.CONFIG).write_text("".join(f"{k}: {v}\n" for k, v in (config or {}).items()))


def scaled(factor: float, accuracy_shift: float = 0.0) -> list[dict]:
    return [{**r, "time_s": r["time_s"] * factor,
             "accuracy": None if r["accuracy"] is None else r["accuracy"] + accuracy_shift} for r in RECORDS]


def test_report_columns_against_the_allreduce_baseline_of_the_same_engine(tmp_path):
    """Targets: each engine's allreduce job's final accuracy (0.86) and held-out loss (0.55)."""
    write_job(tmp_path, "0_allreduce", "allreduce", RECORDS)
    write_job(tmp_path, "1_gossip", "gossip", scaled(0.5, 0.05))       # reaches 0.86 at step 40: 3.5 x 0.5
    write_job(tmp_path, "2_dsgd", "dsgd", scaled(2.0, -0.1))           # never reaches 0.86
    write_job(tmp_path, "3_allreduce_mpi", "allreduce", scaled(3.0, -0.2), engine="mpi")  # its own: 0.66
    write_job(tmp_path, "4_dsgd_mpi", "dsgd", scaled(1.0, -0.2), engine="mpi")             # 0.66 at step 40: 3.5
    # A configured target wins over the baseline's: 0.45 first at step 20 (1.25 x 4)
    write_job(tmp_path, "5_push_sum", "push_sum", scaled(4.0, -0.2), config={"target_accuracy": 0.45})
    report.write_report(tmp_path, plots=True)
    rows = {r["job"]: r for r in csv.DictReader(open(tmp_path / report.CSV_NAME))}
    got = {job: (float(r["target_accuracy"]), r["time_to_target_accuracy_s"]) for job, r in rows.items()}
    assert got == {
        "0_allreduce": (0.86, "3.5"),
        "1_gossip": (0.86, "1.75"),
        "2_dsgd": (0.86, ""),
        "3_allreduce_mpi": (pytest.approx(0.66), "10.5"),
        "4_dsgd_mpi": (pytest.approx(0.66), "3.5"),
        "5_push_sum": (0.45, "5.0"),
    }
    assert rows["1_gossip"]["target_eval_loss"] == "0.55"
    assert rows["1_gossip"]["time_to_target_eval_loss_s"] == "1.75"  # eval_loss 0.55 at step 40: 3.5 x 0.5
    markdown = (tmp_path / report.MD_NAME).read_text()
    assert "time_to_target_accuracy_s" in markdown
    assert (tmp_path / "training.png").is_file()
