"""Datasets that processes share instead of copying: SharedList, SharedDict
and share_dataset().

NOTE [ Shared datasets ]
A map-style dataset kept as Python objects (a list of dicts of paths and
labels) is copied into every worker that reads it: under fork, reading an
object writes its reference count, so each worker slowly copies the pages
it touches; under spawn and forkserver each worker unpickles a copy of its
own.  A SharedList or SharedDict keeps no Python object per item at all:
  - It is built once, from a list or dict.  Each item is pickled (protocol
    5) and the pickles are laid out one after the other in ONE block of
    mpcore shared memory, with an index (int64 offsets) and, for a dict, a
    hash table of its keys, in the same block.  Reading item i slices the
    mapped bytes and unpickles them: the only objects touched are the block
    and the index, which no read writes, so the pages stay shared.
  - numpy arrays and torch tensors inside items are not pickled: their
    bytes go to an aligned region of the same block, and a read gives a
    view of that memory, no copy.  A numpy array comes back read-only
    (writing to it raises numpy's ValueError).  A tensor comes back over
    mpcore's storage of those bytes, writable, as torch gives the tensors
    of a dataset sent to 'spawn' workers (in shared memory, so that a write
    in place is seen by every process): torch has no read-only tensor, and
    a copy per read is what sharing is meant to avoid.  Tensors that are
    views of one storage keep sharing it.  Tensors that a handle cannot
    represent exactly (sparse, quantized, subclasses, ...; NOTE [ What the
    fast path carries ] in _torch.py), arrays of Python objects and array
    subclasses are pickled with the item, as plain pickle would.
  - The block is a block like a shared tensor's: held by each process that
    maps it, freed when the last holder drops it, and the keeper drops the
    holds of a process that dies, SIGKILL included (NOTE [ Blocks and
    references ] in arena.c).  So the object pickles as a handle (a
    ticket), which fork, 'spawn' and 'forkserver' workers (the zygote's
    children) and the ranks of a job on one machine (broadcast_shared) turn
    into a hold on the same memory: one copy per machine, not one per
    process.  A ticket is redeemed once: pickling a SharedList and never
    unpickling the bytes keeps its block until the program's keeper exits.
  - Read-only: every write raises TypeError.  Slicing gives a plain list
    (a new list of the items, as slicing a list does); `in`, index(),
    count() and == read the items one by one; a SharedList equals a list
    (or SharedList) with equal items, a SharedDict a mapping with equal
    items, as list and dict compare.
  - The build reserves the whole block before writing anything.  A dataset
    that does not fit in the memory available is a MemoryError that says
    how many bytes it needed, raised before any shared memory is taken
    (memfds have no name: nothing is ever left in /dev/shm).

NOTE [ Keys of a SharedDict ]
A key is found through a table in the block, so its hash must be the same
in every process: Python's str hash is salted per process (a 'spawn'
worker has another salt), so the table uses crc32 of a canonical encoding
of the key: str, bytes, int (bool and integral floats as ints, since
1 == 1.0 == True are one key), float, None, and tuples and frozensets of
these by their value, anything else by its pickle (so such a key must
pickle the same in every process).  A candidate is then compared with ==,
so a crc32 collision costs a probe, never a wrong answer.
"""
import array
import io
import pickle
import sys
import threading
import zlib
from collections.abc import Mapping

from ..shm import _blocks

__all__ = ["SharedList", "SharedDict", "share_dataset", "broadcast_shared"]

_MAGIC = 0x3130_4C48_5343_504D  # "MPCSHL01"
_LIST, _DICT = 1, 2
_HEADER = 8 * 8
_ALIGN = 64
_KIND_NAME = {_LIST: "SharedList", _DICT: "SharedDict"}

# The block and array region of the item being unpickled in this thread,
# for the rebuild functions below (only set for items that hold arrays).
_tls = threading.local()
_loads = pickle.loads


def _round_up(n, a=_ALIGN):
    return (n + a - 1) // a * a


