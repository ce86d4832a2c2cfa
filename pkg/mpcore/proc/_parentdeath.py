"""A started child dies with the process that started it.

NOTE [ Dying with the parent ]
The parent takes a token when it starts a child: its pid, and whether the
starting thread is its main thread (which lives as long as the process).
The child, first thing, hands it to the core's die_with (NOTE [ Dying with
a process ] in proc.c), which uses PR_SET_PDEATHSIG when the parent thread
lasts and a pidfd watched by a C thread otherwise; no Python thread polls.
A child the zygote forked needs nothing: the zygote SIGKILLs the children
of a requester whose connection closes, which happens when the requester
dies however it dies (NOTE [ Zygote ]).  A parent already gone when the
child gets here kills the child at once.

This module must not import torch.
"""
import logging
import os
import signal
import threading

log = logging.getLogger(__name__)


def token():
    """In the parent, when it starts a child: what the child needs to die
    with this process."""
    return (os.getpid(), threading.current_thread() is threading.main_thread())


def die_with(token):
    """In the child: arranges to be SIGKILLed once the process that made
    `token` has ended; dies now if it has already."""
    pid, thread_lasts = token[0], bool(token[-1])
    from . import _child
    if _child.forked:
        return
    from .. import _core
    try:
        _core.die_with(pid, int(signal.SIGKILL), thread_lasts)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
    except OSError as e:
        log.warning("this process will not die with process %d: %s", pid, e)
