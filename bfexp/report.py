"""A run or sweep folder -> report.csv, report.md and PNG plots.

Every job directory under the folder (one with summary.json or Hydra's
.hydra/overrides.yaml) becomes one row. The swept values come from each
job's .hydra/overrides.yaml: a key whose value differs between jobs is a
column, a key every job shares is listed once as a fixed override, so the
table shows exactly what varied. Failed and diverged jobs stay in the table
with their error and are left out of the plots, with a note saying so.

Figures newer than a job (scaling efficiency, baseline, speedup, ...) are
columns when some job has them; older job folders simply leave them empty.

`bfexp-report FOLDER` runs it by hand; at the end of a sweep (`bfexp -m`)
the MultirunReport callback registered in conf/config.yaml runs it (turn
it off with report=false). matplotlib is imported only to draw, and draws
without pyplot (no global backend state, safe inside the driver).
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import math
import os
import re
import sys
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any, Iterable

from bfexp import results, scaling
from bfexp.errors import ConfigError, NoJobsError

try:  # the Hydra callback API; the report itself does not need Hydra
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[misc,assignment]

CSV_NAME = "report.csv"
MD_NAME = "report.md"
OK_STATUSES = (results.COMPLETED,)

# Summary fields in the order the table shows them (those no job has are dropped); errors last.
TABLE_FIELDS = [f.key for f in results.FIELDS if f.key != "wall_time_s"] + ["error"]
# What identifies a job; shown in the table only when it differs between jobs.
IDENTITY_FIELDS = [k for k in results.IDENTITY if k not in ("seed", "batch_size", "lr")]
# The console shows fewer figures than report.md (width is scarce), under short headers;
# errors follow the table, one line each, rather than squeezing it.
CONSOLE_FIELDS = [f.key for f in results.FIELDS if f.console]
CONSOLE_LABELS = {f.key: f.short for f in results.FIELDS if f.key != "status"}
# Swept keys that do not make a separate curve: repeats and the x axis itself.
NOT_A_SERIES = ("ranks", "seed")
# The two ends of every figure's interval: CSV columns of their own, folded into the figure's cell elsewhere.
BOUNDS = {f.key for f in results.FIELDS if f.bound_of}
# Whether a job's speedup over the allreduce baseline is within noise (its interval holds 1).
NOISE_KEY = "speedup_vs_baseline_within_noise"
# Measured on ranks that outnumbered the cores they shared (the summary's contention note): what those figures
# show is mostly CPU contention, and the table says so beside each (the modeled.* columns stand apart).
CONTENDED_KEY = "measured_on_contended_cores"
CONTENDED_FIGURES = ("throughput_samples_per_s", "scaling_efficiency", "speedup_vs_baseline",
                     "baseline_throughput_samples_per_s", "baseline_scaling_efficiency", "step_time_s", "comm_time_s")
# Swept keys of the algorithm or topology: what the allreduce baseline does not depend on.
SERIES_ONLY = ("algorithm", "topology")
DEFINITIONS = (
    "scaling efficiency = throughput at R ranks / (R x throughput of the same step on 1 rank: the same "
    "algorithm wrapper, model and batch, communication on the engine's single-rank path), so a 1-rank job "
    "scores 1 up to noise; framework overhead = that 1-rank step / a plain torch step of the same model and "
    "batch - 1. Figures are medians of per-step times; [low, high] is the order-statistic 95% interval of the "
    "median of 10 runs of consecutive steps (fewer than 30 steps: of the steps), and figures derived from two "
    "timings take the widest combination of their ends. "
    "Two figures whose intervals overlap differ by less than their combined spread: within noise."
)


# ------------------------------------------------------------------ collecting
@dataclass
class Job:
    """One job directory: what it was asked to run and what it left behind."""

    path: Path
    name: str
    summary: dict
    records: list[dict]
    overrides: dict[str, str]
    # cluster name -> each record's modeled training time (s) there: the run's own pricing (the records'
    # modeled_time_s) and any cluster the report was asked to reprice on (modeled_times)
    modeled: dict[str, list[float | None]] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return str(self.summary.get("status") or "unknown")

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES

    @property
    def number(self) -> int | None:
        """Hydra's job number (the N_ prefix of a sweep subfolder, or the whole name: subdir=${hydra.job.num})."""
        m = re.match(r"(\d+)(?:_|$)", self.name)
        return int(m.group(1)) if m else None

    @functools.cached_property
    def config(self) -> dict:
        """The job's config.yaml as plain data, read once and as results files are (bfexp.files.read_file: a
        regular file within results.JSON_LIMIT, so a FIFO, /dev/zero or a huge file is no config); {} where
        there is none or it is not a YAML mapping."""
        import yaml

        from bfexp.files import read_file

        try:
            data = yaml.safe_load(read_file(self.path / results.CONFIG, results.JSON_LIMIT))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return {}
        return data if isinstance(data, dict) else {}


def is_job_dir(path: Path) -> bool:
    return (path / results.SUMMARY).is_file() or (path / ".hydra" / "overrides.yaml").is_file()


def find_job_dirs(root: Path) -> list[Path]:
    """Job directories at or under root; a job's own subfolders (logs, wandb) are not searched."""
    if is_job_dir(root):
        return [root]
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        if here != root and is_job_dir(here):
            found.append(here)
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    return found


def read_overrides(job_dir: Path) -> dict[str, str]:
    """`key=value` overrides Hydra recorded for this job, in command-line order."""
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    out: dict[str, str] = {}
    try:
        items = OmegaConf.to_container(OmegaConf.load(path)) or []
    except Exception:  # a damaged overrides.yaml: the job is reported without its overrides
        items = []
    for item in items if isinstance(items, list) else []:
        key, sep, value = str(item).partition("=")
        if sep:
            out[key.lstrip("+~")] = value
    return out


def load_job(job_dir: Path, root: Path) -> Job:
    """A job folder read back; a damaged summary.json or metrics.jsonl is said in the job's error (the
    other jobs of the sweep are reported as they are)."""
    summary, damaged = results.read_json_checked(job_dir / results.SUMMARY)
    metrics, bad_metrics = results.read_jsonl_checked(job_dir / results.METRICS)
    if summary is None:
        why = f"damaged summary: {damaged}" if damaged else "no summary.json: the job did not finish or is still running"
        summary = {"status": "unknown", "error": why}
    if bad_metrics:
        summary = {**summary, "error": "; ".join(filter(None, [summary.get("error"), f"damaged metrics: {bad_metrics}"]))}
    name = job_dir.name if job_dir == root else str(job_dir.relative_to(root))
    job = Job(job_dir, name, summary, metrics, read_overrides(job_dir))
    own = summary.get("modeled_cluster")
    if own and metrics and any(_finite(rec.get("modeled_time_s")) for rec in metrics):
        job.modeled[str(own)] = [rec["modeled_time_s"] if _finite(rec.get("modeled_time_s")) else None for rec in metrics]
    elif metrics:
        price_on_own_network(job)
    return job