# --- building ----------------------------------------------------------------

class _Pickler(pickle.Pickler):
    """Pickles items one after the other into one stream; numpy arrays and
    torch tensors are given a place in the array region instead (NOTE
    [ Shared datasets ])."""

    def __init__(self, file):
        super().__init__(file, protocol=5)
        self.arrays = []     # (offset in the region, what to copy there)
        self.region = 0      # bytes of the array region so far
        self.storages = {}   # id(torch storage) -> (offset, storage): views share it
        self.hits = 0        # arrays and tensors placed so far
        np = sys.modules.get("numpy")
        self._ndarray = np.ndarray if np is not None else None
        self._tensor_types = ()
        torch = sys.modules.get("torch")
        if torch is not None:
            try:
                from ..shm import _torch
                self._torch = _torch
                self._tensor_types = _torch.PLAIN_TYPES
            except Exception:  # torch without mpcore's tensor handles: pickled with the item
                pass

    def _place(self, nbytes):
        off = self.region
        self.region = _round_up(off + max(nbytes, 1))
        return off

    def reducer_override(self, obj):
        t = type(obj)
        if t is self._ndarray and not obj.dtype.hasobject:
            if obj.flags.f_contiguous and not obj.flags.c_contiguous:
                order = "F"
            else:
                order = "C"
            off = self._place(obj.nbytes)
            self.arrays.append((off, obj, order))
            self.hits += 1
            dtype = obj.dtype if obj.dtype.fields is not None else obj.dtype.str
            return (_rebuild_array, (dtype, obj.shape, order, off))
        if t in self._tensor_types:
            return self._reduce_tensor(obj)
        if t is SharedList:
            return (list, (list(obj),))
        if t is SharedDict:
            return (dict, (dict(obj.items()),))
        return NotImplemented

    def _reduce_tensor(self, tensor):
        _torch = self._torch
        if tensor.device.type != "cpu" or not _torch.fast_path(tensor) or (
                tensor.requires_grad and not tensor.is_leaf):
            return NotImplemented
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        entry = self.storages.get(id(storage))
        if entry is None or entry[1] is not storage:
            entry = (self._place(nbytes), storage)
            self.storages[id(storage)] = entry
            self.arrays.append((entry[0], storage, None))
        self.hits += 1
        return (_rebuild_tensor,
                (type(tensor) is not _torch.torch.Tensor, entry[0], nbytes,
                 _torch.DTYPE_NAME[tensor.dtype], tensor.storage_offset(), tuple(tensor.size()),
                 tuple(tensor.stride()), tensor.requires_grad))


def _hashable_bytes(key):
    """The canonical encoding of a key (NOTE [ Keys of a SharedDict ])."""
    t = type(key)
    if t is str:
        return b"s" + key.encode("utf-8", "surrogatepass")
    if t is int or t is bool:
        return b"i%d" % key
    if t is float:
        if key.is_integer():
            return b"i%d" % int(key)
        return b"f" + repr(key).encode()
    if t is bytes:
        return b"b" + key
    if key is None:
        return b"n"
    if t is tuple:
        return b"(" + b"\0".join(_hashable_bytes(k).replace(b"\0", b"\0\1") for k in key) + b")"
    if t is frozenset:  # its pickle follows its iteration order, which the hash salt sets
        return b"{" + b"\0".join(sorted(_hashable_bytes(k).replace(b"\0", b"\0\1")
                                         for k in key)) + b"}"
    hash(key)  # TypeError for an unhashable key, as dict gives
    return b"p" + pickle.dumps(key, 5)


def _key_hash(key):
    return zlib.crc32(_hashable_bytes(key))


