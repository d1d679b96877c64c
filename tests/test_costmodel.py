"""The cost model against alpha-beta(-gamma) formulas worked out by hand for small cases.

Each expected value is written out from the textbook formula with the
numbers of the case, not computed by the model's own helpers.
"""

import math

import numpy as np
import pytest

from bfexp import costmodel
from bfexp.algorithms import Allreduce, DSGD, ExactDiffusion, GradientTracking, PushSum
from bfexp.costmodel import Cluster, Link
from bfexp.topology import Exp2, InnerOuterExp2, OnePeerExp2

M = 1_000_000.0  # bytes per message
A_IN, B_IN = 1e-5, 1e10  # inside a machine: 10 us, 10 GB/s
A_OUT, B_OUT = 1e-4, 1e9  # across machines: 100 us, 1 GB/s
R = 2e10  # combine: 20 GB/s


def make(rpm=0, nic_shared=True, reduce=math.inf, cores=0, allreduce="ring"):
    return Cluster("test", rpm, Link(A_IN, B_IN), Link(A_OUT, B_OUT), nic_shared, reduce, cores, allreduce)


def close(a, b):
    return a == pytest.approx(b, rel=1e-12)


def test_ring_allreduce_inside_one_machine():
    # 2(n-1) steps of (alpha + (M/n)/B), plus reducing (n-1)/n of M
    n = 4
    expected = 6 * (1e-5 + 250_000 / 1e10) + 0.75 * M / R
    assert close(costmodel.ring_allreduce_s(make(reduce=R), n, M), expected)
    assert costmodel.ring_allreduce_s(make(), 1, M) == 0.0


def test_ring_allreduce_across_machines_is_paced_by_the_slower_hop():
    # 4 ranks on 2 machines: every step has one cross-machine chunk per card
    expected = 6 * max(1e-5 + 250_000 / 1e10, 1e-4 + 250_000 / 1e9)
    assert close(costmodel.ring_allreduce_s(make(rpm=2), 4, M), expected)


def test_hierarchical_allreduce_shared_and_own_cards():
    # 8 ranks = 2 machines x 4. Inside: reduce-scatter + all-gather, 2(L-1) steps of M/L.
    # Across: 4 rings of M/4 each over 2 machines, 2(m-1) = 2 steps of (M/4)/2 per ring.
    inside = 6 * (1e-5 + 250_000 / 1e10)
    shared = 2 * (1e-4 + 4 * 125_000 / 1e9)  # the 4 rings share one card
    own = 2 * (1e-4 + 125_000 / 1e9)  # one card per rank
    reduce = (0.75 * M + 0.5 * 250_000) / R
    assert close(costmodel.hierarchical_allreduce_s(make(rpm=4, reduce=R), 8, M), inside + shared + reduce)
    assert close(costmodel.hierarchical_allreduce_s(make(rpm=4, nic_shared=False, reduce=R), 8, M), inside + own + reduce)
    # one machine: the same as a flat ring
    assert close(costmodel.hierarchical_allreduce_s(make(reduce=R), 4, M), costmodel.ring_allreduce_s(make(reduce=R), 4, M))
    assert close(costmodel.allreduce_s(make(rpm=4, allreduce="hierarchical"), 8, M), inside + shared)


def test_one_peer_exp2_with_card_contention():
    # 4 ranks, 2 per machine. t=0 (distance 1): 0->1 and 2->3 inside, 1->2 and 3->0 across:
    # each card carries one message out and one in. t=1 (distance 2): every message crosses,
    # so each shared card carries two out and two in. Everyone then combines 2 vectors.
    topo = OnePeerExp2(4)
    combine = 2 * M / R
    t0 = max(1e-5 + M / 1e10, 1e-4 + M / 1e9) + combine
    t1_shared = 1e-4 + 2 * M / 1e9 + combine
    t1_own = 1e-4 + M / 1e9 + combine
    c = make(rpm=2, reduce=R)
    assert close(costmodel.exchange_s(c, 4, costmodel.topology_edges(topo, 0), M), t0)
    assert close(costmodel.exchange_s(c, 4, costmodel.topology_edges(topo, 1), M), t1_shared)
    assert close(costmodel.neighbor_exchange_s(c, topo, M), (t0 + t1_shared) / 2)
    own = make(rpm=2, nic_shared=False, reduce=R)
    assert close(costmodel.neighbor_exchange_s(own, topo, M), (t0 + t1_own) / 2)


