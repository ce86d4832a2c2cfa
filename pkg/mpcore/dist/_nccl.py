"""NCCL for CUDA tensors: the library loaded at run time (csrc/nccl.c), and
one communicator per process group, set up through the group's store.

NOTE [ NCCL ]
Which NCCL: the copy torch already loaded, else the nvidia-nccl wheel's
(nvidia/nccl/lib/libnccl.so.2 on sys.path), else the system's.  mpcore is
built without CUDA or NCCL headers.  Tensors reach NCCL as device pointers
from __cuda_array_interface__, and collectives are enqueued on torch's
current stream, so they are ordered with the program's own kernels as
torch's NCCL backend orders them.  Before NCCL is asked, the ranks compare
their GPUs through the store, so that two ranks on one GPU get an error
that says so rather than NCCL's.
"""
import os
import socket
import sys

from .. import _core

_where = None


def wheel_paths():
    """libnccl.so.2 of an nvidia-nccl wheel on sys.path, if any."""
    found = []
    for entry in sys.path:
        p = os.path.join(entry or ".", "nvidia", "nccl", "lib", "libnccl.so.2")
        if os.path.exists(p):
            found.append(os.path.abspath(p))
    return found


def load():
    """Loads NCCL (once); returns where it came from.  RuntimeError names
    what was tried when there is none."""
    global _where
    if _where is None:
        _where = _core.nccl_load(wheel_paths())
    return _where


def _pointer(t):
    return t.__cuda_array_interface__["data"][0]


class NcclGroup:
    """This rank's NCCL communicator for a process group."""

    def __init__(self, comm, rank, world):
        self.comm = comm
        self.rank = rank
        self.world = world

    @classmethod
    def create(cls, store, rank, world, prefix):
        import torch
        load()
        if not torch.cuda.is_available():
            raise RuntimeError("NCCL needs a CUDA GPU for each rank, and torch sees none here "
                               "(torch.cuda.is_available() is False)")
        dev = torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(dev).uuid)
        me = f"{socket.gethostname()}|{uuid}|{dev}"
        store.set(f"{prefix}gpu/{rank}", me)
        seen = {}
        for r in range(world):
            gpu = store.get(f"{prefix}gpu/{r}").decode()
            host, uuid_r, dev_r = gpu.split("|")
            if (host, uuid_r) in seen:
                raise RuntimeError(
                    f"ranks {seen[(host, uuid_r)]} and {r} both use GPU {dev_r} ({uuid_r}) on "
                    f"{host}: NCCL needs a GPU of its own for each rank; call "
                    "torch.cuda.set_device(local_rank) before init_process_group")
            seen[(host, uuid_r)] = r
        if rank == 0:
            uid = _core.nccl_unique_id()
            store.set(f"{prefix}nccl-id", uid)
        else:
            uid = store.get(f"{prefix}nccl-id")
        return cls(_core.NcclComm(uid, world, rank), rank, world)

    def _stream(self):
        import torch
        return torch.cuda.current_stream().cuda_stream

    def all_reduce(self, tensor, dtype, op):
        p = _pointer(tensor)
        self.comm.all_reduce(p, p, tensor.numel(), dtype, op, self._stream())

    def broadcast(self, tensor, root):
        p = _pointer(tensor)
        self.comm.broadcast(p, p, tensor.numel() * tensor.element_size(), root, self._stream())

    def all_gather(self, out, inp):
        self.comm.all_gather(_pointer(inp), _pointer(out), inp.numel() * inp.element_size(),
                             self._stream())

    def close(self):
        self.comm.destroy()