def _build(kind, items, keys=None, what=None):
    """The Block of a SharedList (items) or SharedDict (keys, items).
    TypeError naming the item that cannot be pickled; MemoryError when the
    block does not fit, raised before any shared memory is taken."""
    import numpy as np
    what = what or _KIND_NAME[kind]
    f = io.BytesIO()
    p = _Pickler(f)
    offsets = array.array("q", [0])
    flags = bytearray()
    n = 0

    def dump(obj, name):
        hits = p.hits
        try:
            p.dump(obj)
        except Exception as e:
            raise TypeError(f"{what} {name()} cannot be pickled "
                            f"({type(e).__name__}: {e})") from e
        p.clear_memo()
        offsets.append(f.tell())
        flags.append(p.hits != hits)

    if kind == _DICT:
        for k, v in zip(keys, items):
            dump(k, lambda: f"key {k!r}")
            dump(v, lambda: f"value of key {k!r}")
            n += 1
        entries = 2 * n
    else:
        for i, v in enumerate(items):
            dump(v, lambda: f"item {i}")
            n += 1
        entries = n
    cap = 0
    if kind == _DICT:
        cap = 8
        while cap < 2 * n:
            cap *= 2
    offs_off = _HEADER
    flags_off = offs_off + 8 * (entries + 1)
    table_off = _round_up(flags_off + entries, 8)
    pickles_off = table_off + 16 * cap
    pickles_len = f.tell()
    arrays_off = _round_up(pickles_off + pickles_len)
    total = arrays_off + p.region
    try:
        block = _blocks.alloc(total)
    except MemoryError as e:
        raise MemoryError(f"{what} needs {total} bytes ({total / 2**20:.1f} MiB) of shared "
                          f"memory, more than is available: {e}") from None
    head = block.array(np.int64, (8,), None, 0)
    head[:] = [0, kind, entries, offs_off, flags_off, table_off, cap, arrays_off]
    offs = block.array(np.int64, (entries + 1,), None, offs_off)
    offs[:] = np.frombuffer(offsets, dtype=np.int64)
    offs += pickles_off
    del offsets
    block.array(np.uint8, (entries,), None, flags_off)[:] = np.frombuffer(bytes(flags),
                                                                          dtype=np.uint8)
    buf = f.getbuffer()
    block.array(np.uint8, (pickles_len,), None, pickles_off)[:] = np.frombuffer(buf,
                                                                                 dtype=np.uint8)
    del buf
    f.close()
    for off, src, order in p.arrays:
        at = arrays_off + off
        if order is None:  # a torch storage
            if src.nbytes():
                p._torch.storage_over(block, at, src.nbytes()).copy_(src)
        elif src.nbytes:
            dst = block.array(src.dtype, src.shape, _strides(src, order), at)
            dst[...] = src
    if kind == _DICT:
        slots = block.array(np.int64, (cap,), None, table_off)
        hashes = block.array(np.int64, (cap,), None, table_off + 8 * cap)
        slots[:] = 0   # a block may reuse memory a freed one wrote: empty slots are 0
        mask = cap - 1
        for i, k in enumerate(keys):
            h = _key_hash(k)
            j = h & mask
            while slots[j]:
                j = (j + 1) & mask
            slots[j] = i + 1
            hashes[j] = h
    head[0] = _MAGIC  # written last: a block without it was never finished
    return block


def _strides(arr, order):
    s = arr.dtype.itemsize
    out = []
    dims = arr.shape if order == "F" else arr.shape[::-1]
    for d in dims:
        out.append(s)
        s *= max(d, 1)
    return tuple(out if order == "F" else out[::-1])


# --- reading -----------------------------------------------------------------

def _rebuild_array(dtype, shape, order, off):
    block, base = _tls.ctx
    import numpy as np
    dtype = np.dtype(dtype)
    n = dtype.itemsize
    for d in shape:
        n *= d
    if n == 0:
        return np.empty(shape, dtype, order=order)
    strides = _strides(_Shape(shape, dtype), order)
    a = block.array(dtype, shape, strides, base + off)
    a.flags.writeable = False
    return a


class _Shape:
    """What _strides needs of an array: its shape and dtype."""
    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def _rebuild_tensor(param, off, nbytes, dtype, storage_offset, size, stride, requires_grad):
    from ..shm import _torch
    block, base = _tls.ctx
    t = _torch.proto(dtype).new()
    if nbytes:
        t.set_(_torch.storage_over(block, base + off, nbytes), storage_offset, size, stride)
    else:
        t = t.new_empty(size)
    if param:
        return _torch.torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad = True
    return t


