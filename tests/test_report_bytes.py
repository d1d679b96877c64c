"""The report's accuracy-vs-bytes plot and the bytes column, from job folders built by hand."""

from __future__ import annotations

import json

from bfexp.report import write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_job(root, name, overrides, summary, records):
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (job / "summary.json").write_text(json.dumps(summary))
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def records(per_step: float, accuracy: float) -> list[dict]:
    return [{"step": s, "loss": 1.0 / s, "accuracy": accuracy * s / 8, "bytes_sent": per_step * s,
             "step_time_s": 0.01, "consensus_distance": 0.1 / s} for s in (2, 4, 6, 8)]


def summary(algorithm: str, ranks: int, per_step: float, accuracy: float) -> dict:
    return {"algorithm": algorithm, "topology": "exp2", "ranks": ranks, "engine": "threads", "status": "completed",
            "error": None, "final_accuracy": accuracy, "final_loss": 0.5, "bytes_sent_per_step": per_step, "steps": 8}


def test_accuracy_against_bytes_sent(tmp_path):
    root = tmp_path / "sweep"
    make_job(root, "0_algorithm=dsgd", ["algorithm=dsgd"], summary("dsgd", 4, 38480.0, 0.8), records(38480.0, 0.8))
    make_job(root, "1_algorithm=choco_sgd", ["algorithm=choco_sgd"], summary("choco_sgd", 4, 784.0, 0.7),
             records(784.0, 0.7))
    make_job(root, "2_algorithm=allreduce", ["algorithm=allreduce"], summary("allreduce", 1, 0.0, 0.9),
             records(0.0, 0.9))
    report = write_report(root)
    png = root / "accuracy_vs_bytes.png"
    assert png in report.files and png.read_bytes().startswith(PNG_SIGNATURE) and png.stat().st_size > 15_000
    assert "accuracy_vs_bytes.png" in (root / "report.md").read_text()
    rows = (root / "report.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert "bytes_sent_per_step" in header
    col = header.index("bytes_sent_per_step")
    assert sorted(float(r.split(",")[col]) for r in rows[1:]) == [0.0, 784.0, 38480.0]


def test_no_plot_without_bytes(tmp_path):
    root = tmp_path / "sweep"
    make_job(root, "0_ranks=1", ["ranks=1"], summary("dsgd", 1, 0.0, 0.8), records(0.0, 0.8))
    report = write_report(root)
    assert not (root / "accuracy_vs_bytes.png").exists()
    assert any("accuracy-vs-bytes" in note for note in report.notes)
