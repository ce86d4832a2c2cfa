"""The backend's code runs uncompiled under torch.compile (NOTE [ The
backend runs uncompiled ])."""
from .. import _hooks, _torchapi

# NOTE [ The backend runs uncompiled ]
# torch calls a backend's methods from C++: c10d's dispatcher, DDP's
# reducer.  Such a call may come while torch.compile's frame hook is on in
# the calling thread: in the eager part of a compiled function after a
# graph break, dynamo compiles every Python frame that starts as a new
# function (a compiled DDP module's forward rebuilds its buckets, and the
# reducer then broadcasts).  gloo's methods are C++ and never seen; ours
# would be traced, and dynamo gives up with a hard error on the group,
# which it takes for an opaque object.  So the entry points torch's C++
# calls are marked, together with everything they call, to run as plain
# Python (dynamo's per-code frame strategy, as torch._dynamo.disable's
# effect without its wrapper on every call).  The marks are set once
# torch._dynamo is imported, never earlier: importing it costs seconds.

def run_uncompiled(*objs):
    """Marks objs (functions, or classes: the functions in their own
    namespace) to run uncompiled (NOTE [ The backend runs uncompiled ]),
    now if torch._dynamo is imported, else when it is."""
    _hooks.when_imported("torch._dynamo.eval_frame", lambda ef: _mark_uncompiled(ef, objs))


def _mark_uncompiled(eval_frame, objs):
    set_strategy = _torchapi.find("torch._dynamo.eval_frame.set_code_exec_strategy")
    if set_strategy is not None:
        plain = _torchapi.get("torch._dynamo.types.FrameExecStrategy")(
            *(_torchapi.get("torch._dynamo.types.FrameAction").SKIP,) * 2)
        mark = lambda code: set_strategy(code, plain)  # noqa: E731
    else:
        mark = _torchapi.find("torch._dynamo.eval_frame.skip_code")   # torch before 2.7's way
        if mark is None:
            return
    for obj in objs:
        for f in vars(obj).values() if isinstance(obj, type) else (obj,):
            if isinstance(f, (staticmethod, classmethod)):
                f = f.__func__
            fs = (f.fget, f.fset) if isinstance(f, property) else (f,)
            for g in fs:
                code = getattr(g, "__code__", None)
                if code is not None:
                    mark(code)
