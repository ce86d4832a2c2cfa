"""Tensors of every kind, sent to a child through a queue and as a Process
argument, for test_torch_kinds.py.  A helper module, not a test file: a
fresh program imports it with or without mpcore, so it imports neither
mpcore nor the helpers at the top.

scenario(method, lib) starts children under `method` with `lib`'s Queue and
Process ("mpcore": mpcore's; "torch": torch.multiprocessing's, whatever
serves it) and returns, for each kind, what the child received.
"""
import json
import os
import sys
import warnings

import torch

# Nested tensors warn that their API is a prototype.
warnings.filterwarnings("ignore", message=".*nested tensors.*")


class Sub(torch.Tensor):
    """A subclass of Tensor, as DTensor and other wrappers are."""


def make(kind):
    c = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    if kind == "plain":
        return torch.arange(6, dtype=torch.float32).view(2, 3)[:, 1:]
    if kind == "parameter":
        return torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
    if kind == "nested_strided":
        return torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0) + 10])
    if kind == "nested_jagged":
        return torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0) + 10],
                                          layout=torch.jagged)
    if kind == "sparse_coo":
        return torch.tensor([[0.0, 1.5, 0.0], [2.5, 0.0, 0.0]]).to_sparse()
    if kind == "sparse_csr":
        return torch.tensor([[0.0, 1.5, 0.0], [2.5, 0.0, 3.5]]).to_sparse_csr()
    if kind == "quantized":
        return torch.quantize_per_tensor(torch.tensor([0.5, 1.0, -1.5]), 0.5, 2, torch.qint8)
    if kind == "meta":
        return torch.empty(3, 4, device="meta")
    if kind == "conj":
        return c.conj()
    if kind == "neg":
        return c.conj().imag
    if kind == "subclass":
        return torch.arange(3.0).as_subclass(Sub)
    raise ValueError(kind)


KINDS = ["plain", "parameter", "nested_strided", "nested_jagged", "sparse_coo", "sparse_csr",
         "quantized", "meta", "conj", "neg", "subclass"]


def _values(t):
    if t.is_nested:
        return [_values(x) for x in t.unbind()]
    if t.layout != torch.strided:
        return _values(t.to_dense())
    if t.is_quantized:
        return [t.dequantize().tolist(), t.q_scale(), t.q_zero_point()]
    if t.is_meta:
        return None
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj()).tolist()
    return t.resolve_neg().tolist()


def describe(t):
    """What a receiver sees of a tensor, as plain data (where reading its
    values fails, the error: torch's own quantized tensors arrive without
    their quantizer)."""
    try:
        values = _values(t)
    except Exception as e:
        values = f"{type(e).__name__}: {str(e).splitlines()[0][-80:]}"
    d = {"type": type(t).__name__, "layout": str(t.layout), "dtype": str(t.dtype),
         "device": t.device.type, "dim": t.dim(), "requires_grad": t.requires_grad,
         "is_conj": t.is_conj(), "is_neg": t.is_neg(), "values": values}
    if not t.is_nested:
        d["shape"] = list(t.shape)
    return d


# The tests' time scale (tests/helpers/timescale.py: NOTE [ Waits scale with how slow
# the machine is ]), read here without the helpers: programs import this module.
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))


def _child_setup():
    # A forked child of a process whose OpenMP pool has run can hang in its
    # first parallel torch op (torch's limitation, not mpcore's).
    torch.set_num_threads(1)


def _via_queue(q_in, q_out, n):
    _child_setup()
    q_out.put([describe(q_in.get(timeout=60 * SLOW)) for _ in range(n)])


def _via_args(q_out, *tensors):
    _child_setup()
    q_out.put([describe(t) for t in tensors])


def _api(method, lib):
    if lib == "mpcore":
        import mpcore
        return mpcore.Queue, mpcore.get_context(method).Process
    import torch.multiprocessing as tmp
    ctx = tmp.get_context(method)
    return ctx.Queue, ctx.Process


def _result(q, proc, timeout=300):
    """The child's report; fails at once if it died without one."""
    import queue
    import time
    deadline = time.monotonic() + timeout * SLOW
    while True:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            if proc.exitcode is not None:
                raise AssertionError(f"child exited with {proc.exitcode} without reporting")
            if time.monotonic() > deadline:
                raise AssertionError("no report from the child")


def scenario(method, lib):
    """{kind: {"queue": description, "arg": description}} as children under
    `method` received them."""
    Queue, Process = _api(method, lib)
    tensors = [make(k) for k in KINDS]
    q_in, q_out = Queue(), Queue()
    procs = [Process(target=_via_queue, args=(q_in, q_out, len(tensors))),
             Process(target=_via_args, args=(q_out, *tensors))]
    try:
        procs[0].start()
        for t in tensors:
            q_in.put(t)
        by_queue = _result(q_out, procs[0])
        procs[1].start()
        by_arg = _result(q_out, procs[1])
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(60 * SLOW)
                if p.is_alive():
                    p.kill()
                    p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return {k: {"queue": a, "arg": b} for k, a, b in zip(KINDS, by_queue, by_arg)}


def main(method, lib):
    print("RESULT " + json.dumps(scenario(method, lib)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
