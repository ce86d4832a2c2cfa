"""torch tensors shared through mpcore: behaviour must match
torch.multiprocessing's.

Scenarios are module-level functions taking a start method.  Under fork
they run inside the pytest process; under spawn they run as a fresh program
that imports this module (so spawn children can import the targets by
module name), because spawning from the pytest process would leave
multiprocessing's resource tracker behind as a child of pytest.  Children
report through queues; every scenario reaps its children even when it
fails.  Nothing here waits on a sleep or asserts on time.
"""
import traceback

import pytest
import torch
import torch.multiprocessing as tmp
from multiprocessing.reduction import ForkingPickler
from torch import nn

import mpcore
from helpers import mpcore_ranges, reap, result, run_scenario, scaled

MODULE = __name__
METHODS = ["fork", "spawn"]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int64, torch.int32, torch.uint8, torch.bool]


# --- helpers ------------------------------------------------------------


def in_mpcore_memory(t):
    """Whether all of the tensor's storage lies in an mpcore memfd mapping."""
    s = t.untyped_storage()
    lo, hi = s.data_ptr(), s.data_ptr() + s.nbytes()
    return any(a <= lo and hi <= b for a, b in mpcore_ranges())


def child_setup():
    # A forked child of a process whose OpenMP pool has run (pytest's, after
    # other tests) hangs in its first parallel torch op -- torch's
    # limitation, not mpcore's; DataLoader workers do the same.
    torch.set_num_threads(1)


def _run_child(result_q, fn_name, *args):
    """Target of every child: runs fn_name(*args) and reports what it
    returned (or its traceback) on result_q."""
    child_setup()
    try:
        out = globals()[fn_name](*args)
    except BaseException:
        result_q.put(("error", traceback.format_exc()))
        raise
    result_q.put(("ok", out))


def start(ctx, procs, fn_name, result_q, *args):
    p = ctx.Process(target=_run_child, args=(result_q, fn_name) + args)
    procs.append(p)
    p.start()
    return p


# --- in one process -----------------------------------------------------

def test_share_memory_moves_storage_in_place():
    t = torch.arange(10, dtype=torch.float32)
    v = t[2:5]
    assert not t.is_shared()
    assert t.share_memory_() is t
    assert t.is_shared() and v.is_shared()
    assert in_mpcore_memory(t)
    # The view follows the storage into shared memory.
    assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert v.data_ptr() == t.data_ptr() + 2 * 4
    assert t.tolist() == list(range(10))
    v.fill_(-1)
    assert t.tolist() == [0, 1, -1, -1, -1, 5, 6, 7, 8, 9]
    # Sharing again is a no-op.
    ptr = t.data_ptr()
    t.share_memory_()
    assert t.data_ptr() == ptr
    assert t.untyped_storage().is_shared()


def test_module_share_memory_shares_parameters_and_buffers():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    w = m[0].weight
    row = m[0].weight.data[1]
    assert m.share_memory() is m
    assert m[0].weight is w
    tensors = list(m.parameters()) + list(m.buffers())
    assert len(tensors) == 7  # weight, bias, bn weight, bn bias, mean, var, count
    for t in tensors:
        assert t.is_shared(), t
        assert in_mpcore_memory(t)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert row.is_shared()
    with torch.no_grad():
        row.fill_(3.5)
    assert m[0].weight[1].tolist() == [3.5] * 4


def test_mpcore_empty_zeros_give_shared_tensors():
    z = mpcore.zeros((3, 4), torch.float32)
    assert isinstance(z, torch.Tensor) and z.dtype == torch.float32
    assert z.shape == (3, 4) and z.is_shared() and in_mpcore_memory(z)
    assert torch.count_nonzero(z).item() == 0
    e = mpcore.empty(5, torch.int64)
    assert e.shape == (5,) and e.dtype == torch.int64 and e.is_shared()
    assert mpcore.share_memory_(torch.ones(2)).is_shared()