def price_on_own_network(job: Job) -> None:
    """A job that ran over a real network between machines (the emulated cluster's hosts, a Slurm
    allocation) with its compute speed measured (no declared one, so its records carry no modeled time):
    its recorded steps priced on the cluster it ran on, compute and the wait for the slowest rank as its
    summary measured them, beside its measured time. What holds the cost model to time to accuracy
    (recipes/bandwidth_study/README.md). Nothing for a job on one machine, or without a ledger."""
    modeled = job.summary.get("modeled")
    if not (isinstance(modeled, dict) and modeled.get("compute_source") == "measured here"
            and isinstance(job.summary.get("run_machines"), int) and job.summary["run_machines"] > 1):
        return
    node = job.config.get("scaling")
    if not isinstance(node, dict) or node.get("modeled") is not False:
        return
    if not node.get("ranks_per_machine") and isinstance(job.summary.get("run_ranks_per_machine"), int):
        node = {**node, "ranks_per_machine": job.summary["run_ranks_per_machine"]}  # where they ran (as the summary)
    from omegaconf import OmegaConf

    try:
        times = modeled_times(job, OmegaConf.create(node), measured_wait_s=modeled.get("wait_time_s") or 0.0)
    except (ConfigError, KeyError, TypeError, ValueError):  # a scaling section this bfexp cannot price: say nothing
        return
    if times and any(_finite(t) for t in times):
        job.modeled[str(modeled.get("cluster") or node.get("name") or "own")] = times


def cluster_node(name: str) -> Any:
    """The scaling config of a shipped cluster (conf/scaling/<name>.yaml, as ``scaling=<name>`` composes it);
    ConfigError naming the shipped ones for any other name."""
    from omegaconf import OmegaConf

    from bfexp.components import option_node

    return OmegaConf.create(option_node("scaling", name))


def priced_clusters(names: Iterable[str], bandwidths_gbit_per_s: Iterable[float] = ()) -> dict[str, Any]:
    """Label -> scaling config of each shipped cluster named, or, with ``bandwidths_gbit_per_s``, of each at
    each bandwidth between machines (``<name>:<b>Gbit/s``: the cluster with inter_bandwidth_gbyte_per_s =
    b / 8, everything else its own). ConfigError for an unknown name or a bandwidth that is not positive."""
    from omegaconf import OmegaConf

    rates = [float(b) for b in bandwidths_gbit_per_s]
    for b in rates:
        if not math.isfinite(b) or b <= 0:
            raise ConfigError(f"bandwidth {b:g} Gbit/s; allowed: a positive number of Gbit/s")
    out: dict[str, Any] = {}
    for name in names:
        node = cluster_node(name)
        if not rates:
            out[name] = node
        for b in rates:
            varied = OmegaConf.merge(node, {"inter_bandwidth_gbyte_per_s": b / 8.0})
            out[f"{name}:{b:g}Gbit/s"] = varied
    return out


def modeled_times(job: Job, scaling_node: Any, measured_wait_s: float = 0.0) -> list[float | None] | None:
    """Each record's training time with the job's recorded steps (its operations.json) priced on the cluster
    of ``scaling_node``, as the run prices them (bfexp.ledger); None for a job without a ledger or a compute
    speed (the cluster's for the model, else the job's own single-rank reference, and then
    ``measured_wait_s`` a step for the slowest rank)."""
    from bfexp.ledger import Ledger, Prices

    try:
        ledger = Ledger.load(job.path)
    except (ValueError, KeyError, TypeError):  # a damaged or foreign operations.json: the job is not repriced
        return None
    if ledger is None or not ledger.facts:
        return None
    step = scaling.get(job.summary.get("reference") or {}, "step_time_s")
    measured = scaling.throughput(1, ledger.facts["batch_size"], step.value if step is not None else None)
    prices = Prices.on(scaling_node, ledger.facts, measured, measured_wait_s)
    if prices is None:
        return None
    last = max((rec["step"] for rec in job.records if isinstance(rec.get("step"), int)), default=0)
    ends = prices.cumulative(ledger, last)  # no further than the records go, whatever the file's runs say
    return [ends[rec["step"] - 1] if isinstance(rec.get("step"), int) and 0 < rec["step"] <= len(ends) else None
            for rec in job.records]


def _job_order(job: Job) -> tuple:
    return (job.number is None, job.number or 0, job.name)


def collect(root: str | os.PathLike) -> list[Job]:
    root = Path(root)
    return sorted((load_job(d, root) for d in find_job_dirs(root)), key=_job_order)


def swept_keys(jobs: list[Job]) -> list[str]:
    """Override keys whose value is not the same in every job (all of them for a single job)."""
    keys: list[str] = []
    for job in jobs:
        keys += [k for k in job.overrides if k not in keys]
    if len(jobs) == 1:
        return keys
    return [k for k in keys if len({job.overrides.get(k) for job in jobs}) > 1]


def fixed_overrides(jobs: list[Job]) -> dict[str, str]:
    """Overrides every job shares (the sweep's constant part)."""
    if len(jobs) < 2:
        return {}
    swept = set(swept_keys(jobs))
    return {k: v for k, v in jobs[0].overrides.items() if k not in swept}


# ------------------------------------------------------------------ table
@dataclass
class Table:
    """Rows of the report: `columns` for people (md, console), `csv_columns` for everything."""

    swept: list[str]
    columns: list[str]
    csv_columns: list[str]
    rows: list[dict[str, Any]]


def swept_value(job: Job, key: str) -> Any:
    if key in job.overrides:
        return job.overrides[key]
    return job.summary.get(key)


def speedup_within_noise(summary: dict) -> bool | None:
    """The job's difference from the allreduce baseline is smaller than their combined spread
    (the speedup's interval holds 1); None without an interval, or for the baseline itself."""
    speedup = scaling.get(summary, "speedup_vs_baseline")
    if speedup is None or summary.get(results.low_key("speedup_vs_baseline")) is None or speedup.low == speedup.high:
        return None
    return scaling.within_noise(speedup, scaling.Spread.exact(1.0))


