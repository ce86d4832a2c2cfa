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
