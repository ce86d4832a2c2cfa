"""Shared memory on the Python side: blocks and numpy arrays (_blocks),
torch's tensors and storages in them (_torch), and mpcore.empty, zeros,
share_memory_ and stats (_api).  Beneath the queues; NOTE [ Layers of the
package ] in mpcore/__init__.py."""
