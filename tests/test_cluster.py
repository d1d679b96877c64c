"""Beyond one machine (issue 14), without Slurm: the mpirun launcher over a hostfile, its
preflight refusals, the Slurm arithmetic, and machines detected from where ranks run.

Real other hosts are not available here, so the machine-detection test stands in for
them at the one point that needs them: the split of the world communicator by machine
(MPI's shared-memory split) is replaced by a split of two or three consecutive ranks,
as a hostfile of that many slots a line would give. Everything after the split is the
engine's own code, compared with today's emulation (engine.ranks_per_machine) and with
numpy references.
"""

from __future__ import annotations

import json
import shutil
import socket

import numpy as np
import pytest

from tests.mpi_helpers import run_ranks


def one_line_refusal(proc, *words: str, code: int = 2) -> str:
    """One line on stderr and the exit code of whose fault it is: 2 bad input, 3 this machine or cluster."""
    assert proc.returncode == code, proc.stderr + proc.stdout[-1500:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bfexp: error:"), proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------ Slurm arithmetic


@pytest.mark.parametrize("ranks, per_node, nodes, tasks", [
    (8, 8, 1, 8), (16, 8, 2, 8), (12, 8, 2, 8), (32, 8, 4, 8), (4, 8, 1, 4), (5, 0, 1, 5), (1, 1, 1, 1),
])
def test_slurm_nodes_are_ceil_of_ranks_over_ranks_per_node(ranks, per_node, nodes, tasks):
    from bfexp.launchers.srun import nodes_for, tasks_per_node

    assert nodes_for(ranks, per_node) == nodes
    assert tasks_per_node(ranks, per_node) == tasks


def test_slurm_preset_resolves_nodes_per_sweep_point():
    """hydra/launcher=slurm composes, and its nodes/tasks follow each point's ranks (a resolver)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from bfexp.config import register_configs
    from bfexp.launchers.slurm_sweep import job_parameters
    from hydra_plugins.bfexp_slurm_launcher.launcher import register_plugin

    register_configs()
    register_plugin()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="bfexp.conf", version_base=None):
        for ranks, per_node, nodes, tasks in ((12, 8, 2, 8), (32, 8, 4, 8), (4, 0, 1, 4)):
            cfg = compose("config", overrides=["hydra/launcher=slurm", f"ranks={ranks}", "launcher=srun",
                                               f"launcher.ranks_per_node={per_node}"], return_hydra_config=True)
            launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
            assert (launcher["nodes"], launcher["tasks_per_node"]) == (nodes, tasks)
            assert launcher["_target_"].startswith("hydra_plugins.")
            params = job_parameters(launcher)
            # sbatch gets the allocation; submitit counts one task (the job function runs once).
            assert params["slurm_additional_parameters"]["nodes"] == nodes
            assert params["slurm_additional_parameters"]["ntasks_per_node"] == tasks
            assert (params["nodes"], params["tasks_per_node"], params["slurm_use_srun"]) == (1, 1, False)
    GlobalHydra.instance().clear()


# ------------------------------------------------------------------ mpirun over a hostfile


def test_mpirun_with_a_hostfile_naming_this_machine_runs(bfexp):
    hostfile = bfexp.cwd / "hosts.txt"
    hostfile.write_text(f"# this machine, two slots\n{socket.gethostname()} slots=2\n")
    proc = bfexp("launcher=mpirun", f"launcher.hostfile={hostfile}", "launcher.network_interface=lo", "ranks=2",
                 "engine=mpi", "steps=10", "log_every=5", "baseline_steps=0", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    summary = json.loads((bfexp.cwd / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    # The layout is read from where the ranks ran: both on this one machine.
    assert (summary["run_machines"], summary["run_ranks_per_machine"], summary["machine_layout"]) == (1, 2, "detected")


def test_mpirun_with_hosts_spelling_runs(bfexp):
    proc = bfexp("launcher=mpirun", "launcher.hosts=localhost:2", "ranks=2", "engine=mpi", "steps=5", "log_every=5",
                 "baseline_steps=0", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    assert json.loads((bfexp.cwd / "run" / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("hostfile, extra, words, code", [
    # TEST-NET-1 (RFC 5737): resolves as an address, belongs to no machine, answers no ssh.
    ("192.0.2.1 slots=4\n", [], ["host 192.0.2.1 is not reachable over ssh", "allowed"], 3),
    ("no-such-host.invalid slots=4\n", [], ["host no-such-host.invalid does not resolve", "allowed"], 3),
    ("{host} slots=2\n", ["ranks=3"], ["ranks=3 exceed the 2 slots", "allowed: ranks <= 2"], 2),
    ("{host} slots=2\n", ["launcher.network_interface=nosuch0"], ["launcher.network_interface=nosuch0", "lo"], 2),
    ("{host} slots=zero\n", [], ["slots=zero", "allowed"], 2),
    # two machines, 2 and 1 ranks: the engine numbers machines by rank // ranks per machine
    ("{host} slots=2\nlocalhost slots=1\n", ["ranks=3"], ["land on machines unequally", "allowed"], 2),
])
def test_mpirun_preflight_refuses_in_one_line(bfexp, hostfile, extra, words, code):
    path = bfexp.cwd / "hosts.txt"
    path.write_text(hostfile.format(host=socket.gethostname()))
    proc = bfexp("launcher=mpirun", f"launcher.hostfile={path}", "engine=mpi", "ranks=2", *extra, "hydra.run.dir=run",
                 timeout=120)
    one_line_refusal(proc, *words, code=code)
    assert not (bfexp.cwd / "run" / "logs").exists(), "no rank may start on bad input"


@pytest.mark.parametrize("overrides, words", [
    (["launcher=mpirun"], ["launcher=mpirun needs machines", "launcher.hosts="]),
    (["launcher=mpirun", "launcher.hosts=a:2", "launcher.hostfile=h"], ["one of the two"]),
    (["launcher=mpirun", "launcher.hosts=a:x"], ["launcher.hosts=a:x", "host:slots"]),
    (["launcher=mpirun", "launcher.hosts=a:2,b:2"], ["launcher.hosts=a:2,b:2 is ambiguous", "launcher.hosts=[a:2,b:2]"]),
    (["launcher=srun", "launcher.ranks_per_node=-1"], ["launcher.ranks_per_node=-1", ">= 0"]),
    (["launcher=ssh"], ["launcher=ssh is not an option", "local, mpirun, srun"]),
])
def test_bad_launcher_settings_are_one_line(bfexp, overrides, words):
    one_line_refusal(bfexp(*overrides, "engine=mpi", "hydra.run.dir=run"), *words)


def test_srun_outside_an_allocation_is_refused(bfexp, monkeypatch):
    for key in ("SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(key, raising=False)
    one_line_refusal(bfexp("launcher=srun", "engine=mpi", "hydra.run.dir=run"), "launcher=srun", code=3)
    assert not (bfexp.cwd / "run" / "logs").exists()


def rank_command(launcher_node: dict, ranks: int = 16) -> list[str]:
    """The worker's command as the driver builds it from a job whose launcher is ``launcher_node``."""
    from omegaconf import OmegaConf

    from bfexp.config import launcher_of
    from bfexp.sessions import launcher_command, worker_command

    cfg = OmegaConf.create({"ranks": ranks, "engine": {"name": "mpi", "mpiexec_args": []}, "launcher": launcher_node})
    return launcher_command(launcher_of(cfg.get("launcher")), cfg.engine, int(cfg.ranks), worker_command("RUN"))


@pytest.mark.skipif(shutil.which("srun") is None, reason="needs Slurm's srun on PATH (.ci/run brings a local Slurm up)")
def test_the_srun_command_spells_what_srun_users_type():
    srun = rank_command({"_target_": "bfexp.launchers.Srun", "ranks_per_node": 8, "network_interface": None,
                         "extra_args": []})
    assert srun[1:6] == ["--mpi=pmix", "--ntasks=16", "--nodes=2", "--ntasks-per-node=8", "--kill-on-bad-exit=1"]


def test_launcher_commands_spell_what_bfrun_users_type():
    """The rank command of each launcher carries the options the README documents."""
    mpirun = rank_command({"_target_": "bfexp.launchers.Mpirun", "hosts": "n1:8,n2:8", "hostfile": None,
                           "network_interface": "eth0", "extra_args": []})
    text = " ".join(mpirun)
    for part in ("-n 16", "--host n1:8,n2:8", "--mca btl_tcp_if_include eth0", "-x NCCL_SOCKET_IFNAME=eth0",
                 "--prtemca oob_tcp_if_include eth0", "-m bfexp.worker RUN"):
        assert part in text, text
    # The list form Hydra reads from launcher.hosts=[n1:8,n2:8] (no quotes) spells the same command.
    listed = rank_command({"_target_": "bfexp.launchers.Mpirun", "hosts": ["n1:8", "n2:8"], "hostfile": None,
                           "network_interface": "eth0", "extra_args": []})
    assert listed == mpirun


def test_mpirun_gives_ranks_on_other_machines_the_local_environment():
    """mpirun sends other machines only what -x names: every variable of the ranks' environment is named, but
    the driver's own machine's and session's; the daemons give up a lost link within the job's timeout_s."""
    from bfexp.launchers import TIMEOUT_VARIABLE, Mpirun
    from bfexp.sessions import launcher_environment

    launcher = Mpirun(hosts="n1:2,n2:2")
    env = {"PATH": "/venv/bin:/usr/bin", "PYTHONPATH": "/src", "BFEXP_RUN_DIR": "/x", "WANDB_MODE": "offline",
           "HOSTNAME": "login1", "PWD": "/home/u", "SSH_AUTH_SOCK": "/tmp/a", "OMPI_MCA_osc": "^ucx",
           "BASH_FUNC_f%%": "() { :; }", "MY_SETTING": "1"}
    args = launcher.forward_environment(env)
    assert args == ["-x", "BFEXP_RUN_DIR", "-x", "MY_SETTING", "-x", "PATH", "-x", "PYTHONPATH", "-x", "WANDB_MODE"]
    ranks_env = launcher_environment(launcher, 4, timeout_s=20)
    assert ranks_env[TIMEOUT_VARIABLE] == "20"
    assert [ranks_env[f"PRTE_MCA_oob_tcp_keepalive_{k}"] for k in ("time", "intvl", "probes")] == ["10", "1", "10"]
    forwarded = launcher.forward_environment(ranks_env)
    for name in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "MALLOC_MMAP_THRESHOLD_", TIMEOUT_VARIABLE):
        assert name in forwarded, forwarded
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in forwarded  # mpirun sends its own


