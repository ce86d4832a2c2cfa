"""What the gloo of particular torch releases does differently, for the tests
that compare mpcore with gloo (NOTE [ What an older torch's gloo refuses or
gets wrong ] in mpcore/dist/_collectives.py)."""
import torch

# The installed torch as (major, minor).
TORCH_RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# torch releases whose gloo reduce_scatter_tensor, coalesced or not, sums whatever
# reduction it is asked for (AVG included, never divided): torch's
# ProcessGroupGloo::reduce_scatter_tensor_coalesced (which _reduce_scatter_base calls
# too) sets the reduction on all-reduce options it then does not pass to its
# all-reduce.  Seen on torch 2.6.0 and 2.8.0; 2.13.0 and 2.14.1 reduce as asked.  The
# releases between were not tried: one of them whose gloo sums too fails
# test_gloo_reduces_as_asked (test_dispatch_reductions.py), which names it.  mpcore
# reduces as asked on every torch.
GLOO_REDUCE_SCATTER_SUMS = ((2, 6), (2, 8))