def build_table(jobs: list[Job]) -> Table:
    swept = swept_keys(jobs)
    rows = []
    for job in jobs:
        row: dict[str, Any] = {"job": job.name}
        row.update(job.summary)
        row[NOISE_KEY] = speedup_within_noise(job.summary)
        row[CONTENDED_KEY] = bool(job.summary.get("contention")) and job.summary.get("time_source") == "measured"
        # Nested figures (e.g. the measured and modeled sets beside the headline) as dotted columns.
        for key, value in job.summary.items():
            if isinstance(value, dict):
                row.update({f"{key}.{k}": v for k, v in value.items() if not isinstance(v, (dict, list))})
        row.update({k: swept_value(job, k) for k in swept})
        for cluster, times in job.modeled.items():
            row[f"modeled_train_time_s@{cluster}"] = times[-1] if times else None
        row.update(time_to_targets(job, jobs, swept))
        rows.append(row)

    def present(key: str) -> bool:
        return any(r.get(key) not in (None, "") for r in rows)

    varying_identity = [k for k in IDENTITY_FIELDS if k not in swept and len({str(r.get(k)) for r in rows}) > 1]
    # per cluster priced (modeled_times): the cluster's columns together, each kind in one order
    kinds = ["modeled_train_time_s", "time_to_target_accuracy_s", "speedup_at_target_accuracy",
             "time_to_target_eval_loss_s", "speedup_at_target_eval_loss"]
    priced = sorted({k for r in rows for k in r if "@" in k and present(k)},
                    key=lambda k: (k.split("@", 1)[1], kinds.index(k.split("@")[0]) if k.split("@")[0] in kinds else 99, k))
    columns = ["job", *swept, *varying_identity,
               *[k for k in TABLE_FIELDS if (present(k) or k == "status") and k not in BOUNDS], *priced]
    # The CSV keeps a stable schema (every known figure and its interval's ends, empty where a job
    # lacks them) plus any newer field.
    speedup_at = TABLE_FIELDS.index(results.high_key("speedup_vs_baseline")) + 1
    known = ["job", *swept, *IDENTITY_FIELDS, *TABLE_FIELDS[:speedup_at], NOISE_KEY, *TABLE_FIELDS[speedup_at:]]
    extra = sorted({k for r in rows for k in r if k not in known and not isinstance(r[k], (dict, list))})
    csv_columns = list(dict.fromkeys(k for k in known if k != "error")) + extra + ["error"]
    return Table(swept, columns, csv_columns, rows)


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if 1e3 <= abs(value) < 1e12:  # throughputs: whole numbers read better than 7.52e+04
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def to_csv(table: Table) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=table.csv_columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in table.rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in table.csv_columns})
    return buf.getvalue()


def cell(row: dict, key: str, digits: int = 4) -> str:
    """A figure as people read it: its value, its interval, and whether it is within noise of the baseline."""
    text = fmt(row.get(key), digits)
    bounds = results.INTERVALS.get(key)
    if text and bounds and all(row.get(b) is not None for b in bounds):
        low, high = (fmt(row[b], 3) for b in bounds)
        if low != high:
            text += f" [{low}, {high}]"
    if key == "speedup_vs_baseline" and row.get(NOISE_KEY):
        text += " (within noise)"
    if text and key in CONTENDED_FIGURES and row.get(CONTENDED_KEY):
        text += " (contended)"
    return text


def _md_cell(row: dict, key: str) -> str:
    return cell(row, key).replace("|", "\\|").replace("\n", " ")


# report.md's columns beyond the console's: a job's step time and its error in full (report.csv keeps every figure).
MD_EXTRA = ("step_time_s", "error")


def md_columns(table: Table) -> list[str]:
    """report.md's table: the console's short set (what varied, status, accuracy, the scaling figures, where
    times come from, time to target and each priced cluster's) plus MD_EXTRA; a cluster priced at several
    bandwidths has its columns in report.csv and crossover.csv only."""
    return [c for c in table.columns if (c not in TABLE_FIELDS or c in CONSOLE_FIELDS or c in MD_EXTRA)
            and not ("@" in c and ":" in c)]


def to_markdown(root: Path, jobs: list[Job], table: Table, plots: list[Path], notes: list[str]) -> str:
    counts = defaultdict(int)
    for job in jobs:
        counts[job.status] += 1
    lines = [
        f"# bfexp report: {root}",
        "",
        f"{len(jobs)} job{'s' if len(jobs) != 1 else ''}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ".",
    ]
    if table.swept:
        what = "Swept" if len(jobs) > 1 else "Overrides"
        lines.append(f"{what}: {', '.join(f'`{k}`' for k in table.swept)}.")
    fixed = fixed_overrides(jobs)
    if fixed:
        lines.append("Fixed overrides: " + " ".join(f"`{k}={v}`" for k, v in fixed.items()) + ".")
    columns = md_columns(table)
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row, job in zip(table.rows, jobs):
        cells = [_md_cell(row, c) for c in columns]
        if job.number is not None and job.path != root:  # the job's number, linked to its folder
            cells[0] = f"[{job.number}](<{job.name}/>)"
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"All figures of every job: [{CSV_NAME}]({CSV_NAME})."]
    if plots:
        lines += ["", "## Plots", ""]
        for path in plots:
            lines += [f"![{path.stem}]({path.name})", ""]
    left_out = [j for j in jobs if not j.ok]
    if left_out:
        lines += ["", "## Left out of the plots", ""]
        lines += [f"- `{j.name}`: {j.status}" + (f": {j.summary['error']}" if j.summary.get("error") else "") for j in left_out]
    refused = refused_points(root)
    if refused:
        lines += ["", "## Refused points (skip_invalid=true: not run)", ""]
        lines += [f"- `{' '.join(overrides)}`: {reason}" for overrides, reason in refused]
    contention = {str(j.summary["contention"]) for j in jobs if j.summary.get("contention")}
    definitions = [DEFINITIONS] if any(j.summary.get("scaling_efficiency") is not None for j in jobs) else []
    notes = [*definitions, *noise_notes(jobs, table.swept), *notes, *sorted(contention)]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def combined(figures: list[scaling.Spread]) -> scaling.Spread:
    """Repeats of one figure (e.g. seeds) as one: their mean, from the lowest low to the highest high."""
    return scaling.Spread(mean(f.value for f in figures), min(f.low for f in figures), max(f.high for f in figures))


def noise_notes(jobs: list[Job], swept: list[str], key: str = "throughput_samples_per_s", most: int = 12) -> list[str]:
    """Curves whose figure at the same rank count differs by less than the combined spread: within noise."""
    by_ranks: dict[int, dict[str, scaling.Spread]] = defaultdict(dict)
    for label, per_ranks in points_by_series([j for j in jobs if j.ok], swept, key).items():
        for ranks, figures in per_ranks.items():
            if any(f.low != f.high for f in figures):
                by_ranks[ranks][label] = combined(figures)
    found = []
    for ranks, series in sorted(by_ranks.items()):
        labels = list(series)
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                if scaling.within_noise(series[a], series[b]):
                    found.append(f"{ranks} ranks: {a} ({fmt(series[a].value)}) and {b} ({fmt(series[b].value)}) "
                                 f"differ in {key} by less than their combined spread: within noise")
    if len(found) > most:
        found = found[:most] + [f"... and {len(found) - most} more pairs within noise"]
    return found


# The console's columns of a priced cluster (report.csv keeps every one): its header, then the cluster's name.
PRICED_LABELS = {"modeled_train_time_s": "modeled s", "time_to_target_accuracy_s": "t->acc s",
                 "speedup_at_target_accuracy": "speedup@acc"}


def render_table(table: Table, title: str) -> Any:
    """The table for the console (rich): short headers, job numbers, errors cut short."""
    from rich.table import Table as RichTable

    numbered = all(re.match(r"\d+(?:_|$)", r["job"]) for r in table.rows)
    columns = [c for c in table.columns if (c not in TABLE_FIELDS or c in CONSOLE_FIELDS)
               and ("@" not in c or (c.split("@")[0] in PRICED_LABELS and ":" not in c))]  # bandwidths: csv
    out = RichTable(title=title, title_justify="left")
    for col in columns:
        label = "#" if (col == "job" and numbered) else CONSOLE_LABELS.get(col, col)
        if "@" in col:  # a figure on a priced cluster (modeled_times): short, with the cluster's name
            label = f"{PRICED_LABELS[col.split('@')[0]]} {col.split('@', 1)[1]}"
        numeric = col not in ("job", "status", "time_source", *table.swept, *IDENTITY_FIELDS)
        out.add_column(label, justify="right" if numeric else "left", overflow="fold", min_width=len(label))
    for row in table.rows:
        cells = []
        for col in columns:
            text = cell(row, col, digits=3)
            if col == "job" and numbered:
                text = text.split("_", 1)[0]
            if col == "status" and text != results.COMPLETED:
                text = f"[red]{text}[/red]" if text == results.FAILED else f"[yellow]{text}[/yellow]"
            cells.append(text)
        out.add_row(*cells)
    return out


