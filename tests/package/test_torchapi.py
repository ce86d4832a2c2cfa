"""The one table of torch changes (_torchapi.py), the torch window, and a
feature falling back to torch's own way when the installed torch cannot
carry it.

A missing symbol is played on the pinned torch by pointing the table's row
at a name torch does not have, before torch is imported: the program then
sees what a torch without that symbol gives (torch 2.6 to 2.12 lack the
storage swap; `make test-window` runs the smoke subset on such a torch)."""
import ast
import os
import re
import sys

import pytest

from helpers import fresh_env, run_program

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("leak_check")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "pkg", "mpcore")
WARNING = re.compile(r"RuntimeWarning: mpcore: ")


def env():
    # run_program adds these to this process's environment: MPCORE_TORCH_WARNED
    # is emptied, since this process may have given the one warning already
    e = {k: v for k, v in fresh_env().items() if not k.startswith("MPCORE_")}
    e["MPCORE_TORCH_WARNED"] = ""
    return e


def test_window_bounds_parse_and_compare():
    from mpcore import _torchapi as t
    assert t._release("2.13.0+cpu") == (2, 13, 0)
    assert t._release("2.15.0a0+git1234") == (2, 15, 0)
    assert t._release("2.6") == (2, 6, 0)
    lo, hi = t.WINDOW
    assert t.in_window(lo) and t.in_window(hi) and t.in_window("2.13.0+cpu")
    assert t.in_window("2.8.0+cu128")
    assert not t.in_window("2.5.1") and not t.in_window("2.14.2")
    assert not t.in_window("2.15.0a0") and not t.in_window("1.13.1")


def test_at_least_compares_the_imported_torch():
    import torch
    from mpcore import _torchapi
    assert _torchapi.at_least("2.6") and _torchapi.at_least(torch.__version__)
    assert not _torchapi.at_least("99.0")


def test_a_work_torch_alone_holds_is_kept_until_waited(monkeypatch):
    # NOTE [ A Work only torch's C++ holds ]: where torch does not keep the
    # Python Work alive (before 2.7), mpcore does until a wait or a future.
    import gc
    import torch
    from mpcore.dist import _work
    monkeypatch.setattr(_work, "HOLD", True)
    monkeypatch.setattr(_work, "HELD", {})
    t = torch.ones(2)
    works = [_work.Done([t]), _work.AllOf([]), _work.Done([t])]
    ids = [id(w) for w in works]
    del works
    gc.collect()
    assert sorted(_work.HELD) == sorted(ids)
    first, allof, last = (_work.HELD[i] for i in ids)
    first.wait()
    allof.wait()
    assert list(_work.HELD) == [id(last)]
    assert last.get_future().wait() == [t]
    assert _work.HELD == {}


def test_pyproject_declares_the_window_of_the_code():
    from mpcore import _torchapi as t
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    # NOTE [ torch is optional ]: the window is an extra, never a dependency
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S)[1]
    assert "torch" not in deps
    extra = re.search(r"^torch = \[\"(.*?)\"\]", text, re.M)[1]
    assert extra == f"torch>={t.WINDOW[0]},<={t.WINDOW[1]}"


def test_every_row_checks_but_what_this_torch_lacks():
    # Every feature is served and no row is missing, except what this torch
    # lacks: the storage swap before torch 2.13 (in-place moves) and funcol's
    # all_gather_single before 2.13 (its fast paths); torchdata's rows where
    # it is not installed.  On the pinned torch: everything, and no warning.
    code = """
        import warnings
        import torch, mpcore
        import torch.distributed._functional_collectives as funcol
        lacks = {"in-place moves": not hasattr(torch.UntypedStorage, "_swap_data_ptr_"),
                 "functional collective fast paths": not hasattr(funcol, "all_gather_single")}
        if not any(lacks.values()):
            warnings.simplefilter("error")     # not even the one warning
        from mpcore import _torchapi as t
        t.check_all()
        # (rows read at use have a way around them where they are missing)
        bad = sorted({r.feature for r in t.TABLE.values()
                      if r.status in ("missing", "wrong shape") and not r.at_use
                      and not r.target.startswith("torchdata")})
        off = sorted(f for f, (ok, why) in t._served.items()
                     if not ok and f != "StatefulDataLoader")
        print(bad, off, sorted(f for f, v in lacks.items() if v))
    """
    r = run_program(code, env=env())
    assert r.returncode == 0, r.stderr
    bad, off, lacks = r.stdout.strip().split("] [")
    assert bad + "]" == "[" + off + "]" == "[" + lacks, r.stdout


