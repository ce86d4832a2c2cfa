"""This process's connection to its zygote: the wire format of requests
and replies, and the reading of replies by several threads and signal
handlers at once (NOTE [ Reading the zygote's replies ])."""
import os
import select
import signal
import socket
import struct
import threading
import warnings

from .. import _core

# The wire format has one definition, mpc_zmsg in mpcore.h; the module
# exports its layout, and the struct is built from it.
_FIELDS = ("magic", "op", "token", "arg", "arg2", "len", "nfds", "flags", "targets")


def _header_struct(layout, size):
    """The struct of the request header from the core's (field, offset, code)
    layout; RuntimeError when it is not the header this module packs."""
    if tuple(name for name, _, _ in layout) != _FIELDS:
        raise RuntimeError(f"mpcore: the zygote header's fields are {layout}, "
                           f"this module packs {_FIELDS}")
    fmt = "="
    for name, offset, code in layout:
        if struct.calcsize(fmt) != offset:
            raise RuntimeError(f"mpcore: the zygote header's field {name} is at byte {offset} "
                               f"in C but at {struct.calcsize(fmt)} in Python")
        fmt += code
    if struct.calcsize(fmt) != size:
        raise RuntimeError(f"mpcore: the zygote header is {size} bytes in C but "
                           f"{struct.calcsize(fmt)} in Python")
    return struct.Struct(fmt)


_MSG = _header_struct(_core.ZYGOTE_MSG_LAYOUT, _core.ZYGOTE_MSG_SIZE)
_MAGIC = _core.ZYGOTE_MAGIC
_SPAWN, _STARTED, FAILED, _EXIT = (_core.ZYGOTE_SPAWN, _core.ZYGOTE_STARTED,
                                    _core.ZYGOTE_FAILED, _core.ZYGOTE_EXIT)
MAX_FDS = _core.ZYGOTE_MAX_FDS
INLINE_MAX = _core.ZYGOTE_INLINE_MAX  # larger payloads travel in a memfd
_FLAG_MEMFD = _core.ZYGOTE_FLAG_MEMFD
FLAG_SIGCHLD = _core.ZYGOTE_FLAG_SIGCHLD


# --- the requester side ---------------------------------------------------

# NOTE [ Reading the zygote's replies ]
# One stream from the zygote carries every reply of this process: STARTED
# for a request, EXIT for each child.  Several threads may wait on it (one
# joins a child while another asks whether a second is alive), and so may
# a signal handler that interrupts a thread in the middle of a wait (a
# SIGTERM handler that looks at its workers while the program joins one),
# where multiprocessing, which waits with waitpid, has no lock to deadlock
# on.  So:
#   - the stream is only read without waiting, under `lock`, which is held
#     for nothing longer; what is read goes into `replies` and `exits`;
#   - a wait that must block has one thread at a time (the `watcher`)
#     sleep in select() on the stream and a wake-up pipe, holding nothing;
#     other blocking waiters sleep on the condition, and whoever reads
#     anything wakes both the watcher (a byte in the pipe) and them;
#   - a non-blocking look never waits for another thread: it reads what
#     is there and answers;
#   - a call made by a signal handler in a thread that holds `lock` (it
#     interrupted one of those short reads) answers from what was read
#     already, touching nothing; a request, which writes the stream, is
#     refused then, and the caller starts its child by exec.

def _poll(fds, events, timeout=None):
    """Waits (timeout in seconds, None: for ever) until one of fds has one
    of events; the list of those that have.  poll(), not select(): the
    program may hold more than FD_SETSIZE fds."""
    p = select.poll()
    for fd in fds:
        p.register(fd, events)
    return p.poll(None if timeout is None else timeout * 1000)


