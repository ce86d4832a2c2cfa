"""mpcore.data: torch.utils.data's DataLoader over mpcore's worker pool.

    from mpcore.data import DataLoader
    loader = DataLoader(dataset, batch_size=32, num_workers=4)

Dataset, IterableDataset, the samplers, default_collate and
get_worker_info are torch's when torch is installed (and equivalents
otherwise, with numpy batches).  DataLoader.state_dict() and
load_state_dict() resume loading mid-epoch, in torchdata
StatefulDataLoader's format; StatefulDataLoader is DataLoader under
torchdata's name and signature.

SharedList, SharedDict and share_dataset() keep a dataset's items in one
block of shared memory that every worker maps instead of copying
(DataLoader(..., share_dataset=True) converts the dataset it is given).
"""
from ._compat import (
    BatchSampler, Dataset, IterableDataset, RandomSampler, Sampler, SequentialSampler,
    SubsetRandomSampler, WeightedRandomSampler, default_collate, default_convert,
    get_worker_info,
)
from ._loader import DataLoader, StatefulDataLoader
from ._shared import SharedDict, SharedList, broadcast_shared, share_dataset

__all__ = [
    "DataLoader", "StatefulDataLoader", "Dataset", "IterableDataset", "Sampler", "SequentialSampler",
    "RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler", "BatchSampler",
    "default_collate", "default_convert", "get_worker_info",
    "SharedList", "SharedDict", "share_dataset", "broadcast_shared",
]
