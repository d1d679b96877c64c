#!/usr/bin/env bash
# An emulated cluster on this machine: hosts with their own hostnames, addresses, /tmp, sshd and CPU
# quota, on a private bridge whose links can be rate-shaped; optionally a multi-node Slurm on them.
# bfexp's multi-host tests run on it (.ci/run brings it up and takes it down).
#
#   scripts/cluster_local.sh up [--hosts N] [--rate RATE] [--cpu FRACTION] [--slurm]
#   scripts/cluster_local.sh down                 everything it made goes: processes, namespaces, cgroups, mounts
#   scripts/cluster_local.sh status               hosts, addresses, shaping, quota, daemons
#   scripts/cluster_local.sh exec HOST CMD...     run CMD on HOST (as its sshd would, in its cgroup)
#   scripts/cluster_local.sh link HOST up|down    take HOST's link down or bring it back
#   scripts/cluster_local.sh rate HOST RATE|none  shape HOST's link (both ends, HTB), e.g. 1gbit, 200mbit
#   scripts/cluster_local.sh cpu HOST FRACTION|none   HOST's CPU quota, in cores (e.g. 0.4)
#   scripts/cluster_local.sh revive HOST          start HOST's daemons again (sshd, munged, slurmd) after a crash
#
# A host (hostA, hostB, ...) is a network namespace (bfx-hostA) with one interface clu0 (10.77.0.10, .11, ...)
# on a bridge that lives in a namespace of its own (bfx-switch), so this machine's interfaces and routes are
# untouched; a UTS namespace for its hostname (an mpi4py job across hosts that share one hangs); a mount
# namespace in which /etc/hosts maps every host to its bridge address, /etc/ssh is its own (sshd on its
# address, root key auth with a key made here), and /tmp, /run/munge and /etc/slurm are its own, as on
# separate machines; everything else is shared, as a cluster's home directories are (bfexp's working tree
# too, where it lives under /tmp).
# A cpu-controller cgroup per host (cgroup v1 or v2) gives it a CPU quota. `up` is idempotent: run again
# with other --rate/--cpu it reshapes. Needs root; installs openssh-server (and Slurm for --slurm) with
# apt-get when missing.
set -euo pipefail

STATE=/run/bfexp-cluster
PREFIX=bfx-
SWITCH=${PREFIX}switch
SUBNET=10.77.0
FIRST=10
IFACE=clu0
CGROUP_NAME=bfexp-cluster
LETTERS=(A B C D E F G H)
REPO=$(cd "$(dirname "$0")/.." && pwd -P)

die() { echo "cluster_local.sh: $*" >&2; exit 2; }
need_root() { [ "$(id -u)" = 0 ] || die "needs root (namespaces, cgroups, daemons)"; }
hosts() { cat "$STATE/hosts" 2>/dev/null || true; }
address() { local i=0 h; for h in $(hosts); do [ "$h" = "$1" ] && { echo "$SUBNET.$((FIRST + i))"; return; }; i=$((i + 1)); done; die "no host $1; hosts: $(hosts | tr '\n' ' ')"; }
is_up() { [ -s "$STATE/hosts" ]; }