# What Open MPI 5 and Slurm 22.05 wrote when another machine was lost (seen on the emulated cluster), the
# heartbeats' hosts, and the one line the driver makes of them.
LOST = [
    ("PRTE has lost communication with a remote daemon.\n\n  HNP daemon   : [prterun-hostA-24194@0,0] on node hostA\n"
     "  Remote daemon: [prterun-hostA-24194@0,1] on node hostB\n",
     "host hostB (rank 1) lost: its daemon stopped answering"),
    ("A daemon failed to report back after being spawned. This could\nbe due to several factors\n\n"
     "  Local host:    hostA\n  Remote host:   hostB\n  Daemon exit status: 255\n",
     "host hostB (rank 1) lost: its daemon stopped answering"),
    ("An MPI communication peer process has unexpectedly disconnected.\n\n  Local host: hostA\n  Local PID:  23779\n"
     "  Peer host:  hostB\n", "host hostB (rank 1) a rank there ended without a word"),
    # mpirun under load: rank 0 ended on its closed connection to the killed rank 1 before hostB's daemon said
    ("[hostA:00000] *** An error occurred in Socket closed\n[hostA:00000] *** reported by process [4143644673,0]\n"
     "[hostA:00000] *** on a NULL communicator\n[hostA:00000] *** Unknown error\n[hostA:00000] *** "
     "MPI_ERRORS_ARE_FATAL (processes in this communicator will now abort,\n[hostA:00000] ***    and MPI will "
     "try to terminate your MPI job as well)\n", "a rank ended without a word (killed, or its host or link is down) "
     "(rank 0 on hostA lost its connection to it: Socket closed); one of rank 1 on hostB, rank 2 on hostC"),
    ("srun: error: hostB: task 1: Killed\nsrun: launch/slurm: _step_signal: Terminating StepId=3.0\n"
     "srun: error: hostA: task 0: Exited with exit code 14\n", "rank 1 on hostB: killed (srun)"),
    # the same under load: srun heard of the aborted rank first, and of the killed one after ending the step
    ("slurmstepd-hostA: error: *** STEP 4.0 ON hostA CANCELLED AT 2026-11-27T06:22:57 ***\n"
     "srun: Job step aborted: Waiting up to 7 seconds for job step to finish.\n"
     "srun: error: hostA: task 0: Exited with exit code 14\nsrun: launch/slurm: _step_signal: Terminating StepId=4.0\n"
     "srun: error: hostB: task 1: Killed\n", "rank 1 on hostB: killed (srun)"),
    ("srun: Job step aborted: Waiting up to 7 seconds for job step to finish.\n"
     "srun: error: hostA: task 0: Exited with exit code 14\nsrun: launch/slurm: _step_signal: Terminating StepId=4.0\n"
     "srun: error: hostC: task 2: Killed\nsrun: error: Timed out waiting for job step to complete\n",
     "host hostB (rank 1) lost: srun never heard from its tasks again"),
]