def _attach(ref, kind):
    block = _blocks.attach(ref)
    return (SharedList if kind == _LIST else SharedDict)._over(block)


class _Shared:
    __slots__ = ("_block", "_mv", "_offs", "_flags", "_n", "_base", "__weakref__")

    def __init__(self, *a, **k):  # pragma: no cover - replaced in subclasses
        raise TypeError

    @classmethod
    def _over(cls, block):
        self = object.__new__(cls)
        self._init_over(block)
        return self

    def _init_over(self, block):
        mv = memoryview(block)
        head = mv[:_HEADER].cast("q")
        magic, kind, entries, offs_off, flags_off, table_off, cap, arrays_off = head.tolist()
        want = _LIST if isinstance(self, SharedList) else _DICT
        if magic != _MAGIC or kind != want:
            raise _blocks.HandleError(f"the block is not a {type(self).__name__}")
        self._block = block
        self._mv = mv
        self._offs = mv[offs_off:offs_off + 8 * (entries + 1)].cast("q")
        self._flags = mv[flags_off:flags_off + entries]
        self._n = entries
        self._base = arrays_off
        if kind == _DICT:
            self._table = mv[table_off:table_off + 8 * cap].cast("q")
            self._hashes = mv[table_off + 8 * cap:table_off + 16 * cap].cast("q")
            self._mask = cap - 1

    def _load(self, i):
        a = self._offs[i]
        data = self._mv[a:self._offs[i + 1]]
        if not self._flags[i]:
            return pickle.loads(data)
        saved = getattr(_tls, "ctx", None)
        _tls.ctx = (self._block, self._base)
        try:
            return pickle.loads(data)
        finally:
            _tls.ctx = saved

    def __reduce__(self):
        return (_attach, (_blocks.ticket(self._block), _LIST if isinstance(self, SharedList)
                          else _DICT))

    def __copy__(self):
        return self  # read-only: a copy could never differ

    def __deepcopy__(self, memo):
        return self

    @property
    def handle(self):
        """(segment id, index, generation) of the block: the same in every
        process that maps this dataset."""
        return self._block.handle

    @property
    def nbytes(self):
        """Bytes of shared memory the dataset takes."""
        return self._block.nbytes

    def _refuse(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is read-only: its items live in shared memory "
                        f"that other processes read; make a private copy to change it "
                        f"({'list' if isinstance(self, SharedList) else 'dict'}(x))")