cgroup_root() {
    if [ -d /sys/fs/cgroup/cpu ] && [ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then
        echo "/sys/fs/cgroup/cpu/$CGROUP_NAME"
    elif grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
        echo "/sys/fs/cgroup/$CGROUP_NAME"
    else
        echo ""
    fi
}

# CFS period of a host's quota: short, so that a host that spent its share waits milliseconds, not tens of them
# (with the default 100 ms, a rank at 0.4 cores could stall 60 ms in the middle of a step).
PERIOD_US=10000

set_cpu() {  # HOST FRACTION|none
    local dir period=$PERIOD_US quota
    dir="$(cgroup_root)/$1"
    [ -d "$dir" ] || die "no cpu cgroup for $1 (this machine has no cpu controller)"
    if [ "$2" = none ]; then quota=-1; else
        quota=$(awk -v f="$2" -v p="$period" 'BEGIN { if (f + 0 <= 0) exit 1; printf "%d", f * p }') \
            || die "--cpu $2; allowed: a positive number of cores, e.g. 0.4, or none"
    fi
    if [ -f "$dir/cpu.cfs_quota_us" ]; then
        echo "$period" >"$dir/cpu.cfs_period_us"; echo "$quota" >"$dir/cpu.cfs_quota_us"
    else
        [ "$quota" = -1 ] && echo "max $period" >"$dir/cpu.max" || echo "$quota $period" >"$dir/cpu.max"
    fi
    echo "$2" >"$STATE/cpu.$1"
    # While any host has a quota, the hosts get it even when the rest of this machine is busy (a quota alone is
    # only a ceiling): their group outweighs everything outside it. Without quotas, the usual equal weight.
    local weight=1024 h
    for h in $(hosts); do [ "$(cat "$STATE/cpu.$h" 2>/dev/null || echo none)" = none ] || weight=262144; done
    if [ -f "$(cgroup_root)/cpu.shares" ]; then echo "$weight" >"$(cgroup_root)/cpu.shares"
    elif [ -f "$(cgroup_root)/cpu.weight" ]; then echo $((weight == 1024 ? 100 : 10000)) >"$(cgroup_root)/cpu.weight"; fi
}

set_rate() {  # HOST RATE|none: HTB on the host's interface and on its switch port
    local h=$1 rate=$2 ns dev
    for end in "$PREFIX$h $IFACE" "$SWITCH p-$h"; do
        read -r ns dev <<<"$end"
        ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
        if [ "$rate" != none ]; then
            ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: htb default 10
            ip netns exec "$ns" tc class add dev "$dev" parent 1: classid 1:10 htb rate "$rate" quantum 60000 \
                || { echo "cluster_local.sh: --rate $rate; allowed: a tc rate such as 1gbit, 200mbit" >&2; return 2; }
        fi
    done
    echo "$rate" >"$STATE/rate.$h"
}

host_exec() {  # HOST CMD...: join the host's cgroup, then its network, UTS and mount namespaces
    local h=$1; shift
    [ -e "$STATE/uts/$h" ] || die "no host $h; hosts: $(hosts | tr '\n' ' ')"
    local cg; cg="$(cgroup_root)/$h"
    # shellcheck disable=SC2016
    exec sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$cg" \
        nsenter --net="/run/netns/$PREFIX$h" --uts="$STATE/uts/$h" --mount="$STATE/mnt/$h" -- "$@"
}

install_packages() {
    local want=()
    command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || want+=(openssh-server)
    if [ "${1:-}" = slurm ]; then
        command -v slurmctld >/dev/null || want+=(slurm-wlm)
        command -v munged >/dev/null || want+=(munge)
        dpkg -s libpmix2 >/dev/null 2>&1 || want+=(libpmix2)
        # Slurm's mpi/pmix plugin dlopens the unversioned libpmix.so, which only the -dev package ships
        # ("srun: error: mpi/pmix_v4: init: ... can not load PMIx library" without it)
        dpkg -s libpmix-dev >/dev/null 2>&1 || want+=(libpmix-dev)
    fi
    [ ${#want[@]} = 0 ] && return
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${want[@]}" >/dev/null
    pkill -x sshd 2>/dev/null || true  # the package's own service on this machine: not ours to run
}

make_host() {  # HOST INDEX
    local h=$1 i=$2 addr=$SUBNET.$((FIRST + $2)) etc=$STATE/etc/$1
    ip netns add "$PREFIX$h"
    ip link add "p-$h" netns "$SWITCH" type veth peer name "$IFACE" netns "$PREFIX$h"
    ip -n "$SWITCH" link set "p-$h" master br0 up
    ip -n "$PREFIX$h" link set lo up
    ip -n "$PREFIX$h" addr add "$addr/24" dev "$IFACE"
    ip -n "$PREFIX$h" link set "$IFACE" up
    # A shaped link is one FIFO (HTB's default leaf queue; this kernel has neither fq nor fq_codel), and TCP
    # small queues let each socket keep up to tcp_limit_output_bytes in it: 4 MiB by this kernel's default,
    # 175 ms at 200 Mbit/s ahead of every other message the host sends (an MPI rendezvous's answer too: a
    # ring allreduce of 16.8 MB on 4 hosts took 1.25x its wire time). 64 KiB holds 2.6 ms there (1.04x).
    ip netns exec "$PREFIX$h" sysctl -qw net.ipv4.tcp_limit_output_bytes=65536
    touch "$STATE/uts/$h" "$STATE/mnt/$h"
    unshare --uts="$STATE/uts/$h" hostname "$h"
    mkdir -p "$etc/ssh" "$STATE/tmp/$h" "$STATE/run/$h/munge" "$etc/slurm"
    chmod 1777 "$STATE/tmp/$h"
    # its own files: /etc/hosts, /etc/ssh, /etc/slurm, /tmp, /run/munge. A working tree that lives under
    # this machine's /tmp (a CI clone, say) stays visible at its path on every host, as a shared home would.
    local keep=""
    case "$REPO" in /tmp/?*)
        mkdir -p "$STATE/tmp/$h/${REPO#/tmp/}"
        keep="mount --bind $REPO $STATE/tmp/$h/${REPO#/tmp/}" ;;
    esac
    unshare --mount="$STATE/mnt/$h" --propagation private sh -c "
        mount --bind $STATE/hosts.txt /etc/hosts
        mount --bind $etc/ssh /etc/ssh
        mkdir -p /etc/slurm && mount --bind $etc/slurm /etc/slurm
        $keep
        mount --rbind $STATE/tmp/$h /tmp
        mkdir -p /run/munge && mount --bind $STATE/run/$h/munge /run/munge"
    mkdir -p "$(cgroup_root)/$h"
    # sshd on its address, its own keys; root logs in with the cluster's key
    cp "$STATE/ssh/host_ed25519" "$STATE/ssh/host_ed25519.pub" "$etc/ssh/"
    cat >"$etc/ssh/sshd_config" <<EOF
ListenAddress $addr
HostKey /etc/ssh/host_ed25519
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
AuthorizedKeysFile $STATE/ssh/authorized_keys
StrictModes no
UsePAM no
PidFile $STATE/run/$h/sshd.pid
MaxStartups 100:30:200
MaxSessions 100
LogLevel ERROR
EOF
    cat >"$etc/ssh/ssh_config" <<EOF
Host *
    IdentityFile $STATE/ssh/id_ed25519
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    ConnectTimeout 5
EOF
    start_sshd "$h"
}

start_sshd() { (host_exec "$1" /usr/sbin/sshd -f /etc/ssh/sshd_config); }

start_munged() {
    (host_exec "$1" runuser -u munge -- /usr/sbin/munged --key-file="$STATE/munge/munge.key" \
        --pid-file="$STATE/run/$1/munge/munged.pid" --log-file="$STATE/munge/munged-$1.log" \
        --seed-file="$STATE/munge/munged-$1.seed" --force)
}

running_on() {  # HOST NAME: whether a process called NAME runs on HOST
    local pid
    for pid in $(ip netns pids "$PREFIX$1" 2>/dev/null); do
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] && return 0
    done
    return 1
}

revive() {  # HOST: its daemons, started again where they are gone (a host whose processes were all killed)
    local h=$1
    running_on "$h" sshd || start_sshd "$h"
    if [ -s "$STATE/slurm/slurmctld.pid" ]; then
        running_on "$h" munged || start_munged "$h"
        [ "$h" != "$(hosts | head -1)" ] || running_on "$h" slurmctld || (host_exec "$h" slurmctld)
        running_on "$h" slurmd || (host_exec "$h" slurmd -N "$h")
        for _ in $(seq 1 40); do
            [ "$( (host_exec "$h" sinfo -h -n "$h" -o '%t') 2>/dev/null)" = idle ] && return 0
            (host_exec "$h" scontrol update NodeName="$h" State=RESUME) >/dev/null 2>&1 || true
            sleep 0.5
        done
        die "$h did not come back in Slurm; see $STATE/slurm/slurmd-$h.log"
    fi
}

slurm_conf() {
    local cpus=${CLUSTER_SLURM_CPUS:-8} mem first nodes
    mem=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.3}' /proc/meminfo)
    first=$(hosts | head -1)
    nodes=$(hosts | paste -sd, -)
    cat <<EOF
# Written by bfexp's scripts/cluster_local.sh: Slurm across the emulated hosts.
ClusterName=bfexp-cluster
SlurmctldHost=$first($(address "$first"))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/slurm/ctld
SlurmdSpoolDir=$STATE/slurm/%n
SlurmctldPidFile=$STATE/slurm/slurmctld.pid
SlurmdPidFile=$STATE/slurm/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurm/slurmctld.log
SlurmdLogFile=$STATE/slurm/slurmd-%n.log
SlurmctldPort=6917
SlurmdPort=6918
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmix
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=30
KillWait=5
InactiveLimit=0
MinJobAge=5
EOF
    local i=0 h
    for h in $(hosts); do
        echo "NodeName=$h NodeAddr=$SUBNET.$((FIRST + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN"
        i=$((i + 1))
    done
    echo "PartitionName=cluster Nodes=$nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
}