def _diagnosis(run_dir, log, hosts):
    """What the driver says of a job whose ranks went down unrecorded: the launcher's word on its log (the
    launcher that prints it: srun's lines through Srun, Open MPI's through Local's, as mpirun's are)."""
    from bfexp.launch import diagnosis
    from bfexp.launchers import Local, Srun

    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "mpiexec.log").write_text(log)
    (run_dir / "heartbeat").mkdir()
    for rank, host in enumerate(hosts):
        (run_dir / "heartbeat" / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "host": host}))
    return diagnosis(run_dir, Srun() if log.startswith(("srun", "slurmstepd")) else Local())


@pytest.mark.parametrize("log, said", LOST)
def test_a_lost_machine_is_named_with_its_ranks(tmp_path, log, said):
    said_here = _diagnosis(tmp_path, log, ["hostA", "hostB", "hostC"])
    assert said_here.startswith(said), said_here


def test_a_rank_killed_on_another_machine_is_named_when_its_peer_is_heard_of_first(tmp_path):
    """Two ranks: the one Open MPI did not report is the one that vanished."""
    assert _diagnosis(tmp_path, LOST[3][0], ["hostA", "hostB"]) == (
        "rank 1 on hostB ended without a word (killed, or its host or link is down) "
        "(rank 0 on hostA lost its connection to it: Socket closed)")