# ------------------------------------------------------------------ plots
def series_label(job: Job, swept: list[str]) -> str:
    """What distinguishes a job's curve from the others', ranks and seeds aside."""
    parts = [f"{k}={swept_value(job, k)}" for k in swept if k not in NOT_A_SERIES]
    if parts:
        return ", ".join(parts)
    return f"{job.summary.get('algorithm', '?')} on {job.summary.get('topology', '?')}"


def job_label(job: Job, swept: list[str], skip: Iterable[str] = ()) -> str:
    parts = [f"{k}={swept_value(job, k)}" for k in swept if k not in skip]
    return ", ".join(parts) if parts else series_label(job, [])


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def training_time_s(records: list[dict]) -> list[float | None]:
    """Seconds of training up to each record: the sum of measured step times (each record's
    step_time_s is the mean over its logging window). Start-up and evaluation are left out,
    so algorithms compare on the time their steps took, not on how busy the machine was at start."""
    total, prev_step, out = 0.0, 0, []
    for rec in records:
        step, step_time = rec.get("step"), rec.get("step_time_s")
        if not (_finite(step) and _finite(step_time)):
            out.append(None)
            continue
        total += (step - prev_step) * step_time
        prev_step = step
        out.append(total)
    return out


def time_axis(records: list[dict]) -> list[float | None]:
    """Each record's training time: the time_s the records carry (simulated clocks on virtual ranks,
    wall seconds inside training steps on real ones), else (older runs) derived by training_time_s."""
    if records and all(_finite(rec.get("time_s")) for rec in records):
        return [float(rec["time_s"]) for rec in records]
    return training_time_s(records)


def time_axis_label(records: list[dict]) -> str:
    """The time axis's label, saying where its seconds come from."""
    sources = sorted({str(rec.get("time_source")) for rec in records if rec.get("time_source")})
    if sources and all(_finite(rec.get("time_s")) for rec in records):
        return f"training time (s, {' and '.join(sources)})"
    return "training time (s): sum of measured step times"


def time_to_target(records: list[dict], key: str, target: float, higher_is_better: bool,
                   times: list[float | None] | None = None) -> float | None:
    """The training time of the first record whose ``key`` reaches ``target`` (>= for accuracy,
    <= for a loss); None when no record does. ``times``: each record's time (a cluster's modeled
    times), instead of time_axis's."""
    for t, rec in zip(time_axis(records) if times is None else times, records):
        value = rec.get(key)
        if _finite(t) and _finite(value) and (value >= target if higher_is_better else value <= target):
            return t
    return None


# metric in metrics.jsonl, the summary's final value, the config key of its target, higher is better
TARGETS = (("accuracy", "final_accuracy", "target_accuracy", True),
           ("eval_loss", "final_eval_loss", "target_eval_loss", False))


def configured_targets(job: Job) -> dict[str, float]:
    """target_accuracy / target_eval_loss as the job's config.yaml sets them (absent: none)."""
    return {key: float(job.config[key]) for _, _, key, _ in TARGETS if _finite(job.config.get(key))}


def baseline_job(job: Job, jobs: list[Job], swept: list[str]) -> Job | None:
    """The completed allreduce job that ran like ``job`` (same ranks, engine and swept values, but
    for the algorithm's, the topology's and a study's method choice, +experiment/...)."""
    same = [k for k in swept if k.split(".")[0] not in SERIES_ONLY and "experiment/" not in k]
    for other in jobs:
        if (other.ok and other.summary.get("algorithm") == "allreduce"
                and all(other.summary.get(k) == job.summary.get(k) for k in ("ranks", "engine"))
                and all(swept_value(other, k) == swept_value(job, k) for k in same)):
            return other
    return None


def time_to_targets(job: Job, jobs: list[Job], swept: list[str]) -> dict[str, Any]:
    """The report's time-to-accuracy columns for one job: each target (config, else the final value of
    its allreduce baseline job) and the training time at which the job first reached it."""
    if not job.records:
        return {}
    targets = configured_targets(job)
    base = baseline_job(job, jobs, swept)
    out: dict[str, Any] = {}
    for metric, final, key, higher in TARGETS:
        target = targets.get(key)
        if target is None and base is not None and _finite(base.summary.get(final)):
            target = float(base.summary[final])
        if target is None:
            continue
        out[key] = target
        out[f"time_to_{key}_s"] = time_to_target(job.records, metric, target, higher)
        for cluster, times in job.modeled.items():  # on each cluster priced: the time and the speedup at the target
            reached = out[f"time_to_{key}_s@{cluster}"] = time_to_target(job.records, metric, target, higher, times)
            theirs = (time_to_target(base.records, metric, target, higher, base.modeled.get(cluster))
                      if base is not None and base.modeled.get(cluster) else None)
            if reached and theirs:
                out[f"speedup_at_{key}@{cluster}"] = theirs / reached
        if metric == "accuracy":  # budget runs also record the average model's and the worst rank's
            for column, suffix in (("average_model_accuracy", "average_model"), ("worst_accuracy", "worst_rank")):
                if any(_finite(rec.get(column)) for rec in job.records):
                    out[f"time_to_{key}_{suffix}_s"] = time_to_target(job.records, column, target, higher)
    return out


def curve(records: list[dict], xkey: str, ykey: str) -> list[tuple[float, float]]:
    """(x, y) points of one metric; xkey "training_time_s" is each record's time_axis value."""
    xs = time_axis(records) if xkey == "training_time_s" else [rec.get(xkey) for rec in records]
    return [(x, rec[ykey]) for x, rec in zip(xs, records) if _finite(x) and _finite(rec.get(ykey))]


def points_by_series(jobs: list[Job], swept: list[str], key: str,
                     label: Any = series_label) -> dict[str, dict[int, list[scaling.Spread]]]:
    """A summary figure of each job with its interval (none: a point), by curve and rank count
    (repeats, e.g. seeds, share a point). ``label(job, swept)`` names a job's curve."""
    points: dict[str, dict[int, list[scaling.Spread]]] = defaultdict(lambda: defaultdict(list))
    for job in jobs:
        figure, ranks = scaling.get(job.summary, key), job.summary.get("ranks")
        if figure is not None and isinstance(ranks, int):
            points[label(job, swept)][ranks].append(figure)
    return points


