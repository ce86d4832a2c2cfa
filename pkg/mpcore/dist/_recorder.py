"""torch's Flight Recorder and mpcore's groups: whether a program keeps
gloo's own groups because it asked for the recorder (NOTE [ The Flight
Recorder ]), and what `mpcore doctor` says of it."""
import os

from .. import _torchapi

# NOTE [ The Flight Recorder ]
# torch's Flight Recorder keeps the last N collectives of a process
# (_dump_fr_trace and _dump_fr_trace_json dump them: "gloo:all_reduce",
# its sizes, sequence numbers, stack).  gloo's group records its calls
# there from C++ (ProcessGroupGloo, not c10d's op kernels), and nothing
# outside torch's C++ can record an entry: torch's Python binds only the
# dumps, the recorder's C++ (c10d::FlightRecorder) is not among
# libtorch_cpu.so's or libtorch_python.so's exported symbols (on 2.13,
# `nm -D --defined-only` lists c10d::dump_fr_trace and no FlightRecorder),
# and 2.14's FlightRecorderHook records from a group's C++ pre- and
# post-hooks under names of its own ("c10d:allreduce", not gloo's), which
# the group's Python methods never reach.
# Measured with a 2-rank program (all_reduce, broadcast, barrier,
# all_gather, send/recv, an async all_reduce): on torch 2.13.0 and 2.14.1
# gloo's groups record 5 entries ("gloo:all_reduce", "gloo:broadcast",
# "gloo:barrier", "gloo:all_gather", "gloo:all_reduce"; point-to-point
# calls record none) with no variable set, since the recorder's size is
# TORCH_FR_BUFFER_SIZE, else TORCH_NCCL_TRACE_BUFFER_SIZE, else 2000, and
# none with either set to 0; on torch 2.6.0 gloo records nothing whatever
# the variables say (its dump, _dump_nccl_trace, is NCCL's alone).  The
# generic dump's binding (_dump_fr_trace) is how a torch is told that has
# the recorder gloo writes to: a torch between 2.6 and 2.13 that binds it
# and whose gloo records nothing would leave gloo's groups to gloo for
# nothing (slower, never wrong).
# So a program that asks for the recorder (either variable set to a
# positive number, on a torch that binds _dump_fr_trace) gets gloo's own
# groups: mpcore leaves "gloo" to gloo (NOTE [ Which backend a group gets ]
# in distributed.py: the backend is not installed, nor is DDP under `mpcore
# run`), one warning says why, and `mpcore doctor` lists "distributed
# backend" and "DDP" as not served, with this reason; the dump then has
# the entries plain torch has.  A group asked
# for as "mpcore" by name stays mpcore's, and records nothing.  The
# recorder torch keeps on by default (no variable set) does not turn
# mpcore off: every program would lose mpcore's backend on the torches
# that have it; there the dump lacks the collectives of mpcore's groups,
# and doctor says so (flight_recorder_note()).  On a torch whose gloo
# records nothing (2.6) nothing changes: gloo's dump is empty too.
_FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")   # torch's order


def _fr_asked():
    """(variable, value) of the Flight Recorder's size a program set, as
    torch reads it (the first variable set wins), or None when neither is
    set."""
    for var in _FR_VARS:
        value = os.environ.get(var)
        if value is not None:
            return var, value
    return None


def _gloo_records():
    """Whether this torch has the recorder gloo's groups write to."""
    return _torchapi.find("torch._C._distributed_c10d._dump_fr_trace") is not None


def flight_recorder():
    """Why gloo's groups are left to gloo in this process (the program
    asked for torch's Flight Recorder, which records gloo's groups alone),
    or None (NOTE [ The Flight Recorder ])."""
    asked = _fr_asked()
    if asked is None:
        return None
    var, value = asked
    try:
        size = int(value.strip())
    except ValueError:
        return None
    if size <= 0 or not _gloo_records():
        return None
    return (f"torch's Flight Recorder is on ({var}={value}) and records the collectives of "
            f"gloo's own groups alone")


def leave_gloo_to_gloo():
    """flight_recorder(), with the fallback recorded where it gives a
    reason: the distributed backend and DDP (whose replacement serves
    mpcore's groups alone) are not served, and the program is told once."""
    why = flight_recorder()
    if why is not None:
        _torchapi.fall_back("distributed backend", why)
        _torchapi.fall_back("DDP", why)
    return why


def doctor_facts():
    """What `mpcore doctor` says of the Flight Recorder: why gloo's groups
    are left to gloo here (the fallbacks recorded, as `mpcore run` records
    them), and its note on the recorder torch keeps on by default."""
    try:
        import torch.distributed as td
    except ImportError:      # no torch
        td = None
    if td is None or not _torchapi.check_window() or not td.is_available():
        return {"left_to_gloo": None, "note": None}
    return {"left_to_gloo": leave_gloo_to_gloo(), "note": flight_recorder_note()}


def flight_recorder_note():
    """What doctor says of the Flight Recorder where mpcore serves gloo's
    groups and the recorder is on by torch's default, or None."""
    if _fr_asked() is not None or not _gloo_records():
        return None
    return ("torch's Flight Recorder is on by default here (2000 entries) and its dumps "
            "(_dump_fr_trace) lack the collectives of mpcore's groups; set "
            "TORCH_FR_BUFFER_SIZE to a positive number to have gloo's groups left to gloo, "
            "with their entries")