def test_multi_peer_static_exp2_on_one_machine():
    # exp2 over 8 ranks: 3 out-neighbors and 3 in-neighbors each; 4 vectors to combine
    expected = 1e-5 + 3 * M / 1e10 + 4 * M / R
    assert close(costmodel.neighbor_exchange_s(make(reduce=R), Exp2(8), M), expected)


def test_inner_outer_exp2_sends_one_message_per_machine_across():
    # 8 ranks, 4 per machine: each step one rank per machine crosses (one message out
    # and one in per card), the other three exchange inside; every rank combines 2.
    topo = InnerOuterExp2(8, ranks_per_machine=4)
    expected = max(1e-5 + M / 1e10, 1e-4 + M / 1e9) + 2 * M / R
    c = make(rpm=4, reduce=R)
    for t in range(topo.period):
        assert close(costmodel.exchange_s(c, 8, costmodel.topology_edges(topo, t), M), expected)
    # one-peer exp2 on the same machines at distance 4 sends all 4 ranks' models through each card
    worst = costmodel.exchange_s(c, 8, costmodel.topology_edges(OnePeerExp2(8), 2), M)
    assert close(worst, 1e-4 + 4 * M / 1e9 + 2 * M / R)


def test_algorithm_traffic():
    # each algorithm class states what one communicating step sends
    c = make(reduce=R)
    topo = OnePeerExp2(4)
    one = costmodel.neighbor_exchange_s(c, topo, M)
    assert close(costmodel.communication_s(c, DSGD.traffic, 4, M, topo), one)
    assert close(costmodel.communication_s(c, ExactDiffusion.traffic, 4, M, topo), one)
    # gradient tracking moves x and y: two model-sized vectors per message
    assert close(costmodel.communication_s(c, GradientTracking.traffic, 4, M, topo), costmodel.neighbor_exchange_s(c, topo, 2 * M))
    # push-sum's weight travels with the data: one more element
    assert close(costmodel.communication_s(c, PushSum.traffic, 4, M, topo, 4), costmodel.neighbor_exchange_s(c, topo, M + 4))
    assert close(costmodel.communication_s(c, Allreduce.traffic, 4, M), costmodel.ring_allreduce_s(c, 4, M))
    assert costmodel.communication_s(c, DSGD.traffic, 1, M, OnePeerExp2(1)) == 0.0


def test_compressed_messages_are_priced_as_they_travel():
    # a model of D float32 elements; top-k 1%: k values of 4 bytes + k int32 indices
    d = 250_000
    top_k = costmodel.Traffic("neighbor", density=0.01, index_bits=32)
    assert close(top_k.message_bytes(4 * d, 4), 0.01 * d * 8)
    # QSGD at 4 bits plus its norm; sign at 1 bit plus its scale; bf16 at 2 bytes
    assert close(costmodel.Traffic("neighbor", value_bits=4, scalars=1).message_bytes(4 * d, 4), d / 2 + 4)
    assert close(costmodel.Traffic("neighbor", value_bits=1, scalars=1).message_bytes(4 * d, 4), d / 8 + 4)
    assert close(costmodel.Traffic("neighbor", value_bits=16).message_bytes(4 * d, 4), 2 * d)
    # the exchange carries the compressed message: exp2 over 8 ranks, 3 out of each, 4 to combine
    c = make(reduce=R)
    expected = 1e-5 + 3 * 0.01 * d * 8 / 1e10 + 4 * 0.01 * d * 8 / R
    assert close(costmodel.communication_s(c, top_k, 8, 4 * d, Exp2(8)), expected)
    # a receiver that decodes each of its 3 messages into a dense vector of 4d bytes and adds it: two
    # dense vectors' combine per message, and nothing for its own (the single-rank compute decodes that)
    decoded = costmodel.Traffic("neighbor", density=0.01, index_bits=32, decoded=True)
    expected = 1e-5 + 3 * 0.01 * d * 8 / 1e10 + 3 * 2 * 4 * d / R
    assert close(costmodel.communication_s(c, decoded, 8, 4 * d, Exp2(8)), expected)
    # with one rank per machine at 0.5 cores, the combine runs at half a core's rate
    slow = make(rpm=1, reduce=R, cores=0.5)
    expected = 1e-4 + 3 * 0.01 * d * 8 / 1e9 + 2 * 3 * 2 * 4 * d / R
    assert close(costmodel.communication_s(slow, decoded, 8, 4 * d, Exp2(8)), expected)
    with pytest.raises(ValueError, match="density"):
        costmodel.Traffic("neighbor", density=0.0)


