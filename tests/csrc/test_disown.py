"""A disowned segment (NOTE [ A disowned segment ] in csrc/arena.c): a large
block whose owner gives up its segment is retired, its memory given back,
once the block is freed, by whichever process frees it; the owner's mapping
goes with its last hold.  A block left owned stays cached for reuse."""
import gc

import pytest

import mpcore
from mpcore import _core
from mpcore.shm import _blocks

BIG = 4 << 20   # above the arena's largest size class: a segment of its own


def _inode(address):
    """The inode of the mapping of this process that covers address, or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return parts[4]
    return None


def _mapped(inode):
    with open("/proc/self/maps") as f:
        return any(line.split()[4] == inode for line in f)


def _what_the_keeper_says(handle):
    """The error of attaching the block's next generation: it redeems no
    ticket, and says whether the segment is known (a stale handle) or
    retired (unknown)."""
    seg, index, gen = handle
    with pytest.raises(mpcore.HandleError) as e:
        _core.attach((seg, index, gen + 2))
    return str(e.value)


def test_a_disowned_block_gives_its_memory_back_once_freed():
    b = _blocks.alloc(BIG)
    memoryview(b)[:5] = b"hello"
    handle, inode = b.handle, _inode(b.address)
    assert inode is not None and _mapped(inode)
    assert b.disown() is True
    ticket = b.ticket()          # in transit, as a shipment's message is
    del b
    gc.collect()
    assert not _mapped(inode), "the owner's mapping outlived its last hold"
    got = _core.attach(ticket)   # the ticket kept the block: another holder reads it
    assert bytes(memoryview(got)[:5]) == b"hello"
    del got                      # the last reference: the segment is retired
    gc.collect()
    assert "unknown shared-memory segment" in _what_the_keeper_says(handle)
    assert not _mapped(inode)


def test_a_block_left_owned_stays_cached_for_the_next_of_its_size():
    b = _blocks.alloc(BIG)
    handle = b.handle
    del b
    gc.collect()
    assert "stale handle" in _what_the_keeper_says(handle)   # freed, its segment kept
    again = _blocks.alloc(BIG)
    assert again.handle[0] == handle[0] and again.handle[2] > handle[2]


def test_a_small_block_is_left_as_it_is_and_a_second_disown_is_refused():
    small = _blocks.alloc(1000)
    assert small.disown() is False           # in an arena shared with other blocks
    assert small.handle in {b.handle for b in _core.live_blocks()}   # still live, still ours
    big = _blocks.alloc(BIG)
    assert big.disown() is True
    with pytest.raises(ValueError, match="is not this process's"):
        big.disown()
