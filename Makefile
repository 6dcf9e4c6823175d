# Two commands on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# On a machine without CUDA, install PyTorch's CPU build first, so that the
# `torch>=` range in pyproject.toml is already met and pip pulls no CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: install demo test test-slow browser docs bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q "$(TORCH_CPU)"; fi
	$(PY) -m pip install -q -e ".[test,demo]"
	$(PY) -m pip install -q --no-deps safeopt==0.16
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/aml-ppl demo --out out

# The default run (under 5 minutes on 2 cores; the slowest 15 tests printed) and the
# `slow` set (longer statistical checks and fault injections); CI runs both. Tests run in
# one process per core (pytest-xdist, at most 4), each process on one thread; the tests of one
# `xdist_group` (those that share a fit or a launch kept by their module) run in one process.
XDIST = -n auto --maxprocesses=4 --dist loadgroup

test: install browser
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) --durations=15

test-slow: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slow $(XDIST) --durations=15

# The report's browser test needs Chromium; on Debian as root, install it when missing (never fatal:
# without it that one test skips and says why).
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
		&& timeout 600 apt-get install -y -qq chromium >/dev/null 2>&1; } || echo "no Chromium: the browser test will skip"

# The documentation site into site/ (the `docs` extra, which `test` takes): the gallery's
# examples run, then MkDocs with warnings as errors.
docs: install
	OMP_NUM_THREADS=1 $(PY) docs/gallery.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: install
	$(PY) -m pip install -q -e ".[test,demo,bench]"
	$(PY) benchmarks/bench_blr.py
	$(PY) benchmarks/bench_svi_step.py
	$(PY) benchmarks/bench_em.py
	$(PY) benchmarks/bench_em.py --memory-table
	$(PY) benchmarks/bench_gp.py
	$(PY) benchmarks/bench_safe_bo.py
	$(PY) benchmarks/bench_posterior.py
	$(PY) benchmarks/bench_bnn_svi.py
	$(PY) benchmarks/bench_chains.py
	$(PY) benchmarks/bench_uci.py  # about 40 min of one core

# On a machine with CUDA: the GPU tests (data on the device; skipped without one) and the
# CPU-against-CUDA table.
gpu-check: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py
	$(PY) benchmarks/bench_gpu.py

clean:
	rm -rf $(VENV) out .pytest_cache site docs/gallery