def efficiency_series(jobs: list[Job], swept: list[str]) -> dict[str, tuple[dict[int, list[scaling.Spread]], str]]:
    """Scaling efficiency by curve and rank count, with a legend suffix saying where it comes from.

    summary.json's scaling_efficiency when every job of the curve has it.
    Otherwise (jobs from before those figures existed) it is derived from the
    curve's own throughputs, relative to its smallest rank count r0:
    (T(n) / n) / (T(r0) / r0), the single-rank definition when r0 = 1.
    """
    measured = points_by_series(jobs, swept, "scaling_efficiency")
    throughput = points_by_series(jobs, swept, "throughput_samples_per_s")
    out: dict[str, tuple[dict[int, list[scaling.Spread]], str]] = {}
    for label in dict.fromkeys([*measured, *throughput]):
        points, tp = measured.get(label, {}), throughput.get(label, {})
        if points and set(tp) <= set(points):
            out[label] = (dict(points), "")
        elif len(tp) >= 2:
            r0 = min(tp)
            per_rank0 = mean(t.value for t in tp[r0]) / r0
            derived = {r: [t.times(1 / (r * per_rank0)) for t in v] for r, v in tp.items()}
            out[label] = (derived, f" (vs {r0} rank{'s' if r0 > 1 else ''}, from throughput)")
    return out


