"""The keeper: one per program, found by every process of it."""
import pytest

from helpers import run_program


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_child_allocates_first_parent_receives(method, leak_check):
    # A fresh program has few fds open, which is where a keeper started at
    # import must still get its sockets onto the right descriptors; the
    # child allocates before the parent ever does.
    r = run_program(f"""
        import os
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
        import torch, mpcore
        def child(q, done):
            q.put(torch.arange(6.))
            done.wait()
        if __name__ == "__main__":
            ctx = mpcore.get_context("{method}")
            q = ctx.Queue()
            done = ctx.Event()
            p = ctx.Process(target=child, args=(q, done))
            p.start()
            t = q.get(timeout=60 * SLOW)
            done.set()
            p.join()
            print(t.tolist(), t.is_shared(), p.exitcode)
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0] True 0"


@pytest.mark.timeout(120)
def test_one_keeper_for_the_whole_program(leak_check):
    r = run_program("""
        import os, mpcore
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
        def child(q):
            q.put((os.environ["MPCORE_KEEPER"], mpcore.zeros(4, "int64")))
        if __name__ == "__main__":
            name = os.environ["MPCORE_KEEPER"]
            q = mpcore.Queue()
            procs = [mpcore.get_context(m).Process(target=child, args=(q,))
                     for m in ("fork", "spawn", "fork")]
            for p in procs: p.start()
            got = [q.get(timeout=60 * SLOW) for _ in procs]
            for p in procs: p.join()
            print(all(n == name for n, _ in got), [a.tolist() for _, a in got])
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]"
