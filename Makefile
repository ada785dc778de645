# Kiln's two commands (see README.md):
#   make demo   the main job: train two models on the kiln device
#   make test   every test: runtime conformance (C API) and PyTorch-level tests
# Both first install what is missing (Debian and Python packages, the build).
# Other targets: deps, build, test-runtime, test-python, clean.

PYTHON ?= python3
export PYTHON
RUNTIME_BUILD := build/runtime-tests

.PHONY: all deps build test test-runtime test-python demo clean

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

test-python: build
	$(PYTHON) -m pytest tests

test: test-runtime test-python

# The main job: the two training examples on the kiln device.
demo: build
	@mkdir -p runs
	$(PYTHON) examples/train_fashion_mnist.py --device kiln --epochs 1 --json runs/fashion_mnist_kiln.json
	$(PYTHON) examples/train_char_gpt.py --device kiln --max-steps 500 --json runs/char_gpt_kiln.json
	@echo "Results: runs/fashion_mnist_kiln.json and runs/char_gpt_kiln.json"

clean:
	rm -rf build runs
