"""mpirun across the emulated cluster of ``scripts/cluster_local.sh``: hosts of this machine with their own
addresses, a CPU quota each and rate-shaped links, where scaling is measured without ranks fighting over cores.

``launcher=emulated`` puts ``ranks_per_host`` ranks on each of the cluster's first hosts, shapes the links of
the hosts it uses to ``link_rate`` and gives each host ``cpu`` cores before the job starts (so one sweep can
vary the link: ``-m launcher.link_rate=200mbit,1gbit``), and starts mpirun on the first host (from this
machine, through the cluster's own entry; on a host, directly). Open MPI's allreduce runs the algorithm
``allreduce_algorithm`` names, so that what is measured is one known algorithm (the cost model prices it).
A rank that waits in MPI sleeps between polls (``wait``, WAITS), and TCP moves large messages as fragments
(TRANSPORT): both because the hosts share this machine's cores and kernel, and both measured below.
The summary records the hosts, the rate and the quota (``emulated_cluster``).

The cluster keeps its state in ``/run/bfexp-cluster`` (hosts, each host's rate and quota, the path of the
script that made it); where that is missing, the job is refused before any rank starts.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import socket
import subprocess
from pathlib import Path
from typing import ClassVar, Sequence

from bfexp.errors import ConfigError, LaunchError, number_in
from bfexp.launchers.base import PROBE_S, find_mpiexec
from bfexp.launchers.mpirun import NOT_SHARED, STALE_SESSION_FOLDERS, Mpirun

__all__ = ["ALLREDUCE_ALGORITHMS", "Emulated", "RESOLVERS", "STATE", "WAITS", "link_rate_bits", "tcp_goodput_gbyte_per_s"]

STATE = Path("/run/bfexp-cluster")
INTERFACE = "clu0"  # every host's one interface (scripts/cluster_local.sh)
# Open MPI's coll/tuned allreduce algorithms by name (coll_tuned_allreduce_algorithm; `ompi_info --param coll
# tuned --level 9` lists them): the one pinned for the job.
ALLREDUCE_ALGORITHMS = {"basic_linear": 1, "nonoverlapping": 2, "recursive_doubling": 3, "ring": 4,
                        "segmented_ring": 5, "rabenseifner": 6}
# Open MPI's TCP transport moves a large message as sends of 128 KiB fragments, not as one put of the whole
# rest: with the put, two ranks that start an exchange within a moment of each other (as after a barrier) take
# turns at random, one's acknowledgment waiting behind the other's whole message. Measured here (Open MPI's
# ring allreduce of 16.8 MB on 2 hosts at 500 Mbit/s, 12 calls right after a barrier): 284 to 566 ms with the
# put, 285 to 333 ms without (the wire alone: 281 ms).
TRANSPORT = ["--mca", "btl_tcp_flags", "send,inplace,need-ack,need-csum"]
# How a rank waits in MPI (launcher.wait), as Open MPI arguments. The hosts share this machine's cores with each
# other and with the kernel that carries their traffic (veth pairs, the bridge): a rank that spins in MPI_Wait
# (Open MPI's default) burns its host's quota and holds a core that a peer's packets need, so a message waits
# for the next quota period or scheduler slice. Measured here (2 hosts at 0.4 cores, exchanges of 16.8 MB each
# way, medians of 15): spin 86-107 ms (one float: 15 ms), yield 29-34 ms, sleep 26 ms (one float: 0.3 ms).
WAITS = {
    "sleep": ["--mca", "mpi_yield_when_idle", "1", "--mca", "threads_pthreads_yield_strategy", "nanosleep",
              "--mca", "threads_pthreads_nanosleep_time", "20000"],  # 20 us asleep between polls
    "yield": ["--mca", "mpi_yield_when_idle", "1"],  # sched_yield between polls (oversubscribed nodes' default)
    "spin": [],  # Open MPI's default: poll without pause (a machine of its own)
}
RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")
# TCP over Ethernet at MTU 1500 with timestamps: 1448 bytes of payload in each 1514-byte frame that the
# shaper counts (14 bytes of Ethernet header, 20 of IP, 20 of TCP, 12 of the timestamp option).
PAYLOAD_PER_FRAME = 1448 / 1514
# (hosts, folder) found to answer ssh from the first host and see the folder, in this process
_ANSWERED: set[tuple[tuple[str, ...], str]] = set()


def link_rate_bits(rate: str) -> float:
    """``1gbit``, ``200mbit``, ``500kbit`` -> bits per second; ``none`` (unshaped) -> inf."""
    if str(rate) == "none":
        return math.inf
    match = RATE.match(str(rate))
    if not match:
        raise ConfigError(f"launcher.link_rate={rate}; allowed: a rate such as 200mbit, 1gbit, 2.5gbit, or none")
    bits = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    if not bits > 0:  # 0bit reached tc, which refused it after the hosts were reshaped
        raise ConfigError(f"launcher.link_rate={rate}; allowed: a rate above 0, such as 200mbit, 1gbit, or none")
    return bits


def tcp_goodput_gbyte_per_s(rate: str) -> float:
    """Payload GB/s (1e9 bytes/s) that TCP moves over a link shaped to ``rate`` (inf: unshaped)."""
    return link_rate_bits(rate) / 8 * PAYLOAD_PER_FRAME / 1e9


# The interpolation resolver of scaling=emulated (conf/scaling/emulated.yaml): a shaped link's TCP payload rate
# from launcher.link_rate. bfexp.launchers.register_resolvers makes it known to OmegaConf.
RESOLVERS = {"bfexp_tcp_gbyte_per_s": tcp_goodput_gbyte_per_s}


class Emulated(Mpirun):
    """mpirun on the emulated cluster (see the module doc).

    ranks_per_host: ranks on each host (1: every exchange crosses a link). link_rate: each used host's link,
    e.g. 1gbit, or none (unshaped). cpu: cores each used host gets (a CFS quota), or null (no quota).
    allreduce_algorithm: Open MPI's allreduce, pinned (ALLREDUCE_ALGORITHMS). wait: how a rank waits in MPI
    (WAITS): sleep (default), yield or spin.
    """

    name: ClassVar[str] = "emulated"
    emulates_cluster: ClassVar[bool] = True

    def __init__(self, ranks_per_host: int = 1, link_rate: str = "1gbit", cpu: float | None = 0.4,
                 allreduce_algorithm: str = "ring", wait: str = "sleep", extra_args: Sequence[str] = ()) -> None:
        number_in("launcher.ranks_per_host", ranks_per_host, low=1, integer=True)
        link_rate_bits(link_rate)
        if cpu is not None:
            number_in("launcher.cpu", cpu, low=0.01, high=float(os.cpu_count() or 1))
        if allreduce_algorithm not in ALLREDUCE_ALGORITHMS:
            raise ConfigError(f"launcher.allreduce_algorithm={allreduce_algorithm}; "
                              f"allowed: {', '.join(ALLREDUCE_ALGORITHMS)}")
        if wait not in WAITS:
            raise ConfigError(f"launcher.wait={wait}; allowed: {', '.join(WAITS)}")
        self.wait = wait
        self.per_host = int(ranks_per_host)
        self.link_rate = str(link_rate)
        self.cpu = None if cpu is None else float(cpu)
        self.allreduce_algorithm = allreduce_algorithm
        self.hosts_spec = None
        self.hostfile = None
        self.network_interface = INTERFACE
        self.extra_args = [str(a) for a in extra_args]

    # ------------------------------------------------------------ the cluster

    @staticmethod
    def cluster_hosts() -> list[str]:
        try:
            return (STATE / "hosts").read_text().split()
        except OSError:
            return []

    @property
    def key(self) -> str:
        return "launcher=emulated"

    def machines(self) -> list[tuple[str, int]]:
        return [(h, self.per_host) for h in self.cluster_hosts()]

    def used(self, ranks: int) -> list[str]:
        return [h for h, _ in self.hosts(ranks)]

    def tool(self) -> str:
        try:
            return (STATE / "tool").read_text().strip()
        except OSError:
            raise LaunchError("launcher=emulated: the emulated cluster is not up; allowed: bring it up with "
                              "`scripts/cluster_local.sh up --hosts N` (as root)") from None

    def on_a_host(self) -> bool:
        return socket.gethostname() in self.cluster_hosts()

    def on_host(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host`` through the cluster's entry, in this folder."""
        return [self.tool(), "exec", host, "sh", "-c", 'cd "$0" && exec "$@"', os.getcwd(), *argv]

    def from_first_host(self, script: str, timeout: float) -> subprocess.CompletedProcess:
        """A shell script run on the cluster's first host (where mpirun starts)."""
        argv = ["sh", "-c", script]
        if not self.on_a_host():
            argv = self.on_host(self.cluster_hosts()[0], argv)
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)

    # ------------------------------------------------------------ the launcher's answers

    def check(self, ranks: int) -> None:
        """The cluster is up with enough hosts; every used host answers ssh from the first and sees this folder."""
        tool = self.tool()
        hosts = self.cluster_hosts()
        if ranks > len(hosts) * self.per_host:
            raise ConfigError(f"ranks={ranks} exceed the emulated cluster's {len(hosts)} hosts x "
                              f"launcher.ranks_per_host={self.per_host}; allowed: ranks <= "
                              f"{len(hosts) * self.per_host}, or `scripts/cluster_local.sh up --hosts N`")
        if not Path(tool).exists():
            raise LaunchError(f"launcher=emulated: {tool}, which made the emulated cluster, is gone; allowed: "
                              "take the cluster down and bring it up again")
        used = self.used(ranks)
        if (tuple(used), os.getcwd()) in _ANSWERED:  # a sweep's jobs: asked once
            find_mpiexec()
            return
        here = shlex.quote(os.getcwd())
        probe = " ".join(f'{{ ssh -o BatchMode=yes -o ConnectTimeout=5 {h} "test -d {here} && echo ok || echo '
                         f'{NOT_SHARED}" || echo unreachable; }} | sed "s/^/{h} /" &' for h in used) + " wait"
        done = self.from_first_host(probe, 30)
        answers = [line for line in done.stdout.split("\n") if line.strip()]
        if not answers and not self.on_a_host():  # the first host could not even enter the folder to ask
            raise LaunchError(f"launcher=emulated: host {hosts[0]} does not see the working folder {os.getcwd()} "
                              "(each host's /tmp is its own); allowed: a folder outside /tmp, e.g. /var/tmp")
        answered = {line.partition(" ")[0] for line in answers}
        for line in answers + [f"{h} unreachable" for h in used if h not in answered]:
            host, _, why = line.partition(" ")
            if why == "ok":
                continue
            if why == NOT_SHARED:
                raise LaunchError(f"launcher=emulated: host {host} does not see the working folder {os.getcwd()} "
                                  "(each host's /tmp is its own); allowed: a folder outside /tmp, e.g. /var/tmp")
            if why:
                raise LaunchError(f"launcher=emulated: host {host} does not answer ssh from {used[0]}; allowed: "
                                  f"`scripts/cluster_local.sh revive {host}`, or bring the cluster up again")
        find_mpiexec()
        _ANSWERED.add((tuple(used), os.getcwd()))

    def prepare(self, ranks: int) -> None:
        """Each host the job uses gets the job's link rate and CPU quota."""
        tool = self.tool()
        for host in self.used(ranks):
            for what, value in (("rate", self.link_rate), ("cpu", "none" if self.cpu is None else f"{self.cpu:g}")):
                done = subprocess.run([tool, what, host, value], capture_output=True, text=True, timeout=30)
                if done.returncode:
                    raise LaunchError(f"launcher=emulated: `cluster_local.sh {what} {host} {value}` failed: "
                                      f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")

    def threads_per_rank(self, ranks: int) -> int:
        """A rank's torch threads: the host's quota, rounded up, shared by its ranks."""
        cores = math.ceil(self.cpu) if self.cpu is not None else os.cpu_count() or 1
        return max(1, cores // max(1, self.per_host))

    def command(self, ranks: int, program: Sequence[str], mpiexec_args: Sequence[str] = ()) -> list[str]:
        self.hosts_spec = ",".join(f"{h}:{n}" for h, n in self.hosts(ranks))
        pinned = ["--mca", "coll_tuned_use_dynamic_rules", "1",
                  "--mca", "coll_tuned_allreduce_algorithm", str(ALLREDUCE_ALGORITHMS[self.allreduce_algorithm])]
        argv = super().command(ranks, program, [*pinned, *TRANSPORT, *WAITS[self.wait], *mpiexec_args])
        return argv if self.on_a_host() else self.on_host(self.cluster_hosts()[0], argv)

    def unreachable(self, hosts: Sequence[str]) -> dict[str, str]:
        probe = " ".join(f"{{ ssh -o BatchMode=yes -o ConnectTimeout={int(PROBE_S)} {h} true || echo {h}; }} &"
                         for h in hosts) + " wait"
        try:
            down = self.from_first_host(probe, PROBE_S + 10).stdout.split()
        except subprocess.TimeoutExpired:
            down = list(hosts)
        return {h: "no answer over ssh" for h in hosts if h in down}

    def clean_up(self, ranks: int) -> None:
        script = " ".join(f"ssh -o BatchMode=yes -o ConnectTimeout=3 {h} {shlex.quote(STALE_SESSION_FOLDERS)} &"
                          for h in self.used(ranks)) + " wait"
        try:
            self.from_first_host(script, 20)
        except (subprocess.TimeoutExpired, LaunchError):
            pass

    def cpu_quotas(self, ranks: int) -> dict[str, float | str]:
        return {h: "none" if self.cpu is None else self.cpu for h in self.used(ranks)}

    def facts(self, ranks: int) -> dict:
        """The summary's emulated_cluster: the hosts used, their link rate and CPU quota as the cluster has them."""
        def state(name: str) -> str | None:
            try:
                return (STATE / name).read_text().strip()
            except OSError:
                return None

        used = self.used(ranks)
        return {"emulated_cluster": {"hosts": used, "ranks_per_host": self.per_host,
                                     "link_rate": {h: state(f"rate.{h}") for h in used},
                                     "cpu_per_host": {h: state(f"cpu.{h}") for h in used},
                                     "allreduce_algorithm": self.allreduce_algorithm, "wait": self.wait}}
