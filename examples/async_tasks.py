"""4 processes each do one second of (simulated) work at the same time.

All four start before any ends, so the whole run takes about one second."""
import sys
import time

import torch.multiprocessing as mp


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def async_task(rank):
    say(f"Starting task in process {rank}")
    time.sleep(1)  # the work
    say(f"Ending task in process {rank}")


def main():
    start = time.perf_counter()
    processes = [mp.Process(target=async_task, args=(rank,)) for rank in range(4)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    assert all(p.exitcode == 0 for p in processes)
    print(f"4 one-second tasks took {time.perf_counter() - start:.1f} s in all")


if __name__ == "__main__":
    main()
