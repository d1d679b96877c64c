"""PyTorch's classic MNIST example, shrunk to scikit-learn's 8x8 digits (no download): a plain
single-process script. tests/data/mnist_style_train_bf.py is the same script made decentralized
with bfexp; tests/test_bfexp_run.py checks that at most three lines differ."""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import bfexp as bf
from sklearn.datasets import load_digits
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def digits() -> tuple[TensorDataset, TensorDataset]:
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = (x - 0.3) / 0.4
    y = torch.tensor(data.target, dtype=torch.int64)
    return TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])


def train(args, model, train_loader, optimizer, epoch):
    model.train()
    seen, total = 0, 0.0
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        seen += len(data)
        total += float(data.sum())
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}]\tLoss: {loss.item():.8f}")
    print(f"Epoch {epoch}: trained on {seen} samples, input sum {total:.6f}")


def test(model, test_loader):
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += int((output.argmax(dim=1) == target).sum())
    test_loss /= len(test_loader.dataset)
    print(f"Test set: Average loss: {test_loss:.8f}, Accuracy: {correct}/{len(test_loader.dataset)}")


def main():
    parser = argparse.ArgumentParser(description="PyTorch digits example")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    train_set, test_set = digits()
    train_loader = bf.shard(DataLoader(train_set, batch_size=args.batch_size, shuffle=True))
    test_loader = DataLoader(test_set, batch_size=256)

    model = Net()
    optimizer = bf.DistributedOptimizer(optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), model)
    print(f"Initial parameters: checksum {sum(float(p.detach().double().sum()) for p in model.parameters()):.12f}")

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, train_loader, optimizer, epoch)
        test(model, test_loader)
        scheduler.step()


if __name__ == "__main__":
    main()
