"""Loaders, datasets and the stream of batches that test_data_resume.py
checkpoints and resumes, shared by the test process and the fresh program
that resumes (run as `python _resume_data.py JOBS OUT`).

A config names a loader: (kind, num_workers), kind one of SAMPLERS (a
map-style dataset through that sampler) or ITERABLES (an IterableDataset,
with or without a state of its own).  A stream is EPOCHS epochs of that
loader, each batch as a list."""
import json
import sys
import warnings

import torch
from torch.utils.data import Dataset, IterableDataset, WeightedRandomSampler, get_worker_info

from mpcore.data import DataLoader

EPOCHS = 2
N_MAP, N_ITER, BATCH = 37, 45, 4
SAMPLERS = ("sequential", "shuffled", "weighted")
ITERABLES = ("iterable-stateful", "iterable-stateless")


class Items(Dataset):
    def __len__(self):
        return N_MAP

    def __getitem__(self, i):
        return torch.tensor([i, 10 * i])


class CountIter:
    """Worker w of n yields w, w + n, w + 2n, ... below `end`."""

    def __init__(self, end, worker, nworkers):
        self.end, self.step, self.pos = end, nworkers, worker

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos >= self.end:
            raise StopIteration
        v, self.pos = self.pos, self.pos + self.step
        return torch.tensor([v])


class StatefulCountIter(CountIter):
    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class Counting(IterableDataset):
    def __init__(self, stateful):
        self.cls = StatefulCountIter if stateful else CountIter

    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.cls(N_ITER, w, n)


def make(kind, num_workers, **kw):
    if kind in ITERABLES:
        return DataLoader(Counting(kind == "iterable-stateful"), batch_size=BATCH,
                          num_workers=num_workers, **kw)
    g = torch.Generator()
    g.manual_seed(7)
    if kind == "sequential":
        return DataLoader(Items(), batch_size=BATCH, num_workers=num_workers, **kw)
    if kind == "shuffled":
        return DataLoader(Items(), batch_size=BATCH, shuffle=True, generator=g,
                          num_workers=num_workers, **kw)
    sampler = WeightedRandomSampler(torch.linspace(0.1, 1.0, N_MAP), 30, generator=g)
    return DataLoader(Items(), batch_size=BATCH, sampler=sampler, num_workers=num_workers, **kw)


def stream(loader, start_epoch=0, marks=()):
    """The batches of epochs start_epoch..EPOCHS-1, and {mark: (state, the
    epoch to resume at)}: for an int mark, loader.state_dict() once that many
    batches came; for "end", once the first epoch has run out."""
    out, states = [], {}
    if 0 in marks:
        states[0] = (loader.state_dict(), start_epoch)
    for epoch in range(start_epoch, EPOCHS):
        for batch in loader:
            out.append(batch.tolist())
            if len(out) in marks:
                states[len(out)] = (loader.state_dict(), epoch)
        if epoch == start_epoch and "end" in marks:
            states["end"] = (loader.state_dict(), epoch + 1)
    return out, states


def resume(kind, num_workers, persistent, state, epoch):
    """In a new loader: the batches after `state`, to the end of the stream."""
    loader = make(kind, num_workers, persistent_workers=persistent)
    loader.load_state_dict(state)
    return stream(loader, epoch)[0]


def main(jobs_path, out_path):
    warnings.simplefilter("ignore")  # the fast-forward warning: tested in-process
    with open(jobs_path) as f:
        jobs = json.load(f)
    out = {}
    for name, (kind, num_workers, persistent, state_path, epoch) in jobs.items():
        state = torch.load(state_path, weights_only=False)
        out[name] = resume(kind, num_workers, persistent, state, epoch)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
