"""What mpcore serves in every process that imports it: numpy arrays
pickled by handle once numpy is imported, and torch's tensors and storages
in mpcore's memory, on pickles and on queues as records, once
torch.multiprocessing is (NOTE [ How mpcore reaches every process ] in
run/_boot.py says what `mpcore run` adds).  Each runs on the import, from a
hook (mpcore._hooks), never importing either library itself."""
from .._hooks import when_imported

_served = False


def _serve_numpy(np):
    from multiprocessing.reduction import ForkingPickler
    from ..shm import _blocks
    ForkingPickler.register(np.ndarray, _blocks.reduce_ndarray)


def _serve_tensors(tmp):
    from .. import _torchapi
    if _torchapi.serves("tensor handles"):
        from ..shm import _torch
        from . import _records
        _torch.install()
        _records.install()


def serve_tensors():
    """Serves numpy's arrays and torch's tensors from mpcore's memory once
    each library is imported (idempotent)."""
    global _served
    if not _served:
        _served = True
        when_imported("numpy", _serve_numpy)
        when_imported("torch.multiprocessing", _serve_tensors)
