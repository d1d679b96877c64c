"""The sweep report: folders of jobs -> report.csv, report.md and PNG plots.

Most tests build job folders by hand (summary.json, metrics.jsonl,
.hydra/overrides.yaml as the CLI writes them), so the expected table is
known exactly; one test runs a real sweep on MPI ranks through the CLI.
"""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bfexp import results
from bfexp.cli import group_options
from bfexp.report import Plotter, collect, efficiency_series, swept_keys, write_report

# Virtual ranks make the real sweep cheap; real MPI ranks where that engine is absent.
ENGINE = "threads" if "threads" in group_options("engine") else "mpi"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A blank 7.5 x 4.8 inch figure at 120 dpi compresses to a few kB; drawn ones are larger.
MIN_PNG_BYTES = 15_000
SCALING_FIELDS = [
    "scaling_efficiency", "baseline_throughput_samples_per_s", "baseline_scaling_efficiency",
    "speedup_vs_baseline", "comm_time_s", "compute_time_s", "time_source",
]


def make_job(root, name, overrides, summary, records=()):
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (job / "summary.json").write_text(json.dumps(summary))
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return job


def curve(ranks, throughput, final_loss=0.5):
    """Records of a short healthy run; step_time_s follows from the throughput (batch 32 per rank)."""
    step_time = 32 * ranks / throughput
    return [
        {"step": s, "loss": 1.0 / s, "accuracy": 0.5 + 0.04 * s, "consensus_distance": 0.1 / s**2,
         "step_time_s": step_time, "elapsed_s": 1.0 + s * step_time}
        for s in (2, 4, 6, 8)
    ]


def summary(algorithm, ranks, throughput, **extra):
    out = {"algorithm": algorithm, "topology": "exp2", "ranks": ranks, "engine": "mpi", "status": "completed",
           "error": None, "final_loss": 0.5, "final_accuracy": 0.8, "consensus_distance": 0.01,
           "step_time_s": 32 * ranks / throughput, "throughput_samples_per_s": throughput, "steps": 8}
    out.update(extra)
    return out


@pytest.fixture
def sweep(tmp_path):
    """A sweep over algorithm x ranks: jobs from before the scaling figures existed (no
    scaling_efficiency) and after, one failed job, one diverged job."""
    root = tmp_path / "sweep"
    fixed = ["steps=8", "log_every=2"]
    make_job(root, "0_algorithm=dsgd,ranks=1", ["algorithm=dsgd", "ranks=1", *fixed],
             summary("dsgd", 1, 100.0), curve(1, 100.0))
    make_job(root, "1_algorithm=dsgd,ranks=2", ["algorithm=dsgd", "ranks=2", *fixed],
             summary("dsgd", 2, 180.0), curve(2, 180.0))
    make_job(root, "2_algorithm=dsgd,ranks=4", ["algorithm=dsgd", "ranks=4", *fixed],
             summary("dsgd", 4, 320.0, scaling_efficiency=0.8, baseline_throughput_samples_per_s=200.0,
                     baseline_scaling_efficiency=0.5, speedup_vs_baseline=1.6, comm_time_s=0.01,
                     compute_time_s=0.3, time_source="measured"),
             curve(4, 320.0))
    make_job(root, "10_algorithm=allreduce,ranks=1", ["algorithm=allreduce", "ranks=1", *fixed],
             summary("allreduce", 1, 100.0), curve(1, 100.0))
    make_job(root, "11_algorithm=allreduce,ranks=2", ["algorithm=allreduce", "ranks=2", *fixed],
             summary("allreduce", 2, 150.0, status="failed", error="rank 1: RuntimeError: injected | failure"),
             curve(2, 150.0)[:1])
    make_job(root, "12_algorithm=allreduce,ranks=4", ["algorithm=allreduce", "ranks=4", *fixed],
             summary("allreduce", 4, 250.0, status="diverged", error="loss inf at step 4"), curve(4, 250.0))
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_job_numbers_of_both_folder_forms():
    # Hydra's default subdir N_overrides, and a study's subdir=${hydra.job.num}: 10 sorts after 2 in both
    from bfexp.report import Job

    numbers = [Job(Path(n), n, {}, [], {}).number for n in ("10_lr=0.1", "2", "10", "lr=0.1", "3x")]
    assert numbers == [10, 2, 10, None, None]


