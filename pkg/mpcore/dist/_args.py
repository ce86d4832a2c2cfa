"""What the group's methods check and make of their arguments: dense
stand-ins for tensors that are not contiguous, a gather's or scatter's one
plain list, and the checks whose errors name what was wrong."""
import torch


def nbytes(t):
    return t.numel() * t.element_size()


ALIGN = 16   # bytes: where each piece of a packed all-gather starts


class Dense:
    """A contiguous CPU stand-in for a tensor: the tensor itself when it is
    one, else a contiguous copy (copied in when `read`) that back() copies
    out into the tensor."""
    __slots__ = ("orig", "t")

    def __init__(self, t, read=True):
        if t.is_contiguous() and t.layout == torch.strided:
            self.orig, self.t = None, t
        else:
            self.orig = t
            self.t = t.contiguous() if read else torch.empty(t.shape, dtype=t.dtype)

    def back(self):
        if self.orig is not None:
            self.orig.copy_(self.t)


def plain_list(lists, like, n):
    """The one list of n tensors in `lists` (a call's output lists of a
    gather, input lists of a scatter; n == 0: none, or one empty list),
    when each is a contiguous CPU tensor of like's dtype and shape; else
    None (the call's general path, which also names what is wrong)."""
    if not n:
        return () if not lists or (len(lists) == 1 and not lists[0]) else None
    if len(lists) != 1 or len(lists[0]) != n:
        return None
    dtype, shape = like.dtype, like.shape
    for t in lists[0]:
        if not (t.is_cpu and t.is_contiguous() and t.dtype == dtype and t.shape == shape):
            return None
    return lists[0]


def check_cpu(what, tensors):
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"mpcore: {what} got a tensor on {t.device}; a call takes tensors "
                             "all on the CPU or all on CUDA devices")
        if t.layout != torch.strided:
            raise ValueError(f"mpcore: {what} takes dense tensors, not {t.layout}")


def same_shapes(what, tensors, like):
    for t in tensors:
        if t.dtype != like.dtype or t.shape != like.shape:
            raise ValueError(f"mpcore: {what}: every tensor must have the input's dtype and "
                             f"shape ({like.dtype}, {tuple(like.shape)}), not ({t.dtype}, "
                             f"{tuple(t.shape)})")