def test_an_allgather_of_compressed_payloads():
    # 4 ranks on 2 machines: n-1 = 3 steps, each paced by the slower hop; nothing reduced
    expected = 3 * max(1e-5 + M / 1e10, 1e-4 + M / 1e9)
    assert close(costmodel.ring_allgather_s(make(rpm=2, reduce=R), 4, M), expected)
    traffic = costmodel.Traffic("allgather", density=0.01, index_bits=32)
    msg = 0.01 * (M / 4) * 8
    assert close(costmodel.communication_s(make(), traffic, 4, M), 3 * (1e-5 + msg / 1e10))
    # every rank decodes the 3 payloads it received into dense vectors of M bytes and adds them
    decoded = costmodel.Traffic("allgather", density=0.01, index_bits=32, decoded=True)
    assert close(costmodel.communication_s(make(reduce=R), decoded, 4, M), 3 * (1e-5 + msg / 1e10) + 3 * 2 * M / R)


def test_the_median_of_the_slowest_of_k_ranks_by_hand():
    times = [4.0, 1.0, 3.0, 2.0, 5.0]
    # the median of one draw is the middle value; of the slowest of 2, the 0.5^(1/2) = 0.7071 quantile:
    # position 4 x 0.7071 = 2.828 between 3 and 4
    assert close(costmodel.median_slowest(times, 1), 3.0)
    assert close(costmodel.median_slowest(times, 2), 3.0 + (4 * 0.5 ** 0.5 - 2))
    skewed = [0.10, 0.11, 0.11, 0.12, 0.13, 0.30]
    for k in (1, 2, 3, 4, 8):
        assert close(costmodel.median_slowest(skewed, k), float(np.quantile(skewed, 0.5 ** (1 / k))))
    assert costmodel.median_slowest([5.0], 3) == 5.0


def test_an_exchange_waits_on_the_ranks_it_hears_from():
    neighbor, allreduce = costmodel.Traffic("neighbor"), costmodel.Traffic("allreduce")
    assert costmodel.waited_ranks(allreduce, 8) == 8
    assert costmodel.waited_ranks(costmodel.Traffic("allgather"), 8) == 8
    assert costmodel.waited_ranks(neighbor, 8, Exp2(8)) == 4  # itself and its 3 in-neighbors
    assert costmodel.waited_ranks(neighbor, 4, Exp2(4)) == 3
    assert costmodel.waited_ranks(neighbor, 8, OnePeerExp2(8)) == 2  # one in-neighbor at every t


