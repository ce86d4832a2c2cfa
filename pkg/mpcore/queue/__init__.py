"""Queues over a shared-memory ring: the pickler (_pickle), Queue,
SimpleQueue and JoinableQueue (_queue), tensors on a queue as records
(_records), and what serves numpy's and torch's objects to pickles and
queues once those libraries are imported (_serve).  Over mpcore.shm;
NOTE [ Layers of the package ] in mpcore/__init__.py."""