start_slurm() {
    local h first
    first=$(hosts | head -1)
    mkdir -p "$STATE/slurm/ctld" "$STATE/munge"
    [ -s "$STATE/munge/munge.key" ] || dd if=/dev/urandom bs=1 count=1024 of="$STATE/munge/munge.key" 2>/dev/null
    chown -R munge:munge "$STATE/munge"; chmod 0700 "$STATE/munge"; chmod 0400 "$STATE/munge/munge.key"
    for h in $(hosts); do
        slurm_conf >"$STATE/etc/$h/slurm/slurm.conf"
        mkdir -p "$STATE/slurm/$h"
        chown munge:munge "$STATE/run/$h/munge"
        start_munged "$h"
    done
    (host_exec "$first" slurmctld)
    for h in $(hosts); do (host_exec "$h" slurmd -N "$h"); done
    for _ in $(seq 1 60); do
        if [ "$( (host_exec "$first" sinfo -h -o '%t') 2>/dev/null | grep -cE '^(idle|mix|alloc)')" -ge 1 ] \
            && ! (host_exec "$first" sinfo -h -o '%t') 2>/dev/null | grep -qvE '^(idle|mix|alloc)'; then
            echo "slurm: up on $(hosts | paste -sd, -)"
            return
        fi
        sleep 0.5
    done
    (host_exec "$first" sinfo) >&2 || true
    die "Slurm did not come up; see $STATE/slurm/*.log"
}

