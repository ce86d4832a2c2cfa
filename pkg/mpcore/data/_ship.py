"""A dataset that travels once: what a 'spawn' or 'forkserver' loader's
workers need of the main process (the dataset, collate_fn, worker_init_fn)
pickled once into a block of shared memory that every worker unpickles
from.  The loader's side is _loader.py's _PoolIter, the worker's
_worker.main.

NOTE [ A dataset travels once ]
A 'spawn' or 'forkserver' worker (a zygote child, NOTE [ Zygote ] in
proc/_zygote.py) gets its Process object pickled, arguments and all, so a
loader of N workers pickled its dataset N times, one after the other, in
the main process, before its first batch (torch does the same).  Instead:
  - The main process pickles (dataset, collate_fn, worker_init_fn) once,
    as the Process would be pickled (ForkingPickler, its default protocol,
    with a spawning popen set, so that every reducer takes the path it
    takes when a process is started), into one block of shared memory.
    The workers' Process objects carry none of the three.
  - Each worker's first message on its index ring is that block: a ticket
    on it, and one more ticket on each block the pickle named (a tensor of
    the dataset is moved into shared memory and travels as a handle, as
    before; the pickle's handles are redeemed once per worker, so each
    worker gets tickets of its own, which are interchangeable).  The
    worker maps the block, unpickles from it (as the spawned child would:
    before its seeds, with its process marked as inheriting), and lets the
    block go.  The main process lets it go once every message is on its
    ring, so the block is freed when the last worker has unpickled it.
  - Nothing leaks on a kill, by the rules the rings already keep (NOTE
    [ Journal ] in journal.c): a message still in a ring has its tickets
    dropped when the ring is freed; a worker killed between taking the
    message and redeeming a ticket has it dropped by the keeper, from its
    journal; a worker that holds the block and dies has its hold dropped.
  - A reducer that needs the real popen (an fd handed to the child, as a
    Pipe's Connection, a multiprocessing Queue or a sharedctypes Value
    need) cannot be pickled once for every worker: the one pickle is
    abandoned where the fd is asked for, and the loader pickles per worker,
    as before.  Any other error of the pickling is raised as it is: it is
    the error starting the first worker gave (the same type and message as
    torch's).
  - Persistent workers receive it once for their whole life; a loader
    that makes workers again (each epoch without persistent_workers, a new
    loader, load_state_dict) pickles again, as torch does, so that a
    change to the dataset between epochs reaches the new workers.
  - The block's memory goes back to the system once the last worker has
    unpickled it.  A freed large block's segment would otherwise stay with
    the main process for reuse (within the arena's cache budget, NOTE
    [ Blocks and references ] in arena.c): the whole pickle's size (183 MB
    for 2,000,000 small dicts), for the life of the program, for a
    shipment made once.  So the main process disowns the segment when it
    lets the block go (NOTE [ A disowned segment ] in arena.c): its own
    mapping goes at once, each worker's with its hold, and whichever
    process frees the block has the keeper retire the segment.  Measured
    (2,000,000 small dicts, 'spawn', 2 workers, the loader dropped after
    its first batch): the main process's RSS 1,284 MB with the segment
    cached, 1,101 MB disowned (1,096 MB before the loader); USS 1,207 and
    1,024 MB.  A later loader's shipment makes a segment of its own: about
    0.2 s for 183 MB here (0.02 s into a cached one), beside 4.1 s for
    its pickle.
Cost: one pickle, whatever the number of workers, and no copy of it per
worker into the zygote's request.  Each worker
still unpickles its own copy, so the time to its first batch still grows
with the size of the dataset (a SharedList or SharedDict, share_dataset(),
pickles as a handle: that is what makes it not grow).  numpy arrays travel inside the pickle and
each worker gets its own copy, as under torch (one already in mpcore memory
travels as a handle, as before): handing out views of the block instead
(pickle protocol 5's out-of-band buffers) would make them shared between
workers (or read-only), which torch's workers do not see.  Tensors are
shared already: torch moves a dataset's tensors into shared memory when it
sends them to 'spawn' workers, and so does mpcore, into its blocks.
Measured (bench row shared-start-plain; 2 cores at load 2 to 4.6): a list
of 2,000,000 small dicts (183 MB pickled; one pickle 4.1 s, one unpickle
10.1 s, 1.8 s with the collector paused), 'spawn', first batch: 4 workers
11.5 s, 1 worker 5.8 s; pickled per worker as before, 39.9 s; torch 53.2 s
(1 worker: 12.1 s).  With 200,000 dicts: 1.1 s, 0.39 s, 1.8 s and 8.3 s.

NOTE [ A pickle error at a worker's start ]
When a worker's arguments do not pickle, torch's DataLoader raises the
error of Process.start() and, on the torches that have it, first warns
("Got pickle error when attempting to start a worker Process. ..."),
for the exception types its handler names.  A program under mpcore sees
the same: the error of the one pickle (or of the worker's start, where it
pickles per worker) as it is, after the warning torch would give.  The
warning's text, category and the types it is given for are read from
torch's own handler (its row of the table, _torchapi.py), not written
here, so that each torch of the window gets its own words and a torch
without the handler gets no warning.  Without torch there is no warning.

NOTE [ Unpickling with the collector paused ]
Unpickling a dataset of Python objects makes containers by the million,
and the cyclic collector runs every few hundred of them, each full pass
over all that were made so far: unpickling 200,000 small dicts took 473 ms
with the collector running and 141 ms with it paused.  The worker pauses
it while it unpickles what its loader shipped (nothing it makes then is
garbage yet), and starts it again after, as it was.
"""
import ast
import builtins
import gc
import inspect
import io
import pickle
import queue
import sys
import textwrap
import warnings
from multiprocessing import context as _mpctx
from multiprocessing import process as _mpprocess
from multiprocessing.reduction import ForkingPickler

