"""A torch DataLoader with 2 worker processes over a small map-style Dataset.

Plain torch API: under `mpcore run` its workers and batches go through mpcore."""
import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        x = torch.full((8,), float(idx))
        return x, x.pow(2).sum()


def main():
    loader = DataLoader(Squares(1000), batch_size=64, num_workers=2, shuffle=False)
    batches, seen, total = 0, 0, 0.0
    for x, y in loader:
        batches += 1
        seen += len(x)
        total += y.sum().item()
    print(f"{batches} batches, {seen} samples, sum of targets {total:.0f}")
    assert seen == 1000 and batches == 16
    assert total == 8 * sum(i * i for i in range(1000))


if __name__ == "__main__":
    main()
