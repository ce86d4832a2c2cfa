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
    import sys as _sys
    from .. import _torchapi
    # torch's private names come through the table (_torchapi.py): one that
    # a torch lacks is named in the ImportError of mpcore.data.
    try:
        _DatasetKind = _torchapi.get("torch.utils.data.dataloader._DatasetKind")
        ExceptionWrapper = _torchapi.get("torch._utils.ExceptionWrapper")
        sharding_worker_init_fn = _torchapi.get(
            "torch.utils.data.dataloader._sharding_worker_init_fn")
        apply_random_seed = _torchapi.get("torch.utils.data.graph_settings.apply_random_seed")
        _generate_state = _torchapi.get("torch.utils.data._utils.worker._generate_state")
        _WorkerInfo = _torchapi.get("torch.utils.data._utils.worker.WorkerInfo")
        _torchapi.get("torch.utils.data._utils.worker._worker_info")
        pin_memory = _torchapi.get("torch.utils.data._utils.pin_memory.pin_memory")
        IterBase = _torchapi.get("torch.utils.data.dataloader._BaseDataLoaderIter")
    except _torchapi.Missing as e:
        raise ImportError(f"mpcore.data needs torch's DataLoader internals: torch "
                          f"{torch.__version__} {e}") from None
    MAP, ITERABLE = _DatasetKind.Map, _DatasetKind.Iterable
    from torch.utils.data import (
        BatchSampler, Dataset, IterableDataset, RandomSampler, Sampler, SequentialSampler,
        SubsetRandomSampler, WeightedRandomSampler, default_collate, default_convert,
        get_worker_info,
    )
    # DataPipes are torch's alone; the loader treats them as torch's does
    # (NOTE [ DataPipes ] in _loader.py).
    from torch.utils.data import IterDataPipe, MapDataPipe
    _torch_worker = _sys.modules["torch.utils.data._utils.worker"]

    def base_seed(generator):
        return torch.empty((), dtype=torch.int64).random_(generator=generator).item()

    def numpy_seed(base, worker_id):
        return _generate_state(base, worker_id)

    def set_worker_info(worker_id, num_workers, seed, dataset):
        """Fills in torch's get_worker_info() in a worker (its row of the
        table: torch.utils.data._utils.worker._worker_info)."""
        _torch_worker._worker_info = _WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)
        _torchapi.mark("torch.utils.data._utils.worker._worker_info", "replaced",
                       "set in each worker of mpcore's DataLoader")
else:
    from ._standalone import (  # noqa: F401
        ITERABLE, MAP, BatchSampler, Dataset, ExceptionWrapper, IterableDataset, RandomSampler,
        Sampler,
        SequentialSampler, SubsetRandomSampler, WeightedRandomSampler, base_seed,
        default_collate, default_convert, get_worker_info, numpy_seed, set_worker_info,
    )
    IterDataPipe = MapDataPipe = ()  # no DataPipes without torch: isinstance is False
    sharding_worker_init_fn = apply_random_seed = pin_memory = IterBase = None


def wrap_exception(worker_id):
    """The exception being handled, for re-raising in the main process."""
    return ExceptionWrapper(where=f"in DataLoader worker process {worker_id}")


def parent_token():
    """What a worker needs to die with this process (see die_with_parent)."""
    from ..proc import _parentdeath
    return _parentdeath.token()


def die_with_parent(token):
    """A worker dies with the main process, even by SIGKILL."""
    from ..proc import _parentdeath
    _parentdeath.die_with(token)
