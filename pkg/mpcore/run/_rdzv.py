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
the main thread, which is in torch's rendezvous loop (with a SIGINT of its
own: class _Watch), and the launcher ends with the same error.  The
watcher stops when this node's rendezvous returns.

The node that finds the mismatch may be the one that hosts the store, and
its end would close the store under the others before their watchers read
the key: they would fail with a lost connection instead.  So a watcher that
reads the key acknowledges it under a second key, and the node that found
the mismatch waits for the first acknowledgement (at most _TOLD_S), then
two more watch periods, for the other watchers, which look as often, and
for the interrupted nodes to leave torch's rendezvous, before it ends.  A
node whose rendezvous fails in any way once its watcher has read the key
reports the key's error.  The path where the nodes agree is torch's alone.
"""
import os
import signal
import socket
import threading
import time
from datetime import timedelta

_WATCH_S = 0.5  # how often a waiting node looks for the error key
_TOLD_S = 4 * _WATCH_S  # how long the node that found a mismatch waits to be heard
_GRACE_S = 2 * _WATCH_S  # and then, for the other watchers and the interrupted rendezvous


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
    """The mismatch another node reported to this launcher's rendezvous, if
    any."""
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
        try:
            store.wait([f"{err_key}.read"], timedelta(seconds=_TOLD_S))
            time.sleep(_GRACE_S)
        except Exception:  # nobody is waiting (or the store is gone): nothing to keep
            pass
        raise NnodesMismatch(msg)
    handler = create_handler(store, backend, params)
    inner = handler.next_rendezvous

    def next_rendezvous():
        watch = _Watch(store, err_key)
        try:
            return inner()
        finally:
            watch.stop()
    handler.next_rendezvous = next_rendezvous
    return handler


class _Watch:
    """The watcher of one rendezvous (NOTE [ Nodes that disagree on
    --nnodes ]).  While it runs, SIGINT's handler is one that raises
    KeyboardInterrupt once the error key has been read, and otherwise does
    what the handler before it would have done: a launcher started in the
    background of a shell ignores SIGINT, and the watcher's signal must
    still stop it.  The watcher sends a real SIGINT to the main thread, so
    that torch's loop, asleep between its looks at the store, wakes at once.
    From a thread other than the main one nothing is signalled; the join
    timeout stays the bound there."""

    def __init__(self, store, err_key):
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._main = threading.main_thread().ident
        if threading.get_ident() != self._main:
            self._before = None
        else:
            self._before = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._on_sigint)
        threading.Thread(target=self._run, args=(store, err_key), name="mpcore-rdzv-watch",
                         daemon=True).start()

    def stop(self):
        with self._lock:
            self._stopped.set()
            if self._before is not None:
                signal.signal(signal.SIGINT, self._before)

    def _on_sigint(self, signum, frame):
        if _state["error"] is not None:
            raise KeyboardInterrupt
        if callable(self._before):
            return self._before(signum, frame)
        if self._before == signal.SIG_DFL:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return None  # SIG_IGN: ignored, as before

    def _run(self, store, err_key):
        from torch.distributed import TCPStore
        try:  # the store's own address: the endpoint's port may be 0 (a free one)
            conn = TCPStore(store.host, store.port, is_master=False,
                            timeout=timedelta(seconds=5))
        except Exception:  # no second connection (a FileStore): the join timeout stays the bound
            return
        while not self._stopped.wait(_WATCH_S):
            try:
                if not conn.check([err_key]):
                    continue
                _state["error"] = conn.get(err_key).decode()
                conn.set(f"{err_key}.read", "1")
            except Exception:  # the store went away: the join timeout stays the bound
                return
            with self._lock:
                if not self._stopped.is_set() and self._before is not None:
                    signal.pthread_kill(self._main, signal.SIGINT)
            return