def test_get_and_replace_check_their_row_and_record():
    from mpcore import _torchapi as t
    with pytest.raises(KeyError, match="not in mpcore's table"):
        t.get("torch._C._no_such_symbol")
    row = t.TABLE["torch._C._dispatch_keys"]
    import torch
    assert t.get("torch._C._dispatch_keys") is torch._C._dispatch_keys
    assert row.status == "ok"
    # what install() did, as doctor --json shows it
    rows = {r["target"]: r for r in t.report()["table"]}
    assert rows["torch.UntypedStorage.is_shared"]["status"] == "replaced"
    assert rows["multiprocessing.reduction.ForkingPickler[torch tensors and storages]"][
        "status"] == "replaced"


NO_SWAP = """
    import sys
    from mpcore import _torchapi
    # this torch, as one without UntypedStorage._swap_data_ptr_ (2.6 to 2.12)
    _torchapi.TABLE["torch.UntypedStorage._swap_data_ptr_"].target = \\
        "torch.UntypedStorage._swap_data_ptr_not_here"
    import torch
    import mpcore
    import torch.multiprocessing as mp
    from torch.utils.data import DataLoader

    def double(q, done):
        t = q.get(timeout=60)
        t.mul_(2)
        done.put(t.sum().item())

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 6
        def __getitem__(self, i):
            return torch.full((2,), i)

    if __name__ == "__main__":
        t = torch.ones(3)
        t.share_memory_()
        print("shared", t.is_shared(), type(t.untyped_storage()).share_memory_.__module__)
        ctx = mp.get_context("spawn")
        q, done = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=double, args=(q, done))
        p.start()
        u = torch.arange(4, dtype=torch.float32)
        q.put(u)
        print("child", done.get(timeout=60))
        p.join()
        print("queue", u.tolist())
        m = mpcore.zeros((2,), dtype=torch.int64)     # made in mpcore memory: a handle
        q2 = mpcore.Queue()
        q2.put(m)
        q2.get(timeout=60).add_(5)
        print("handle", m.tolist())
        # torch's own DataLoader with workers: every batch arrives (this hung
        # when the feeder thread's pickling raised and dropped the batch)
        print("loader", [b.sum().item() for b in DataLoader(Items(), batch_size=2,
                                                            num_workers=2, timeout=60)])
        print("stats", mpcore.stats().get("storages_shared", 0))
        print("served", _torchapi.report_feature("in-place moves"))
"""


