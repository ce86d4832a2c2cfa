"""The c10d rendezvous of `mpcore run` (torchrun's command line): torch's
own handler, with nodes that disagree on --nnodes told so at once.

NOTE [ Nodes that disagree on --nnodes ]
torch's dynamic rendezvous keeps each node's --nnodes to itself: a node
started with --nnodes 2 and one with --nnodes 3 both wait, each for a
count the other never reaches, until the join timeout (600 s by default),
which then says that too few nodes came.  Here each node, once torch's
handler has reached the rendezvous's store, compare-sets its MIN:MAX under
a key of the run: the first node's value stays, and a node whose value
differs writes an error key naming both and stops with that error.  The
nodes already waiting watch that key from a thread of their own, on a
connection of their own (a store client serialises its calls, and torch's
rendezvous uses its own connection throughout), looking every half second
with a non-blocking check (a thread must not be inside a blocking store
call when the interpreter exits): when it appears, the watcher interrupts
the main thread, which is in torch's rendezvous loop (it wakes at least
every second), and the launcher ends with the same error.  The watcher
stops when this node's rendezvous returns.
"""
import _thread
import socket
import threading
from datetime import timedelta

_WATCH_S = 0.5  # how often a waiting node looks for the error key


class NnodesMismatch(Exception):
    pass


_state = {"error": None}


def install():
    """Wraps torch's c10d rendezvous handler (NOTE [ Nodes that disagree on
    --nnodes ]).  Idempotent."""
    from torch.distributed.elastic.rendezvous import registry  # noqa: F401 (registers torch's)
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry as reg
    creator = reg._registry.get("c10d")
    if creator is None or getattr(creator, "_mpcore", False):
        return

    def create(params):
        return _create(params)
    create._mpcore = True
    reg._registry["c10d"] = create


def error():
    """The mismatch that interrupted this launcher's rendezvous, if any."""
    return _state["error"]


def _create(params):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    backend, store = create_backend(params)
    mine = f"{params.min_nodes}:{params.max_nodes}"
    key = f"mpcore.rdzv.{params.run_id}.nnodes"
    err_key = f"{key}.error"
    first = store.compare_set(key, "", mine).decode()
    if first != mine:
        msg = (f"mpcore run: the rendezvous {params.run_id!r} at {params.endpoint}: this node "
               f"({socket.gethostname()}) has --nnodes {mine}, the node(s) that came before it "
               f"have --nnodes {first}; every node must give the same --nnodes")
        store.set(err_key, (f"mpcore run: the rendezvous {params.run_id!r} at "
                            f"{params.endpoint}: a node ({socket.gethostname()}) came with "
                            f"--nnodes {mine}, this node has --nnodes {first}; every node must "
                            "give the same --nnodes"))
        raise NnodesMismatch(msg)
    handler = create_handler(store, backend, params)
    inner = handler.next_rendezvous

    def next_rendezvous():
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(store, err_key, stop),
                                   name="mpcore-rdzv-watch", daemon=True)
        watcher.start()
        try:
            return inner()
        finally:
            stop.set()
    handler.next_rendezvous = next_rendezvous
    return handler


def _watch(store, err_key, stop):
    from torch.distributed import TCPStore
    try:  # the store's own address: the endpoint's port may be 0 (a free one)
        conn = TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=5))
    except Exception:  # no second connection (a FileStore): the join timeout stays the bound
        return
    while not stop.wait(_WATCH_S):
        try:
            if not conn.check([err_key]):
                continue
            msg = conn.get(err_key).decode()
        except Exception:  # the store went away: the join timeout stays the bound
            return
        if not stop.is_set():
            _state["error"] = msg
            _thread.interrupt_main()
        return
