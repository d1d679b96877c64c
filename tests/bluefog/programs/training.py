import bluefog.torch as bf
import argparse
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data.distributed

# The MNIST example's loop written against BlueFog's API, on scikit-learn's 8x8 digits (no download;
# --data is an .npz of sklearn.datasets.load_digits' images and target): each distributed optimizer
# wrapper, with its per-step dynamic weights set through its attributes.

parser = argparse.ArgumentParser(description="BlueFog-style digits training")
parser.add_argument("--data", required=True, help="npz with 'images' (n, 8, 8) and 'target' (n,)")
args = parser.parse_args()

bf.init()
torch.manual_seed(7)
digits = np.load(args.data)
images = torch.tensor(digits["images"], dtype=torch.float32).view(-1, 64) / 16.0
labels = torch.tensor(digits["target"])
dataset = torch.utils.data.TensorDataset(images, labels)
sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=bf.size(), rank=bf.rank())
loader = torch.utils.data.DataLoader(dataset, batch_size=64, sampler=sampler)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def full_loss(model):
    model.eval()
    with torch.no_grad():
        loss = F.nll_loss(model(images), labels).item()
    model.train()
    return bf.allreduce(torch.tensor([loss]), name="loss").item()


def make(kind):
    torch.manual_seed(bf.rank())  # different starts: broadcast_parameters must align them
    model = Net()
    if kind == "awc_adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    bf.broadcast_parameters(model.state_dict(), root_rank=0)
    bf.broadcast_optimizer_state(optimizer, root_rank=0)
    if kind in ("awc", "awc_adam"):
        optimizer = bf.DistributedAdaptWithCombineOptimizer(
            optimizer, model=model, communication_type=bf.CommunicationType.neighbor_allreduce,
            num_steps_per_communication=2 if kind == "awc_adam" else 1)
    elif kind == "atc":
        optimizer = bf.DistributedAdaptThenCombineOptimizer(optimizer, model=model)
    elif kind == "hierarchical":
        optimizer = bf.DistributedAdaptWithCombineOptimizer(
            optimizer, model=model, communication_type=bf.CommunicationType.hierarchical_neighbor_allreduce)
    elif kind == "gradient_allreduce":
        optimizer = bf.DistributedGradientAllreduceOptimizer(optimizer, model=model)
    elif kind == "win_put":
        optimizer = bf.DistributedWinPutOptimizer(optimizer, model=model)
        optimizer.force_barrier = True  # lockstep, so the test does not depend on how ranks interleave
    return model, optimizer


bf.set_topology(bf.ExponentialTwoGraph(bf.size()))
bf.set_machine_topology(bf.RingGraph(bf.machine_size()))
losses, checks = {}, {}
for kind in ["awc", "awc_adam", "atc", "hierarchical", "gradient_allreduce", "win_put"]:
    model, optimizer = make(kind)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    one_peer = bf.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), bf.rank())
    if bf.machine_size() > 1:
        machine_peer = bf.GetExp2DynamicSendRecvMachineRanks(bf.size(), bf.local_size(), bf.rank(), bf.local_rank())
    before = full_loss(model)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for batch, (data, target) in enumerate(loader):
            if kind in ("awc", "atc"):
                send, recv = next(one_peer)
                optimizer.dst_weights = send
                optimizer.src_weights = {r: 1 / (len(recv) + 1) for r in recv}
                optimizer.self_weight = 1 / (len(recv) + 1)
                optimizer.enable_topo_check = False
            elif kind == "hierarchical" and bf.machine_size() > 1:
                send, recv = next(machine_peer)
                optimizer.dst_machine_weights = send
                optimizer.src_machine_weights = {r: 1 / (len(recv) + 1) for r in recv}
                optimizer.self_weight = 1 / (len(recv) + 1)
            elif kind == "win_put":
                outs = bf.out_neighbor_ranks()
                optimizer.dst_weights = {outs[batch % len(outs)]: 1.0}
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
        scheduler.step()
    losses[kind] = (before, full_loss(model))
    try:
        optimizer.self_wieght = 0.5  # a misspelt knob
        checks[kind + "_typo_raises"] = False
    except AttributeError:
        checks[kind + "_typo_raises"] = True
    checks[kind + "_is_torch_optimizer"] = isinstance(optimizer, torch.optim.Optimizer)
    if kind == "win_put":
        optimizer.unregister_window()
    # How far apart the ranks' models ended (gradient allreduce keeps them identical).
    flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
    checks[kind + "_spread"] = (bf.allreduce(flat) - flat).abs().max().item()

RESULT = {"losses": losses, "checks": checks}