up() {
    local n=3 rate=none cpu=none slurm=no
    while [ $# -gt 0 ]; do
        case "$1" in
            --hosts|--rate|--cpu)
                [ $# -ge 2 ] || die "$1 needs a value; allowed: --hosts N, --rate RATE, --cpu FRACTION, --slurm"
                case "$1" in --hosts) n=$2 ;; --rate) rate=$2 ;; --cpu) cpu=$2 ;; esac
                shift 2 ;;
            --slurm) slurm=yes; shift ;;
            *) die "unknown option $1; allowed: --hosts N, --rate RATE, --cpu FRACTION, --slurm" ;;
        esac
    done
    # Every value checked before anything is made (namespaces, sshd, Slurm): a bad one leaves nothing behind.
    [[ "$n" =~ ^[1-8]$ ]] || die "--hosts $n; allowed: 1 to 8"
    if [ "$rate" != none ]; then
        [[ "$rate" =~ ^([0-9]+(\.[0-9]+)?)([kmg]?bit)$ ]] && awk -v r="${BASH_REMATCH[1]}" 'BEGIN { exit !(r + 0 > 0) }' \
            || die "--rate $rate; allowed: a tc rate above 0 such as 1gbit, 200mbit, 500kbit, or none"
    fi
    if [ "$cpu" != none ]; then
        local cores; cores=$(nproc)
        awk -v f="$cpu" -v c="$cores" 'BEGIN { exit !(f ~ /^[0-9]*\.?[0-9]+$/ && f + 0 > 0 && f + 0 <= c) }' \
            || die "--cpu $cpu; allowed: a number of cores above 0 and at most this machine's $cores, e.g. 0.4, or none"
    fi
    need_root
    if is_up; then
        [ "$(hosts | wc -l)" = "$n" ] || die "already up with $(hosts | wc -l) hosts; run down first for $n"
    else
        install_packages "$([ $slurm = yes ] && echo slurm)"
        [ -n "$(cgroup_root)" ] || die "this machine has no cgroup cpu controller (needed for --cpu)"
        mkdir -p "$STATE"
        mountpoint -q "$STATE" || { mount --bind "$STATE" "$STATE"; mount --make-private "$STATE"; }
        mkdir -p "$STATE/uts" "$STATE/mnt" "$STATE/ssh" "$STATE/etc" "$STATE/tmp" "$STATE/run" "$(cgroup_root)"
        echo "$REPO/scripts/cluster_local.sh" >"$STATE/tool"  # how bfexp reshapes the links between jobs
        mkdir -p /run/sshd  # sshd's privilege separation folder
        ssh-keygen -q -t ed25519 -N '' -f "$STATE/ssh/id_ed25519" -C bfexp-cluster
        ssh-keygen -q -t ed25519 -N '' -f "$STATE/ssh/host_ed25519" -C bfexp-cluster-host
        cp "$STATE/ssh/id_ed25519.pub" "$STATE/ssh/authorized_keys"
        local i
        { echo "127.0.0.1 localhost"; for ((i = 0; i < n; i++)); do echo "$SUBNET.$((FIRST + i)) host${LETTERS[i]}"; done; } \
            >"$STATE/hosts.txt"
        ip netns add "$SWITCH"
        ip -n "$SWITCH" link add br0 type bridge
        ip -n "$SWITCH" link set br0 up
        for ((i = 0; i < n; i++)); do
            echo "host${LETTERS[i]}" >>"$STATE/hosts"
            make_host "host${LETTERS[i]}" "$i"
        done
    fi
    local h
    for h in $(hosts); do set_rate "$h" "$rate"; set_cpu "$h" "$cpu"; done
    if [ $slurm = yes ] && [ ! -s "$STATE/slurm/slurmctld.pid" ]; then start_slurm; fi
    # every host answers ssh from every host
    for h in $(hosts); do
        (host_exec "$(hosts | head -1)" ssh -o BatchMode=yes "$h" true) || die "host $h does not answer ssh"
    done
    status
}

