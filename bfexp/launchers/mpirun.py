"""Open MPI's mpirun over machines reached with ssh, what BlueFog's bfrun and horovodrun wrap.

``launcher=mpirun launcher.hosts=[n1:8,n2:8]`` (a list: Hydra reads an unquoted
``n1:8,n2:8`` as a sweep of two values; the quoted string ``'"n1:8,n2:8"'``
works too) or ``launcher.hostfile=hosts.txt`` (``n1 slots=8`` a line). Before
any rank starts: every host resolves and answers ssh without a password, the
slots cover the ranks, and the network interface exists here.

mpirun gives ranks on other machines only its own variables and those ``-x``
names, so every variable of the ranks' environment is named (as horovodrun
does), except those that describe the driver's own machine or shell session.

A machine whose link goes down leaves its daemon (prted) and ranks waiting on
sockets that neither close nor answer; TCP notices only after many minutes.
The daemons' connections to mpirun therefore probe their peer while idle
(keepalive), often enough that a daemon that lost mpirun ends itself and its
ranks within timeout_s, and mpirun, losing the daemon, names its machine.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
from pathlib import Path
from typing import ClassVar, Sequence

from bfexp.errors import ConfigError, LaunchError, text_of
from bfexp.launchers.base import TIMEOUT_VARIABLE, Launcher, find_mpiexec, processor_slots, ssh_probe

__all__ = ["Mpirun", "check_interface", "interface_args", "is_this_machine", "parse_hosts", "read_hostfile"]

SSH_TIMEOUT_S = 5
NOT_SHARED = "bfexp-working-folder-not-here"  # what a host that lacks the working folder answers
# Open MPI's folders of daemons and mpirun (prted.<pid>, prterun.<pid>, ompi.<pid>) whose process is gone (or a
# zombie: a killed daemon whose parent went with it waits for init to reap it).
STALE_SESSION_FOLDERS = ('for d in "${TMPDIR:-/tmp}"/prted.* "${TMPDIR:-/tmp}"/prterun.* "${TMPDIR:-/tmp}"/ompi.*; do '
                         'p=${d##*.}; case $p in ""|*[!0-9]*) continue;; esac; '
                         'case "$(sed "s/.*) //" "/proc/$p/stat" 2>/dev/null | cut -c1)" in ""|Z) rm -rf "$d";; esac; done')
# Variables that belong to the driver's machine or shell session, not to the ranks' job: not sent along.
LOCAL_VARIABLES = re.compile(r"^(HOSTNAME|PWD|OLDPWD|SHLVL|_|PS[1-4]|DISPLAY|TERM|TERMCAP|COLUMNS|LINES|LS_COLORS|"
                             r"SSH_\w+|XDG_\w+|TMUX\w*|STY|WINDOW|BASH_FUNC_.*|KRB5CCNAME|MAIL|LOGNAME|USER|HOME)$")
# Hosts found to answer ssh, so that a second preflight in the same driver does not ask again.
_ANSWERED: set[str] = set()


class Mpirun(Launcher):
    """mpirun over ``hosts`` (``n1:8,n2:8``) or a ``hostfile``: one of the two.

    ``network_interface``: the interface ranks talk over (Open MPI's btl/oob_tcp_if_include, NCCL's
    NCCL_SOCKET_IFNAME), e.g. eth0. ``extra_args``: more arguments for mpirun.
    """

    name: ClassVar[str] = "mpirun"

    def __init__(self, hosts: str | Sequence[str] | None = None, hostfile: str | None = None,
                 network_interface: str | None = None, extra_args: Sequence[str] = ()) -> None:
        if hosts is not None and not isinstance(hosts, str):
            hosts = ",".join(str(h) for h in hosts)  # [n1:8,n2:8], as Hydra reads it unquoted
        if hosts and hostfile:
            raise ConfigError(f"launcher.hosts={hosts} and launcher.hostfile={hostfile}; allowed: one of the two")
        if not (hosts or hostfile):
            raise ConfigError("launcher=mpirun needs machines; allowed: launcher.hosts=[n1:8,n2:8] "
                              "or launcher.hostfile=PATH")
        if hosts:
            parse_hosts(hosts)  # its form, now
        self.hosts_spec = None if hosts is None else str(hosts)
        self.hostfile = None if hostfile is None else str(hostfile)
        self.network_interface = network_interface
        self.extra_args = [str(a) for a in extra_args]

    @property
    def key(self) -> str:
        """How the user named the machines (for messages)."""
        return f"launcher.hosts={self.hosts_spec}" if self.hosts_spec else f"launcher.hostfile={self.hostfile}"

    def machines(self) -> list[tuple[str, int]]:
        """(host, slots) as given."""
        return parse_hosts(self.hosts_spec) if self.hosts_spec else read_hostfile(str(self.hostfile))

    def hosts(self, ranks: int) -> list[tuple[str, int]]:
        """Open MPI fills each host's slots in order."""
        out, left = [], ranks
        for host, slots in self.machines():
            if left <= 0:
                break
            out.append((host, min(slots, left)))
            left -= min(slots, left)
        return out or [(socket.gethostname(), ranks)]

    def check(self, ranks: int) -> None:
        check_interface(self.network_interface)
        machines = self.machines()
        check_hosts([host for host, _ in machines], self.key)
        slots = sum(n for _, n in machines)
        if slots < ranks:
            raise ConfigError(f"ranks={ranks} exceed the {slots} slots of {self.key}; allowed: ranks <= {slots}, "
                              "or more slots")
        find_mpiexec()

    def environment(self, ranks: int, env: dict[str, str]) -> dict[str, str]:
        """Keepalive probes on the daemons' connections, tuned to the job's timeout_s (see the module doc):
        a silent peer is given up between timeout_s / 2 and timeout_s after it went silent."""
        timeout = float(env.get(TIMEOUT_VARIABLE) or 0)
        if timeout > 0:
            half = max(1, int(timeout // 2))
            for key, value in (("time", half), ("intvl", 1), ("probes", half)):
                env.setdefault(f"PRTE_MCA_oob_tcp_keepalive_{key}", str(value))
        return env

    def clean_up(self, ranks: int) -> None:
        """The session folders (prted.<pid>, under each machine's TMPDIR) of daemons that were killed (a lost
        machine, a job ended at once): each machine removes those whose process is gone."""
        remote = [h for h, _ in self.hosts(ranks) if not is_this_machine(h)]
        if remote:
            ssh_probe(remote, SSH_TIMEOUT_S, STALE_SESSION_FOLDERS)
        subprocess.run(["sh", "-c", STALE_SESSION_FOLDERS], stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=SSH_TIMEOUT_S)

    def forward_environment(self, env: dict[str, str]) -> list[str]:
        """``-x NAME`` for each variable of the ranks' environment but the driver's own (LOCAL_VARIABLES) and
        Open MPI's, which mpirun sends itself."""
        names = sorted(k for k in env if not LOCAL_VARIABLES.match(k) and not k.startswith(("OMPI_", "PMIX_", "PRTE_"))
                       and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k))
        return [arg for name in names for arg in ("-x", name)]

    def command(self, ranks: int, program: Sequence[str], mpiexec_args: Sequence[str] = ()) -> list[str]:
        placement = ["--host", self.hosts_spec] if self.hosts_spec else ["--hostfile", str(self.hostfile)]
        # Fill each host's slots in order, threads free to move (horovodrun's defaults too).
        return [find_mpiexec(), "-n", str(ranks), *placement, "--map-by", "slot", "--bind-to", "none",
                *interface_args(self.network_interface), *map(str, mpiexec_args), *self.extra_args, *program]


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``n1:8,n2:8`` -> [(n1, 8), (n2, 8)]; a host without ``:N`` has one slot (as mpirun's --host)."""
    out = []
    for item in str(spec).split(","):
        name, _, slots = item.strip().partition(":")
        if not name or (slots and not slots.isdigit()) or slots == "0":
            raise ConfigError(f"launcher.hosts={spec}; allowed: host:slots,... e.g. n1:8,n2:8")
        out.append((name, int(slots or 1)))
    return out


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """Open MPI's hostfile: ``host [slots=N]`` a line, ``#`` comments. A line without slots gets
    the host's processor cores (as Open MPI does); only this machine's are known here, others count 1."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"launcher.hostfile={path} does not exist; allowed: a file of `host slots=N` lines")
    out = []
    text = text_of(file, "launcher.hostfile", "a text file of `host slots=N` lines")
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = next((w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")), None)
        if slots is not None and not (slots.isdigit() and int(slots) > 0):
            raise ConfigError(f"launcher.hostfile={path} line {number}: slots={slots}; allowed: slots=N with N >= 1")
        out.append((words[0], int(slots) if slots else (processor_slots() if is_this_machine(words[0]) else 1)))
    if not out:
        raise ConfigError(f"launcher.hostfile={path} names no host; allowed: `host slots=N` lines")
    return out


def is_this_machine(host: str) -> bool:
    """Whether a host name is this machine: it resolves to an address a socket here can bind."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def check_hosts(hosts: list[str], key: str) -> None:
    """Each host must resolve, and (when it is another machine) answer ssh without a password and see the working
    folder (LaunchError, for the first host in order that does not). The other machines are asked at once; their
    answer removes Open MPI's folders of daemons that are gone (a job whose machine crashed, say)."""
    remote = [h for h in dict.fromkeys(hosts) if h not in _ANSWERED and not is_this_machine(h)]
    resolved = [h for h in remote if _resolves(h)]
    ssh = shutil.which("ssh") is not None
    # The ranks read their config from the run folder, under the working folder: the hosts must see it.
    here = os.getcwd()
    sees = f"test -d {shlex.quote(here)} || {{ echo {NOT_SHARED} >&2; exit 1; }}; "
    answers = ssh_probe(resolved, SSH_TIMEOUT_S, sees + STALE_SESSION_FOLDERS) if ssh and resolved else {}
    for host in remote:
        if host not in resolved:
            raise LaunchError(f"{key}: host {host} does not resolve; allowed: host names this machine resolves")
        if not ssh:
            raise LaunchError(f"{key}: host {host} is another machine and ssh is not installed here; "
                              "allowed: this machine's names, or install ssh")
        answer = answers[host]
        if answer == NOT_SHARED:
            raise LaunchError(f"{key}: host {host} does not see the working folder {here} (every rank reads the job's "
                              "config and writes its records in the run folder there); allowed: a folder every host "
                              "mounts at the same path, e.g. a shared home or scratch")
        if answer is not None:
            raise LaunchError(f"{key}: host {host} is not reachable over ssh ({answer}); "
                              "allowed: hosts that answer `ssh -o BatchMode=yes HOST true`")
    _ANSWERED.update(remote)


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return False
    return True


def check_interface(name: str | None) -> None:
    """network_interface must name an interface of this machine (bad input: the user named it)."""
    if not name:
        return
    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise ConfigError(f"launcher.network_interface={name} is not an interface here; allowed: {', '.join(names)}")


def interface_args(name: str | None) -> list[str]:
    """mpirun arguments that keep ranks on one interface, as bfrun and horovodrun set them:
    MPI's TCP traffic (btl) and, off loopback, the runtime's own wire-up (oob); NCCL's sockets."""
    if not name:
        return []
    args = ["--mca", "btl_tcp_if_include", name, "-x", f"NCCL_SOCKET_IFNAME={name}"]
    if name != "lo":  # PRRTE wires daemons over routable interfaces only; on one machine it needs none
        args += ["--prtemca", "oob_tcp_if_include", name]
    return args