def test_the_wait_for_the_slowest_rank_by_hand():
    times = [0.10, 0.11, 0.11, 0.12, 0.13, 0.30]

    def slowest(k):  # numpy's quantile of the same times: the median of the slowest of k
        return float(np.quantile(times, 0.5 ** (1 / k)))

    allreduce, neighbor = costmodel.Traffic("allreduce"), costmodel.Traffic("neighbor")
    # an allreduce over 4 ranks waits on all 4; one-peer exp2 on a rank and its one in-neighbor
    assert close(costmodel.straggler_wait_s(times, allreduce, 4), slowest(4) - slowest(1))
    assert close(costmodel.straggler_wait_s(times, neighbor, 4, OnePeerExp2(4)), slowest(2) - slowest(1))
    # every 4 steps: the slowest of 4-step sums, whose spread is twice one step's: half a step's wait per step
    assert close(costmodel.straggler_wait_s(times, allreduce, 4, period=4), (slowest(4) - slowest(1)) / 2)
    # Gossip-PGA every 3rd exchange: two neighbor waits and one allreduce wait
    pga = costmodel.Traffic("neighbor", global_every=3)
    expected = (2 * (slowest(2) - slowest(1)) + slowest(4) - slowest(1)) / 3
    assert close(costmodel.straggler_wait_s(times, pga, 4, OnePeerExp2(4)), expected)
    # of 20 rounds, one disturbed (0.3 s, then 3 s) sits beyond the 0.84 quantile 4 ranks wait on
    rounds = [0.100 + 0.001 * i for i in range(19)]
    assert close(costmodel.straggler_wait_s(rounds + [3.0], allreduce, 4),
                 costmodel.straggler_wait_s(rounds + [0.3], allreduce, 4))
    # one rank waits on nobody; equal times make no wait
    assert costmodel.straggler_wait_s(times, allreduce, 1) == 0.0
    assert costmodel.straggler_wait_s([0.2] * 5, allreduce, 8) == 0.0


def test_gossip_pga_prices_one_exact_average_every_h_exchanges():
    c = make(reduce=R)
    topo = OnePeerExp2(8)
    gossip = costmodel.neighbor_exchange_s(c, topo, M)
    average = costmodel.ring_allreduce_s(c, 8, M)
    pga = costmodel.Traffic("neighbor", global_every=10)
    assert close(costmodel.communication_s(c, pga, 8, M, topo), (9 * gossip + average) / 10)
    assert close(costmodel.communication_s(c, costmodel.Traffic("neighbor", global_every=1), 8, M, topo), average)
    # compressed gossip, uncompressed averages
    both = costmodel.Traffic("neighbor", density=0.01, index_bits=32, global_every=4)
    small = costmodel.neighbor_exchange_s(c, topo, 0.01 * (M / 4) * 8)
    assert close(costmodel.communication_s(c, both, 8, M, topo, 4), (3 * small + average) / 4)


def test_each_algorithm_states_its_traffic_with_its_options():
    from bfexp.algorithms import ChocoSGD, CompressedAllreduce, DiLoCo, QGDSGDm, SlowMo

    T = costmodel.Traffic
    assert ChocoSGD.traffic_of(compressor="top_k") == T("neighbor", density=0.01, index_bits=32, decoded=True)
    assert ChocoSGD.traffic_of(compressor={"_target_": "bfexp.compression.QSGD", "bits": 2},
                               global_average_every=5) == T("neighbor", value_bits=2, scalars=1, global_every=5,
                                                            decoded=True)
    assert CompressedAllreduce.traffic_of(compressor="sign") == T("allgather", value_bits=1, scalars=1, decoded=True)
    assert ChocoSGD.traffic_of(compressor="identity") == T("neighbor", decoded=True)
    assert DSGD.traffic_of(global_average_every=10) == T("neighbor", global_every=10)
    assert DSGD.traffic_of() == DSGD.traffic and Allreduce.traffic_of() == Allreduce.traffic
    assert DiLoCo.traffic_of(average="allreduce") == T("allreduce")
    assert DiLoCo.traffic_of(average="topology", global_average_every=3) == T("neighbor", global_every=3)
    assert SlowMo.traffic_of(average="allreduce").kind == "allreduce" and QGDSGDm.traffic_of() == T("neighbor")


def test_an_outer_period_spreads_its_exchange():
    # DiLoCo syncing every 20 steps: one allreduce of the model, nothing hidden, a twentieth per step
    comm = costmodel.ring_allreduce_s(make(reduce=R), 8, M)
    est = costmodel.step_estimate(0.09, comm, overlap=False, period=20)
    assert close(est.exposed_comm_s, comm / 20) and close(est.step_s, 0.09 + comm / 20)


