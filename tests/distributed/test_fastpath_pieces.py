"""How the fast paths read a list of tensors (NOTE [ A list of tensors read
in one call ] in csrc/py_pieces.c): _core.tensor_pieces gives the first
address of a list laid end to end, the list of addresses otherwise, and
None for every list the core does not take as it stands (torch's function
then serves the call and raises its own errors)."""
import pytest
import torch

from mpcore import _core

pieces = _core.tensor_pieces
T = torch.Tensor


def call(ts, like, w=None):
    return pieces(ts, T, like.dtype, like.shape, len(ts) if w is None else w, like.nbytes)


def test_end_to_end_gives_the_first_address():
    flat = torch.arange(12.0).reshape(3, 4)
    ts = list(flat.unbind(0))
    assert call(ts, ts[0]) == flat.data_ptr()
    one = [torch.zeros(4)]
    assert call(one, one[0]) == one[0].data_ptr()


def test_apart_gives_every_address():
    ts = [torch.zeros(2, 3) for _ in range(3)]
    assert call(ts, ts[0]) == [t.data_ptr() for t in ts]
    flat = torch.zeros(3, 4)
    shuffled = [flat[1], flat[0], flat[2]]
    assert call(shuffled, flat[0]) == [t.data_ptr() for t in shuffled]


def test_empty_pieces_are_never_end_to_end():
    ts = [torch.zeros(0), torch.zeros(0)]
    got = call(ts, ts[0])
    assert type(got) is list and got == [t.data_ptr() for t in ts]


@pytest.mark.parametrize("what, ts", [
    ("a tuple", (torch.zeros(4), torch.zeros(4))),
    ("one short", [torch.zeros(4)]),
    ("another dtype", [torch.zeros(4), torch.zeros(4, dtype=torch.float64)]),
    ("another shape", [torch.zeros(4), torch.zeros(2, 2)]),
    ("not contiguous", [torch.zeros(4), torch.zeros(8)[::2]]),
    ("a subclass", [torch.zeros(4), torch.nn.Parameter(torch.zeros(4))]),
    ("not a tensor", [torch.zeros(4), [0.0] * 4]),
    ("a meta tensor", [torch.zeros(4), torch.zeros(4, device="meta")]),
])
def test_any_other_list_gives_none(what, ts):
    like = torch.zeros(4)
    assert pieces(ts, T, like.dtype, like.shape, 2, like.nbytes) is None, what


def test_a_world_outside_the_core_gives_none():
    like = torch.zeros(1)
    assert pieces([], T, like.dtype, like.shape, 0, like.nbytes) is None
    many = [torch.zeros(1) for _ in range(65)]
    assert pieces(many, T, like.dtype, like.shape, 65, like.nbytes) is None


def test_an_attribute_that_raises_propagates():
    class Odd(torch.Tensor):
        @property
        def is_cpu(self):
            raise KeyError("no device")
    like = torch.zeros(2)
    odd = torch.zeros(2).as_subclass(Odd)
    with pytest.raises(KeyError, match="no device"):
        pieces([odd], Odd, like.dtype, like.shape, 1, like.nbytes)


def test_a_list_changed_while_it_is_read_gives_none():
    ts = []

    class Shrinks(torch.Tensor):
        @property
        def is_cpu(self):
            ts.clear()
            return True
    a = torch.zeros(2).as_subclass(Shrinks)
    ts.extend([a, torch.zeros(2).as_subclass(Shrinks)])
    assert pieces(ts, Shrinks, a.dtype, a.shape, 2, a.nbytes) is None


def test_dtype_and_shape_from_the_first_item():
    flat = torch.zeros(3, 2, 3)
    ts = list(flat.unbind(0))
    assert pieces(ts, T, None, None, 3, ts[0].nbytes) == flat.data_ptr()
    apart = [torch.zeros(2, 3) for _ in range(2)]
    assert pieces(apart, T, None, None, 2, 24) == [t.data_ptr() for t in apart]
    for other in (torch.zeros(3, 2), torch.zeros(2, 3, dtype=torch.float64),
                  torch.zeros(2, 6)[:, ::2]):
        assert pieces([apart[0], other], T, None, None, 2, 24) is None
    assert pieces([torch.zeros(2, 6)[:, ::2], apart[0]], T, None, None, 2, 24) is None
    assert pieces([[0.0] * 6, apart[0]], T, None, None, 2, 24) is None


def test_a_second_list_checked_alike():
    ins = list(torch.zeros(2, 4).unbind(0))
    outs = [torch.zeros(4) for _ in range(2)]
    got = pieces(ins, T, None, None, 2, 16, outs)
    assert got == (ins[0].data_ptr(), [t.data_ptr() for t in outs])
    assert pieces(ins, T, ins[0].dtype, ins[0].shape, 2, 16, outs) == got
    # the second list is held to the first's dtype and shape
    assert pieces(ins, T, None, None, 2, 16, [torch.zeros(4), torch.zeros(2, 2)]) is None
    assert pieces(ins, T, None, None, 2, 16,
                  [torch.zeros(4), torch.zeros(4, dtype=torch.int32)]) is None
    assert pieces(ins, T, None, None, 2, 16, outs[:1]) is None
    assert pieces(ins[:1], T, None, None, 2, 16, outs) is None


def test_bad_arguments_raise():
    like = torch.zeros(2)
    with pytest.raises(TypeError, match="6 or 7 arguments"):
        pieces([like], T, like.dtype, like.shape, 1)
    with pytest.raises(TypeError, match="both None or neither"):
        pieces([like], T, None, like.shape, 1, like.nbytes)
    with pytest.raises(TypeError):
        pieces([like], T, like.dtype, like.shape, "one", like.nbytes)
    with pytest.raises(OverflowError):
        pieces([like], T, like.dtype, like.shape, 1, -1)
