"""What the DataLoader takes from torch when torch is installed, and the
equivalents it uses when not (_standalone.py).

NOTE [ Same results as torch ]
With torch present, Dataset, IterableDataset, the samplers,
default_collate, get_worker_info and the exception wrapper are torch's own,
and a worker seeds torch, `random` and numpy with torch's formulas, so a
program gets the same batches, seeds and error messages under mpcore.
"""

try:
    import torch
except ImportError:  # mpcore works without torch: batches are numpy arrays
    torch = None

if torch is not None:
    from torch.utils.data.dataloader import _DatasetKind
    MAP, ITERABLE = _DatasetKind.Map, _DatasetKind.Iterable
    from torch.utils.data import (
        BatchSampler, Dataset, IterableDataset, RandomSampler, Sampler, SequentialSampler,
        SubsetRandomSampler, WeightedRandomSampler, default_collate, default_convert,
        get_worker_info,
    )
    from torch.utils.data._utils import worker as _torch_worker
    from torch._utils import ExceptionWrapper
    # DataPipes are torch's alone; the loader treats them as torch's does
    # (NOTE [ DataPipes ] in _loader.py).
    from torch.utils.data import IterDataPipe, MapDataPipe
    from torch.utils.data.dataloader import _sharding_worker_init_fn as sharding_worker_init_fn
    from torch.utils.data.graph_settings import apply_random_seed

    def base_seed(generator):
        return torch.empty((), dtype=torch.int64).random_(generator=generator).item()

    def numpy_seed(base, worker_id):
        return _torch_worker._generate_state(base, worker_id)

    def set_worker_info(worker_id, num_workers, seed, dataset):
        _torch_worker._worker_info = _torch_worker.WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)
else:
    from ._standalone import (  # noqa: F401
        ITERABLE, MAP, BatchSampler, Dataset, ExceptionWrapper, IterableDataset, RandomSampler,
        Sampler,
        SequentialSampler, SubsetRandomSampler, WeightedRandomSampler, base_seed,
        default_collate, default_convert, get_worker_info, numpy_seed, set_worker_info,
    )
    IterDataPipe = MapDataPipe = ()  # no DataPipes without torch: isinstance is False
    sharding_worker_init_fn = apply_random_seed = None


def wrap_exception(worker_id):
    """The exception being handled, for re-raising in the main process."""
    return ExceptionWrapper(where=f"in DataLoader worker process {worker_id}")


def parent_token():
    """What a worker needs to die with this process (see die_with_parent)."""
    from .. import _parentdeath
    return _parentdeath.token()


def die_with_parent(token):
    """A worker dies with the main process, even by SIGKILL."""
    from .. import _parentdeath
    _parentdeath.die_with(token)