from .. import _core
from ..shm import _blocks

TAG = "mpcore-dataset"
_CHECK_INTERVAL = 5.0


class _NeedsPopen(BaseException):
    """A reducer asked the spawning popen for something only a real one
    has.  A BaseException, so that no reducer's `except Exception` takes it
    for its own error."""


class _OnePickle:
    """The spawning popen while the dataset is pickled once: reducers that
    only ask whether a process is being spawned (a Lock, a Manager's
    proxy, an AuthenticationString) pickle as they do for a Process; one
    that wants an fd handed to the child (DupFd) cannot be served for
    every worker from one pickle."""

    def duplicate_for_child(self, fd):
        raise _NeedsPopen(f"fd {fd} handed to the child")

    def __getattr__(self, name):
        raise _NeedsPopen(name)


_ONE = _OnePickle()


class Shipment:
    """What the workers of one loader need, pickled once into a block
    (NOTE [ A dataset travels once ])."""

    def __init__(self, block, nbytes, blocks, refs):
        self._block = block      # the pickle's block, held here until close()
        self._nbytes = nbytes
        self._blocks = blocks    # the blocks the pickle has handles of, one per handle
        self._refs = refs        # the pickle's own tickets, dropped by close()
        self._message = pickle.dumps((TAG, nbytes), 4)

    def send(self, ring):
        """Puts the shipment on a worker's index ring: a ticket on its
        block and one on each block its pickle names.  On failure the
        tickets taken are dropped, and the error raised."""
        refs = []
        try:
            refs.append(self._block.ticket(True))
            for b in self._blocks:
                refs.append(b.ticket(True))
            ring.put(refs, self._message)
        except BaseException:
            for ref in refs:
                _core.drop_ticket(ref)
            raise

    def close(self):
        """Lets go of the block (the workers' tickets keep it) and drops
        the pickle's own tickets.  The block's segment is disowned first,
        so that its memory goes back once the last worker has unpickled
        (NOTE [ A dataset travels once ]).  Idempotent."""
        refs, self._refs = self._refs, []
        for ref in refs:
            _core.drop_ticket(ref)
        block, self._block = self._block, None
        if block is not None:
            block.disown()
        self._blocks = []


def _reduce_ndarray(arr):
    """A numpy array as a Process's pickle has it: by handle where it lives
    in mpcore memory already, else inside the pickle, so that each worker
    gets its own copy.  (The pickle is taken inside a transfer, to collect
    its tickets, where mpcore's reducer would copy a large array into
    shared memory, as for a Queue, and the workers would share it.)"""
    if not arr.dtype.hasobject and _blocks.array_block(arr)[0] is not None:
        return _blocks.reduce_ndarray(arr)
    return arr.__reduce_ex__(4)


def _drop(refs):
    for ref in refs:
        _core.drop_ticket(ref)


