"""An alpha-beta-gamma cost model of one training step on a described cluster.

A message of ``b`` bytes over a link costs ``alpha + b / bandwidth`` (Hockney's
model); combining ``b`` bytes locally (a reduction, a weighted add) costs
``b / reduce_rate`` (the gamma term of Thakur, Rabenseifner and Gropp,
"Optimization of collective communication operations in MPICH", 2005).

A cluster is ``machines x ranks_per_machine`` ranks, rank r on machine
``r // ranks_per_machine`` (the Engine's convention). Links inside a machine
(NVLink, shared memory) and between machines (a network card) differ; when a
machine's ranks share one network card, their cross-machine bytes queue on
it (network-card contention). When ranks are CPU processes that outnumber the
cores they share (``shares_cores``), every copy and reduction slows down by
ranks / cores (cores may be a fraction: a CPU quota). Over TCP on CPUs a
rank also moves every byte it sends or receives across machines through its
kernel's network stack (``stack``: bytes per second of one core). The stack,
the link and the switch are stages of one pipeline, and the slowest paces the
bytes: on the emulated cluster's hosts the stack hides under a shaped link once
a waiting rank stops spinning in MPI (launcher.wait=sleep), and is the whole
cost of an unshaped one (scripts/check_costmodel.py measures both).

Step time = compute + the communication that backward does not hide
(``overlap``), averaged over a local-SGD period (communication every
``period`` steps; an outer optimizer's sync period is one). What a step sends
is a ``Traffic``, which each algorithm class states as its ``traffic`` (its
``traffic_of(**options)`` refines it with the run's options: a compressor's
wire format, Gossip-PGA's global averages): this module knows no algorithm by name and
imports neither torch nor bfexp.algorithms. Every formula is written so a
test can check it by hand; the model is deliberately simple: no congestion
inside switches, no protocol switch points, transfers of one step run
concurrently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable, Literal, Sequence

from bfexp.errors import number_in


@dataclass(frozen=True)
class Traffic:
    """What one communicating step of an algorithm sends (each algorithm class states its own).

    kind: "allreduce" (a global average), "neighbor" (one exchange over the topology's W(t))
        or "allgather" (every rank's message reaches every rank: compressed payloads that
        cannot be summed on the way, e.g. error-feedback compressed allreduce).
    vectors: model-sized vectors per exchange (gradient tracking moves x and y: 2).
    scalars: extra elements per message (push-sum's weight travels with the data: 1).
    density: the share of a vector's elements a message carries (top-k, random-k: their ratio).
    value_bits: bits per carried element (0: the element's own size; QSGD: its bits; sign: 1; bf16: 16).
    index_bits: bits naming each carried element's position (top-k, random-k: 32).
    global_every: every this many communicating steps the exchange is an exact average
        (an allreduce of the uncompressed vectors) instead (Gossip-PGA); 0: never.
    decoded: a receiver rebuilds every message it receives as a dense vector, then adds it (a
        compressor's payload): its combine is priced on the dense vectors, not on the bytes that travel.
    """

    kind: Literal["allreduce", "neighbor", "allgather"]
    vectors: int = 1
    scalars: int = 0
    density: float = 1.0
    value_bits: float = 0.0
    index_bits: int = 0
    global_every: int = 0
    decoded: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("allreduce", "neighbor", "allgather"):
            raise ValueError(f"Traffic.kind={self.kind!r}; allowed: allreduce, neighbor, allgather")
        number_in("Traffic.density", self.density, low=0, high=1, low_open=True, error=ValueError)

    def message_bytes(self, param_bytes: float, element_bytes: int) -> float:
        """Bytes of one exchange's message for a model of ``param_bytes``, as compressed."""
        elements = param_bytes / element_bytes
        bits = (self.value_bits or 8 * element_bytes) + self.index_bits
        return self.vectors * elements * self.density * bits / 8 + self.scalars * element_bytes

    def dense_bytes(self, param_bytes: float, element_bytes: int) -> float:
        """Bytes of the same message uncompressed (what a Gossip-PGA average moves)."""
        return self.vectors * param_bytes + self.scalars * element_bytes

    def decoded_bytes(self, param_bytes: float) -> float:
        """The dense vectors a receiver rebuilds from one message (0: it combines the message as it travels)."""
        return self.vectors * param_bytes if self.decoded else 0.0


@dataclass(frozen=True)
class Link:
    """One hop: fixed cost per message and bytes per second."""

    latency_s: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class Cluster:
    """Where ranks run and how fast they talk and reduce.

    ranks_per_machine: ranks on one machine (0: every rank on one machine).
    nic_shared: a machine's ranks share one network card's ``inter`` bandwidth;
        False when each rank has its own card (e.g. 8 x 400 Gb/s per 8-GPU machine).
    reduce_bytes_per_s: how fast a rank combines received data into its own.
    cores: CPU cores the ranks of one machine share (0: ranks do not share
        processors, e.g. one GPU each; a fraction: a CPU quota). Copies, reductions
        and the network stack's work slow down by ranks_on_machine / cores when
        ranks outnumber cores.
    stack_bytes_per_s: how fast one core moves a rank's cross-machine bytes (sent
        and received) through its network stack; inf: free (RDMA, GPUDirect).
    switch_bytes_per_s: how many bytes a second the network between machines forwards
        in all, every machine's flows together; inf: a non-blocking switch, as a real
        cluster's. The emulated cluster's hosts share one machine's kernel, which
        forwards all of their traffic (conf/scaling/emulated.yaml).
    allreduce: "ring" (one flat ring over all ranks) or "hierarchical"
        (reduce-scatter in each machine, ring across machines, all-gather).
    """

    name: str
    ranks_per_machine: int
    intra: Link
    inter: Link
    nic_shared: bool = True
    reduce_bytes_per_s: float = math.inf
    cores: float = 0
    allreduce: str = "ring"
    stack_bytes_per_s: float = math.inf
    switch_bytes_per_s: float = math.inf

    def local_size(self, n: int) -> int:
        rpm = self.ranks_per_machine
        if rpm <= 0 or rpm >= n:
            return n
        if n % rpm:
            raise ValueError(f"ranks={n} is not a multiple of ranks_per_machine={rpm}")
        return rpm

    def machines(self, n: int) -> int:
        return n // self.local_size(n)

    def contention(self, n: int) -> float:
        """Slow-down of copies and reductions from ranks sharing too few cores."""
        if self.cores <= 0:
            return 1.0
        return max(1.0, self.local_size(n) / self.cores)

    def reduce_s(self, nbytes: float, n: int) -> float:
        return self.contention(n) * nbytes / self.reduce_bytes_per_s

    def intra_s(self, nbytes: float, n: int, messages: int = 1) -> float:
        return messages * self.intra.latency_s + self.contention(n) * nbytes / self.intra.bandwidth_bytes_per_s

    def inter_s(self, wire_bytes: float, n: int, stack_bytes: float | None = None, messages: int = 1,
                network_bytes: float | None = None) -> float:
        """A cross-machine transfer: ``wire_bytes`` on the busiest direction of the link, and the rank's
        network stack moving ``stack_bytes`` (what it sends plus what it receives; default: twice the wire's).
        ``network_bytes``: what every machine sends across at the same time (default: each machine
        ``wire_bytes``, as in a ring's step), which the switch forwards at ``switch_bytes_per_s`` in all.
        The stack, the link and the switch are stages of one pipeline: the slowest paces the bytes."""
        stack = 2 * wire_bytes if stack_bytes is None else stack_bytes
        network = self.machines(n) * wire_bytes if network_bytes is None else network_bytes
        stages = (wire_bytes / self.inter.bandwidth_bytes_per_s, network / self.switch_bytes_per_s,
                  self.contention(n) * stack / self.stack_bytes_per_s)
        return messages * self.inter.latency_s + max(stages)


# ---------------------------------------------------------------- collectives


def ring_allreduce_s(cluster: Cluster, n: int, nbytes: float) -> float:
    """Flat ring: reduce-scatter then all-gather, 2(n-1) steps of nbytes/n each.

    Ranks are ordered by machine, so in every step each machine sends one
    chunk out and receives one in: a step costs the slower of the inside and
    the cross-machine hop (with one rank per machine, only the latter). Each
    rank reduces (n-1)/n of the vector.
    """
    if n <= 1:
        return 0.0
    chunk = nbytes / n
    # with one rank per machine every hop crosses machines: there is no hop inside one
    step = cluster.intra_s(chunk, n) if cluster.local_size(n) > 1 else 0.0
    if cluster.machines(n) > 1:
        step = max(step, cluster.inter_s(chunk, n))
    return 2 * (n - 1) * step + cluster.reduce_s((n - 1) / n * nbytes, n)


def hierarchical_allreduce_s(cluster: Cluster, n: int, nbytes: float) -> float:
    """Reduce-scatter inside each machine (L ranks), ring allreduce of each 1/L
    shard across the m machines (L rings at once, which share the machine's
    card when nic_shared), all-gather inside each machine."""
    if n <= 1:
        return 0.0
    local, machines = cluster.local_size(n), cluster.machines(n)
    if machines == 1 or local == 1:
        return ring_allreduce_s(cluster, n, nbytes)
    shard = nbytes / local
    inside = 2 * (local - 1) * cluster.intra_s(shard, n)
    rings = local if cluster.nic_shared else 1  # concurrent flows on one card
    # each rank's own stack moves its own ring's chunk, sent and received
    across = 2 * (machines - 1) * cluster.inter_s(rings * shard / machines, n, 2 * shard / machines)
    reduce = cluster.reduce_s((local - 1) / local * nbytes + (machines - 1) / machines * shard, n)
    return inside + across + reduce


def decode_s(cluster: Cluster, n: int, messages: int, decoded_bytes: float) -> float:
    """A receiver rebuilding ``messages`` payloads as dense vectors of ``decoded_bytes`` and adding each to its
    sum: the decode writes a dense vector and the add reads it back, so each costs two vectors' combine (its
    own payload's decode is part of the single-rank compute, which has one too)."""
    return cluster.reduce_s(messages * 2 * decoded_bytes, n)


def ring_allgather_s(cluster: Cluster, n: int, nbytes: float, decoded_bytes: float = 0.0) -> float:
    """Ring allgather of one ``nbytes`` message per rank: n-1 steps, each rank passing one
    message on (paced by the slower hop, as in the ring allreduce); nothing is reduced.
    ``decoded_bytes``: every rank then decodes the n-1 messages it received (decode_s)."""
    if n <= 1:
        return 0.0
    step = cluster.intra_s(nbytes, n) if cluster.local_size(n) > 1 else 0.0
    if cluster.machines(n) > 1:
        step = max(step, cluster.inter_s(nbytes, n))
    return (n - 1) * step + (decode_s(cluster, n, n - 1, decoded_bytes) if decoded_bytes else 0.0)


def allreduce_s(cluster: Cluster, n: int, nbytes: float) -> float:
    """Allreduce of ``nbytes`` with the cluster's allreduce algorithm."""
    if cluster.allreduce == "hierarchical":
        return hierarchical_allreduce_s(cluster, n, nbytes)
    if cluster.allreduce == "ring":
        return ring_allreduce_s(cluster, n, nbytes)
    raise ValueError(f"scaling.allreduce={cluster.allreduce!r}; allowed: ring, hierarchical")


# ---------------------------------------------------------------- neighbor exchange


def exchange_s(cluster: Cluster, n: int, edges: Iterable[tuple[int, int]], nbytes: float,
               decoded_bytes: float = 0.0) -> float:
    """One neighbor exchange: every (sender, receiver) edge carries ``nbytes``.

    Per rank, sends and receives run concurrently; a rank's busiest direction
    sets its transfer time on each link kind (inside the machine, across
    machines), and the two link kinds run in parallel. Across machines, a
    shared card carries all of its machine's cross-machine bytes. The rank
    then combines what it received with its own value ((in-degree + 1)
    vectors), or, with ``decoded_bytes``, decodes each message it received and
    adds it (decode_s). The exchange ends when the slowest rank is done.
    """
    local = cluster.local_size(n)
    intra_out = [0.0] * n
    intra_in = [0.0] * n
    inter_out = [0.0] * n
    inter_in = [0.0] * n
    in_degree = [0] * n
    for src, dst in edges:
        in_degree[dst] += 1
        if src // local == dst // local:
            intra_out[src] += nbytes
            intra_in[dst] += nbytes
        else:
            inter_out[src] += nbytes
            inter_in[dst] += nbytes
    if cluster.nic_shared:
        machines = n // local
        card_out = [sum(inter_out[m * local : (m + 1) * local]) for m in range(machines)]
        card_in = [sum(inter_in[m * local : (m + 1) * local]) for m in range(machines)]
    network = sum(inter_out)  # every cross-machine byte of the exchange, through the switch at once
    slowest = 0.0
    for r in range(n):
        inside = max(intra_out[r], intra_in[r])
        t_inside = cluster.intra_s(inside, n) if inside else 0.0
        if cluster.nic_shared:
            m = r // local
            across = max(card_out[m], card_in[m]) if (inter_out[r] or inter_in[r]) else 0.0
        else:
            across = max(inter_out[r], inter_in[r])
        t_across = cluster.inter_s(across, n, inter_out[r] + inter_in[r], network_bytes=network) if across else 0.0
        if not in_degree[r]:
            combine = 0.0
        elif decoded_bytes:
            combine = decode_s(cluster, n, in_degree[r], decoded_bytes)
        else:
            combine = cluster.reduce_s((in_degree[r] + 1) * nbytes, n)
        slowest = max(slowest, max(t_inside, t_across) + combine)
    return slowest


def topology_edges(topology: Any, t: int) -> list[tuple[int, int]]:
    """(sender, receiver) pairs of W(t), read rank by rank from ``weights(rank, t)``."""
    edges = []
    for rank in range(topology.size):
        for src in topology.weights(rank, t).src_weights:
            edges.append((int(src), rank))
    return edges


def neighbor_exchange_s(cluster: Cluster, topology: Any, nbytes: float, decoded_bytes: float = 0.0) -> float:
    """Mean exchange time over one period of a (possibly dynamic) topology."""
    period = max(1, int(getattr(topology, "period", 1)))
    n = topology.size
    return sum(exchange_s(cluster, n, topology_edges(topology, t), nbytes, decoded_bytes)
               for t in range(period)) / period


def hierarchical_exchange_s(cluster: Cluster, n: int, machine_edges: Iterable[tuple[int, int]], nbytes: float) -> float:
    """A hierarchical neighbor exchange (BlueFog's): each machine averages inside (an allreduce over its
    ranks' links), its machines' exchange of ``nbytes`` crosses the network over ``machine_edges`` (one
    flow per machine edge, as one rank a machine would send it), and each machine's result reaches its
    ranks (a broadcast inside, priced as half an allreduce)."""
    local, machines = cluster.local_size(n), cluster.machines(n)
    inside = replace(cluster, ranks_per_machine=0)  # one machine's ranks: every hop on its own links
    average = 1.5 * ring_allreduce_s(inside, local, nbytes) if local > 1 else 0.0
    leaders = replace(cluster, ranks_per_machine=1, nic_shared=False)  # one flow per machine
    across = exchange_s(leaders, machines, machine_edges, nbytes) if machines > 1 else 0.0
    return average + across


# Recorded engine operations priced as a message on each edge of a graph (operation_s).
EXCHANGES = ("neighbor_allreduce", "neighbor_allgather", "win_put", "win_accumulate", "win_get", "win_exchange")


def operation_s(cluster: Cluster, n: int, op: str, message_bytes: float,
                edges: Sequence[tuple[int, int]] = (), decoded_bytes: float = 0.0) -> float:
    """One engine operation as a rank posted it (bfexp.ledger records them): ``message_bytes`` is one
    rank's message (a collective's vector; an exchange's message on each edge), ``edges`` the
    (sender, receiver) pairs of an exchange, every rank's (a hierarchical one's: machines'). Collectives
    at their bandwidth-optimal schedules: allreduce as the cluster runs it, allgather and broadcast as
    rings (a broadcast pipelined in n pieces), a barrier as an allreduce of nothing; window operations
    as the messages they move. Operations a step did not send (win_update, win_create) cost nothing.
    ``decoded_bytes``: a compressor's payloads (an allgather's, a neighbor exchange's) are rebuilt as dense
    vectors of that size by their receivers before they are added (decode_s)."""
    if n <= 1:
        return 0.0
    if op == "allreduce":
        return allreduce_s(cluster, n, message_bytes)
    if op == "allgather":
        return ring_allgather_s(cluster, n, message_bytes, decoded_bytes)
    if op == "broadcast":
        return ring_allgather_s(cluster, n, message_bytes / n)
    if op == "barrier":
        return allreduce_s(cluster, n, 0.0)
    if op in ("neighbor_allreduce", "neighbor_allgather"):
        return exchange_s(cluster, n, edges, message_bytes, decoded_bytes) if edges else 0.0
    if op in EXCHANGES:
        return exchange_s(cluster, n, edges, message_bytes) if edges else 0.0
    if op == "hierarchical_neighbor_allreduce":
        return hierarchical_exchange_s(cluster, n, edges, message_bytes)
    return 0.0


# ---------------------------------------------------------------- one step


@dataclass(frozen=True)
class StepEstimate:
    """Per-rank mean step time split into compute, the communication left exposed and the wait for the
    slowest rank."""

    compute_s: float
    comm_s: float  # one communicating step's communication, hidden or not
    exposed_comm_s: float  # mean per step, after overlap and the local-SGD period
    step_s: float
    wait_s: float = 0.0  # mean per step (straggler_wait_s)

    def throughput(self, ranks: int, batch: int) -> float:
        return ranks * batch / self.step_s if self.step_s > 0 else math.inf


def communication_s(
    cluster: Cluster, traffic: Traffic, n: int, param_bytes: float, topology: Any = None, element_bytes: int = 4
) -> float:
    """Communication of one communicating step that sends ``traffic`` (an algorithm's ``traffic``).

    With ``global_every`` H, the mean over H communicating steps: H-1 exchanges of
    the traffic's kind and one allreduce of the uncompressed vectors (Gossip-PGA).
    """
    if n <= 1:
        return 0.0
    nbytes = traffic.message_bytes(param_bytes, element_bytes)
    decoded = traffic.decoded_bytes(param_bytes)
    if traffic.kind == "allreduce":
        own = allreduce_s(cluster, n, nbytes)
    elif traffic.kind == "allgather":
        own = ring_allgather_s(cluster, n, nbytes, decoded)
    elif topology is None:
        raise ValueError("neighbor traffic is priced on a topology; none was given")
    else:
        own = neighbor_exchange_s(cluster, topology, nbytes, decoded)
    every = traffic.global_every
    if every <= 1:
        return allreduce_s(cluster, n, traffic.dense_bytes(param_bytes, element_bytes)) if every == 1 else own
    return ((every - 1) * own + allreduce_s(cluster, n, traffic.dense_bytes(param_bytes, element_bytes))) / every


def quantile(times: Sequence[float], u: float) -> float:
    """The ``u`` quantile of ``times``, interpolated linearly between order statistics (numpy's default):
    with x_(0) <= ... <= x_(m-1) sorted and p = (m - 1) u, x_(floor p) + (p - floor p)(x_(floor p + 1) - x_(floor p))."""
    xs = sorted(float(t) for t in times)
    if not xs:
        raise ValueError("a quantile needs at least one time")
    p = (len(xs) - 1) * u
    i = min(int(p), len(xs) - 1)
    return xs[i] + (p - i) * (xs[min(i + 1, len(xs) - 1)] - xs[i])


def median_slowest(times: Sequence[float], k: int) -> float:
    """The median of the slowest of ``k`` independent draws from the distribution of ``times``: the slowest
    is at most x with probability F(x)^k, so its median is the 0.5^(1/k) quantile."""
    return quantile(times, 0.5 ** (1 / k))


def waited_ranks(traffic: Traffic, n: int, topology: Any = None) -> int:
    """How many ranks' compute one exchange waits on: every rank's in an allreduce or allgather; in a neighbor
    exchange a rank's own and its in-neighbors' (the most of any rank over the topology's period)."""
    if traffic.kind != "neighbor" or topology is None:
        return n
    period = max(1, int(getattr(topology, "period", 1)))
    degree = max(len(topology.weights(rank, t).src_weights) for rank in range(n) for t in range(period))
    return min(n, degree + 1)


def straggler_wait_s(times: Sequence[float], traffic: Traffic, n: int, topology: Any = None, period: int = 1) -> float:
    """What waiting for the slowest rank adds to a step, when ranks' step times vary as the single-rank
    reference's ``times`` did: an exchange that waits on k ranks (waited_ranks) starts after the slowest of k
    draws (synchronous SGD's straggler cost, as in Dutta et al., "Slow and Stale Gradients Can Win the Race",
    AISTATS 2018). Step times are medians (the measured ones are each rank's median), so the wait is
    median_slowest(times, k) - median_slowest(times, 1): quantiles, which a reference round that something
    else disturbed does not move. With a communication ``period`` p it waits on the slowest of k sums of p
    steps, whose spread grows as sqrt(p) for independent steps: per step, the one-step figure over sqrt(p).
    Gossip-PGA's global averages wait on every rank (mixed in as communication_s mixes their price)."""
    if n <= 1 or len(times) < 2:
        return 0.0
    one = median_slowest(times, 1)

    def excess(k: int) -> float:
        return (median_slowest(times, k) - one) / math.sqrt(max(1, period))

    own = excess(waited_ranks(traffic, n, topology))
    every = traffic.global_every
    if every <= 1:
        return excess(n) if every == 1 else own
    return ((every - 1) * own + excess(n)) / every


def step_estimate(
    compute_s: float,
    comm_s: float,
    *,
    backward_fraction: float = 2 / 3,
    overlap: bool = True,
    period: int = 1,
    buckets: int = 0,
    wait_s: float = 0.0,
) -> StepEstimate:
    """Compute plus the communication backward does not hide, every ``period`` steps, plus ``wait_s``
    per step waiting for the slowest rank (straggler_wait_s).

    With overlap, communication runs during the backward pass
    (``backward_fraction`` of compute) and only what sticks out past it
    costs time. ``buckets`` k: the message goes in k equal buckets, bucket j
    ready j/k of the way through backward, one after another on the link, so
    the exchange ends max(c/k, c - backward (k-1)/k) after backward (the
    last bucket always waits for backward's end: one bucket hides nothing);
    0: as finely cut as it takes, max(0, c - backward).
    """
    backward = backward_fraction * compute_s if overlap else 0.0
    if buckets >= 1 and overlap:
        exposed = max(comm_s / buckets, comm_s - backward * (buckets - 1) / buckets)
    else:
        exposed = max(0.0, comm_s - backward)
    exposed /= max(1, period)
    return StepEstimate(compute_s, comm_s, exposed, compute_s + exposed + wait_s, wait_s)
