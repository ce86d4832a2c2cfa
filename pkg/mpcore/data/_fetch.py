"""The DataLoader's fetcher: the samples of one task, from a map-style or
an iterable-style dataset, as torch's fetchers get them, stopping short of
collation (the worker collates, into shared memory when it can)."""
from . import _compat


class Fetcher:
    """torch's map-style and iterable-style fetchers without the collate
    step.  fetch(index) raises StopIteration when an iterable ran out."""

    def __init__(self, kind, dataset, auto_collation, drop_last):
        self.kind = kind
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.drop_last = drop_last
        self.ended = False
        if kind == _compat.ITERABLE:
            self.it = iter(dataset)

    def fetch(self, index):
        if self.kind != _compat.ITERABLE:
            if not self.auto_collation:
                return self.dataset[index]
            getitems = getattr(self.dataset, "__getitems__", None)
            if getitems:
                return getitems(index)
            return [self.dataset[i] for i in index]
        if self.ended:
            raise StopIteration
        if not self.auto_collation:
            return next(self.it)
        data = []
        for _ in index:
            try:
                data.append(next(self.it))
            except StopIteration:
                self.ended = True
                break
        if not data or (self.drop_last and len(data) < len(index)):
            raise StopIteration
        return data
