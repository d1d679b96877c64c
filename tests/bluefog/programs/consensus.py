import bluefog.torch as bf
import torch

# Average consensus written against BlueFog's API: static, dynamic and push-sum window variants.
# Every rank can rebuild every rank's start value, so each checks the exact average itself.

bf.init()
n, me = bf.size(), bf.rank()


def start(r):
    g = torch.Generator().manual_seed(1000 + r)
    return torch.randn(6, generator=g, dtype=torch.float64)


x_bar = sum(start(r) for r in range(n)) / n
errors = {}


def error(x):
    return (x - x_bar).abs().max().item()


# Static exponential-2 graph, uniform weights.
bf.set_topology(bf.ExponentialTwoGraph(n))
x = start(me)
for _ in range(60):
    x = bf.neighbor_allreduce(x, name="x")
errors["static_exp2"] = error(x)

# Static ring with the graph's own weights (is_weighted), nonblocking form.
bf.set_topology(bf.RingGraph(n), is_weighted=True)
x = start(me)
for _ in range(60):
    handle = bf.neighbor_allreduce_nonblocking(x, name="x")
    x = bf.synchronize(handle)
errors["static_ring_weighted"] = error(x)

# Dynamic one-peer exponential-2: one message per rank and iteration.
bf.set_topology(bf.ExponentialTwoGraph(n))
schedule = bf.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), me)
x = start(me)
for _ in range(40):
    send, recv = next(schedule)
    w = 1.0 / (len(recv) + 1)
    x = bf.neighbor_allreduce(x, self_weight=w, src_weights={r: w for r in recv}, dst_weights=send,
                              enable_topo_check=False)
errors["dynamic_one_peer"] = error(x)

# Hierarchical: machine average, then a ring among machines.
bf.set_machine_topology(bf.RingGraph(bf.machine_size()))
x = bf.hierarchical_neighbor_allreduce(start(me))
for _ in range(30):
    x = bf.hierarchical_neighbor_allreduce(x)
errors["hierarchical"] = error(x)

# Asynchronous push-sum: win_accumulate with the associated weight p, no barrier in the loop (BlueFog's
# example's asynchronous mode): one barrier at the end, so every push has landed, a last collect, then x / p.
outs = bf.out_neighbor_ranks()
bf.turn_on_win_ops_with_associated_p()
x = start(me)
bf.win_create(x, name="x", zero_init=True)
for i in range(100):
    w = 1.0 / (len(outs) + 1)
    bf.win_accumulate(x, name="x", self_weight=w, dst_weights={r: w for r in outs}, require_mutex=True)
    bf.win_update_then_collect(name="x")
bf.barrier()
bf.win_update_then_collect(name="x")
mass = bf.allreduce(x, average=False)  # nothing lost in flight: sum of x stays sum of the starts
p_total = bf.allreduce(torch.tensor([bf.win_associated_p("x")], dtype=torch.float64), average=False)
errors["push_sum_accumulate"] = error(x / bf.win_associated_p("x"))
errors["push_sum_mass"] = (mass - n * x_bar).abs().max().item()
errors["push_sum_p_total"] = abs(p_total.item() - n)
bf.win_free("x")

# Synchronous push-sum over a dynamic graph with win_put: one out-neighbor per iteration, weight 1/2.
y = start(me)
bf.win_create(y, name="y", zero_init=True)
for i in range(60):
    bf.win_put(y, name="y", self_weight=0.5, dst_weights={outs[i % len(outs)]: 0.5})
    bf.barrier()
    with bf.win_mutex("y", for_self=True):
        bf.win_update_then_collect(name="y")
    bf.barrier()
errors["push_sum_put_dynamic"] = error(y / bf.win_associated_p("y"))
bf.win_free()
bf.turn_off_win_ops_with_associated_p()

# Collectives, checked against values every rank can compute.
checks = {
    "allreduce_sum": bf.allreduce(torch.tensor([float(me)]), average=False).item() == n * (n - 1) / 2,
    "allgather": bf.allgather(torch.full((me + 1, 2), float(me))).tolist()
    == [[float(r)] * 2 for r in range(n) for _ in range(r + 1)],
    "broadcast": bf.broadcast(torch.tensor([float(me)]), root_rank=n - 1).item() == n - 1,
    "local_allreduce": bf.allreduce(torch.tensor([float(me)]), is_hierarchical_local=True).item()
    == sum(range(bf.machine_rank() * bf.local_size(), (bf.machine_rank() + 1) * bf.local_size())) / bf.local_size(),
}
bf.set_topology(bf.ExponentialTwoGraph(n))
srcs = sorted(bf.in_neighbor_ranks(), reverse=True)  # a requested order that is not ascending
gathered = bf.neighbor_allgather(torch.full((1, 2), float(me)), src_ranks=srcs, dst_ranks=bf.out_neighbor_ranks())
checks["neighbor_allgather_order"] = gathered[:, 0].tolist() == [float(r) for r in srcs]
checks["infer_sources"] = sorted(bf.InferSourceFromDestinationRanks(bf.out_neighbor_ranks())) == sorted(
    bf.in_neighbor_ranks())
bf.barrier()

RESULT = {"errors": errors, "checks": checks}
