"""Several "nodes" on one machine, for tests of groups across hosts.

Each node is a network namespace of its own, joined to the first by a veth
pair (node 0 is 10.77.0.1/24 on its end of every pair; node k is
10.77.<k-1>.2/24 with pair k-1 ... for two nodes: 10.77.0.1 and 10.77.0.2),
and each process started on a node also gets a UTS namespace with the
hostname "node<k>", so that mpcore's host id (hostname and boot id)
differs between nodes and the traffic between them crosses a real network
interface, and a mount namespace whose /etc/hosts resolves every node's
name to its address, as a cluster's would (torch's rendezvous looks its
own host name up).  Nothing is routed anywhere else.

It needs root and iproute2's `ip` (Debian: apt-get install iproute2), and
util-linux's `unshare`.  Names carry the test process's pid, so that runs
at once do not meet; Nodes.close() deletes the namespaces (and with them
the veth ends in them) and kills whatever still runs in them.
"""
import os
import shutil
import signal
import subprocess
import tempfile
import time

from .timescale import scaled

BASE_ADDR = "10.77.0"


def missing():
    """Why two nodes cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "the multi-node tests need root (network namespaces and a veth pair)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"the multi-node tests need `{tool}` (Debian package {package})"
    probe = f"mpcprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return ("the multi-node tests need to make network namespaces (root with "
                f"CAP_SYS_ADMIN, e.g. a privileged container): `ip netns add` said "
                f"{r.stderr.strip()!r}")
    _ip("netns", "del", probe, check=False)
    return None


def _ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=scaled(20))
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")
    return r


class Nodes:
    """Two nodes joined by one veth pair: node k has the address
    addr(k) on the interface ifname(k)."""

    def __init__(self, tag=None):
        tag = tag or f"mpc{os.getpid()}"
        self.ns = [f"{tag}n{k}" for k in range(2)]
        self.ifs = [f"{tag}v{k}"[:15] for k in range(2)]
        self._made = []
        fd, self.hosts = tempfile.mkstemp(prefix=f"{tag}-hosts-")
        with os.fdopen(fd, "w") as f:
            f.write("127.0.0.1 localhost\n" +
                    "".join(f"{self.addr(k)} node{k}\n" for k in range(2)))
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
                self._made.append(ns)
            _ip("link", "add", self.ifs[0], "type", "veth", "peer", "name", self.ifs[1])
            for k in range(2):
                _ip("link", "set", self.ifs[k], "netns", self.ns[k])
                _ip("-n", self.ns[k], "addr", "add", f"{self.addr(k)}/24", "dev", self.ifs[k])
                _ip("-n", self.ns[k], "link", "set", self.ifs[k], "up")
                _ip("-n", self.ns[k], "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def addr(k):
        return f"{BASE_ADDR}.{k + 1}"

    def ifname(self, k):
        return self.ifs[k]

    def command(self, k, argv):
        """argv run on node k: in its network namespace, with a UTS
        namespace named node<k> and a mount namespace with the nodes'
        /etc/hosts (the command execs: its pid is argv's)."""
        return ["ip", "netns", "exec", self.ns[k], "unshare", "--uts", "--mount", "sh", "-c",
                f'hostname node{k} && mount --bind {self.hosts} /etc/hosts && exec "$@"',
                "sh", *argv]

    def pids(self):
        """The pids of the processes in the nodes' namespaces."""
        out = []
        for ns in self._made:
            r = _ip("netns", "pids", ns, check=False)
            out += [int(p) for p in r.stdout.split()]
        return out

    def leftovers(self):
        """What of the nodes is still on the machine (namespaces, links)."""
        names = _ip("netns", "list", check=False).stdout.split()
        links = _ip("-o", "link", "show", check=False).stdout
        return ([n for n in self.ns if n in names] +
                [i for i in self.ifs if f" {i}@" in links or f" {i}:" in links])

    def close(self):
        """Kills what still runs on the nodes and deletes them.  Safe to
        call twice."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + scaled(10)
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)  # the kernel's reaping of what was killed: nothing to wait on
        for ns in list(self._made):
            _ip("netns", "del", ns, check=False)
            self._made.remove(ns)
        _ip("link", "del", self.ifs[0], check=False)  # if it never moved into a namespace
        try:
            os.unlink(self.hosts)
        except FileNotFoundError:
            pass


# --- what the node tests share ---------------------------------------------------

def tail(path, n=4000):
    """The end of a log file."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "(no log)"


def wait_files(out, names, procs, deadline, logs):
    """Waits until every file in names exists under out; fails naming the
    processes (by index) that exited or the files still missing at the
    deadline, with the end of each log."""
    while True:
        missing = [n for n in names if not os.path.exists(os.path.join(out, n))]
        if not missing:
            return
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise AssertionError(f"the job did not write {missing}; exited: {dead}\n" +
                                 "\n".join(f"--- {i}:\n{tail(log)}" for i, log in enumerate(logs)))
        time.sleep(0.05)  # the ranks write files; there is no event to wait on across namespaces


def kill_sessions(procs, session_members):
    """SIGKILLs what is left of procs (each the leader of a session) and of
    their sessions."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for pid, _ in session_members(p.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