def test_csv_has_one_row_per_job_with_swept_values_and_new_figures(sweep):
    report = write_report(sweep, plots=False)
    rows = read_csv(sweep / "report.csv")
    # Hydra job numbers order the rows (10 after 2, not after 1).
    assert [r["job"] for r in rows] == [
        "0_algorithm=dsgd,ranks=1", "1_algorithm=dsgd,ranks=2", "2_algorithm=dsgd,ranks=4",
        "10_algorithm=allreduce,ranks=1", "11_algorithm=allreduce,ranks=2", "12_algorithm=allreduce,ranks=4",
    ]
    assert report.table.swept == ["algorithm", "ranks"]  # steps and log_every are fixed, not columns
    assert [(r["algorithm"], r["ranks"]) for r in rows] == [
        ("dsgd", "1"), ("dsgd", "2"), ("dsgd", "4"), ("allreduce", "1"), ("allreduce", "2"), ("allreduce", "4")]
    assert [r["status"] for r in rows] == ["completed"] * 4 + ["failed", "diverged"]
    assert rows[4]["error"] == "rank 1: RuntimeError: injected | failure"
    # The newer figures are columns; a job from before they existed leaves them empty.
    assert set(SCALING_FIELDS) <= set(rows[0])
    assert rows[0]["scaling_efficiency"] == "" and rows[0]["time_source"] == ""
    assert float(rows[2]["scaling_efficiency"]) == 0.8 and float(rows[2]["speedup_vs_baseline"]) == 1.6
    assert rows[2]["time_source"] == "measured"
    assert float(rows[1]["throughput_samples_per_s"]) == 180.0


def test_markdown_names_what_varied_and_what_was_left_out(sweep):
    write_report(sweep, plots=False)
    md = (sweep / "report.md").read_text()
    assert "Swept: `algorithm`, `ranks`." in md
    assert "Fixed overrides: `steps=8` `log_every=2`." in md
    header = next(line for line in md.splitlines() if line.startswith("| job"))
    assert header.split(" | ")[1:3] == ["algorithm", "ranks"]
    for column in ("scaling_efficiency", "speedup_vs_baseline", "time_source", "step_time_s", "error"):
        assert column in header
    # a short set: what the terminal shows, the step time and the error; report.csv keeps every figure
    csv_header = (sweep / "report.csv").read_text().splitlines()[0].split(",")
    for column in ("framework_overhead_fraction", "reference_source", "peak_memory_bytes", "compute_time_s"):
        assert column not in header.split(" | ") and column in csv_header, column
    table_rows = [line for line in md.splitlines() if line.startswith("| [")]
    assert len(table_rows) == 6
    assert "injected \\| failure" in md  # a | inside a cell does not break the table
    left_out = md.split("## Left out of the plots", 1)[1]
    assert "`11_algorithm=allreduce,ranks=2`: failed: rank 1" in left_out
    assert "`12_algorithm=allreduce,ranks=4`: diverged: loss inf" in left_out


