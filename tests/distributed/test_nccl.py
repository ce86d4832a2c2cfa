"""NCCL loaded at run time (csrc/nccl.c, pkg/mpcore/_nccl.py) on a machine
with the nvidia-nccl wheel and no GPU: it loads, says where from, and every
path that needs a GPU fails with a clear error, never a crash or a hang.
What needs a GPU is proven by benchmarks/gpu_check.sh."""
import subprocess
import sys
import types

import pytest
import torch

from mpcore import _core
from mpcore.dist import _nccl

from helpers import require, scaled


def wheel():
    paths = _nccl.wheel_paths()
    require(paths, "the nvidia-nccl wheel is not installed (make test installs it)")
    return paths


def run_fresh(code):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=scaled(60))
    return r


def test_loads_the_wheel_and_reports_its_version():
    paths = wheel()
    where = _nccl.load()
    assert where in paths or "already loaded" in where
    version = _core.nccl_version()
    assert version >= 21300  # 2.13 or later: the wheel is recent


def test_no_nccl_anywhere_is_a_clear_error():
    # A fresh process that offers no path: this machine has no system NCCL.
    r = run_fresh("import mpcore._core as c\n"
                  "try:\n    c.nccl_load(['/nowhere/libnccl.so.2'])\n"
                  "except RuntimeError as e:\n    print('ERR', e)\n")
    assert r.returncode == 0, r.stderr
    assert "ERR NCCL is not installed" in r.stdout
    assert "/nowhere/libnccl.so.2" in r.stdout  # says what it tried


def test_calls_before_loading_say_so():
    r = run_fresh("import mpcore._core as c\n"
                  "try:\n    c.nccl_unique_id()\n"
                  "except RuntimeError as e:\n    print('ERR', e)\n")
    assert "ERR NCCL is not loaded" in r.stdout, r.stdout + r.stderr


def test_unique_id_without_a_gpu():
    wheel()
    _nccl.load()
    uid = _core.nccl_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128


def test_communicator_without_a_gpu_gives_nccls_own_error():
    wheel()
    _nccl.load()
    with pytest.raises(RuntimeError, match=r"NCCL ncclCommInitRank failed: .*cuda"):
        _core.NcclComm(_core.nccl_unique_id(), 1, 0)


def test_a_malformed_unique_id_is_refused():
    wheel()
    _nccl.load()
    with pytest.raises(ValueError, match="128 bytes"):
        _core.NcclComm(b"short", 1, 0)


def test_group_without_a_gpu_says_there_is_none():
    wheel()
    store = torch.distributed.HashStore()
    with pytest.raises(RuntimeError, match="NCCL needs a CUDA GPU"):
        _nccl.NcclGroup.create(store, 0, 1, "t/")


def test_two_ranks_on_one_gpu_are_named(monkeypatch):
    wheel()
    props = types.SimpleNamespace(uuid="GPU-1234")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    store = torch.distributed.HashStore()
    import socket
    store.set("t/gpu/1", f"{socket.gethostname()}|GPU-1234|0")  # rank 1 is on the same GPU
    with pytest.raises(RuntimeError, match=r"ranks 0 and 1 both use GPU 0 \(GPU-1234\)"):
        _nccl.NcclGroup.create(store, 0, 2, "t/")


@pytest.mark.timeout(60)
def test_init_process_group_nccl_without_nccl_in_torch_is_a_clear_error(tmp_path):
    code = """
import os, datetime, socket
import mpcore.distributed as dist
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
try:
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=20))
except Exception as e:
    print("ERR", type(e).__name__, e)
"""
    r = run_fresh(code)
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "NCCL" in r.stdout, r.stdout