def test_tensor_pickles_as_a_small_handle():
    t = torch.ones(1 << 20)  # 4 MB
    sent = mpcore.stats().get("handles_sent", 0)
    data = ForkingPickler.dumps(t)
    assert len(data) < 4096, len(data)
    assert mpcore.stats()["handles_sent"] == sent + 1
    assert t.is_shared() and in_mpcore_memory(t)
    back = ForkingPickler.loads(data)
    assert back.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert back.shape == t.shape and back.sum().item() == float(1 << 20)


def test_non_leaf_tensor_requiring_grad_is_refused():
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    q = mpcore.Queue()
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf tensor"):
        q.put(y)
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf tensor"):
        q.put({"nested": [torch.zeros(2), y]})
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf tensor"):
        ForkingPickler.dumps(y)
    assert q.empty()
    # Leaves and detached tensors are fine.
    q.put((x, y.detach()))
    a, b = q.get(timeout=scaled(10))
    assert a.requires_grad and a.is_leaf and a.tolist() == [1, 1, 1]
    assert not b.requires_grad and b.tolist() == [2, 2, 2]
    assert q.empty()


# --- a child changes what the parent shares -----------------------------

def _child_changes(t, u, m):
    seen = {"t": t.tolist(), "u": u.tolist(), "w": m.weight.tolist(),
            "shared": [t.is_shared(), m.weight.is_shared()]}
    t.add_(1)
    t[1].fill_(5)
    u.mul_(10)
    with torch.no_grad():
        m.weight.fill_(2)
        m.bias.zero_()
    return seen


def scenario_child_changes_seen(method):
    ctx = mpcore.get_context(method)
    t = torch.zeros(3, 2)
    row = t[2]                      # a view made before the move
    t.share_memory_()
    u = torch.arange(4, dtype=torch.float32)   # not shared by the parent
    m = nn.Linear(2, 2)
    m.share_memory()
    w0 = m.weight.tolist()
    q = mpcore.Queue()
    procs = []
    try:
        start(ctx, procs, "_child_changes", q, t, u, m)
        seen = result(q, procs)
        procs[0].join(scaled(60))
        assert procs[0].exitcode == 0
    finally:
        reap(procs)
    assert seen["t"] == [[0, 0]] * 3 and seen["u"] == [0, 1, 2, 3] and seen["w"] == w0
    assert seen["shared"] == [True, True]
    assert t.tolist() == [[1, 1], [5, 5], [1, 1]]
    assert row.tolist() == [1, 1]
    assert m.weight.tolist() == [[2, 2], [2, 2]] and m.bias.tolist() == [0, 0]
    if method == "spawn":
        # Pickling a tensor for a spawned child moves it to shared memory.
        assert u.is_shared()
        assert u.tolist() == [0, 10, 20, 30]
    else:
        # A forked child's copy of unshared memory is its own.
        assert not u.is_shared()
        assert u.tolist() == [0, 1, 2, 3]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_child_changes_seen_by_parent(method, leak_check, scenario_runner):
    run_scenario(MODULE, "scenario_child_changes_seen", method, runner=scenario_runner)


# --- views and storage identity across a queue ---------------------------

def _child_views(q_in):
    a, b = q_in.get(timeout=scaled(60))
    c = q_in.get(timeout=scaled(60))
    sa, sb, sc = a.untyped_storage(), b.untyped_storage(), c.untyped_storage()
    info = {
        "same_ab": sa.data_ptr() == sb.data_ptr() and sa._cdata == sb._cdata,
        "same_ac": sa.data_ptr() == sc.data_ptr() and sa._cdata == sc._cdata,
        "b_offset": b.storage_offset(), "a": a.tolist(), "b": b.tolist(),
        "shared": a.is_shared(),
    }
    b.fill_(-7)            # seen through a and c
    c[0] = 100
    info["a_after"] = a.tolist()
    return info, b[1:]     # a view of a view goes back


