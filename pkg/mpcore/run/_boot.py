"""Hooks that make mpcore serve a program: on import of torch (or numpy),
and under `mpcore run` in every process of the program.

NOTE [ How mpcore reaches every process ]
`mpcore run` sets MPCORE_RUN=1 in the environment.  Processes started by
fork inherit the hooks; processes started by exec (spawn, forkserver,
subprocess) run mpcore.pth from site-packages at start-up, which calls
activate_run() when MPCORE_RUN is set and costs nothing otherwise.
Hooks run right after a watched module finishes executing (NOTE [ Hooks
run after the import ] in _hooks.py), so the program's own `import
torch.multiprocessing as mp` already sees mpcore's.

Every torch attribute the hooks replace goes through _torchapi.replace(),
and each feature is installed only where _torchapi.serves() it on the
installed torch (NOTE [ A feature torch cannot carry falls back ] in
_torchapi.py): a hook never raises into the program's `import torch`.
"""
import os
import sys

from .._hooks import when_imported
from ..queue import _serve

_patched = False


def serve_torch(patch_multiprocessing):
    """Serves tensors from mpcore's memory once torch is imported (what
    `import mpcore` does); with patch_multiprocessing, also makes
    torch.multiprocessing, DataLoader, torchdata's StatefulDataLoader, the
    distributed backend and DDP mpcore's as each is imported."""
    global _patched
    _serve.serve_tensors()
    if patch_multiprocessing and not _patched:
        _patched = True
        when_imported("torch.multiprocessing", _patch_torch_multiprocessing)
        # Not from torch.utils.data's hook: torchdata may be what imports torch.
        when_imported("torchdata.stateful_dataloader", _patch_torchdata)


def _patch_torch_multiprocessing(tmp):
    """Makes torch.multiprocessing's names mpcore's."""
    from .. import _torchapi
    if not _torchapi.serves("torch.multiprocessing"):
        return
    import mpcore
    for name in _torchapi.TM_NAMES:
        _torchapi.replace(f"torch.multiprocessing.{name}", getattr(mpcore, name))
    tmp.__mpcore__ = True
    _supply_torch_sleep(sys.modules["torch"])
    when_imported("torch.utils.data", _patch_torch_data)
    when_imported("torch.distributed", _patch_torch_distributed)
    when_imported("torch.nn.parallel", _patch_torch_ddp)


def _patch_torch_data(tud):
    """Makes torch.utils.data.DataLoader mpcore's (get_worker_info is
    torch's own: mpcore's workers fill it in)."""
    from .. import _torchapi
    if not _torchapi.serves("DataLoader"):
        return
    from ..data import DataLoader
    _torchapi.replace("torch.utils.data.DataLoader", DataLoader)
    _torchapi.replace("torch.utils.data.dataloader.DataLoader", DataLoader)


def _patch_torchdata(tsd):
    """Makes torchdata's StatefulDataLoader mpcore's (whose state dicts it
    reads and writes)."""
    from .. import _torchapi
    if not _torchapi.check_window() or not _torchapi.serves("StatefulDataLoader"):
        return
    from ..data import StatefulDataLoader
    _torchapi.replace("torchdata.stateful_dataloader.StatefulDataLoader", StatefulDataLoader)
    _torchapi.replace("torchdata.stateful_dataloader.stateful_dataloader.StatefulDataLoader",
                      StatefulDataLoader)


def _patch_torch_distributed(td):
    """Registers mpcore's backend and makes it what CPU groups get
    (NOTE [ Which backend a group gets ] in distributed.py), unless the
    program asked for torch's Flight Recorder, which records gloo's own
    groups alone: then nothing of torch.distributed changes, nor DDP (NOTE
    [ The Flight Recorder ] in dist/_recorder.py)."""
    from .. import _torchapi
    if td.is_available() and _torchapi.serves("distributed backend"):
        from ..dist import _recorder
        if _recorder.leave_gloo_to_gloo() is not None:
            return
        from .. import distributed
        distributed.install()


def _patch_torch_ddp(tnp):
    """Makes torch.nn.parallel.DistributedDataParallel mpcore's."""
    from .. import _torchapi
    if sys.modules["torch.distributed"].is_available() and _torchapi.serves("DDP"):
        from ..parallel import DistributedDataParallel
        _torchapi.replace("torch.nn.parallel.DistributedDataParallel", DistributedDataParallel)
        _torchapi.replace("torch.nn.parallel.distributed.DistributedDataParallel",
                          DistributedDataParallel)


def _supply_torch_sleep(torch):
    """NOTE [ torch.sleep ]
    The founding article calls torch.sleep(1), meaning a one-second sleep;
    PyTorch has no such function.  Under `mpcore run`, and only where torch
    lacks one, torch.sleep is time.sleep.  Nothing else of torch changes."""
    import time
    from .. import _torchapi
    _torchapi.replace("torch.sleep", time.sleep)


def activate_run(launcher=False):
    """Serves this process of a program started by `mpcore run` (the
    launcher's own process when launcher is true)."""
    os.environ["MPCORE_RUN"] = "1"
    import mpcore  # noqa: F401  (registers the tensor hooks)
    serve_torch(patch_multiprocessing=True)
    if launcher:
        # NOTE [ The zygote costs only programs that use it ]
        from ..proc import _zygote
        _zygote.fork_at_torch_import()
