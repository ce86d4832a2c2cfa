"""A 4x4 tensor in shared memory, updated in place by 4 processes.

Process r adds r to row r; the parent then sees every row changed."""
import torch
import torch.multiprocessing as mp


def add_rank(shared, rank):
    shared[rank] += rank


def main():
    shared = torch.zeros(4, 4).share_memory_()
    processes = [mp.Process(target=add_rank, args=(shared, rank)) for rank in range(4)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    print(shared)
    assert all(p.exitcode == 0 for p in processes)
    assert torch.equal(shared, torch.arange(4.0).repeat_interleave(4).view(4, 4))
    print("served by mpcore:", getattr(mp, "__mpcore__", False))


if __name__ == "__main__":
    main()
