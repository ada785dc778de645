# Kiln's two commands (see README.md):
#   make demo   the main job: train two models on the kiln device
#   make test   the tests: runtime conformance (C API) and PyTorch-level tests
#               (`make test-full` adds the slow ones)
# Both first install what is missing (Debian and Python packages, the build).
# Other targets: deps, build, test-runtime, test-python, conformance,
# conformance-compiled, bench, clean.

PYTHON ?= python3
export PYTHON
RUNTIME_BUILD := build/runtime-tests

.PHONY: all deps build test test-full test-runtime test-python test-python-full conformance conformance-compiled demo bench clean

all: build

deps:
	@scripts/install_deps.sh

# Editable install through pyproject.toml -> scikit-build-core -> CMake;
# incremental (build/<wheel tag>). --no-build-isolation builds against the
# installed torch 2.13.0 instead of resolving torch again.
build: deps
	$(PYTHON) -m pip install --quiet --no-build-isolation --no-deps -e .

test-runtime: deps
	cmake -S runtime -B $(RUNTIME_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKILN_BUILD_RUNTIME_TESTS=ON >/dev/null
	cmake --build $(RUNTIME_BUILD)
	ctest --test-dir $(RUNTIME_BUILD) --output-on-failure

# On PYTEST_WORKERS pytest-xdist worker processes (2: the machine's cores;
# 1 runs them in this process, in file order); --dist loadgroup keeps the
# kccl suites on one worker (tests/conftest.py).
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 1,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)

test-python: build
	$(PYTHON) -m pytest tests -m "not slow" $(PYTEST_PARALLEL) --durations=30

# Every PyTorch-level test, also those marked slow (the 500-step char GPT on
# both devices, the 4-rank --parallel runs).
test-python-full: build
	$(PYTHON) -m pytest tests $(PYTEST_PARALLEL) --durations=30

test: test-runtime test-python

test-full: test-runtime test-python-full

# PyTorch's OpInfo and ModuleInfo databases on kiln, every op, dtype and pass
# (tests/conformance/); writes docs/conformance.md and runs/conformance.json.
# Fails on a failure not in tests/conformance/known_failures.txt and on a
# listed failure that now passes. `make test` runs its quick shard.
conformance: build
	@mkdir -p runs
	$(PYTHON) tests/conformance/run.py --jobs 2 --json runs/conformance.json --report docs/conformance.md

# The compiled pass (not in `make test` or `make conformance`: every case
# compiles C++): every op in float32 and int64, first sample, under
# torch.compile on kiln against eager kiln. Writes the compiled section of
# docs/conformance.md; judged by tests/conformance/known_failures_compiled.txt.
# Inductor's cache lives in runs/conformance-compiled-logs/inductor-cache.
conformance-compiled: build
	@mkdir -p runs
	$(PYTHON) tests/conformance/run.py --passes compiled --jobs 2 --log-dir runs/conformance-compiled-logs \
		--json runs/conformance-compiled.json --records runs/conformance-compiled.jsonl \
		--report docs/conformance.md

# The main job: the two training examples on the kiln device.
demo: build
	@mkdir -p runs
	$(PYTHON) examples/train_fashion_mnist.py --device kiln --epochs 1 --json runs/fashion_mnist_kiln.json
	$(PYTHON) examples/train_char_gpt.py --device kiln --max-steps 500 --json runs/char_gpt_kiln.json
	@echo "Results: runs/fashion_mnist_kiln.json and runs/char_gpt_kiln.json"

# Kiln next to PyTorch CPU, side by side, with issue 4's targets (bench/README.md).
# About 2 minutes (4 on a busy machine); `$(PYTHON) bench/run.py --quick` about 30 s.
bench: build
	@mkdir -p runs
	$(PYTHON) bench/run.py --json runs/bench.json

clean:
	rm -rf build runs
