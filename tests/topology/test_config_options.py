"""Every conf/topology option composes through Hydra and builds on a few ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from bfexp.config import SCHEMAS, register_configs
from bfexp.topology import TOPOLOGIES, build_topology

CONF = Path(__file__).resolve().parents[2] / "conf" / "topology"
OPTIONS = sorted(p.stem for p in CONF.glob("*.yaml"))


def test_options_schemas_and_classes_agree():
    assert set(OPTIONS) == set(SCHEMAS["topology"]) == set(TOPOLOGIES)


@pytest.fixture(scope="module")
def composer():
    register_configs()
    with initialize_config_module(config_module="bfexp.conf", version_base=None):
        yield lambda overrides: compose("config", overrides=overrides)


@pytest.mark.parametrize("name", OPTIONS)
def test_option_composes_and_builds(composer, name):
    cfg = composer([f"topology={name}", "ranks=8", "engine.ranks_per_machine=4"])
    assert cfg.topology.name == name
    topo = build_topology(cfg.topology, cfg.ranks, cfg.engine.ranks_per_machine)
    assert topo.size == 8
    assert topo.is_strongly_connected()
    assert topo.is_row_stochastic() or topo.is_column_stochastic()
