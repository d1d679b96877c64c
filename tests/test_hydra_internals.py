"""bfexp.hydra_internals: Hydra still asks ``Hydra.get_mode`` before it runs a command line, and the mode
read from the command line is the one Hydra's own composition finds, for every command line where it
answers (bfexp's configuration, every experiment of it, ``hydra.mode`` overrides), and it leaves the rest
to Hydra (another configuration searched, a ``hydra/`` group chosen). A sweep composes each point once, and
what each caller gets is what a fresh composition gives."""

from __future__ import annotations

import contextlib
import inspect
import json

import pytest
from hydra import initialize_config_module
from hydra._internal import utils as hydra_utils
from hydra._internal.hydra import Hydra
from hydra.core.global_hydra import GlobalHydra

from bfexp.cli import group_options
from bfexp.config import register_configs
from bfexp.hydra_internals import known_mode, mode_from_arguments, sweep_points_composed_once
from tests.cli_in_process import call, compose_only, ran

ANSWERED = [[], ["lr=0.1", "steps=1,2"], ["hydra.mode=MULTIRUN"], ["hydra.mode=RUN", "seed=3"],
            ["hydra.mode=MULTIRUN", "hydra.mode=RUN"], ["hydra.mode=null"], ["hydra.run.dir=x"]]
ANSWERED += [[f"+experiment={name}"] for name in group_options("experiment")]
LEFT = [["-cd", "myconf"], ["--config-dir=myconf", "seed=1"], ["-cn", "other"], ["--config-name", "x"],
        ["-cp", "pkg://x"], ["hydra/launcher=slurm"], ["hydra.mode=SOMETIMES"]]


@pytest.fixture
def composed_mode():
    """Hydra's own answer: the configuration composed as ``hydra.main`` composes it for ``get_mode``."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="bfexp.conf", version_base=None):
        hydra = GlobalHydra.instance().hydra
        yield lambda overrides: Hydra.get_mode(hydra, "config", overrides)
    GlobalHydra.instance().clear()


def test_hydra_main_still_asks_get_mode_before_it_runs():
    """``_run_hydra`` is where Hydra composes for the mode; were the call gone, known_mode would do nothing."""
    assert "get_mode" in vars(Hydra), "hydra._internal.hydra.Hydra.get_mode is gone"
    assert list(inspect.signature(Hydra.get_mode).parameters) == ["self", "config_name", "overrides"]
    assert "hydra.get_mode(config_name=config_name, overrides=overrides)" in inspect.getsource(hydra_utils._run_hydra)


@pytest.mark.parametrize("args", ANSWERED, ids=[" ".join(a) or "none" for a in ANSWERED])
def test_the_mode_read_from_the_command_line_is_the_composed_one(composed_mode, args):
    decided, mode = mode_from_arguments(args)
    assert decided
    assert mode == composed_mode(args)


@pytest.mark.parametrize("args", LEFT, ids=[" ".join(a) for a in LEFT])
def test_command_lines_whose_mode_a_file_may_set_are_left_to_hydra(args):
    assert mode_from_arguments(args) == (False, None)
    original = Hydra.get_mode
    with known_mode(args):
        assert Hydra.get_mode is original
    assert Hydra.get_mode is original


def test_hydra_mode_multirun_on_the_command_line_still_sweeps(tmp_path, monkeypatch):
    """``hydra.mode=MULTIRUN`` without ``-m`` sweeps as Hydra's docs say, and a refused point of it exits 2
    naming the point (the sweep's check ran: the mode was known)."""
    monkeypatch.chdir(tmp_path)
    got = call(["hydra.mode=MULTIRUN", "lr=0.1,-1", "steps=1"])
    assert got["code"] == 2 and "sweep point lr=-1" in got["stderr"], got
    assert got["escaped"] is None


def test_a_sweep_composes_each_point_once_and_each_caller_gets_a_fresh_copy(tmp_path, monkeypatch):
    """Three points: the sweeper's check, bfexp's check of every point and the launcher each asked for each
    point (nine compositions); now three, and each job's config is the one a fresh composition gives."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    monkeypatch.chdir(tmp_path)
    composing, counted = ConfigLoaderImpl.load_configuration, []

    def load_configuration(self, config_name, overrides, run_mode, from_shell=True, validate_sweep_overrides=True):
        counted.append(list(overrides))
        return composing(self, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", load_configuration)
    import bfexp.cli as cli
    import bfexp.launchers.slurm_sweep as slurm_sweep

    for module, name in ((cli, "run_job"), (cli, "check_sweep"), (slurm_sweep, "launch")):
        monkeypatch.setattr(module, name, getattr(module, name))  # compose_only replaces them: back after the test
    jobs = compose_only()
    monkeypatch.setattr("bfexp.report.MultirunReport.on_multirun_end", lambda self, config, **kwargs: None)
    got = call(["-m", "ranks=2,3,4", "lr=0.05"])
    ran(got)
    points = [c for c in counted if any(o.startswith("ranks=") and "," not in o for o in c)]
    assert sorted(points) == [["hydra.mode=MULTIRUN", f"ranks={n}", "lr=0.05"] for n in (2, 3, 4)], counted
    assert [j["config"]["ranks"] for j in jobs] == [2, 3, 4]

    # Each job's config against a fresh composition of its point (no memo): equal.
    monkeypatch.setattr("bfexp.hydra_internals.sweep_points_composed_once", _nothing)
    got = call(["-m", "ranks=2,3,4", "lr=0.05"])
    assert got["code"] == 0, got
    fresh = jobs[3:]
    assert len(fresh) == 3
    for once, again in zip(jobs[:3], fresh):
        assert json.dumps(once["config"], sort_keys=True) == json.dumps(again["config"], sort_keys=True)
        assert once["task"] == again["task"] and once["choices"] == again["choices"]


def test_each_caller_owns_its_copy_of_a_point():
    """The launcher writes the job's number into the config it gets: a later caller sees none of it."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from omegaconf import OmegaConf

    calls = []

    def compose(self, master, overrides):
        calls.append(overrides)
        return OmegaConf.create({"point": list(overrides), "hydra": {"job": {"num": 0}}})

    original = ConfigLoaderImpl.load_sweep_config
    ConfigLoaderImpl.load_sweep_config = compose
    try:
        master = OmegaConf.create({})
        with sweep_points_composed_once():
            first = ConfigLoaderImpl.load_sweep_config(None, master, ["a=1"])
            first.hydra.job.num = 7
            second = ConfigLoaderImpl.load_sweep_config(None, master, ["a=1"])
            other = ConfigLoaderImpl.load_sweep_config(None, OmegaConf.create({}), ["a=1"])
        assert second.hydra.job.num == 0 and second is not first
        assert calls == [["a=1"], ["a=1"]]  # the same point of another sweep is composed again
        assert other.point == ["a=1"]
        assert ConfigLoaderImpl.load_sweep_config is compose  # restored on leaving
    finally:
        ConfigLoaderImpl.load_sweep_config = original


@contextlib.contextmanager
def _nothing():
    yield