class Plotter:
    """Draws the report's figures into one folder, with colors that mean the same series everywhere."""

    DPI = 120

    def __init__(self, out: Path, jobs: list[Job], swept: list[str]) -> None:
        import matplotlib

        self.mpl = matplotlib
        self.out = out
        self.swept = swept
        self.ok = [j for j in jobs if j.ok]
        self.left_out = [j for j in jobs if not j.ok]
        labels = list(dict.fromkeys(series_label(j, swept) for j in self.ok))
        cmap = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
        self.colors = {label: cmap(i % cmap.N) for i, label in enumerate(labels)}
        self.notes: list[str] = []
        self.written: list[Path] = []
        self.figures: dict[str, Any] = {}  # file name -> the matplotlib Figure written there

    # -- helpers
    def figure(self, width: float = 7.5, height: float = 4.8):
        from matplotlib.figure import Figure

        return Figure(figsize=(width, height), layout="constrained")

    def footnote(self, fig, extra: str = "") -> None:
        text = []
        if self.left_out:
            names = ", ".join(f"{j.name} ({j.status})" for j in self.left_out[:4])
            more = f" and {len(self.left_out) - 4} more" if len(self.left_out) > 4 else ""
            text.append(f"Left out (failed or diverged, see report.md): {names}{more}")
        if extra:
            text.append(extra)
        if text:
            width = int(fig.get_figwidth() * 17)  # characters of 7-point text per line
            wrapped = "\n".join(textwrap.fill(t, width) for t in text)
            fig.supxlabel(wrapped, fontsize=7, color="0.35", ha="left", x=0.01)

    def save(self, fig, name: str) -> None:
        path = self.out / name
        tmp = self.out / f".{name}.tmp"
        fig.savefig(tmp, format="png", dpi=self.DPI)
        os.replace(tmp, path)
        self.written.append(path)
        self.figures[name] = fig

    def rank_axis(self, ax, ranks: list[int]) -> None:
        from matplotlib.ticker import NullLocator, ScalarFormatter

        if ranks and max(ranks) / max(1, min(ranks)) >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(ranks)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("ranks")
        ax.grid(True, alpha=0.3)

    def log_axes(self, ax, **props: str) -> None:
        """A job-curve figure's axes: ``props`` (one axis's log scale, the labels, the title), a grid on the
        minor ticks too, and the legend."""
        ax.set(**props)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)

    def draw_series(self, ax, label: str, per_ranks: dict[int, list[scaling.Spread]], suffix: str = "",
                    several: str = "mean of repeats", **style: Any) -> list[float]:
        """One curve with error bars: each job's interval (``several`` jobs at one x: their mean, from the
        lowest low to the highest high). Returns the values drawn (the axis limits follow them: an interval
        as wide as a busy machine can make it runs off the chart rather than flattening every curve)."""
        xs = sorted(per_ranks)
        points = [combined(per_ranks[x]) for x in xs]
        lo = [p.value - p.low for p in points]
        hi = [p.high - p.value for p in points]
        bars = any(lo) or any(hi)
        repeats = any(len(v) > 1 for v in per_ranks.values())
        what = [several] if repeats else []
        if bars:
            what.append("widest interval" if repeats else "median, interval")
        what = f" ({', '.join(what)})" if what else ""
        ax.errorbar(xs, [p.value for p in points], yerr=[lo, hi] if bars else None, capsize=3,
                    **{"marker": "o", "color": self.colors.get(label), **style}, label=label + suffix + what)
        return [p.value for p in points]

    def baseline_label(self, job: Job, swept: list[str]) -> str:
        """The allreduce baseline's curve for a job: one per value of the swept keys it depends on (all
        but the algorithm's, the topology's, ranks and seeds), e.g. one per batch_size."""
        parts = [f"{k}={swept_value(job, k)}" for k in swept
                 if k not in NOT_A_SERIES and k.split(".")[0] not in SERIES_ONLY]
        return "allreduce baseline" + (f" ({', '.join(parts)})" if parts else "")

    def draw_baselines(self, ax, key: str) -> list[float]:
        """The allreduce baseline's figure, one dashed curve per baseline_label. Returns what it drew."""
        drawn: list[float] = []
        curves = points_by_series(self.ok, self.swept, key, self.baseline_label)
        for i, (label, per_ranks) in enumerate(curves.items()):
            drawn += self.draw_series(ax, label, per_ranks, several="mean over its jobs", ls=["--", "-.", ":"][i % 3],
                                      marker="s",
                                      color=str(round(0.2 + 0.5 * i / max(1, len(curves) - 1), 2)))
        return drawn

    def time_source(self) -> str:
        """Where the plotted times come from (measured here, or modeled), for the title."""
        found = sorted({str(j.summary["time_source"]) for j in self.ok if j.summary.get("time_source")})
        return f" ({' and '.join(found)})" if found else ""

    # -- figures
    def scaling_plots(self) -> None:
        all_ranks = sorted({j.summary.get("ranks") for j in self.ok if isinstance(j.summary.get("ranks"), int)})
        has_field = any(_finite(j.summary.get("scaling_efficiency")) for j in self.ok)
        if len(all_ranks) < 2 and not has_field:
            self.notes.append("No scaling plots: the completed jobs ran at one rank count and carry no scaling_efficiency.")
            return
        self.efficiency_plot(all_ranks)
        self.throughput_plot(all_ranks)

    def efficiency_plot(self, all_ranks: list[int]) -> None:
        fig = self.figure()
        ax = fig.add_subplot()
        values: list[float] = []
        for label, (points, suffix) in efficiency_series(self.ok, self.swept).items():
            values += self.draw_series(ax, label, points, suffix)
        drawn = bool(values)
        base = self.draw_baselines(ax, "baseline_scaling_efficiency")
        ax.axhline(1.0, ls=":", color="black", label="ideal (linear scaling)")
        ax.set_ylabel("scaling efficiency (1 = linear)")
        # Headroom above the ideal line so neither it nor points at 1 hide under the frame or legend.
        ax.set_ylim(0, max([1.0, *base, *values]) * 1.25)
        self.rank_axis(ax, all_ranks)
        ax.set_title(f"Scaling efficiency{self.time_source()}: throughput / (ranks × single-rank throughput)",
                     fontsize=11)
        if drawn or base:
            ax.legend(fontsize=8)
        self.footnote(fig)
        self.save(fig, "scaling_efficiency.png")

    def throughput_plot(self, all_ranks: list[int]) -> None:
        fig = self.figure()
        ax = fig.add_subplot()
        values = []
        for label, points in points_by_series(self.ok, self.swept, "throughput_samples_per_s").items():
            values += self.draw_series(ax, label, points)
        values += self.draw_baselines(ax, "baseline_throughput_samples_per_s")
        if values and max(values) / max(min(values), 1e-12) >= 10:
            ax.set_yscale("log")
        ax.set_ylabel("throughput (samples/s, all ranks)")
        self.rank_axis(ax, all_ranks)
        ax.set_title(f"Throughput vs ranks{self.time_source()}")
        if values:
            ax.legend(fontsize=8)
        self.footnote(fig)
        self.save(fig, "throughput.png")

    def training_plots(self) -> None:
        """Loss and accuracy vs step and vs time; one figure per rank count when ranks vary."""
        with_records = [j for j in self.ok if j.records]
        if not with_records:
            self.notes.append("No training curves: no completed job has metrics.jsonl records.")
            return
        ranks = sorted({j.summary.get("ranks") for j in with_records}, key=lambda r: (r is None, r or 0))
        groups = [(r, [j for j in with_records if j.summary.get("ranks") == r]) for r in ranks] if len(ranks) > 1 else [(ranks[0], with_records)]
        loss_label = "training loss (cross-entropy, mean over ranks)"
        acc_label = "held-out accuracy (fraction, mean over ranks)"
        panels = [
            ("step", "loss", "step", loss_label),
            ("training_time_s", "loss", "", loss_label),
            ("step", "accuracy", "step", acc_label),
            ("training_time_s", "accuracy", "", acc_label),
        ]
        for r, group in groups:
            time_label = time_axis_label([rec for j in group for rec in j.records])
            panels = [(x, y, time_label if x == "training_time_s" else xl, yl) for x, y, xl, yl in panels]
            fig = self.figure(11, 8)
            axes = fig.subplots(2, 2)
            for ax, (xkey, ykey, xlabel, ylabel) in zip(axes.flat, panels):
                for job in group:
                    pts = curve(job.records, xkey, ykey)
                    if pts:
                        label = job_label(job, self.swept, skip=("ranks",)) if len(ranks) > 1 else job_label(job, self.swept)
                        color = self.colors.get(series_label(job, self.swept))
                        ax.plot(*zip(*pts), marker=".", ms=3, lw=1.2, color=color, label=label,
                                ls=["-", "--", "-.", ":"][group.index(job) % 4])
                ax.set_xlabel(xlabel)
                ax.set_ylabel(ylabel, fontsize=9)
                ax.grid(True, alpha=0.3)
            handles, labels = axes[0, 0].get_legend_handles_labels()
            if handles:
                fig.legend(handles, labels, loc="outside right upper", fontsize=8)
            where = f", {r} ranks" if r is not None else ""
            fig.suptitle(f"Training loss and held-out accuracy{where}")
            self.footnote(fig)
            self.save(fig, f"training_ranks{r}.png" if len(groups) > 1 else "training.png")

    def modeled_plots(self, variants: bool = True) -> None:
        """Held-out accuracy and training loss against modeled training time, one figure per cluster priced
        (the run's own, and each the report was asked for; ``variants``: also each at another bandwidth), its
        name in the title and the file's."""
        clusters = list(dict.fromkeys(c for j in self.ok for c in j.modeled if variants or ":" not in c))
        for cluster in clusters:
            jobs = [j for j in self.ok if j.modeled.get(cluster)]
            fig = self.figure(11, 4.4)
            axes = fig.subplots(1, 2)
            for ax, key, ylabel in ((axes[0], "accuracy", "held-out accuracy (fraction, mean over ranks)"),
                                    (axes[1], "loss", "training loss (cross-entropy, mean over ranks)")):
                for i, job in enumerate(jobs):
                    pts = [(t, rec[key]) for t, rec in zip(job.modeled[cluster], job.records)
                           if _finite(t) and _finite(rec.get(key))]
                    if pts:
                        ax.plot(*zip(*pts), marker=".", ms=3, lw=1.2, color=self.colors.get(series_label(job, self.swept)),
                                label=job_label(job, self.swept), ls=["-", "--", "-.", ":"][i % 4])
                ax.set_xlabel(f"modeled training time on {cluster} (s)")
                ax.set_ylabel(ylabel, fontsize=9)
                ax.grid(True, alpha=0.3)
            handles, labels = axes[0].get_legend_handles_labels()
            if handles:
                fig.legend(handles, labels, loc="outside right upper", fontsize=8)
            fig.suptitle(f"Accuracy and loss against modeled time on {cluster}", x=0.02, ha="left")
            self.footnote(fig, "Modeled time: each recorded step's operations priced by bfexp's cost model "
                               f"(compute from {cluster}'s device or declared speed, else the job's measured one).")
            self.save(fig, f"modeled_{re.sub(r'[^A-Za-z0-9_.-]', '_', cluster)}.png")

    def crossover_plots(self, cells: list[dict]) -> None:
        """For each cluster priced at several bandwidths: which method reaches the target first in each cell
        (bandwidth x ranks), by how much (the runner-up's time over the winner's), a color per method."""
        import numpy as np

        for base in dict.fromkeys(c["cluster"] for c in cells):
            mine = [c for c in cells if c["cluster"] == base]
            rates = sorted({c["bandwidth_gbit_per_s"] for c in mine})
            ranks = sorted({c["ranks"] for c in mine})
            methods = sorted({m for c in cells for m in c["times"]})
            cmap = self.mpl.colormaps["tab10"]
            grid = np.full((len(rates), len(ranks), 4), 0.93)
            fig = self.figure(1.6 + 1.5 * len(ranks), 1.4 + 0.75 * len(rates))
            ax = fig.subplots()
            for c in mine:
                i, j = rates.index(c["bandwidth_gbit_per_s"]), ranks.index(c["ranks"])
                if c["winner"]:
                    grid[i, j] = cmap(methods.index(c["winner"]) % cmap.N)
                    grid[i, j, 3] = 0.55
                    by = f"x{c['margin']:.2f}" if _finite(c.get("margin")) else "alone"
                    text = f"{c['winner']}\n{by}"
                else:
                    text = "none reached"
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
            ax.imshow(grid, aspect="auto", origin="lower")
            ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
            ax.set_yticks(range(len(rates)), [f"{b:g}" for b in rates])
            ax.set_xlabel("ranks")
            ax.set_ylabel("bandwidth between machines (Gbit/s)")
            target = mine[0]["target"]
            ax.set_title(f"First to the target on {base} (modeled time)\n"
                         f"target: {target}; xN: the runner-up's time over the winner's", fontsize=9)
            self.save(fig, f"crossover_{re.sub(r'[^A-Za-z0-9_.-]', '_', base)}.png")

    def consensus_plot(self) -> None:
        fig = self.figure()
        ax = fig.add_subplot()
        zero, drawn = [], 0
        for i, job in enumerate(self.ok):
            pts = curve(job.records, "step", "consensus_distance")
            positive = [(s, c) for s, c in pts if c > 0]
            if not positive:
                if pts:
                    zero.append(job_label(job, self.swept))
                continue
            ax.plot(*zip(*positive), marker=".", ms=3, lw=1.2, ls=["-", "--", "-.", ":"][i % 4],
                    color=self.colors.get(series_label(job, self.swept)), label=job_label(job, self.swept))
            drawn += 1
        if not drawn:
            self.notes.append("No consensus plot: " + (
                "every completed job kept identical models (consensus distance 0 at every logged step)."
                if zero else "no completed job logged consensus_distance."))
            return
        self.log_axes(ax, yscale="log", xlabel="step", ylabel="consensus distance: mean ‖x_i − x̄‖² over ranks",
                      title="Consensus distance vs step (log scale)")
        note = ""
        if zero:
            note = "Not drawn (zero at every logged step: all ranks hold the same model): " + "; ".join(zero[:4])
            note += " ..." if len(zero) > 4 else ""
        self.footnote(fig, note)
        self.save(fig, "consensus_distance.png")


    # What the bytes plots draw against the bytes sent: (axis label, title, log y axis).
    BYTES_PLOTS = {
        "accuracy": ("held-out accuracy (fraction, mean over ranks)", "Accuracy", False),
        # A language model's (dataset=text): exp of the held-out mean token cross-entropy, lower is better.
        "perplexity": ("held-out perplexity (mean over ranks' losses, log scale)", "Perplexity", True),
    }

    def bytes_plot(self, key: str = "accuracy") -> None:
        """Held-out accuracy (or a language model's perplexity) against the bytes each rank has sent
        (metrics.jsonl's bytes_sent, log scale): what a compressed or less frequent exchange buys for what
        it sends. ``<key>_vs_bytes.png``."""
        ylabel, what, log_y = self.BYTES_PLOTS[key]
        fig = self.figure()
        ax = fig.add_subplot()
        silent, drawn = [], 0
        for i, job in enumerate(self.ok):
            pts = [(b, a) for b, a in curve(job.records, "bytes_sent", key) if b > 0]
            if not pts:
                if curve(job.records, "bytes_sent", key):
                    silent.append(job_label(job, self.swept))  # one rank: nothing to send
                continue
            color = self.colors.get(series_label(job, self.swept))
            ax.plot(*zip(*pts), marker=".", ms=3, lw=1.2, ls=["-", "--", "-.", ":"][i % 4], color=color,
                    label=job_label(job, self.swept))
            ax.plot(*pts[-1], marker="o", ms=6, color=color)  # where the run ended
            drawn += 1
        if not drawn:
            if key == "accuracy":
                self.notes.append("No accuracy-vs-bytes plot: no completed job logged bytes_sent above 0.")
            return
        self.log_axes(ax, xscale="log", xlabel="bytes sent per rank (cumulative, compressed as sent)",
                      ylabel=ylabel, title=f"{what} vs bytes sent (log scale); a dot marks each run's end")
        if log_y:
            ax.set_yscale("log")
        self.footnote(fig, "Not drawn (sent nothing): " + "; ".join(silent[:4]) if silent else "")
        self.save(fig, f"{key}_vs_bytes.png")


