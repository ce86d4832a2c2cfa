"""Tensors mpcore's handles cannot represent (nested, sparse, quantized,
meta, conjugate and negative views, subclasses) take torch's own reduction,
and arrive as torch's multiprocessing delivers them: through an mpcore
Queue and as a Process argument, under fork, forkserver and spawn, and
under `mpcore run` through torch.multiprocessing's names.  Plain tensors
and Parameters keep mpcore's fast path (NOTE [ What the fast path carries ]).

Each scenario runs in a fresh program (tests/shm/torch_kinds.py), so that the
reference run has no mpcore in it at all and no spawn child belongs to
pytest; each program's keeper is awaited.  One reference program serves
the three start methods, and runs alongside the tests' mpcore programs.
"""
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import program_result, run_program, scaled, wait_keeper_gone

import torch_kinds as K

TESTS = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.timeout(600)


METHODS = ["fork", "forkserver", "spawn"]


def run_kinds(methods, lib, launcher=False):
    """{method: torch_kinds.scenario(method, lib)} for each of `methods`, in
    turn, in one fresh program."""
    code = f"""
    import json, sys
    sys.path.insert(0, {TESTS!r})
    import torch_kinds
    if __name__ == "__main__":
        if {lib!r} == "torch" and not {launcher!r}:
            assert "mpcore" not in sys.modules, "the reference run must be torch's alone"
        out = {{m: torch_kinds.scenario(m, {lib!r}) for m in {methods!r}}}
        print("RESULT " + json.dumps(out), flush=True)
        m = sys.modules.get("mpcore")
        print("KEEPER=%d" % ((m and m._core.keeper_pid()) or 0))
    """
    r = run_program(code, timeout=540, launcher=launcher)
    got = program_result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    keeper = int(re.search(r"KEEPER=(\d+)", r.stdout).group(1))
    if keeper:
        wait_keeper_gone(keeper)
    return got


@pytest.fixture(scope="module")
def torchs():
    """torchs(method): what torch's own multiprocessing delivers under
    `method`, without mpcore (a Process argument is pickled under spawn and
    forkserver only).  One program gives the three methods' references; it
    starts with the module, in a thread, and runs alongside the tests' own
    programs."""
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(run_kinds, METHODS, "torch")
        yield lambda method: ref.result()[method]


def check_like_torch(got, ref):
    assert set(got) == set(K.KINDS)
    for kind in K.KINDS:
        for way in ("queue", "arg"):
            assert got[kind][way] == ref[kind][way], (kind, way)
    # The reference itself says what each kind is, so that a test of
    # nothing cannot pass.
    q = {k: ref[k]["queue"] for k in K.KINDS}
    assert q["nested_strided"]["values"] == [[0.0, 1.0], [10.0, 11.0, 12.0]]
    assert q["nested_jagged"]["layout"] == "torch.jagged"
    assert q["nested_jagged"]["values"] == [[0.0, 1.0], [10.0, 11.0, 12.0]]
    assert q["sparse_coo"]["values"] == [[0.0, 1.5, 0.0], [2.5, 0.0, 0.0]]
    assert q["sparse_csr"]["layout"] == "torch.sparse_csr"
    assert q["quantized"]["dtype"] == "torch.qint8"
    assert q["meta"]["device"] == "meta" and q["meta"]["shape"] == [3, 4]
    assert q["subclass"]["type"] == "Sub"
    assert q["parameter"]["type"] == "Parameter" and q["parameter"]["requires_grad"] is True


@pytest.mark.parametrize("method", METHODS)
def test_every_kind_arrives_as_under_torch(method, torchs):
    check_like_torch(run_kinds([method], "mpcore")[method], torchs(method))


def test_every_kind_arrives_as_under_torch_with_mpcore_run(torchs):
    check_like_torch(run_kinds(["spawn"], "torch", launcher=True)["spawn"], torchs("spawn"))


def test_fast_path_takes_exactly_the_plain_tensors():
    from mpcore.shm import _torch
    with torch.inference_mode():
        inference = torch.ones(3)
    plain = [K.make("plain"), K.make("parameter"), torch.ones(2, dtype=torch.bfloat16),
             torch.ones(3, requires_grad=True), inference,
             torch.tensor([1 + 1j]),  # complex, no conjugate bit
             torch.ones(4)[::2]]
    other = [K.make(k) for k in K.KINDS if k not in ("plain", "parameter")]
    other += [torch.ones(2, 2).to_mkldnn(), torch._efficientzerotensor(2)]
    assert all(_torch.fast_path(t) for t in plain)
    assert not any(_torch.fast_path(t) for t in other)


def test_parameter_keeps_the_fast_path():
    # A Parameter travels as a handle into mpcore memory and comes back a
    # Parameter that requires grad, sharing the sender's storage.
    import mpcore
    p = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
    before = mpcore.stats().get("storages_shared", 0)
    q = mpcore.Queue()
    q.put(p)
    r = q.get(timeout=scaled(30))
    assert mpcore.stats().get("storages_shared", 0) == before + 1
    assert type(r) is torch.nn.Parameter and r.requires_grad
    assert r.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
    with torch.no_grad():
        r[0] = 7
    assert p[0].item() == 7


def test_torch_drops_the_conjugate_bit_and_so_do_we():
    # torch's reduction rebuilds a conjugate view as its plain storage: the
    # receiver gets the un-conjugated values.  mpcore gives the same.
    import mpcore
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = K.make("conj")
    q = mpcore.Queue()
    q.put(c)
    r = q.get(timeout=scaled(30))
    assert not r.is_conj()
    assert torch.equal(r, c.conj())
