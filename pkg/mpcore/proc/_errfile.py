"""Error files: how a started child reports its exception to the process
that started it (torch.multiprocessing.spawn's transport, with the child's
exception itself and its chain where they pickle).

NOTE [ Error files ]
As torch does, each child reports an exception through a file of its own
(a one-shot message that cannot deadlock, unlike a queue).  The files go in
a private directory (mode 0700, a random name per call) that only a failing
child creates, so a call whose children all succeed touches nothing on disk,
even if the parent is killed; the parent removes it once every child is
reaped, and reads no file from a directory that is not its own and private.
A file holds a pickled dict: the traceback text, and the exception chain as
one separately pickled blob per exception, so that one exception that does
not unpickle costs only itself.  A file holding a str (torch's format) is
read too.

This module must not import torch.
"""
import io
import os
import pickle
import shutil
import stat
import traceback

MAX_CHAIN = 64  # exceptions of a child's chain sent back, at most


# --- the child's side ----------------------------------------------------------

def _exception_chain(exc):
    """exc and the exceptions of its __cause__/__context__ chain, in order."""
    order, index, stack = [], {}, [exc]
    while stack and len(order) < MAX_CHAIN:
        e = stack.pop()
        if id(e) in index:
            continue
        index[id(e)] = len(order)
        order.append(e)
        for nxt in (e.__context__, e.__cause__):  # the cause is popped first
            if nxt is not None and id(nxt) not in index:
                stack.append(nxt)
    return order, index


def _pickled(e):
    """e pickled, if it pickles and unpickles here; else None."""
    try:
        blob = pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)
        return blob
    except BaseException:
        return None


def _error_payload(exc):
    order, index = _exception_chain(exc)
    chain = []
    for e in order:
        tb = e.__traceback__
        chain.append({
            "blob": _pickled(e),
            "frames": "".join(traceback.format_tb(tb)) if tb is not None else "",
            "text": "".join(traceback.format_exception(type(e), e, tb)),
            "cause": index.get(id(e.__cause__)) if e.__cause__ is not None else None,
            "context": index.get(id(e.__context__)) if e.__context__ is not None else None,
            "suppress_context": bool(e.__suppress_context__),
        })
    return {"format": "mpcore-1", "traceback": chain[0]["text"], "chain": chain}


def private_dir(path):
    """Whether path is a directory of ours that nobody else can enter."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & 0o077)


def write_error(error_file, exc):
    try:
        payload = _error_payload(exc)
    except BaseException:
        payload = traceback.format_exc()  # torch's format: the text alone
    tmp = f"{error_file}.{os.getpid()}.tmp"
    try:
        folder = os.path.dirname(error_file)
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        if not private_dir(folder):
            raise PermissionError(f"{folder} is not a private directory of this user")
        with open(tmp, "wb") as f:
            pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, error_file)  # the parent never reads half a file
    except OSError:
        # Nowhere to report to (the parent is gone or dropped its context):
        # stderr is all there is.
        traceback.print_exception(type(exc), exc, exc.__traceback__)


# --- the parent's side: reading an error file ------------------------------------

class _Unpickler(pickle.Unpickler):
    # A class defined in the main script is `__mp_main__.X` in a spawn child.
    def find_class(self, module, name):
        if module == "__mp_main__":
            module = "__main__"
        return super().find_class(module, name)


def _loads(blob):
    try:
        return _Unpickler(io.BytesIO(blob)).load()
    except BaseException:
        return None


def read_error_file(path, private=False, where="a spawned process"):
    """(traceback text, the child's exception or None), or None if there is
    no readable report (or, when private, none in a private directory)."""
    if private and not private_dir(os.path.dirname(path)):
        return None
    try:
        with open(path, "rb") as f:
            payload = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception:
        return None
    if isinstance(payload, str):
        return payload, None
    if not isinstance(payload, dict) or "traceback" not in payload:
        return None
    return payload["traceback"], _rebuild_chain(payload.get("chain") or (), where)


def _rebuild_chain(chain, where):
    excs = []
    for node in chain:
        e = _loads(node["blob"]) if node.get("blob") is not None else None
        if not isinstance(e, BaseException):
            e = None
        excs.append(e)
    for e, node in zip(excs, chain):
        if e is None:
            continue
        try:
            e.child_traceback = node["text"]
        except Exception:
            pass
        frames = node.get("frames")
        if frames and hasattr(e, "add_note"):
            try:
                e.add_note(f"[raised in {where}; its traceback there, most recent call "
                           f"last:]\n{frames.rstrip()}")
            except Exception:
                pass
        for attr, key in (("__cause__", "cause"), ("__context__", "context")):
            k = node.get(key)
            if k is not None and excs[k] is not None:
                setattr(e, attr, excs[k])
        e.__suppress_context__ = node.get("suppress_context", False)
    return excs[0] if excs else None


def remove_dir(path, owner):
    if os.getpid() == owner and private_dir(path):
        shutil.rmtree(path, ignore_errors=True)
