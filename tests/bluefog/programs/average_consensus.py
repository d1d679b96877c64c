import bluefog.torch as bf
import argparse
import torch

# Average consensus as BlueFog's example programs write it: neighbor_allreduce rounds, or, with
# --asynchronous-mode, push-sum on one-sided windows (win_accumulate with the associated weight p,
# win_update_then_collect), with no barrier inside the loop. Every rank prints its relative error
# against the true mean (an allreduce of the start values), its p, and the error of the sum of x that
# push-sum conserves; the last two lines are parsed by the tests (tests/bluefog/test_async_programs.py).

parser = argparse.ArgumentParser(description="average consensus, BlueFog style")
parser.add_argument("--data-size", type=int, default=1000)
parser.add_argument("--max-iters", type=int, default=200)
parser.add_argument("--virtual-topology", default="expo2", choices=["expo2", "ring", "full"])
parser.add_argument("--asynchronous-mode", action="store_true")
parser.add_argument("--enable-dynamic-topology", action="store_true")
parser.add_argument("--seed", type=int, default=2020)
args = parser.parse_args()

bf.init()
if args.virtual_topology == "ring":
    bf.set_topology(bf.RingGraph(bf.size(), connect_style=1))
elif args.virtual_topology == "full":
    bf.set_topology(bf.FullyConnectedGraph(bf.size()))

torch.manual_seed(args.seed * (bf.rank() + 1))
x = torch.randn(args.data_size, dtype=torch.double)
x_bar = bf.allreduce(x, average=True)


def relative_error(value):
    return (torch.norm(value - x_bar) / torch.norm(x_bar)).item()


p = 1.0
if not args.asynchronous_mode:
    for _ in range(args.max_iters):
        x = bf.neighbor_allreduce(x, name="x")
else:
    outs = bf.out_neighbor_ranks()
    bf.turn_on_win_ops_with_associated_p()
    bf.win_create(x, name="x", zero_init=True)
    for i in range(args.max_iters):
        if args.enable_dynamic_topology:  # one out-neighbor a round, half of the mass to it
            self_weight, dst_weights = 0.5, {outs[i % len(outs)]: 0.5}
        else:
            self_weight = 1.0 / (len(outs) + 1)
            dst_weights = {r: self_weight for r in outs}
        bf.win_accumulate(x, name="x", self_weight=self_weight, dst_weights=dst_weights, require_mutex=True)
        bf.win_update_then_collect(name="x")
    bf.barrier()  # every push has landed: collect the last ones
    bf.win_update_then_collect(name="x")
    p = bf.win_associated_p(name="x")
    x = x / p
    bf.turn_off_win_ops_with_associated_p()
    bf.win_free(name="x")

p_mean = bf.allreduce(torch.tensor([p], dtype=torch.double), average=True).item()
# what push-sum keeps in any order of the ranks' loops: the sum of x (p times each estimate)
mass_error = relative_error(bf.allreduce(x * p, average=True))
print(f"rank {bf.rank()}: mass error {mass_error:.3e}")
print(f"rank {bf.rank()}: relative error {relative_error(x):.3e} p {p:.6g} mean p {p_mean:.17g}")