def scenario_views(method, kind="mpcore"):
    ctx = mpcore.get_context(method)
    q_in = mpcore.Queue() if kind == "mpcore" else tmp.get_context(method).Queue()
    q_out = mpcore.Queue()
    t = torch.arange(8, dtype=torch.float32)
    procs = []
    try:
        start(ctx, procs, "_child_views", q_out, q_in)
        q_in.put((t, t[1:3]))
        if kind == "mpcore":
            # put() moved the sender's storage to shared memory in place.
            assert t.is_shared() and in_mpcore_memory(t)
        q_in.put(t)
        info, back = result(q_out, procs)
        procs[0].join(scaled(60))
        assert procs[0].exitcode == 0
    finally:
        reap(procs)
    assert info["same_ab"] and info["same_ac"]
    assert info["b_offset"] == 1 and info["shared"]
    assert info["a"] == list(range(8)) and info["b"] == [1, 2]
    assert info["a_after"] == [100, -7, -7, 3, 4, 5, 6, 7]
    assert t.tolist() == [100, -7, -7, 3, 4, 5, 6, 7]
    # The view that came back is over the sender's own storage.
    assert back.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert back.storage_offset() == 2 and back.tolist() == [-7]
    back.fill_(9)
    assert t[2].item() == 9


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_views_and_identity_through_queue(method, leak_check, scenario_runner):
    run_scenario(MODULE, "scenario_views", method, runner=scenario_runner)


def scenario_views_torch_queue(method):
    scenario_views(method, kind="torch")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_views_and_identity_through_torch_multiprocessing_queue(method, leak_check, scenario_runner):
    run_scenario(MODULE, "scenario_views_torch_queue", method, runner=scenario_runner)


# --- a sender that exits before the receiver gets -----------------------

def _child_send_and_exit(q):
    child_setup()
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3) * 1.5
    p = nn.Parameter(torch.full((2,), 3.0))
    q.put({"x": x, "xt": x.t(), "p": p, "n": torch.tensor(7), "big": torch.ones(300_000)})
    if hasattr(q, "close"):
        q.close()
        q.join_thread()


def _sender_exits_first(method, q):
    ctx = mpcore.get_context(method)
    p = ctx.Process(target=_child_send_and_exit, args=(q,))
    try:
        p.start()
        p.join(scaled(90))
        assert p.exitcode == 0
        msg = q.get(timeout=scaled(60))
    finally:
        reap([p])
    assert msg["x"].tolist() == [[0, 1.5, 3], [4.5, 6, 7.5]]
    assert msg["xt"].tolist() == [[0, 4.5], [1.5, 6], [3, 7.5]]
    assert isinstance(msg["p"], nn.Parameter) and msg["p"].requires_grad
    assert msg["p"].tolist() == [3, 3]
    assert msg["n"].item() == 7 and msg["n"].dtype == torch.int64 and msg["n"].dim() == 0
    assert msg["big"].sum().item() == 300_000
    # The memory is still good to write to, and views still share it.
    msg["x"][0, 1] = 42
    assert msg["xt"][1, 0].item() == 42


def scenario_sender_exits_first(method):
    _sender_exits_first(method, mpcore.Queue())