def test_overlap_and_local_sgd_period():
    # compute 90 ms, backward = 2/3 of it = 60 ms hides that much communication
    est = costmodel.step_estimate(0.09, 0.1, backward_fraction=2 / 3, overlap=True, period=1)
    assert close(est.exposed_comm_s, 0.04) and close(est.step_s, 0.13)
    assert close(costmodel.step_estimate(0.09, 0.1, backward_fraction=2 / 3, overlap=False).step_s, 0.19)
    # communicating every 4th step spreads the exposed part over 4 steps
    assert close(costmodel.step_estimate(0.09, 0.1, backward_fraction=2 / 3, overlap=True, period=4).step_s, 0.09 + 0.01)
    assert close(costmodel.step_estimate(0.09, 0.05, backward_fraction=2 / 3).step_s, 0.09)  # fully hidden
    assert close(est.throughput(8, 32), 8 * 32 / 0.13)
    # waiting 20 ms a step for the slowest rank adds to the step, hides nothing and hides behind nothing
    waited = costmodel.step_estimate(0.09, 0.1, backward_fraction=2 / 3, overlap=True, wait_s=0.02)
    assert close(waited.step_s, 0.15) and close(waited.exposed_comm_s, 0.04) and waited.wait_s == 0.02
    assert close(waited.throughput(8, 32), 8 * 32 / 0.15)


def test_buckets_backward_releases_hide_what_they_can():
    # backward 60 ms, communication 100 ms. One bucket waits for the end of backward: all 100 ms show.
    assert close(costmodel.step_estimate(0.09, 0.1, buckets=1).exposed_comm_s, 0.1)
    # 4 buckets of 25 ms, ready at 15, 30, 45, 60 ms: the link is busy from 15 ms to 115 ms, 55 ms past backward
    assert close(costmodel.step_estimate(0.09, 0.1, buckets=4).exposed_comm_s, 0.1 - 0.06 * 3 / 4)
    # 4 buckets of 5 ms each: the last one, ready at 60 ms, still takes its 5 ms after backward
    assert close(costmodel.step_estimate(0.09, 0.02, buckets=4).exposed_comm_s, 0.005)
    # without overlap the buckets change nothing
    assert close(costmodel.step_estimate(0.09, 0.1, overlap=False, buckets=4).exposed_comm_s, 0.1)


def test_ranks_sharing_cores_slow_copies_and_reductions():
    # 4 ranks on 2 cores: bandwidth and reduce terms twice as slow, latency unchanged
    n = 4
    expected = 6 * (1e-5 + 2 * 250_000 / 1e10) + 2 * 0.75 * M / R
    assert close(costmodel.ring_allreduce_s(make(reduce=R, cores=2), n, M), expected)
    assert close(costmodel.ring_allreduce_s(make(reduce=R, cores=8), n, M), costmodel.ring_allreduce_s(make(reduce=R), n, M))


S = 5e8  # a network stack that moves 0.5 GB/s a core


def one_per_machine(cores=0.0, stack=S, switch=math.inf):
    return Cluster("hosts", 1, Link(A_IN, B_IN), Link(A_OUT, B_OUT), True, R, cores, "ring", stack, switch)


def test_one_rank_per_machine_ring_has_no_hop_inside_a_machine_and_pays_the_slower_of_stack_and_wire():
    # 4 machines x 1 rank: 6 steps, each a cross-machine chunk of M/4 on the wire (0.25 ms at 1 GB/s) while the
    # rank's stack moves the chunk it sends and the one it receives (1 ms at 0.5 GB/s): the stack paces the step;
    # no shared-memory hop at all
    n, chunk = 4, 250_000
    expected = 6 * (1e-4 + 2 * chunk / S) + 0.75 * M / R
    assert close(costmodel.ring_allreduce_s(one_per_machine(), n, M), expected)
    # a quota of 0.4 cores slows the stack and the reduction by 1 / 0.4, not the wire
    expected = 6 * (1e-4 + 2.5 * 2 * chunk / S) + 2.5 * 0.75 * M / R
    assert close(costmodel.ring_allreduce_s(one_per_machine(cores=0.4), n, M), expected)
    # a stack 10x faster (0.1 ms a step) hides under the wire's 0.25 ms
    expected = 6 * (1e-4 + chunk / 1e9) + 0.75 * M / R
    assert close(costmodel.ring_allreduce_s(one_per_machine(stack=10 * S), n, M), expected)
    # no stack cost: the ring of before
    free = one_per_machine(stack=math.inf)
    assert close(costmodel.ring_allreduce_s(free, n, M), 6 * (1e-4 + chunk / 1e9) + 0.75 * M / R)


