"""The torch.distributed backend: the shared-memory group of a process
group's ranks (_dist), NCCL (_nccl), the process group itself (_backend),
groups across hosts (_hier) and the fast paths of torch's module functions
(_fastpath).  Over mpcore.proc; mpcore.distributed and mpcore.parallel are
its faces.  NOTE [ Layers of the package ] in mpcore/__init__.py."""