def test_a_failure_on_another_machine_names_it():
    from bfexp.results import describe_errors

    here = socket.gethostname()
    assert describe_errors([{"rank": 4, "host": "hostC", "type": "ValueError", "message": "boom"}]) == \
        "rank 4 on hostC: ValueError: boom"
    assert describe_errors([{"rank": 1, "host": here, "type": "ValueError", "message": "boom"}]) == \
        "rank 1: ValueError: boom"


ORPHAN = """
import sys, time
from bfexp import watchdog

class Call:
    op = "allreduce"

    def where(self, root):
        return "x.py:1"

class Waiting:  # a rank inside a communication call that never returns
    virtual, rank, comm_time_s, activity = False, 3, 1.5, Call()

watchdog.Heartbeat(Waiting(), sys.argv[1], period_s=0.1, timeout_s=0.5)
time.sleep(30)
print("still here")
"""


def test_a_process_rank_waiting_past_its_drivers_timeout_ends_itself(tmp_path):
    """Its driver ended the job timeout_s after the rank stopped moving; a rank still waiting ORPHAN_GRACE_S
    later cannot hear it (another machine cut off) and ends itself, saying why."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", ORPHAN.replace("from bfexp import watchdog",
                                                                "from bfexp import watchdog; watchdog.ORPHAN_GRACE_S = 1.0"),
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 71, proc.stdout + proc.stderr
    assert "rank 3" in proc.stderr and "waited in allreduce" in proc.stderr and "ends itself" in proc.stderr
    assert "still here" not in proc.stdout


# ------------------------------------------------------------------ machines detected from where ranks run

DETECTION = """
import torch
from bfexp.comm.mpi import MPIEngine
from bfexp.errors import CommError
from bfexp.topology import build_topology
from bfexp.worker import layout_ranks_per_machine
from omegaconf import OmegaConf

