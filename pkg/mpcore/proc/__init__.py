"""Processes: dying with the parent (_parentdeath), the zygote (_zygote),
start-method contexts and Process (_context), error files (_errfile) and
torch.multiprocessing's spawn API (_spawn).  Over mpcore.queue; NOTE
[ Layers of the package ] in mpcore/__init__.py."""
