# The two commands of the README: `make demo` and `make test`.
# Both set up .venv from nothing (torch pinned to 2.13.0, the CPU build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
STAMP := $(VENV)/.deps-stamp

.PHONY: demo test install bench clean

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) "numpy>=1.24" pytest pytest-timeout matplotlib setuptools wheel nvidia-nccl-cu13
	# torchdata for the test that moves loader state between it and mpcore; --no-deps keeps the pinned torch.
	$(PY) -m pip install -q --no-deps torchdata==0.11.0
	# Lightning for the test that runs its DDP strategy under `mpcore run`; --no-deps as above.
	$(PY) -m pip install -q --no-deps lightning==2.6.6 lightning-utilities==0.15.3 \
	  torchmetrics==1.9.0 tqdm==4.70.1 pyyaml==6.0.4
	touch $(STAMP)

install: $(STAMP)
	$(PY) -m pip install -q --no-build-isolation --no-deps --force-reinstall .

demo: install
	@for f in examples/*.py; do \
	  echo "== mpcore run $$f"; \
	  $(VENV)/bin/mpcore run $$f || exit 1; \
	done
	$(VENV)/bin/mpcore bench --quick

# tests/test_multinode.py plays two machines in network namespaces: it needs `ip` and `unshare`.
# tests/test_cross_compile.py builds the core for aarch64 with Debian's cross compiler.
test: install
	@command -v ip >/dev/null && command -v unshare >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq iproute2 util-linux)
	@command -v aarch64-linux-gnu-gcc >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq gcc-aarch64-linux-gnu)
	$(PY) -m pytest -q -p no:cacheprovider tests

# faster-fifo is a comparison in the bench's dict row only, never a dependency of mpcore.
bench: install
	$(PY) -m pip install -q faster-fifo || echo "faster-fifo did not install: the dict row runs without it"
	$(VENV)/bin/mpcore bench --json bench-out/bench.json --plot bench-out/bench.png

clean:
	rm -rf build $(VENV) pkg/mpcore/*.so *.egg-info