def test_an_exchange_pays_the_stack_for_what_a_rank_sends_and_receives():
    # static exp2 on 4 machines: each rank sends M to 2 peers and receives M from 2; the card's busier direction
    # carries 2M (2 ms), the stack moves 4M (8 ms) and paces it, then the rank combines 3 vectors
    expected = 1e-4 + 4 * M / S + 3 * M / R
    assert close(costmodel.exchange_s(one_per_machine(), 4, costmodel.topology_edges(Exp2(4), 0), M), expected)
    # one-peer exp2: M out, M in
    expected = 1e-4 + 2 * M / S + 2 * M / R
    assert close(costmodel.exchange_s(one_per_machine(), 4, costmodel.topology_edges(OnePeerExp2(4), 0), M), expected)
    # on a link 8x slower (0.125 GB/s: 16 ms for 2M) the stack's 8 ms hides under the wire
    slow = Cluster("hosts", 1, Link(A_IN, B_IN), Link(A_OUT, 1.25e8), True, R, 0.0, "ring", S)
    expected = 1e-4 + 2 * M / 1.25e8 + 3 * M / R
    assert close(costmodel.exchange_s(slow, 4, costmodel.topology_edges(Exp2(4), 0), M), expected)


def test_a_switch_that_forwards_less_than_every_link_paces_the_steps_it_cannot_keep_up_with():
    # the emulated cluster's hosts share one kernel: every machine's bytes of a step pass it at once
    n, chunk, sw = 4, 250_000, 5e8  # the switch forwards 0.5 GB/s in all
    switched = one_per_machine(switch=sw)
    # a ring step: 4 chunks cross at once, 4 x 250 kB / 0.5 GB/s = 2 ms, slower than one link's 0.25 ms and the
    # stack's 1 ms
    expected = 6 * (1e-4 + 4 * chunk / sw) + 0.75 * M / R
    assert close(costmodel.ring_allreduce_s(switched, n, M), expected)
    # static exp2 exchange: 8 messages of M cross the switch (16 ms) against a card's 2M (2 ms), the stack's 4M (8 ms)
    expected = 1e-4 + 8 * M / sw + 3 * M / R
    assert close(costmodel.exchange_s(switched, 4, costmodel.topology_edges(Exp2(4), 0), M), expected)
    # one message alone (0 -> 1) has the switch to itself: M / 0.5 GB/s, as long as the stack's M / 0.5 GB/s;
    # the receiver also combines
    expected = 1e-4 + M / sw + 2 * M / R
    assert close(costmodel.exchange_s(switched, 4, [(0, 1)], M), expected)
    # a switch faster than the links need changes nothing: 4 x 250 kB at 10 GB/s = 0.1 ms < 0.25 ms
    assert close(costmodel.ring_allreduce_s(one_per_machine(switch=1e10), n, M),
                 costmodel.ring_allreduce_s(one_per_machine(), n, M))


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="ranks=12 is not a multiple"):
        make(rpm=8).local_size(12)
    with pytest.raises(ValueError, match="allowed: ring, hierarchical"):
        costmodel.allreduce_s(make(allreduce="tree"), 4, M)


def test_the_cost_model_imports_neither_torch_nor_the_algorithms():
    # algorithms import the cost model (their traffic), never the reverse; the driver prices jobs without torch
    import subprocess
    import sys

    code = "import sys, bfexp.costmodel; print(sorted(m for m in sys.modules if m in ('torch', 'bfexp.algorithms')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