class SharedList(_Shared):
    """A read-only list whose items live in one block of shared memory
    (NOTE [ Shared datasets ]).  SharedList(iterable) builds it; pickling
    it (to 'spawn' workers, over a Queue) sends a handle, and a forked
    child inherits it: every process reads the same memory."""

    __slots__ = ()

    def __init__(self, items=()):
        if isinstance(items, SharedList):
            block = items._block
        else:
            block = _build(_LIST, items if isinstance(items, (list, tuple)) else list(items))
        self._init_over(block)

    def __len__(self):
        return self._n

    def __getitem__(self, i):
        if type(i) is int and 0 <= i < self._n and not self._flags[i]:
            offs = self._offs  # the common read, inline (NOTE [ Shared datasets ])
            return _loads(self._mv[offs[i]:offs[i + 1]])
        if type(i) is not int:
            if isinstance(i, slice):
                return [self._load(j) for j in range(*i.indices(self._n))]
            try:
                i = i.__index__()
            except AttributeError:
                raise TypeError(f"SharedList indices must be integers or slices, "
                                f"not {type(i).__name__}") from None
        n = self._n
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("SharedList index out of range")
        return self._load(i)

    def __getitems__(self, indices):
        return [self[i] for i in indices]

    def __iter__(self):
        for i in range(self._n):
            yield self._load(i)

    def __reversed__(self):
        for i in range(self._n - 1, -1, -1):
            yield self._load(i)

    def __contains__(self, value):
        return any(v is value or v == value for v in self)

    def index(self, value, start=0, stop=sys.maxsize):
        for i in range(*slice(start, stop).indices(self._n)):
            v = self._load(i)
            if v is value or v == value:
                return i
        raise ValueError(f"{value!r} is not in SharedList")

    def count(self, value):
        return sum(1 for v in self if v is value or v == value)

    def __eq__(self, other):
        if isinstance(other, SharedList):
            if other._block is self._block:
                return True
        elif not isinstance(other, list):
            return NotImplemented
        if len(other) != self._n:
            return False
        return all(a == b for a, b in zip(self, other))

    def __ne__(self, other):
        r = self.__eq__(other)
        return r if r is NotImplemented else not r

    __hash__ = None

    def __add__(self, other):
        return list(self) + list(other) if isinstance(other, (list, SharedList)) \
            else NotImplemented

    def __radd__(self, other):
        return list(other) + list(self) if isinstance(other, list) else NotImplemented

    def __repr__(self):
        head = ", ".join(repr(self._load(i)) for i in range(min(self._n, 3)))
        more = ", ..." if self._n > 3 else ""
        return f"SharedList([{head}{more}], len={self._n}, nbytes={self.nbytes})"

    __setitem__ = __delitem__ = append = extend = insert = pop = remove = clear = \
        sort = reverse = __iadd__ = __imul__ = _Shared._refuse


class SharedDict(_Shared):
    """A read-only dict whose keys and values live in one block of shared
    memory (NOTE [ Shared datasets ], NOTE [ Keys of a SharedDict ]);
    insertion order is kept."""

    __slots__ = ("_table", "_hashes", "_mask")

    def __init__(self, items=()):
        if isinstance(items, SharedDict):
            block = items._block
        else:
            d = items if isinstance(items, dict) else dict(items)
            block = _build(_DICT, list(d.values()), list(d.keys()))
        self._init_over(block)

    def __len__(self):
        return self._n // 2

    def _find(self, key):
        """Position of key, or -1."""
        h = _key_hash(key)
        mask = self._mask
        j = h & mask
        table, hashes = self._table, self._hashes
        while True:
            pos = table[j]
            if not pos:
                return -1
            if hashes[j] == h:
                k = self._load(2 * (pos - 1))
                if k is key or k == key:
                    return pos - 1
            j = (j + 1) & mask

    def __getitem__(self, key):
        pos = self._find(key)
        if pos < 0:
            raise KeyError(key)
        return self._load(2 * pos + 1)

    def __getitems__(self, keys):
        return [self[k] for k in keys]

    def get(self, key, default=None):
        pos = self._find(key)
        return default if pos < 0 else self._load(2 * pos + 1)

    def __contains__(self, key):
        return self._find(key) >= 0

    def __iter__(self):
        for i in range(0, self._n, 2):
            yield self._load(i)

    def keys(self):
        return list(self)

    def values(self):
        return [self._load(i) for i in range(1, self._n, 2)]

    def items(self):
        return [(self._load(i), self._load(i + 1)) for i in range(0, self._n, 2)]

    def __eq__(self, other):
        if isinstance(other, SharedDict) and other._block is self._block:
            return True
        if not isinstance(other, (dict, SharedDict, Mapping)):
            return NotImplemented
        if len(other) != len(self):
            return False
        for k, v in self.items():
            try:
                if other[k] != v:
                    return False
            except KeyError:
                return False
        return True

    def __ne__(self, other):
        r = self.__eq__(other)
        return r if r is NotImplemented else not r

    __hash__ = None

    def __or__(self, other):
        return dict(self.items()) | dict(other) if isinstance(other, Mapping) \
            else NotImplemented

    def __repr__(self):
        head = ", ".join(f"{self._load(i)!r}: {self._load(i + 1)!r}"
                         for i in range(0, min(self._n, 6), 2))
        more = ", ..." if self._n > 6 else ""
        return f"SharedDict({{{head}{more}}}, len={len(self)}, nbytes={self.nbytes})"

    __setitem__ = __delitem__ = pop = popitem = clear = update = setdefault = \
        __ior__ = _Shared._refuse