@pytest.mark.parametrize("launcher", [False, True], ids=["python", "mpcore-run"])
def test_without_the_swap_sharing_is_torchs_own_with_one_warning(launcher):
    r = run_program(NO_SWAP, env=env(), launcher=launcher, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "shared True torch.storage", lines
    assert lines[1:5] == ["child 12.0", "queue [0.0, 2.0, 4.0, 6.0]", "handle [5, 5]",
                          "loader [2, 10, 18]"], lines
    assert lines[5] == "stats 0", lines          # nothing moved into mpcore memory
    assert lines[6].startswith("served torch ") and "_swap_data_ptr_not_here" in lines[6]
    warnings = WARNING.findall(r.stderr)
    assert len(warnings) == 1, r.stderr          # one for the program, children included
    assert "lacks torch.UntypedStorage._swap_data_ptr_not_here" in r.stderr
    assert "share_memory_() and sending tensors not yet in mpcore memory are torch's own" \
        in r.stderr


OUTSIDE = """
    import torch
    torch.__version__ = "2.5.1"        # a torch older than the window
    import mpcore
    from multiprocessing.reduction import ForkingPickler
    t = torch.ones(2)
    t.share_memory_()
    print(type(t.untyped_storage()).share_memory_.__module__,
          torch.Tensor in ForkingPickler._extra_reducers and
          ForkingPickler._extra_reducers[torch.Tensor].__module__)
    from mpcore.run import _boot
    _boot.serve_torch(patch_multiprocessing=True)
    import torch.multiprocessing as mp, torch.utils.data as tud
    print(mp.Process.__module__, tud.DataLoader.__module__, hasattr(torch, "sleep"))
    print(mpcore.stats().get("storages_shared", 0))
"""


def test_outside_the_window_one_warning_and_torchs_own_behaviour():
    r = run_program(OUTSIDE, env=env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "torch.storage torch.multiprocessing.reductions",
        "multiprocessing.context torch.utils.data.dataloader False", "0"], r.stdout
    assert len(WARNING.findall(r.stderr)) == 1, r.stderr
    assert "torch 2.5.1 is outside mpcore's window, torch 2.6 to 2.14.1" in r.stderr


def test_the_launcher_walks_no_frames():
    # NOTE [ The rank's return queue ]: no frame walking for torch's locals
    for d, _, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(d, name)) as f:
                    src = f.read()
                assert "_getframe" not in src and "f_locals" not in src, name


def _private_torch_reads(tree):
    """`from torch._x import`, `import torch._x`, and torch._x / torch.a._b
    attribute chains read in code, from torch or from a name bound to one
    of its modules or objects (`import torch.distributed as dist`, `from
    torch.distributed import distributed_c10d as c10d`: dist._x, c10d._x)."""
    out = []
    bases = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "torch":
            bases.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            bases.update(a.asname for a in node.names
                         if a.asname and a.name.split(".")[0] == "torch")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("torch") and any(
                    p.startswith("_") for p in node.module.split(".")):
                out.append((node.lineno, f"from {node.module} import"))
            elif node.module.startswith("torch") and any(
                    a.name.startswith("_") for a in node.names):
                out.append((node.lineno, f"from {node.module} import _"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch") and any(
                        p.startswith("_") for p in a.name.split(".")):
                    out.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bases \
                    and "__spec__" not in ast.unparse(node):   # importlib's, not torch's
                out.append((node.lineno, ast.unparse(node)))
    return out


# The files whose torch internals go through the table.
TABLED = (os.path.join("shm", "_torch.py"), os.path.join("queue", "_records.py"),
          os.path.join("queue", "_serve.py"), os.path.join("run", "_boot.py"),
          os.path.join("run", "_torchrun.py"), os.path.join("run", "_launcher.py"),
          os.path.join("run", "_program.py"), "_doctor.py", os.path.join("proc", "_zygote.py"),
          os.path.join("proc", "_inherit.py"), os.path.join("proc", "_child.py"),
          os.path.join("data", "_compat.py"), os.path.join("data", "_loader.py"),
          os.path.join("data", "_single.py"), "distributed.py", "parallel.py",
          *(os.path.join("dist", n) for n in ("_args.py", "_backend.py", "_buffers.py", "_dist.py",
                                              "_fastpath.py", "_group.py", "_hier.py", "_nccl.py",
                                              "_profile.py", "_recorder.py", "_reduce.py",
                                              "_uncompiled.py", "_work.py")))


def test_the_private_reads_check_sees_aliases():
    tree = ast.parse("import torch.distributed as dist\n"
                     "from torch.distributed import distributed_c10d as c10d\n"
                     "a = dist._x\nb = c10d._world.pg_map\nc = dist.all_reduce\n")
    assert _private_torch_reads(tree) == [(3, "dist._x"), (4, "c10d._world")]


@pytest.mark.parametrize("name", TABLED)
def test_private_torch_reads_go_through_the_table(name):
    with open(os.path.join(PKG, name)) as f:
        tree = ast.parse(f.read())
    assert _private_torch_reads(tree) == []