status() {
    if ! is_up; then echo "cluster: down"; return 0; fi
    local h
    echo "cluster: up; enter a host with: $0 exec HOST CMD"
    for h in $(hosts); do
        printf '  %-6s %-12s interface %s  rate %-8s cpu %-5s processes %s\n' "$h" "$(address "$h")" "$IFACE" \
            "$(cat "$STATE/rate.$h" 2>/dev/null || echo none)" "$(cat "$STATE/cpu.$h" 2>/dev/null || echo none)" \
            "$(ip netns pids "$PREFIX$h" 2>/dev/null | wc -l)"
    done
    [ -s "$STATE/slurm/slurmctld.pid" ] && echo "  slurm: controller on $(hosts | head -1), partition cluster"
    return 0
}

down() {
    need_root
    local h ns pid
    for _ in 1 2 3; do  # processes of every host (ranks, daemons), then the namespaces
        for ns in $(hosts | sed "s/^/$PREFIX/") "$SWITCH"; do
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        done
        sleep 0.2
    done
    for h in $(hosts); do
        ip netns del "$PREFIX$h" 2>/dev/null || true
        umount "$STATE/uts/$h" "$STATE/mnt/$h" 2>/dev/null || true
    done
    ip netns del "$SWITCH" 2>/dev/null || true
    local root; root=$(cgroup_root)
    if [ -n "$root" ] && [ -d "$root" ]; then
        for h in "$root"/*/; do [ -d "$h" ] && rmdir "$h" 2>/dev/null || true; done
        rmdir "$root" 2>/dev/null || true
    fi
    if mountpoint -q "$STATE" 2>/dev/null; then umount -l "$STATE"; fi
    rm -rf "$STATE"
    echo "cluster: down"
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) down ;;
    status) status ;;
    exec) shift; [ $# -ge 2 ] || die "usage: $0 exec HOST CMD..."; is_up || die "the cluster is down"; host_exec "$@" ;;
    link)
        is_up || die "the cluster is down"
        [ "${3:-}" = up ] || [ "${3:-}" = down ] || die "usage: $0 link HOST up|down"
        address "$2" >/dev/null
        ip -n "$SWITCH" link set "p-$2" "$3"
        ;;
    rate) is_up || die "the cluster is down"; address "$2" >/dev/null; set_rate "$2" "${3:?usage: rate HOST RATE|none}" ;;
    revive) is_up || die "the cluster is down"; address "${2:?usage: revive HOST}" >/dev/null; revive "$2" ;;
    cpu) is_up || die "the cluster is down"; address "$2" >/dev/null; set_cpu "$2" "${3:?usage: cpu HOST FRACTION|none}" ;;
    *) echo "usage: $0 up [--hosts N] [--rate RATE] [--cpu FRACTION] [--slurm] | down | status | exec HOST CMD... |" \
        "link HOST up|down | rate HOST RATE|none | cpu HOST FRACTION|none" >&2; exit 2 ;;
esac
