"""Every conf/topology option names its class by `_target_`, states its defaults, composes
through Hydra and builds on a few ranks through build_topology. A mandatory key (``???``,
the file option's path) is given a real file here."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_module
from hydra.utils import get_class
from omegaconf import OmegaConf

from bfexp.config import register_configs
from bfexp.topology import CustomTopology, Exp2, Topology, WeightScheme, Weights, build_topology

CONF = Path(__file__).resolve().parents[2] / "conf" / "topology"
OPTIONS = sorted(p.stem for p in CONF.glob("*.yaml"))
RUNTIME = ("size", "ranks_per_machine")  # passed by the run, never set in a YAML


@pytest.mark.parametrize("name", OPTIONS)
def test_option_names_its_class_with_its_defaults(name):
    node = OmegaConf.load(CONF / f"{name}.yaml")
    cls = get_class(node._target_)
    assert issubclass(cls, Topology) and cls.name == name
    assert node._target_ == f"bfexp.topology.{cls.__name__}"
    assert "name" not in node and "defaults" not in node
    # The constructor is the schema: every option keyword-only, annotated, defaulted, and stated in the YAML.
    params = {k: p for k, p in inspect.signature(cls).parameters.items() if k not in RUNTIME}
    hints = typing.get_type_hints(cls.__init__)
    assert set(node) - {"_target_"} == set(params)
    for key, p in params.items():
        assert p.kind is p.KEYWORD_ONLY and key in hints, key
        # a keyword without a default is the user's to give: Hydra's mandatory ??? in the YAML
        assert OmegaConf.is_missing(node, key) if p.default is p.empty else node[key] == p.default, key
    # a user's own graph may also bring its own weights ("given"); Base-(k+1) graphs' weights are
    # their construction (exact finite-time averaging), so they take none (tests/topology/test_base_graph.py)
    if "weights" in params:
        assert hints["weights"] == (Weights if issubclass(cls, CustomTopology) else WeightScheme)


@pytest.fixture(scope="module")
def composer():
    register_configs()
    with initialize_config_module(config_module="bfexp.conf", version_base=None):
        yield lambda overrides: compose("config", overrides=overrides)


@pytest.mark.parametrize("name", OPTIONS)
def test_option_composes_and_builds(composer, name, tmp_path):
    np.save(tmp_path / "w.npy", Exp2(8).mixing_matrix())
    given = {"file": [f"topology.path={tmp_path / 'w.npy'}", "topology.direction=in"]}
    cfg = composer([f"topology={name}", "ranks=8", "engine.ranks_per_machine=4", *given.get(name, [])])
    assert get_class(cfg.topology._target_).name == name
    topo = build_topology(cfg.topology, cfg.ranks, cfg.engine.ranks_per_machine)
    assert topo.name == name
    assert topo.size == 8
    assert topo.is_strongly_connected()
    assert topo.is_row_stochastic() or topo.is_column_stochastic()