def draw_plots(out: Path, jobs: list[Job], swept: list[str],
               crossovers: list[dict] | None = None) -> tuple[list[Path], list[str]]:
    """Every plot the jobs allow; returns the files written and notes on what was not drawn."""
    plotter = Plotter(out, jobs, swept)
    if not plotter.ok:
        return [], ["No plots: no job completed."]
    plotter.scaling_plots()
    plotter.training_plots()
    if crossovers:
        plotter.crossover_plots(crossovers)
    plotter.modeled_plots(variants=not crossovers)  # a crossover's bandwidths: its heatmap, not a figure each
    plotter.consensus_plot()
    plotter.bytes_plot()
    plotter.bytes_plot("perplexity")  # drawn where some job logged a perplexity (a language model's)
    if plotter.left_out:
        plotter.notes.append(f"{len(plotter.left_out)} failed or diverged job(s) are in the table but not in the plots.")
    return plotter.written, plotter.notes


# ------------------------------------------------------------------ crossovers
CROSSOVER_NAME = "crossover.csv"


def method_label(row: dict, swept: list[str]) -> str:
    """A job's method in a crossover (its table row): its swept values but ranks (a lone key's value without its
    name)."""
    parts = [(k, row.get(k)) for k in swept if k not in NOT_A_SERIES]
    if len(parts) == 1:
        return str(parts[0][1])
    return ", ".join(f"{k}={v}" for k, v in parts) or f"{row.get('algorithm', '?')} on {row.get('topology', '?')}"


def crossover_table(jobs: list[Job], table: Table, labels: list[str]) -> list[dict]:
    """One cell per cluster label ``<cluster>:<b>Gbit/s`` and rank count: each completed job's modeled time to its
    target accuracy there (its table row's, from time_to_targets: the config's target_accuracy, else the
    allreduce job's final), the first to reach it and the runner-up's time over its (the margin)."""
    cells = []
    # (the job's ranks, its row): a row holds the swept text of ranks where ranks were swept
    ok = [(job.summary["ranks"], row) for job, row in zip(jobs, table.rows)
          if job.ok and isinstance(job.summary.get("ranks"), int)]
    for label in labels:
        base, _, rate = label.rpartition(":")
        if not rate.endswith("Gbit/s"):
            continue
        for ranks in sorted({n for n, _ in ok}):
            mine = [row for n, row in ok if n == ranks]
            times = {method_label(r, table.swept): r.get(f"time_to_target_accuracy_s@{label}") for r in mine}
            target = next((r["target_accuracy"] for r in reversed(mine) if r.get("target_accuracy") is not None), None)
            done = sorted((t, m) for m, t in times.items() if _finite(t))
            cells.append({"cluster": base, "bandwidth_gbit_per_s": float(rate[:-len("Gbit/s")]), "ranks": ranks,
                          "target": target, "times": times, "winner": done[0][1] if done else None,
                          "time_s": done[0][0] if done else None,
                          "runner_up": done[1][1] if len(done) > 1 else None,
                          "margin": done[1][0] / done[0][0] if len(done) > 1 and done[0][0] > 0 else None})
    return cells


def crossover_csv(cells: list[dict]) -> str:
    """crossover.csv: a row per cell, the winner, the margin, and every method's modeled time to the target."""
    methods = sorted({m for c in cells for m in c["times"]})
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["cluster", "bandwidth_gbit_per_s", "ranks", "target_accuracy", "first", "time_to_target_s",
                     "runner_up", "runner_up_time_over_first", *[f"time_to_target_s[{m}]" for m in methods]])
    for c in cells:
        writer.writerow([c["cluster"], f"{c['bandwidth_gbit_per_s']:g}", c["ranks"], fmt(c["target"]),
                         c["winner"] or "", fmt(c["time_s"]), c["runner_up"] or "", fmt(c["margin"]),
                         *[fmt(c["times"].get(m)) for m in methods]])
    return buf.getvalue()