def test_plots_are_valid_pngs_of_nontrivial_size(sweep):
    report = write_report(sweep)
    pngs = {p.name for p in report.files if p.suffix == ".png"}
    # One training figure per rank count, since ranks varied.
    assert pngs == {"scaling_efficiency.png", "throughput.png", "consensus_distance.png",
                    "training_ranks1.png", "training_ranks2.png", "training_ranks4.png"}
    for name in pngs:
        data = (sweep / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        assert len(data) > MIN_PNG_BYTES, (name, len(data))
    md = (sweep / "report.md").read_text()
    for name in pngs:
        assert f"]({name})" in md
    assert "2 failed or diverged job(s) are in the table but not in the plots." in md
    assert not list(sweep.glob(".*.tmp")), "no temporary files left behind"


def test_scaling_efficiency_from_summary_or_derived_from_throughput(sweep):
    ok = [job for job in collect(sweep) if job.ok]
    series = efficiency_series(ok, swept_keys(ok))
    # dsgd: the 1- and 2-rank jobs predate scaling_efficiency, so the curve is derived from
    # throughput relative to 1 rank: 180 / (2 x 100) = 0.9 and 320 / (4 x 100) = 0.8.
    points, suffix = series["algorithm=dsgd"]
    assert {r: v[0].value for r, v in points.items()} == pytest.approx({1: 1.0, 2: 0.9, 4: 0.8})
    assert "from throughput" in suffix
    # A single completed allreduce job: one rank count, nothing to derive from.
    assert "algorithm=allreduce" not in series
    # When every job of a curve has the figure, the summary's value is used as is.
    only_new = [job for job in ok if job.summary["ranks"] == 4]
    points, suffix = efficiency_series(only_new, ["algorithm", "ranks"])["algorithm=dsgd"]
    assert points == {4: [(0.8, 0.8, 0.8)]} and suffix == ""  # a job without ends: no spread


def test_single_run_folder_and_unfinished_job(tmp_path):
    run = make_job(tmp_path, "outputs/2026-01-01/10-00-00", ["ranks=2"], summary("dsgd", 2, 100.0), curve(2, 100.0))
    report = write_report(run)
    assert [j.name for j in report.jobs] == ["10-00-00"] and report.table.swept == ["ranks"]
    # A job whose driver died before summary.json: in the table as unknown, never a crash.
    dead = tmp_path / "outputs/2026-01-01/11-00-00"
    (dead / ".hydra").mkdir(parents=True)
    (dead / ".hydra" / "overrides.yaml").write_text("- ranks=4\n")
    report = write_report(tmp_path / "outputs")
    rows = read_csv(tmp_path / "outputs" / "report.csv")
    assert [(r["ranks"], r["status"]) for r in rows] == [("2", "completed"), ("4", "unknown")]
    assert "no summary.json" in rows[1]["error"]


def test_report_command_rejects_a_folder_without_jobs(tmp_path):
    for folder in (tmp_path / "missing", tmp_path):
        proc = subprocess.run([sys.executable, "-m", "bfexp.report", str(folder)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert proc.stderr.startswith("bfexp-report: error:") and len(proc.stderr.strip().splitlines()) == 1


def test_real_sweep_writes_the_report_with_a_failed_job(bfexp):
    """bfexp -m through the real CLI: the report lands in the sweep folder when the sweep ends.
    Rank 4 fails at step 2; only the 5-rank job has a rank 4."""
    proc = bfexp("-m", "ranks=1,4,5", "fail_rank=4", "fail_step=2", "steps=6", "log_every=2", f"engine={ENGINE}",
                 "hydra.sweep.dir=sweep", timeout=300)
    assert proc.returncode == 1, proc.stderr  # a job failed
    sweep = bfexp.cwd / "sweep"
    rows = read_csv(sweep / "report.csv")
    assert [(r["ranks"], r["status"]) for r in rows] == [("1", "completed"), ("4", "completed"), ("5", "failed")]
    assert rows[2]["error"].startswith("rank 4: RuntimeError: injected failure")
    for row in rows[:2]:
        assert row["steps"] == "6" and float(row["final_accuracy"]) > 0 and float(row["throughput_samples_per_s"]) > 0
    pngs = sorted(sweep.glob("*.png"))
    assert {p.name for p in pngs} == {"scaling_efficiency.png", "throughput.png", "consensus_distance.png",
                                      "training_ranks1.png", "training_ranks4.png", "accuracy_vs_bytes.png"}
    for png in pngs:
        data = png.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > MIN_PNG_BYTES, png.name
    md = (sweep / "report.md").read_text()
    assert "Swept: `ranks`." in md
    assert f"Fixed overrides: `fail_rank=4` `fail_step=2` `steps=6` `log_every=2` `engine={ENGINE}`." in md
    left_out = md.split("## Left out of the plots", 1)[1].split("##")[0].strip().splitlines()
    assert len(left_out) == 1 and left_out[0].startswith("- `2_") and ": failed: rank 4: RuntimeError" in left_out[0]
    # The table printed at the end, and the plain progress lines (stdout is a pipe here).
    assert "report: sweep/report.md (6 plots, report.csv)" in proc.stdout
    assert "step 6/6" in proc.stdout and "eta" in proc.stdout


def test_report_switch_off_and_on(sweep, capsys):
    """The callback conf/config.yaml registers: report=false writes nothing."""
    from omegaconf import OmegaConf

    from bfexp.report import MultirunReport

    MultirunReport().on_multirun_end(OmegaConf.create({"report": False, "hydra": {"sweep": {"dir": str(sweep)}}}))
    assert not (sweep / "report.md").exists() and capsys.readouterr().out == ""
    MultirunReport().on_multirun_end(OmegaConf.create({"report": True, "hydra": {"sweep": {"dir": str(sweep)}}}))
    assert (sweep / "report.md").exists() and (sweep / "report.csv").exists()
    assert f"report: {sweep}/report.md (6 plots, report.csv)" in capsys.readouterr().out


def with_intervals(summary, **figures):
    """A summary with figures and their interval ends: figures={key: (value, low, high)}."""
    for key, (value, low, high) in figures.items():
        lo, hi = results.INTERVALS[key]
        summary.update({key: value, lo: low, hi: high})
    return summary


def error_bars(ax):
    """{curve label: {x: (low end, high end)}} of every curve drawn with error bars."""
    out = {}
    for container in ax.containers:
        if container.has_yerr:
            segments = container.lines[2][0].get_segments()
            out[container.get_label()] = {round(seg[0][0]): (seg[0][1], seg[1][1]) for seg in segments}
    return out


@pytest.fixture
def noisy_sweep(tmp_path):
    """dsgd and exact_diffusion at 2 and 4 ranks with intervals on every figure: at 4 ranks their
    throughputs overlap (within noise), at 2 they do not; exact diffusion's speedup interval holds 1."""
    root = tmp_path / "noisy"
    figures = {  # (algorithm, ranks): throughput, efficiency, speedup, each (value, low, high)
        ("dsgd", 2): ((180.0, 170.0, 190.0), (0.9, 0.85, 0.95), (1.2, 1.1, 1.3)),
        ("dsgd", 4): ((320.0, 300.0, 330.0), (0.8, 0.75, 0.83), (1.3, 1.2, 1.4)),
        ("exact_diffusion", 2): ((150.0, 145.0, 160.0), (0.75, 0.72, 0.8), (1.0, 0.95, 1.07)),
        ("exact_diffusion", 4): ((310.0, 290.0, 325.0), (0.78, 0.72, 0.81), (1.05, 0.97, 1.1)),
    }
    for i, ((algorithm, ranks), (tput, eff, speedup)) in enumerate(figures.items()):
        s = with_intervals(summary(algorithm, ranks, tput[0], time_source="measured"),
                           throughput_samples_per_s=tput, scaling_efficiency=eff, speedup_vs_baseline=speedup)
        make_job(root, f"{i}_algorithm={algorithm},ranks={ranks}", [f"algorithm={algorithm}", f"ranks={ranks}"],
                 s, curve(ranks, tput[0]))
    return root


def test_csv_intervals_error_bars_and_what_is_within_noise(noisy_sweep, tmp_path):
    write_report(noisy_sweep)
    rows = read_csv(noisy_sweep / "report.csv")
    # every figure with an interval has its two ends as columns, beside it
    header = list(rows[0])
    for key, (low, high) in results.INTERVALS.items():
        assert header.index(low) == header.index(key) + 1 and header.index(high) == header.index(key) + 2
    for row in rows:
        for key in ("throughput_samples_per_s", "scaling_efficiency", "speedup_vs_baseline"):
            low, high = results.INTERVALS[key]
            assert float(row[low]) <= float(row[key]) <= float(row[high])
    # exact diffusion's speedup interval holds 1: its difference from the baseline is within noise
    assert [r["speedup_vs_baseline_within_noise"] for r in rows] == ["False", "False", "True", "True"]
    md = (noisy_sweep / "report.md").read_text()
    assert "1.05 [0.97, 1.1] (within noise)" in md and "1.3 [1.2, 1.4] |" in md
    assert "4 ranks: algorithm=dsgd (320) and algorithm=exact_diffusion (310) differ in throughput_samples_per_s " \
           "by less than their combined spread: within noise" in md
    assert "2 ranks: algorithm=dsgd" not in md  # 170..190 and 145..160 do not overlap
    assert "scaling efficiency = throughput at R ranks / (R x throughput of the same step on 1 rank" in md
    # the scaling plot draws each job's interval from the CSV as its error bar
    jobs = collect(noisy_sweep)
    plotter = Plotter(tmp_path, jobs, swept_keys(jobs))
    plotter.efficiency_plot([2, 4])
    drawn = error_bars(plotter.figures["scaling_efficiency.png"].axes[0])
    for algorithm in ("dsgd", "exact_diffusion"):
        expected = {int(r["ranks"]): (float(r["scaling_efficiency_low"]), float(r["scaling_efficiency_high"]))
                    for r in rows if r["algorithm"] == algorithm}
        [label] = [k for k in drawn if k.startswith(f"algorithm={algorithm} ")]
        assert "(median, interval)" in label and drawn[label].keys() == expected.keys()
        for ranks, ends in expected.items():
            assert drawn[label][ranks] == pytest.approx(ends)


def test_one_baseline_curve_per_batch_size(tmp_path):
    """batch_size swept: the allreduce baseline differs per batch size, so each gets its own curve
    (an average over batch sizes would be no baseline at all)."""
    root = tmp_path / "batches"
    i = 0
    for batch in (32, 256):
        for algorithm in ("dsgd", "push_sum"):
            for ranks in (2, 4):
                base_tput = 100.0 * ranks * (2 if batch == 256 else 1)
                s = summary(algorithm, ranks, base_tput * 1.1, batch_size=batch, baseline_throughput_samples_per_s=base_tput,
                            baseline_scaling_efficiency=0.5 if batch == 32 else 0.9, scaling_efficiency=0.6)
                make_job(root, f"{i}_b{batch}_{algorithm}_{ranks}",
                         [f"algorithm={algorithm}", f"batch_size={batch}", f"ranks={ranks}"], s, curve(ranks, base_tput))
                i += 1
    jobs = collect(root)
    plotter = Plotter(tmp_path, jobs, swept_keys(jobs))
    plotter.efficiency_plot([2, 4])
    plotter.throughput_plot([2, 4])
    def baselines(name):
        return {c.get_label().split(" (mean")[0]: [tuple(map(float, xy)) for xy in zip(*c.lines[0].get_data())]
                for c in plotter.figures[name].axes[0].containers if c.get_label().startswith("allreduce")}

    assert baselines("throughput.png") == {"allreduce baseline (batch_size=32)": [(2, 200.0), (4, 400.0)],
                                           "allreduce baseline (batch_size=256)": [(2, 400.0), (4, 800.0)]}
    assert baselines("scaling_efficiency.png") == {"allreduce baseline (batch_size=32)": [(2, 0.5), (4, 0.5)],
                                                   "allreduce baseline (batch_size=256)": [(2, 0.9), (4, 0.9)]}


def test_figures_measured_on_ranks_that_shared_too_few_cores_say_so_in_the_table(tmp_path, capsys):
    """A job whose summary carries the contention note and whose figures were measured here: its throughput,
    efficiency and speedup cells read "(contended)" in report.md and on the terminal, and report.csv has the
    flag; a job on enough cores, and one whose headline is modeled, do not."""
    from bfexp.report import print_report

    note = "8 ranks share 2 cores on this machine: measured throughput and scaling efficiency mostly show ..."
    make_job(tmp_path, "0_ranks=2", ["ranks=2"],
             summary("dsgd", 2, 100.0, scaling_efficiency=0.9, time_source="measured", contention=None))
    make_job(tmp_path, "1_ranks=8", ["ranks=8"],
             summary("dsgd", 8, 120.0, scaling_efficiency=0.3, time_source="measured", contention=note))
    make_job(tmp_path, "2_ranks=16", ["ranks=16"],
             summary("dsgd", 16, 900.0, scaling_efficiency=0.8, time_source="modeled", contention=note))
    report = write_report(tmp_path, plots=False)
    rows = {line.split(" | ")[0]: line for line in (tmp_path / "report.md").read_text().splitlines()
            if line.startswith("| [")}
    assert [key for key, line in rows.items() if "(contended)" in line] == ["| [1](<1_ranks=8/>)"]
    assert "0.3 (contended)" in rows["| [1](<1_ranks=8/>)"] and "120 (contended)" in rows["| [1](<1_ranks=8/>)"]
    with open(tmp_path / "report.csv", newline="") as f:
        flags = [r["measured_on_contended_cores"] for r in csv.DictReader(f)]
    assert flags == ["False", "True", "False"]
    print_report(report)
    assert capsys.readouterr().out.count("(contended)") >= 2
