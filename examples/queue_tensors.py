"""A producer process sends tensors to a consumer through torch.multiprocessing.Queue.

Under `mpcore run` the queue is mpcore's and tensors travel by shared-memory handle."""
import time

import torch
import torch.multiprocessing as mp

COUNT = 200
SHAPE = (256, 1024)  # 1 MiB of float32 per tensor


def producer(q, done):
    for i in range(COUNT):
        q.put((i, torch.full(SHAPE, float(i))))
    q.put(None)
    done.wait()  # plain torch needs the sender alive until its tensors are received


def consumer(q, results):
    received, checksum = 0, 0.0
    while True:
        item = q.get()
        if item is None:
            break
        i, t = item
        assert t.shape == SHAPE and t[0, 0].item() == i
        checksum += t[-1, -1].item()
        received += 1
    results.put((received, checksum))


def main():
    q, results, done = mp.Queue(maxsize=16), mp.Queue(), mp.Event()
    print("queue:", type(q).__module__ + "." + type(q).__qualname__,
          "| served by mpcore:", getattr(mp, "__mpcore__", False))
    start = time.perf_counter()
    procs = [mp.Process(target=producer, args=(q, done)),
             mp.Process(target=consumer, args=(q, results))]
    for p in procs:
        p.start()
    received, checksum = results.get()
    done.set()
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - start
    assert all(p.exitcode == 0 for p in procs)
    assert received == COUNT and checksum == sum(range(COUNT))
    mib = COUNT * torch.zeros(SHAPE).nbytes / 2**20
    print(f"{received} tensors ({mib:.0f} MiB) in {elapsed:.2f} s: "
          f"{received / elapsed:.0f} tensors/s, {mib / elapsed:.0f} MiB/s")


if __name__ == "__main__":
    main()