Mapping.register(SharedDict)


# --- whole datasets ----------------------------------------------------------

def _is_dataset(obj):
    from . import _compat
    return isinstance(obj, (_compat.Dataset, _compat.IterableDataset))


def share_dataset(dataset, min_items=1024):
    """Replaces, in place, each list and dict attribute of `dataset` with at
    least `min_items` items by a SharedList or SharedDict of the same items,
    so that an existing Dataset class works unchanged and its workers share
    one copy (NOTE [ Shared datasets ]).  Datasets held in its attributes
    (Subset's dataset, ConcatDataset's datasets, ...) are converted too.
    Returns the dataset.

    Only exact lists and dicts are converted (a subclass may behave
    otherwise), and an attribute already shared is left as it is.  Where an
    attribute cannot be converted (an item that cannot be pickled, ...) a
    TypeError names the attribute and why, and the dataset is left as it
    was; a dataset that does not fit in the memory available is a
    MemoryError, likewise."""
    done = []
    try:
        _share_into(dataset, type(dataset).__name__, min_items, done, set())
    except BaseException:
        for obj, name, old in reversed(done):
            obj.__dict__[name] = old
        raise
    return dataset


def _share_into(obj, path, min_items, done, seen):
    if id(obj) in seen:
        return
    seen.add(id(obj))
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return
    for name, value in list(attrs.items()):
        where = f"{path}.{name}"
        t = type(value)
        if _is_dataset(value):
            _share_into(value, where, min_items, done, seen)
        elif t is list and value and all(_is_dataset(v) for v in value[:64]) \
                and all(_is_dataset(v) for v in value):
            for i, v in enumerate(value):
                _share_into(v, f"{where}[{i}]", min_items, done, seen)
        elif (t is list or t is dict) and len(value) >= min_items:
            try:
                if t is list:
                    shared = SharedList._over(_build(_LIST, value, what=where))
                else:
                    shared = SharedDict._over(_build(_DICT, list(value.values()),
                                                     list(value.keys()), what=where))
            except TypeError as e:
                raise TypeError(f"share_dataset: {where} cannot be shared: {e}") from e
            done.append((obj, name, value))
            attrs[name] = shared


def broadcast_shared(obj=None, src=0, group=None):
    """The ranks of a job on one machine map one copy: `src` passes its
    SharedList or SharedDict (the others pass None, or anything), every
    rank of `group` gets the same shared object back.  Collective: every
    rank must call it.  A rank on another machine (another keeper) cannot
    map this machine's memory: RuntimeError there, build it on that
    machine."""
    import os

    import torch.distributed as dist
    keeper = os.environ.get("MPCORE_KEEPER", "")
    rank = dist.get_rank(group)
    keepers = [None] * dist.get_world_size(group)
    dist.all_gather_object(keepers, keeper, group=group)
    if rank == src:
        if not isinstance(obj, _Shared):
            raise TypeError(f"broadcast_shared: rank {src} must pass a SharedList or "
                            f"SharedDict, not {type(obj).__name__}")
        kind = _LIST if isinstance(obj, SharedList) else _DICT
        refs = [obj._block.ticket() if r != rank and keepers[r] == keeper else None
                for r in range(len(keepers))]
        payload = [(kind, refs, keeper)]
    else:
        payload = [None]
    gsrc = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast_object_list(payload, src=gsrc, group=group)
    kind, refs, where = payload[0]
    if rank == src:
        return obj
    if refs[rank] is None:
        raise RuntimeError(f"broadcast_shared: rank {rank} is not on rank {src}'s machine "
                           f"(keeper {keeper!r}, not {where!r}); build the dataset there")
    return _attach(refs[rank], kind)
