import bluefog.torch as bf
import argparse
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data.distributed

# BlueFog's MNIST example loop with the win-put optimizer, on scikit-learn's 8x8 digits (no download;
# --data is an .npz of load_digits' images and target): no barrier and no collective between the
# first broadcast and the end of training, each rank tests its own model after every epoch (with
# --dynamic-topology, from the second epoch on each rank puts to one out-neighbor a batch, in turn).
# The last line each rank prints is parsed by tests/bluefog/test_async_programs.py.

parser = argparse.ArgumentParser(description="BlueFog-style win_put digits training")
parser.add_argument("--data", required=True, help="npz with 'images' (n, 8, 8) and 'target' (n,)")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--dynamic-topology", action="store_true", help="from epoch 2, one out-neighbor a batch")
parser.add_argument("--force-barrier", action="store_true", help="lockstep: a barrier before every win_update")
args = parser.parse_args()

bf.init()
torch.manual_seed(args.seed)
digits = np.load(args.data)
images = torch.tensor(digits["images"], dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
labels = torch.tensor(digits["target"])
train_set = torch.utils.data.TensorDataset(images[:1500], labels[:1500])
test_images, test_labels = images[1500:], labels[1500:]
sampler = torch.utils.data.distributed.DistributedSampler(train_set, num_replicas=bf.size(), rank=bf.rank())
loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)


class Net(nn.Module):
    """Softmax regression on the 64 pixels (dropout on the input: each rank draws from its own RNG)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return F.log_softmax(self.fc(self.drop(x.flatten(1))), dim=1)


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * bf.size(), momentum=0.5)
bf.broadcast_parameters(model.state_dict(), root_rank=0)
bf.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = bf.DistributedWinPutOptimizer(optimizer, model=model)
optimizer.force_barrier = args.force_barrier


def test():
    model.eval()
    with torch.no_grad():
        accuracy = (model(test_images).argmax(1) == test_labels).float().mean().item()
    model.train()
    return 100.0 * accuracy


record = []
outs = bf.out_neighbor_ranks()
for epoch in range(1, args.epochs + 1):
    sampler.set_epoch(epoch)
    for batch, (data, target) in enumerate(loader):
        if args.dynamic_topology and epoch > 1:
            optimizer.dst_weights = {outs[batch % len(outs)]: 1.0}
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
    record.append(test())

bf.barrier()
optimizer.unregister_window()
mean = bf.allreduce(torch.tensor([record[-1]]), average=True).item()
print(f"rank {bf.rank()}: accuracy by epoch {[round(a, 2) for a in record]} mean final {mean:.2f}")