def scenario_sender_exits_first_torch_queue(method):
    # The parent has used mpcore memory before (see
    # test_tensor_from_child_to_parent_that_has_not_used_mpcore for when not).
    held = mpcore.zeros(4, torch.float32)
    _sender_exits_first(method, tmp.get_context(method).Queue())
    assert held.tolist() == [0, 0, 0, 0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_sender_may_exit_before_receiver_gets(method, leak_check, scenario_runner):
    run_scenario(MODULE, "scenario_sender_exits_first", method, runner=scenario_runner)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_sender_may_exit_before_receiver_gets_torch_queue(method, leak_check, scenario_runner):
    run_scenario(MODULE, "scenario_sender_exits_first_torch_queue", method, runner=scenario_runner)


# --- Hogwild -------------------------------------------------------------

STEPS = 5
LR = 0.125


def _child_train(model, lock, steps):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.ones(1, 3)
    for _ in range(steps):
        # The lock makes the expected result exact; without it Hogwild may
        # lose updates, which is allowed but not checkable.
        with lock:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    return {"grad": model.weight.grad.tolist(), "shared": model.weight.is_shared()}


def scenario_hogwild(method):
    ctx = mpcore.get_context(method)
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
        model.bias.copy_(torch.tensor([0.5, -0.5]))
    model.share_memory()
    # The parent's .grad is its own: children's backward must not touch it.
    model.weight.grad = torch.full((2, 3), 0.25)
    lock = ctx.Lock()
    q = mpcore.Queue()
    nchildren = 2
    procs = []
    try:
        for _ in range(nchildren):
            start(ctx, procs, "_child_train", q, model, lock, STEPS)
        reports = [result(q, procs) for _ in range(nchildren)]
        for p in procs:
            p.join(scaled(60))
            assert p.exitcode == 0
    finally:
        reap(procs)
    for r in reports:
        assert r["shared"]
        assert r["grad"] == [[1.0] * 3] * 2     # d(sum(Wx+b))/dW with x = 1
    # Each of the 2 * STEPS steps subtracted LR from every parameter
    # (LR is a power of two: exact in float32).
    total = nchildren * STEPS * LR
    assert model.weight.tolist() == [[1 - total, 2 - total, 3 - total],
                                     [4 - total, 5 - total, 6 - total]]
    assert model.bias.tolist() == [0.5 - total, -0.5 - total]
    assert model.weight.grad.tolist() == [[0.25] * 3] * 2
    assert model.bias.grad is None
    assert not model.weight.grad.is_shared()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_hogwild_training_updates_parent(method, leak_check, scenario_runner):
    run_scenario(MODULE, "scenario_hogwild", method, runner=scenario_runner)


# --- Parameters, requires_grad, identity within one pickle ---------------

def _child_params(q_in):
    model, opt, frozen, leaf, plain = q_in.get(timeout=scaled(60))
    w = model[0].weight
    info = {
        "w_type": type(w).__name__, "w_rg": w.requires_grad,
        "opt_is_model": (opt.param_groups[0]["params"][0] is w
                         and opt.param_groups[0]["params"][1] is model[0].bias),
        "frozen": (type(frozen).__name__, frozen.requires_grad),
        "leaf": (type(leaf).__name__, leaf.requires_grad, leaf.is_leaf),
        "plain": (type(plain).__name__, plain.requires_grad),
        "grad_before": w.grad is None,
    }
    # Train through the optimizer that came in the same message.
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    return info


def scenario_params(method):
    ctx = mpcore.get_context(method)
    model = nn.Sequential(nn.Linear(2, 2))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    leaf = torch.ones(3, requires_grad=True)
    plain = torch.zeros(2)
    q_in, q_out = mpcore.Queue(), mpcore.Queue()
    procs = []
    try:
        start(ctx, procs, "_child_params", q_out, q_in)
        q_in.put((model, opt, frozen, leaf, plain))
        info = result(q_out, procs)
        procs[0].join(scaled(60))
        assert procs[0].exitcode == 0
    finally:
        reap(procs)
    assert info["w_type"] == "Parameter" and info["w_rg"]
    assert info["opt_is_model"]
    assert info["frozen"] == ("Parameter", False)
    assert info["leaf"] == ("Tensor", True, True)
    assert info["plain"] == ("Tensor", False)
    assert info["grad_before"]
    # The child's optimizer step moved the parent's parameters...
    assert model[0].weight.tolist() == [[0.5, 1.5], [2.5, 3.5]]
    assert model[0].bias.tolist() == [-0.5, -0.5]
    # ...and left the parent's gradients alone.
    assert model[0].weight.grad is None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_parameters_and_optimizer_arrive_intact(method, leak_check, scenario_runner):
    run_scenario(MODULE, "scenario_params", method, runner=scenario_runner)


# --- dtypes and layouts ---------------------------------------------------

def _make_cases():
    cases = {}
    for dt in DTYPES:
        name = str(dt).split(".")[1]
        mod = 2 if dt is torch.bool else 7
        base = (torch.arange(24) % mod).to(dt).reshape(4, 6)
        cases[name + "/contiguous"] = base.clone()
        cases[name + "/transposed"] = base.clone().t()
        cases[name + "/strided"] = base.clone()[1:, ::2]
        cases[name + "/zero-dim"] = torch.tensor(1 if dt is torch.bool else 5).to(dt)
        cases[name + "/empty"] = torch.empty(0, 3, dtype=dt)
    return cases


def _mutate(t):
    if t.dtype is torch.bool:
        t.logical_not_()
    else:
        t.add_(1)


def _describe(t):
    return (str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.tolist())


def _child_dtypes(q_in):
    cases = q_in.get(timeout=scaled(60))
    seen = {k: _describe(t) for k, t in cases.items()}
    for t in cases.values():
        _mutate(t)
    return seen


def scenario_dtypes(method):
    ctx = mpcore.get_context(method)
    cases = _make_cases()
    expected = {k: _describe(t) for k, t in cases.items()}
    mutated = {k: t.clone() for k, t in cases.items()}
    for t in mutated.values():
        _mutate(t)
    q_in, q_out = mpcore.Queue(), mpcore.Queue()
    procs = []
    try:
        start(ctx, procs, "_child_dtypes", q_out, q_in)
        q_in.put(cases)
        seen = result(q_out, procs)
        procs[0].join(scaled(60))
        assert procs[0].exitcode == 0
    finally:
        reap(procs)
    assert set(seen) == set(expected)
    bad = {k: (seen[k], expected[k]) for k in expected if seen[k] != expected[k]}
    assert not bad, bad
    for k, t in cases.items():
        assert torch.equal(t, mutated[k]), (k, t, mutated[k])
        if t.numel():
            assert t.is_shared(), k


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_dtypes_and_layouts(method, leak_check, scenario_runner):
    run_scenario(MODULE, "scenario_dtypes", method, runner=scenario_runner)


# --- a tensor made in a child comes to the parent ------------------------

def _child_makes(q_in):
    a = q_in.get(timeout=scaled(60))            # a tensor of the parent's
    made = torch.full((4,), 2.5)        # a tensor of the child's
    return made, made[2:], a[1]


def scenario_child_makes(method):
    ctx = mpcore.get_context(method)
    q_in, q_out = mpcore.Queue(), mpcore.Queue()
    a = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    procs = []
    try:
        start(ctx, procs, "_child_makes", q_out, q_in)
        q_in.put(a)
        made, tail, row = result(q_out, procs)
        procs[0].join(scaled(60))
        assert procs[0].exitcode == 0
    finally:
        reap(procs)
    assert made.tolist() == [2.5] * 4 and made.is_shared()
    assert tail.untyped_storage().data_ptr() == made.untyped_storage().data_ptr()
    tail.fill_(0)
    assert made.tolist() == [2.5, 2.5, 0, 0]
    assert row.tolist() == [3, 4]
    row[0] = 30
    assert a.tolist() == [[1, 2], [30, 4]]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_tensor_made_in_child_reaches_parent(method, leak_check, scenario_runner):
    run_scenario(MODULE, "scenario_child_makes", method, runner=scenario_runner)


# --- children's tensors reach a parent that has not used mpcore yet ------

def _child_sends_and_waits(q, ack, back):
    child_setup()
    t = torch.arange(5, dtype=torch.float32)
    q.put(t)
    if not ack.wait(scaled(60)):
        raise AssertionError("no ack from the parent")
    back.put(t.tolist())


def scenario_fresh_parent(method):
    # A plain torch.multiprocessing program: the parent makes a queue of
    # torch.multiprocessing's (no mpcore memory) and a worker sends it a
    # tensor, staying alive until the parent has it.
    ctx = mpcore.get_context(method)
    q = tmp.get_context(method).Queue()
    back = tmp.get_context(method).Queue()
    ack = ctx.Event()
    p = ctx.Process(target=_child_sends_and_waits, args=(q, ack, back))
    try:
        p.start()
        t = q.get(timeout=scaled(90))
        assert t.tolist() == [0, 1, 2, 3, 4]
        t[0] = 42
        ack.set()
        assert back.get(timeout=scaled(90)) == [42, 1, 2, 3, 4]
        p.join(scaled(60))
        assert p.exitcode == 0
    finally:
        ack.set()
        reap([p])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_tensor_from_child_to_parent_that_has_not_used_mpcore(method, leak_check):
    run_scenario(MODULE, "scenario_fresh_parent", method, fresh=True)
