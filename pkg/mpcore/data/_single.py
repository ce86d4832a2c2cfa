"""Single-process iteration (num_workers=0): torch's
_SingleProcessDataLoaderIter step for step, with a position that
state_dict() saves and a saved state restores (NOTE [ Resumable loading ]
in _state.py).  Works over torch's iterator base or, without torch,
_base.DataLoaderIterBase."""
from . import _compat, _state
from ._fetch import Fetcher

torch = _compat.torch
if torch is not None:
    _IterBase = _compat.IterBase
else:
    from ._base import DataLoaderIterBase as _IterBase


class SingleIter(_state.Position, _IterBase):
    def __init__(self, loader, state=None):
        super().__init__(loader)
        self.loader_ref = _state.loader_ref(loader)
        if isinstance(self._dataset, (_compat.IterDataPipe, _compat.MapDataPipe)):
            torch.utils.data.graph_settings.apply_sharding(
                self._dataset, self._world_size, self._rank)
        self._start_epoch()
        if state is None:
            self._fetcher = self._make_fetcher()
        else:
            self._resume(state)

    def _make_fetcher(self):
        return Fetcher(self._dataset_kind, self._dataset, self._auto_collation, self._drop_last)

    def __next__(self):
        try:
            return super().__next__()
        except StopIteration:
            self.finished = True
            raise

    def _next_data(self):
        index = self._next_index()  # may raise StopIteration
        data = self._collate_fn(self._fetcher.fetch(index))  # may raise StopIteration
        if self._pin_memory:
            data = _compat.pin_memory(data, self._pin_memory_device)
        return data

    def state_dict(self):
        w = _state.worker_state(0, self._dataset_kind, self._fetcher, self._dataset)
        out = self._main_state(self._sampler_iter_yielded)
        out[_state.NUM_YIELDED] = self._num_yielded
        out[_state.W_FETCHER] = w[_state.W_FETCHER]  # the same keys as a worker's
        out[_state.W_DATASET] = w[_state.W_DATASET]
        out[_state.FINISHED] = self.finished
        return out

    def _resume(self, state):
        seed = state.get(_state.SHARED_SEED)
        if seed is not None and isinstance(self._dataset, _compat.IterDataPipe):
            self._shared_seed = seed
            rng = torch.Generator()
            rng.manual_seed(seed)
            self._dataset = _compat.apply_random_seed(self._dataset, rng)
        self._IterableDataset_len_called = state.get(_state.LEN_CALLED)
        _state.restore_sampler(self, state)
        saved = state
        _state.restore_dataset(saved, self._dataset)
        self._fetcher = self._make_fetcher()
        _state.restore_fetcher(saved, self._dataset_kind, self._fetcher)
        n = state[_state.NUM_YIELDED]
        if self._dataset_kind == _compat.ITERABLE and not _state.saved_state(saved) and n:
            _state.warn_fast_forward(n)
            _state.fast_forward(self, n)
        self._num_yielded = n
        self.finished = bool(state.get(_state.FINISHED, False))

    def __del__(self):
        _state.retire(self)
