"""mpcore.data.DataLoader used directly, and loader.stats(): is loading the
bottleneck of this loop?"""
import time

import torch
from mpcore.data import DataLoader, Dataset


class Images(Dataset):
    """Fake 3x64x64 images; each takes a little work to make."""

    def __len__(self):
        return 2048

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"image": torch.rand(3, 64, 64, generator=g), "label": i % 10}


def main():
    loader = DataLoader(Images(), batch_size=64, num_workers=2, shuffle=True)
    total = 0
    for batch in loader:
        time.sleep(0.002)  # the training step
        total += batch["label"].sum().item()
    s = loader.stats()
    print(f"{s['batches']} batches; waited {s['wait_s']:.2f} s of {s['total_s']:.2f} s "
          f"({s['wait_fraction']:.0%})")
    for w in s["workers"]:
        print(f"worker {w['id']}: {w['batches']} batches, {w['samples']} samples, "
              f"{w['batches_per_s']:.0f} batches/s while busy")
    print(f"batches ready on average: {s['ring']['mean_ready']:.1f} of {s['ring']['slots']}")
    assert total == sum(i % 10 for i in range(2048))


if __name__ == "__main__":
    main()