class Client:
    """This process's connection to the zygote."""

    def __init__(self, address):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect("\0" + address)
        self.sock.setblocking(False)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.watcher = None   # the thread asleep in select()
        self.send_lock = threading.RLock()
        self.buf = b""
        self.token = 0
        self.replies = {}
        self.exits = {}

    def close(self):
        self.sock.close()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)

    def _pump(self):
        """Reads what the stream holds now into replies and exits; with
        lock held.  ConnectionError once the zygote has gone."""
        got, gone = b"", False
        while True:
            try:
                chunk = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                gone = True
                break
            got += chunk
        if got:
            self.buf += got
            n = len(self.buf) // _MSG.size * _MSG.size
            for at in range(0, n, _MSG.size):
                magic, op, token, arg, arg2, *_ = _MSG.unpack_from(self.buf, at)
                if op == _EXIT:
                    self.exits[arg] = arg2
                else:
                    self.replies[token] = (op, arg, arg2)
            self.buf = self.buf[n:]
            self._wake()
            self.cond.notify_all()
        if gone:
            raise ConnectionError("the mpcore zygote has gone")

    def _wake(self):
        if self.watcher is not None:
            try:
                os.write(self.wake_w, b"!")
            except BlockingIOError:  # a byte is there already
                pass

    def _wait(self, ready, block):
        """Waits until ready() holds (NOTE [ Reading the zygote's replies ]):
        True then; False at once if it does not hold and not `block`."""
        if self.lock._is_owned():  # a signal handler, amid this thread's read
            return ready()
        me = threading.get_ident()
        with self.cond:
            outer = self.watcher == me  # a signal handler, amid this thread's select
            try:
                while True:
                    if ready():
                        return True
                    self._pump()
                    if ready():
                        return True
                    if not block:
                        return False
                    if self.watcher not in (None, me):
                        self.cond.wait()
                        continue
                    self.watcher = me
                    self.lock.release()
                    try:
                        _poll([self.sock, self.wake_r], select.POLLIN)
                        try:
                            os.read(self.wake_r, 4096)
                        except BlockingIOError:
                            pass
                    finally:
                        self.lock.acquire()
                        self.watcher = None
                        self.cond.notify_all()  # another waiter may watch now
            finally:
                if outer:  # that select may have missed what was read here
                    self.watcher = me
                    self._wake()

    def request(self, payload, fds, targets, flags=0):
        """Asks for a child; a payload above INLINE_MAX bytes goes as one
        more fd, a sealed memfd (NOTE [ Zygote payloads ] in proc.c).
        `flags`: FLAG_SIGCHLD or 0."""
        if self.send_lock._is_owned() or self.lock._is_owned():
            raise Fallback("a signal handler starts a process while its thread talks to "
                            "the zygote")
        nbytes = len(payload)
        pfd = _core.zygote_payload_fd(payload) if nbytes > INLINE_MAX else None
        try:
            with self.send_lock:
                self.token += 1
                token = self.token
                sent = list(fds) + ([pfd] if pfd is not None else [])
                msg = _MSG.pack(_MAGIC, _SPAWN, token, 0, 0, nbytes, len(sent),
                                flags | (_FLAG_MEMFD if pfd is not None else 0),
                                *(list(targets) + [0] * (MAX_FDS - len(targets))))
                self._send(msg, sent, payload if pfd is None else b"")
            if pfd is not None:
                os.close(pfd)
                pfd = None
            self._wait(lambda: token in self.replies, True)
            return self.replies.pop(token)
        finally:
            if pfd is not None:
                os.close(pfd)

    def _send(self, msg, fds, payload):
        """Writes a request on the non-blocking stream, waiting for room."""
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        while True:
            try:
                n = self.sock.sendmsg([msg], ancillary)  # the fds go with its first byte
                break
            except BlockingIOError:
                _poll([self.sock], select.POLLOUT)
        for data in (memoryview(msg)[n:], memoryview(payload)):  # the payload uncopied
            while data:
                try:
                    data = data[self.sock.send(data):]
                except BlockingIOError:
                    _poll([self.sock], select.POLLOUT)

    def exit_status(self, pid, block):
        try:
            if not self._wait(lambda: pid in self.exits, block):
                return None
        except ConnectionError:
            return _killed_with_the_zygote(pid, block)
        return self.exits.pop(pid)


_ZYGOTE_GONE_WAIT_S = 5.0  # the most a child killed with the zygote is waited for


def _killed_with_the_zygote(pid, block):
    """The wait status of child `pid` once its zygote has gone: the kernel
    kills a zygote child when the zygote ends (PR_SET_PDEATHSIG), so it is
    SIGKILL's, given once the child is gone (None before, when not
    `block`).  A pid reused meanwhile is waited for at most
    _ZYGOTE_GONE_WAIT_S.  Warns once."""
    global _gone_warned
    if not _gone_warned:
        _gone_warned = True
        warnings.warn("mpcore: the zygote has gone, and the processes it started were killed "
                      "with it", RuntimeWarning, stacklevel=2)
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already
        return signal.SIGKILL
    try:
        gone = _poll([fd], select.POLLIN, _ZYGOTE_GONE_WAIT_S if block else 0)
    finally:
        os.close(fd)
    return signal.SIGKILL if gone or block else None


_gone_warned = False


class Fallback(Exception):
    """The zygote cannot start this child: it is started by exec instead."""