def pack(obj):
    """A Shipment of obj, pickled once as a Process's arguments are; None
    when it must be pickled per worker instead (a reducer needs the real
    popen, or the block does not fit).  An error of the pickling itself is
    raised, the tickets it took dropped."""
    f = io.BytesIO()
    p = ForkingPickler(f)
    np = sys.modules.get("numpy")
    if np is not None and np.ndarray in p.dispatch_table:
        p.dispatch_table[np.ndarray] = _reduce_ndarray
    with _blocks.transfer() as t:
        _mpctx.set_spawning_popen(_ONE)
        try:
            p.dump(obj)
        except _NeedsPopen:
            _drop(t.refs)
            return None
        except BaseException:
            _drop(t.refs)
            raise
        finally:
            _mpctx.set_spawning_popen(None)
    refs = list(t.refs)
    try:
        held = {}
        if refs:
            held = {b.handle: b for b in _core.live_blocks()}
        blocks = [held.get(tuple(r)) for r in refs]
        if None in blocks:  # a handle of a block not held here: not ours to ticket again
            _drop(refs)
            return None
        data = f.getbuffer()
        nbytes = len(data)
        try:
            block = _blocks.alloc(nbytes)
        except MemoryError:
            del data
            _drop(refs)
            return None
        memoryview(block)[:nbytes] = data
        del data
    except BaseException:
        _drop(refs)
        raise
    f.close()
    return Shipment(block, nbytes, blocks, refs)


_NO_WARNING = ((), None, None)
_start_warning = None   # (exception types, message, category), read once


def _handler_warning(fn):
    """(exception types, message, category) of the warnings.warn call in
    fn's handler of pickle errors (an `except` naming PicklingError), or
    _NO_WARNING."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return _NO_WARNING
    for node in ast.walk(tree):
        if not isinstance(node, ast.ExceptHandler) or node.type is None:
            continue
        names = [n.id if isinstance(n, ast.Name) else getattr(n, "attr", None)
                 for n in (node.type.elts if isinstance(node.type, ast.Tuple) else [node.type])]
        if "PicklingError" not in names:
            continue
        types = tuple(pickle.PicklingError if n == "PicklingError" else getattr(builtins, n)
                      for n in names if n == "PicklingError" or isinstance(
                          getattr(builtins, n or "", None), type))
        for call in ast.walk(node):
            if (isinstance(call, ast.Call) and call.args
                    and getattr(call.func, "attr", getattr(call.func, "id", None)) == "warn"):
                try:
                    message = ast.literal_eval(call.args[0])
                except ValueError:
                    return _NO_WARNING
                category = UserWarning
                cat = call.args[1] if len(call.args) > 1 else next(
                    (k.value for k in call.keywords if k.arg == "category"), None)
                if cat is not None:
                    category = getattr(builtins, getattr(cat, "id", ""), None)
                    if not (isinstance(category, type) and issubclass(category, Warning)):
                        return _NO_WARNING
                return types, message, category
    return _NO_WARNING


def warn_start_error(exc):
    """Before a worker's pickle error is raised: the warning torch's
    DataLoader gives for it, if any (NOTE [ A pickle error at a worker's
    start ]).  Called by the loader's iterator, so that the warning names
    its caller, as torch's does."""
    global _start_warning
    if _start_warning is None:
        _start_warning = _NO_WARNING
        if "torch" in sys.modules:
            from .. import _torchapi
            init = _torchapi.find(
                "torch.utils.data.dataloader._MultiProcessingDataLoaderIter.__init__")
            if init is not None:
                _start_warning = _handler_warning(init)
    types, message, category = _start_warning
    if types and isinstance(exc, types):
        warnings.warn(message, category, stacklevel=3)


def receive(ring):
    """In a worker: the object its loader shipped, the first message on
    its index ring; None when the ring was closed first (the loader has
    gone)."""
    while True:
        try:
            refs, msg = ring.get(True, _CHECK_INTERVAL)
            break
        except queue.Empty:
            continue
        except ValueError:
            return None
    got = pickle.loads(msg)
    if type(got) is not tuple or len(got) != 2 or got[0] != TAG or not refs:
        _core.drop_journaled(refs)
        raise RuntimeError(f"mpcore DataLoader worker: its first message is {got!r}, "
                           "not its dataset")
    nbytes = got[1]

    def load(_):
        block = _blocks.attach(refs[0])
        mv = memoryview(block)[:nbytes]
        me = _mpprocess.current_process()
        me._inheriting = True  # as a spawned child unpickles its Process
        collecting = gc.isenabled()
        gc.disable()  # NOTE [ Unpickling with the collector paused ]
        try:
            return pickle.loads(mv)
        finally:
            if collecting:
                gc.enable()
            del me._inheriting
            try:
                mv.release()
            except BufferError:  # something unpickled still views it: it keeps the block
                pass
    return _blocks.receive(refs, load, None)
