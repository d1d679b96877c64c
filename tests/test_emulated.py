"""launcher=emulated and scaling=emulated without the cluster: the link arithmetic, the composed scaling config
(the launcher's rate and quota reach the cost model), the one-line refusals, the mpirun command it spells.
The measured side (jobs on the emulated cluster, measured against modeled) is tests/test_bandwidth_study.py."""

from __future__ import annotations

import pytest

from bfexp.launchers import Emulated
from bfexp.launchers.emulated import link_rate_bits, tcp_goodput_gbyte_per_s
from tests.cli_in_process import call


@pytest.mark.parametrize("rate, bits", [("1gbit", 1e9), ("200mbit", 2e8), ("2.5gbit", 2.5e9), ("64kbit", 64e3)])
def test_link_rates_read_as_tc_writes_them(rate, bits):
    assert link_rate_bits(rate) == bits


def test_tcp_moves_1448_payload_bytes_of_each_1514_byte_frame():
    # 1 Gbit/s = 125 MB/s of frames; TCP's share at MTU 1500 with timestamps: 1448 / 1514
    assert tcp_goodput_gbyte_per_s("1gbit") == pytest.approx(0.125 * 1448 / 1514, rel=1e-12)
    assert tcp_goodput_gbyte_per_s("none") == float("inf")


def test_the_scaling_config_prices_the_launchers_link_and_quota():
    from hydra import compose, initialize_config_module

    from bfexp import scaling
    from bfexp.config import register_configs

    register_configs()
    with initialize_config_module(config_module="bfexp.conf", version_base=None):
        cfg = compose(config_name="config", overrides=["launcher=emulated", "scaling=emulated",
                                                       "launcher.link_rate=200mbit", "launcher.cpu=0.25"])
    cluster = scaling.cluster(cfg.scaling)
    assert cluster.inter.bandwidth_bytes_per_s == pytest.approx(2e8 / 8 * 1448 / 1514)
    assert cluster.cores == 0.25 and cluster.contention(4) == 4.0  # one rank on a quarter of a core
    assert cluster.ranks_per_machine == 1 and cluster.local_size(4) == 1
    assert cluster.stack_bytes_per_s == pytest.approx(float(cfg.scaling.inter_stack_gbyte_per_s) * 1e9)
    switch = float(cfg.scaling.switch_gbyte_per_s)  # the hosts' one kernel forwards all their traffic; 0: it keeps up
    assert cluster.switch_bytes_per_s == (pytest.approx(switch * 1e9) if switch else float("inf"))
    # the other clusters' switches keep up with every link
    with initialize_config_module(config_module="bfexp.conf", version_base=None):
        real = scaling.cluster(compose(config_name="config", overrides=["scaling=h100_cluster"]).scaling)
    assert real.switch_bytes_per_s == float("inf")


@pytest.mark.parametrize("overrides, words", [
    (["launcher=emulated", "launcher.link_rate=fast"], ["launcher.link_rate=fast", "200mbit"]),
    (["launcher=emulated", "launcher.cpu=0"], ["launcher.cpu=0", "allowed"]),
    (["launcher=emulated", "launcher.allreduce_algorithm=tree"], ["launcher.allreduce_algorithm=tree", "ring"]),
    (["launcher=emulated", "launcher.wait=busy"], ["launcher.wait=busy", "sleep, yield, spin"]),
    (["scaling=emulated"], ["scaling=emulated with launcher=local", "launcher=emulated"]),
])
def test_bad_settings_are_one_line(overrides, words):
    got = call([*overrides, "engine=mpi"])
    assert got["code"] == 2, got
    line = got["stderr"].strip()
    assert "\n" not in line and all(w in line for w in words), line


def test_the_command_starts_mpirun_on_the_first_host_with_the_allreduce_pinned(monkeypatch, tmp_path):
    import bfexp.launchers.emulated as emulated

    monkeypatch.setattr(emulated, "STATE", tmp_path)
    (tmp_path / "hosts").write_text("hostA\nhostB\nhostC\n")
    (tmp_path / "tool").write_text("/opt/cluster_local.sh\n")
    launcher = Emulated(link_rate="500mbit", cpu=0.5, allreduce_algorithm="segmented_ring")
    argv = launcher.command(2, ["python", "-m", "bfexp.worker"])
    assert argv[:3] == ["/opt/cluster_local.sh", "exec", "hostA"]  # this machine is none of the hosts
    assert "hostA:1,hostB:1" in argv and argv[-3:] == ["python", "-m", "bfexp.worker"]
    pinned = argv.index("coll_tuned_allreduce_algorithm")
    assert argv[pinned + 1] == "5" and "btl_tcp_if_include" in argv and "clu0" in argv
    assert launcher.hosts(2) == [("hostA", 1), ("hostB", 1)] and launcher.threads_per_rank(2) == 1
    assert launcher.cpu_quotas(3) == {"hostA": 0.5, "hostB": 0.5, "hostC": 0.5}
    mca = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv[:-2]) if a == "--mca"}
    # by default a waiting rank sleeps 20 us between polls (launcher.wait=sleep)
    assert mca["mpi_yield_when_idle"] == "1" and mca["threads_pthreads_yield_strategy"] == "nanosleep"
    assert mca["threads_pthreads_nanosleep_time"] == "20000"
    # large messages go as fragments of sends, without TCP's emulated put
    assert mca["btl_tcp_flags"] == "send,inplace,need-ack,need-csum"


@pytest.mark.parametrize("wait, expected", [
    ("spin", {}),
    ("yield", {"mpi_yield_when_idle": "1"}),
    ("sleep", {"mpi_yield_when_idle": "1", "threads_pthreads_yield_strategy": "nanosleep",
               "threads_pthreads_nanosleep_time": "20000"}),
])
def test_each_wait_reaches_mpirun_as_open_mpis_parameters(monkeypatch, tmp_path, wait, expected):
    import bfexp.launchers.emulated as emulated

    monkeypatch.setattr(emulated, "STATE", tmp_path)
    (tmp_path / "hosts").write_text("hostA\nhostB\n")
    (tmp_path / "tool").write_text("/opt/cluster_local.sh\n")
    argv = Emulated(wait=wait).command(2, ["python"])
    mca = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv[:-2]) if a == "--mca"}
    assert {k: v for k, v in mca.items() if "yield" in k or "nanosleep" in k} == expected
    assert Emulated(wait=wait).facts(2)["emulated_cluster"]["wait"] == wait


def test_a_cluster_that_is_not_up_is_refused_before_any_rank(monkeypatch, tmp_path):
    import bfexp.launchers.emulated as emulated

    monkeypatch.setattr(emulated, "STATE", tmp_path / "none")
    got = call(["launcher=emulated", "engine=mpi", "ranks=2", f"hydra.run.dir={tmp_path / 'run'}"])
    assert got["code"] == 3, got
    assert "the emulated cluster is not up" in got["stderr"] and "cluster_local.sh up" in got["stderr"]
    assert not (tmp_path / "run" / "logs").exists()
