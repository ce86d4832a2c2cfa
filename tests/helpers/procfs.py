"""What runs on the machine and what it holds, read from /proc: mpcore's
memfds and mappings, what a test left in /dev/shm (NOTE [ Whose /dev/shm
entry is it ]), keepers, children, sessions."""
import os


def _memfd_links(pid):
    """The /proc/PID/fd/N links of the mpcore memfds pid has open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for fd in fds:
        link = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(link).startswith("/memfd:mpcore"):
                out.append(link)
        except OSError:
            pass
    return out


def mpcore_memfds(exclude_pids=()):
    """{pid: count} of mpcore memfds open in any process."""
    found = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) not in exclude_pids:
            n = len(_memfd_links(pid))
            if n:
                found[int(pid)] = n
    return found


def memfd_inodes(pid, maps=False):
    """{inode: bytes} of the mpcore memfds pid has open (and, with maps, those
    it maps), with the memory a mapped one holds (0 for one only open)."""
    inos = {}
    for link in _memfd_links(pid):
        try:
            inos.setdefault(os.stat(link).st_ino, 0)
        except OSError:
            pass
    if maps:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5].startswith("/memfd:mpcore"):
                    try:   # the memory the segment holds: its allocated blocks
                        held = os.stat(f"/proc/{pid}/map_files/{parts[0]}").st_blocks * 512
                    except OSError:
                        held = 0
                    inos[int(parts[4])] = held
    return inos


def mpcore_ranges():
    """[(start, end)] of this process's mappings of mpcore memfds."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:mpcore" in line:
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


# What the programs a test runs name their /dev/shm entries: multiprocessing's
# semaphores and SharedMemory, torch's file_system strategy, mpcore's tests.
SHM_NAMES = ("sem.", "psm_", "torch_", "mpcore")


def shm_gained(before, ours=None):
    """The entries of /dev/shm made since `before` (a set of its names) that
    a test can have left: those still there that no live process outside
    the test maps.  The test process and the processes for which ours(pid)
    is true are the test's.

    NOTE [ Whose /dev/shm entry is it ]
    Other programs on the machine make and remove /dev/shm entries while a
    test runs (the semaphores of their multiprocessing locks, torch's
    shared files), so a snapshot before and after finds theirs too.  One
    that is gone again was nobody's leak.  One that a process outside the
    test maps is that process's.  The match is by inode, not by name: glibc
    makes a named semaphore under a temporary name, maps it, links it to its
    name and unlinks the temporary one, so its creator's maps name
    "/dev/shm/sem.XXXXXX (deleted)" and never "sem.mp-..." (a match by name
    took every other program's multiprocessing lock for the test's).
    And only the names a test's programs make count (SHM_NAMES: Python's
    semaphores and SharedMemory, torch's shared files, mpcore's own): another
    program's entry that nobody maps at the moment of the check (Open MPI's
    sm_segment.* between a rank's death and its launcher's cleanup) is not
    the test's."""
    gained = {}
    for name in set(os.listdir("/dev/shm")) - set(before):
        if not name.startswith(SHM_NAMES):
            continue
        try:
            st = os.stat(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            continue        # gone again
        gained[name] = (st.st_dev, st.st_ino)
    if not gained:
        return []
    wanted = set(gained.values())
    me = os.getpid()
    theirs = set()
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == me or (ours is not None and ours(int(p))):
            continue
        try:
            with open(f"/proc/{p}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and fields[4] != "0":
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                key = (os.makedev(major, minor), int(fields[4]))
                if key in wanted:
                    theirs.add(key)
    return sorted(n for n, key in gained.items() if key not in theirs)


def mpcore_processes(all_groups=False):
    """pids of live (not zombie) mpcore keepers in this process group, where
    the programs a test starts run (other sessions' keepers are not ours)."""
    out = []
    mygroup = os.getpgid(0)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if comm != "mpcore-keeper" or fields[0] in EXITED:
            continue
        if all_groups or int(fields[3]) == mygroup:
            out.append(int(pid))
    return out


def _proc_stats():
    """(pid, state, ppid, session) of every process there is now."""
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        yield int(p), fields[0], int(fields[1]), int(fields[3])


def children_of(pid):
    """Direct children of pid that are still there (zombies included)."""
    return [(p, state) for p, state, ppid, _ in _proc_stats() if ppid == pid]


def cmdline_of(pid):
    """pid's command line as /proc gives it (NUL-separated bytes); b"" once
    it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def is_resource_tracker(pid):
    # multiprocessing's resource tracker, started by the first spawn of the
    # test process, lives as long as the test process: it is not a leak.
    return b"resource_tracker" in cmdline_of(pid)


def is_own_zygote(pid):
    # The test process's zygote, like its keeper, lives as long as it does.
    from mpcore.proc import _zygote
    return _zygote._service is not None and _zygote._service[1] == pid


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


# A process being reaped passes from Z through X (dead) before it leaves /proc.
EXITED = ("Z", "X")


def exited(pid):
    """True once `pid` has exited: a zombie, being reaped, or gone."""
    return _state(pid) in (None, *EXITED)


def comm_of(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def session_members(sid):
    """pids (with their state) of the processes in session `sid`."""
    return [(p, state) for p, state, _, s in _proc_stats() if s == sid]