def hosts_of(per):
    class Hosts(MPIEngine):
        # Stands in for machines of `per` slots each: the split a hostfile of `per` slots a line gives.
        def _machine_comm(self):
            r = self.comm.Get_rank()
            return self.comm.Split(r // per if per > 0 else r % 2, r)
    return Hosts

rank = MPIEngine().rank
x = torch.arange(5, dtype=torch.float64) * (rank + 1) + 10 * rank
out = {}
for per in (2, 3):
    for kind, engine in (("detected", hosts_of(per)()), ("emulated", MPIEngine(ranks_per_machine=per))):
        m, machines = engine.machine, engine.machines
        y = engine.hierarchical_neighbor_allreduce(x, 0.5, {(m - 1) % machines: 0.5}, [(m + 1) % machines])
        key = f"{kind}{per}"
        out[key] = {"layout": [engine.local_size, machines, engine.layout_source], "hier": y.tolist()}
        if per == 3:  # inner_outer_exp2 needs 1 or >= 3 ranks per machine
            topo = build_topology(OmegaConf.create({"_target_": "bfexp.topology.InnerOuterExp2"}), engine.size,
                                  layout_ranks_per_machine(engine))
            steps = []
            for t in range(topo.period):
                w = topo.weights(rank, t)
                steps.append(engine.neighbor_allreduce(x, w.self_weight, w.src_weights, sorted(w.dst_weights)).tolist())
            out[key]["inner_outer"] = steps
            out[key]["period"] = topo.period
        engine.close()
real = MPIEngine()
out["real"] = [real.local_size, real.machines, real.layout_source]
try:
    hosts_of(0)()  # ranks 0,2,4 and 1,3,5 on two machines: not consecutive
    out["scattered"] = None
except CommError as e:
    out["scattered"] = str(e)
emit(out)
"""


def test_detected_machines_give_the_numbers_of_todays_emulation(tmp_path):
    n = 6
    got = run_ranks(n, DETECTION, tmp_path, timeout=300)
    x = np.array([np.arange(5) * (r + 1) + 10 * r for r in range(n)], dtype=np.float64)
    for per in (2, 3):
        machines = n // per
        means = x.reshape(machines, per, 5).mean(axis=1)
        expected = [0.5 * means[r // per] + 0.5 * means[(r // per - 1) % machines] for r in range(n)]
        for r in range(n):
            det, emu = got[r][f"detected{per}"], got[r][f"emulated{per}"]
            assert det["layout"] == [per, machines, "detected"]
            assert emu["layout"] == [per, machines, "emulated"]
            np.testing.assert_allclose(det["hier"], expected[r], rtol=0, atol=1e-12)
            assert det["hier"] == emu["hier"]
    # inner_outer_exp2 on the detected layout: W(t) x at every step of its period, as emulated.
    from omegaconf import OmegaConf

    from bfexp.topology import build_topology

    topo = build_topology(OmegaConf.create({"_target_": "bfexp.topology.InnerOuterExp2"}), n, 3)
    assert got[0]["detected3"]["period"] == topo.period
    for t in range(topo.period):
        y = topo.mixing_matrix(t) @ x
        for r in range(n):
            np.testing.assert_allclose(got[r]["detected3"]["inner_outer"][t], y[r], rtol=0, atol=1e-12)
            assert got[r]["detected3"]["inner_outer"][t] == got[r]["emulated3"]["inner_outer"][t]
    # On this one host, MPI's shared-memory split finds one machine of every rank.
    assert all(g["real"] == [n, 1, "detected"] for g in got)
    assert all(g["scattered"] and "consecutive" in g["scattered"] for g in got)


@pytest.mark.parametrize("launcher, ranks, most", [
    ({"_target_": "bfexp.launchers.Mpirun", "hosts": "n1:8,n2:8", "hostfile": None}, 12, 8),  # n1's slots first
    ({"_target_": "bfexp.launchers.Mpirun", "hosts": "n1:2,n2:6", "hostfile": None}, 5, 3),
    ({"_target_": "bfexp.launchers.Srun", "ranks_per_node": 8}, 32, 8),
    ({"_target_": "bfexp.launchers.Srun", "ranks_per_node": 8}, 4, 4),
    ({"_target_": "bfexp.launchers.Local"}, 6, 6),
])
def test_ranks_per_machine_the_gpu_check_counts(launcher, ranks, most):
    """A GPU engine needs a GPU for each rank on the busiest machine of the placement."""
    from omegaconf import OmegaConf

    from bfexp.config import launcher_of

    assert launcher_of(OmegaConf.create({"ranks": ranks, "launcher": launcher}).launcher).ranks_per_host(ranks) == most


def test_gpu_engine_over_mpirun_is_checked_before_any_rank(bfexp):
    from bfexp.comm.nccl import nccl_available

    ok, _ = nccl_available(2, 2)
    if ok:
        pytest.skip("this machine has the GPUs for engine=nccl")
    one_line_refusal(bfexp("engine=nccl", "launcher=mpirun", "launcher.hosts=localhost:2", "ranks=2",
                           "hydra.run.dir=run"), "engine=nccl cannot run here", code=3)
    assert not (bfexp.cwd / "run" / "logs").exists()
