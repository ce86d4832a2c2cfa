"""Calls a function once a module is imported: the one hook mpcore sets
on imports (a meta path finder), used by every layer that waits for a
library (torch, numpy, torch._dynamo, ...) rather than importing it.

NOTE [ Hooks run after the import ]
A hook runs right after the watched module finishes executing, so the
program's own `import torch.multiprocessing as mp` already sees what the
hook changed.  A module imported already gets its hooks at once.
"""
import sys

_callbacks = {}  # module name -> [fn(module)]


class _PostImportFinder:
    # a meta path finder (importlib.abc.MetaPathFinder's protocol; that module
    # costs an empty program's start-up more than the rest of this file)
    def find_spec(self, name, path=None, target=None):
        if name not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_hook(module):
            exec_module(module)
            _run_callbacks(name, module)

        loader.exec_module = exec_and_hook
        return spec


_finder = _PostImportFinder()


def _run_callbacks(name, module):
    for fn in _callbacks.pop(name, ()):
        fn(module)


def when_imported(name, fn):
    """Calls fn(module) once `name` is imported (now, if it already is)."""
    mod = sys.modules.get(name)
    if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False) is False:
        fn(mod)
        return
    _callbacks.setdefault(name, []).append(fn)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def pending():
    """The names of the modules that hooks still wait for."""
    return list(_callbacks)


def forget(name):
    """Drops the hooks that wait for `name`, unrun."""
    _callbacks.pop(name, None)
