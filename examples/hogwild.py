"""Hogwild training: 4 processes update one model's shared parameters without locks.

Each process fits its own shard of a linear-regression data set and prints its losses."""
import sys

import torch
import torch.multiprocessing as mp
from torch import nn, optim

NUM_PROCESSES = 4
EPOCHS = 10


def say(line):
    # One write per line, so that the processes' lines never mix.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def train(rank, model, optimizer, data, target):
    torch.set_num_threads(1)  # 4 processes share the cores: no thread pools per process
    criterion = nn.MSELoss()
    shard = slice(rank, None, NUM_PROCESSES)
    x, y = data[shard], target[shard]
    for epoch in range(EPOCHS):
        for i in range(0, len(x), 16):
            optimizer.zero_grad()
            loss = criterion(model(x[i:i + 16]), y[i:i + 16])
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            loss = criterion(model(x), y)
        say(f"Process {rank}, Epoch {epoch}, Loss: {loss.item():.4f}")


def main():
    torch.manual_seed(0)
    data = torch.randn(512, 10)
    true_w = torch.randn(10, 1)
    target = data @ true_w + 0.01 * torch.randn(512, 1)
    model = nn.Linear(10, 1)
    model.share_memory()  # weight and bias now live in shared memory
    # Made here, not in each process: its first use costs imports that
    # 4 processes would otherwise each pay; its parameters are the shared ones.
    optimizer = optim.SGD(model.parameters(), lr=0.05)
    criterion = nn.MSELoss()
    with torch.no_grad():
        before = criterion(model(data), target).item()
    processes = [mp.Process(target=train, args=(rank, model, optimizer, data, target))
                 for rank in range(NUM_PROCESSES)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    assert all(p.exitcode == 0 for p in processes)
    with torch.no_grad():
        after = criterion(model(data), target).item()
    print(f"loss of the shared model: {before:.4f} before, {after:.4f} after")
    assert after < before / 10, "the processes' updates did not reach the shared model"


if __name__ == "__main__":
    main()
