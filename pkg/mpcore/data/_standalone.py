"""torch.utils.data's pieces for programs without torch: datasets,
samplers, collation into numpy arrays, worker info, and the DataLoader's
construction rules (with torch's messages).  Used only when torch is not
installed (_compat.py); random draws use numpy's generators.  The
DataLoader's own rules without torch are in _base.py."""
import collections.abc
import copy
import random
import sys
import traceback

import numpy as np

MAP, ITERABLE = 0, 1


class Dataset:
    def __getitem__(self, index):
        raise NotImplementedError("Subclasses of Dataset should implement __getitem__.")


class IterableDataset(Dataset):
    def __iter__(self):
        raise NotImplementedError("Subclasses of IterableDataset should implement __iter__.")


class Sampler:
    def __init__(self, data_source=None):
        pass

    def __iter__(self):
        raise NotImplementedError


class SequentialSampler(Sampler):
    def __init__(self, data_source):
        self.data_source = data_source

    def __iter__(self):
        return iter(range(len(self.data_source)))

    def __len__(self):
        return len(self.data_source)


def _rng(generator):
    if generator is None:
        return np.random.default_rng(np.random.randint(0, 2**63 - 1, dtype=np.int64))
    return generator


class RandomSampler(Sampler):
    def __init__(self, data_source, replacement=False, num_samples=None, generator=None):
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator
        if not isinstance(self.replacement, bool):
            raise TypeError(f"replacement should be a boolean value, but got replacement={self.replacement}")
        if not isinstance(self.num_samples, int) or self.num_samples <= 0:
            raise ValueError(f"num_samples should be a positive integer value, but got num_samples={self.num_samples}")

    @property
    def num_samples(self):
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self):
        n = len(self.data_source)
        rng = _rng(self.generator)
        if self.replacement:
            yield from rng.integers(0, n, size=self.num_samples).tolist()
            return
        for _ in range(self.num_samples // n):
            yield from rng.permutation(n).tolist()
        yield from rng.permutation(n)[: self.num_samples % n].tolist()

    def __len__(self):
        return self.num_samples


class SubsetRandomSampler(Sampler):
    def __init__(self, indices, generator=None):
        self.indices = indices
        self.generator = generator

    def __iter__(self):
        for i in _rng(self.generator).permutation(len(self.indices)).tolist():
            yield self.indices[i]

    def __len__(self):
        return len(self.indices)


class WeightedRandomSampler(Sampler):
    def __init__(self, weights, num_samples, replacement=True, generator=None):
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples <= 0:
            raise ValueError(f"num_samples should be a positive integer value, but got num_samples={num_samples}")
        self.weights = np.asarray(weights, dtype=np.float64)
        self.num_samples = num_samples
        self.replacement = replacement
        self.generator = generator

    def __iter__(self):
        p = self.weights / self.weights.sum()
        yield from _rng(self.generator).choice(len(p), self.num_samples, self.replacement, p).tolist()

    def __len__(self):
        return self.num_samples


class BatchSampler(Sampler):
    def __init__(self, sampler, batch_size, drop_last):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size should be a positive integer value, but got batch_size={batch_size}")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self):
        batch = []
        for i in self.sampler:
            batch.append(i)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self):
        if self.drop_last:
            return len(self.sampler) // self.batch_size
        return (len(self.sampler) + self.batch_size - 1) // self.batch_size


class InfiniteConstantSampler(Sampler):
    """torch's _InfiniteConstantSampler: what an iterable-style dataset's
    loader draws its (None) indices from."""

    def __iter__(self):
        while True:
            yield None


# --- collation -----------------------------------------------------------

_ERR = ("default_collate: batch must contain numpy arrays, numbers, dicts or lists; "
        "found {}")


def default_convert(data):
    return data


def default_collate(batch):
    elem = batch[0]
    if isinstance(elem, np.ndarray):
        if elem.dtype.kind in "SaUOV":
            raise TypeError(_ERR.format(elem.dtype))
        return np.stack(batch)
    if isinstance(elem, (np.bool_, np.number)):
        return np.array(batch)
    if isinstance(elem, float):
        return np.array(batch, dtype=np.float64)
    if isinstance(elem, bool):
        return np.array(batch)
    if isinstance(elem, int):
        return np.array(batch, dtype=np.int64)
    if isinstance(elem, (str, bytes)):
        return batch
    if isinstance(elem, collections.abc.Mapping):
        out = {key: default_collate([d[key] for d in batch]) for key in elem}
        if isinstance(elem, collections.abc.MutableMapping):
            clone = copy.copy(elem)
            clone.update(out)
            return clone
        try:
            return type(elem)(out)
        except TypeError:
            return out
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        return type(elem)(*(default_collate(s) for s in zip(*batch)))
    if isinstance(elem, collections.abc.Sequence):
        size = len(elem)
        if not all(len(e) == size for e in batch):
            raise RuntimeError("each element in list of batch should be of equal size")
        cols = [default_collate(s) for s in zip(*batch)]
        if isinstance(elem, tuple):
            return cols
        try:
            return type(elem)(cols)
        except TypeError:
            return cols
    raise TypeError(_ERR.format(type(elem)))


# --- workers ----------------------------------------------------------------

class WorkerInfo:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

    def __repr__(self):
        items = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"WorkerInfo({items})"


_worker_info = None


def get_worker_info():
    """In a DataLoader worker: id, num_workers, seed and dataset; None
    elsewhere."""
    return _worker_info


def set_worker_info(worker_id, num_workers, seed, dataset):
    global _worker_info
    _worker_info = WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)


def base_seed(generator):
    if generator is None:
        return random.getrandbits(63)
    return int(generator.integers(0, 2**63 - 1))


def numpy_seed(base, worker_id):
    return np.random.SeedSequence([worker_id, base & 0xFFFFFFFF, base >> 32]).generate_state(4)


class ExceptionWrapper:
    """An exception and its traceback, re-raised in another process with
    the place it happened."""

    def __init__(self, exc_info=None, where="in background"):
        if exc_info is None:
            exc_info = sys.exc_info()
        self.exc_type = exc_info[0]
        self.exc_msg = "".join(traceback.format_exception(*exc_info))
        self.where = where

    def reraise(self):
        msg = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
        try:
            exception = self.exc_type(msg)
        except Exception:
            raise RuntimeError(msg) from None
        raise exception