# ------------------------------------------------------------------ the report
@dataclass
class Report:
    root: Path
    out: Path
    jobs: list[Job]
    table: Table
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)



def refused_points(root: Path) -> list[tuple[list[str], str]]:
    """The points a sweep with skip_invalid=true did not run, with the reason each was refused
    (results.REFUSED in the sweep folder; none for a sweep that refused nothing)."""
    listed = (results.read_json(root / results.REFUSED) or {}).get("refused", [])
    return [([str(o) for o in p.get("overrides", [])], str(p.get("reason", ""))) for p in listed if isinstance(p, dict)]


def write_report(root: str | os.PathLike, out: str | os.PathLike | None = None, plots: bool = True,
                 clusters: Iterable[str] = (), bandwidths_gbit_per_s: Iterable[float] = ()) -> Report:
    """Collect every job under root and write report.csv, report.md and plots into out (default: root).
    ``clusters``: shipped scaling configs to price every job's recorded steps on (modeled_times), each at
    every one of ``bandwidths_gbit_per_s`` where given (priced_clusters: then also crossover.csv and
    crossover_<cluster>.png, which method reaches the target first at each bandwidth and rank count)."""
    root = Path(root)
    if not root.is_dir():
        raise NoJobsError(f"{root} is not a folder")
    nodes = priced_clusters(clusters, bandwidths_gbit_per_s)  # a bad name: before any job is read
    jobs = collect(root)
    if not jobs:
        raise NoJobsError(f"no jobs under {root} (a job folder has summary.json or .hydra/overrides.yaml)")
    for name, node in nodes.items():
        for job in jobs:
            times = modeled_times(job, node) if job.ok else None
            if times is not None:
                job.modeled[name] = times
    out_dir = Path(out) if out is not None else root
    out_dir.mkdir(parents=True, exist_ok=True)
    table = build_table(jobs)
    crossovers = crossover_table(jobs, table, list(nodes)) if list(bandwidths_gbit_per_s) else []
    pngs, notes = draw_plots(out_dir, jobs, table.swept, crossovers) if plots else ([], [])
    if crossovers:
        results.write_text_atomic(out_dir / CROSSOVER_NAME, crossover_csv(crossovers))
        notes = [f"Which method reaches the target first at each bandwidth and rank count: {CROSSOVER_NAME}.", *notes]
    results.write_text_atomic(out_dir / CSV_NAME, to_csv(table))
    results.write_text_atomic(out_dir / MD_NAME, to_markdown(root, jobs, table, pngs, notes))
    extra = [out_dir / CROSSOVER_NAME] if crossovers else []
    return Report(root, out_dir, jobs, table, [out_dir / CSV_NAME, out_dir / MD_NAME, *pngs, *extra], notes)


def print_report(report: Report) -> None:
    from bfexp.progress import console

    from rich.console import Console

    n = len(report.jobs)
    table = render_table(report.table, f"{report.root}: {n} job{'s' if n != 1 else ''}")
    # A terminal fits the table to its width; a pipe or log file (80 columns by default)
    # gets it at full width rather than squeezed into unreadable fragments.
    if console.is_terminal:
        console.print(table)
    else:
        probe = Console(file=io.StringIO(), width=1000)
        probe.print(table)
        width = max(len(line.rstrip()) for line in probe.file.getvalue().splitlines())
        Console(file=console.file, width=max(console.width, width)).print(table)
    numbered = all(job.number is not None for job in report.jobs)
    for job in report.jobs:
        if job.summary.get("error"):
            name = job.number if numbered else job.name
            console.print(f"{name} ({job.status}): {job.summary['error']}", highlight=False, soft_wrap=True)
    for overrides, reason in refused_points(report.root):
        console.print(f"refused, not run (skip_invalid=true): {' '.join(overrides)}: {reason}", highlight=False,
                      soft_wrap=True)
    for note in report.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    pngs = sum(1 for path in report.files if path.suffix == ".png")
    console.print(f"report: {report.out / MD_NAME} ({pngs} plots, {CSV_NAME})", highlight=False, soft_wrap=True)


class MultirunReport(Callback):
    """Hydra callback: at the end of a sweep, print the table and write the report into the sweep folder.
    ``clusters`` and ``bandwidths_gbit_per_s``: as ``bfexp-report --cluster ... --bandwidths ...`` (a study's
    YAML sets them under hydra.callbacks.report)."""

    def __init__(self, clusters: Iterable[str] = (), bandwidths_gbit_per_s: Iterable[float] = ()) -> None:
        self.clusters = [str(c) for c in clusters]
        self.bandwidths = [float(b) for b in bandwidths_gbit_per_s]

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if not config.get("report", True):
            return
        try:
            report = write_report(Path(config.hydra.sweep.dir), clusters=self.clusters,
                                  bandwidths_gbit_per_s=self.bandwidths)
        except Exception as e:  # the jobs' results stand; a report problem must not hide them
            print(f"bfexp: warning: sweep report not written: {e}", file=sys.stderr)
            return
        print_report(report)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="bfexp-report",
        description="Turn a bfexp run or sweep folder into report.csv, report.md and PNG plots.",
    )
    parser.add_argument("folder", help="a multirun folder (multirun/<date>/<time>), a run folder, or any folder of them")
    parser.add_argument("--out", help="where to write the report (default: the folder itself)")
    parser.add_argument("--no-plots", action="store_true", help="only the table: report.csv and report.md")
    parser.add_argument("--cluster", default="", metavar="NAME[,NAME...]",
                        help="price every job's recorded steps on these shipped clusters (scaling=NAME) without "
                             "rerunning: modeled time, time to target and speedup at the target, and plots")
    parser.add_argument("--bandwidths", default="", metavar="GBIT[,GBIT...]",
                        help="with --cluster: price on each cluster at each of these bandwidths between machines "
                             "(Gbit/s), and draw which method reaches the target first at each (crossover_*.png)")
    args = parser.parse_args(argv)
    try:
        bandwidths = [float(b) for b in args.bandwidths.split(",") if b.strip()]
    except ValueError:
        print(f"bfexp-report: error: --bandwidths {args.bandwidths}; allowed: numbers of Gbit/s separated by "
              "commas, e.g. 1,10,100", file=sys.stderr)
        sys.exit(2)
    if bandwidths and not args.cluster:
        print("bfexp-report: error: --bandwidths without --cluster; allowed: --cluster NAME --bandwidths "
              "GBIT[,GBIT...]", file=sys.stderr)
        sys.exit(2)
    try:
        report = write_report(args.folder, args.out, plots=not args.no_plots,
                              clusters=[c.strip() for c in args.cluster.split(",") if c.strip()],
                              bandwidths_gbit_per_s=bandwidths)
    except ConfigError as e:  # no jobs there, a damaged file of the sweep's own
        print(f"bfexp-report: error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # --out: read-only, a file, a full disk
        where = e.filename or args.out or args.folder
        print(f"bfexp-report: error: cannot write the report to {where}: {e.strerror or e}; allowed: --out "
              "a folder this user can write", file=sys.stderr)
        sys.exit(2)
    print_report(report)


if __name__ == "__main__":
    main()
