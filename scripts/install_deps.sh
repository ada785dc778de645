#!/usr/bin/env bash
# Installs what Kiln needs to build, test and run its demo, where missing;
# safe to run again (idempotent). Used by `make test` and `make demo`.
# Debian packages come from apt-get (as root, or through sudo); Python
# packages from pip into $PYTHON. torch is pinned to 2.13.0 (the CPU wheel on
# this machine): an unpinned `torch` could pull a multi-GB CUDA build.
set -euo pipefail

PYTHON=${PYTHON:-python3}

# dataset-fashion-mnist: the data of examples/train_fashion_mnist.py.
apt_packages=(cmake ninja-build g++ libgtest-dev dataset-fashion-mnist)

missing=()
for p in "${apt_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing Debian packages: ${missing[*]}"
  as_root=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install_deps: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    as_root=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get install -y --no-install-recommends "${missing[@]}" ||
    { "${as_root[@]}" apt-get update && "${as_root[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; }
fi

pip_missing=()
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null ||
  pip_missing+=("torch==2.13.0")
"$PYTHON" -c "import scikit_build_core" 2>/dev/null || pip_missing+=("scikit-build-core>=0.10")
"$PYTHON" -c "import pytest" 2>/dev/null || pip_missing+=("pytest")
# make test runs the tests on two worker processes (Makefile: PYTEST_WORKERS).
"$PYTHON" -c "import xdist" 2>/dev/null || pip_missing+=("pytest-xdist")
"$PYTHON" -c "import numpy" 2>/dev/null || pip_missing+=("numpy")
# torch.testing._internal (OpInfo, ModuleInfo: tests/conformance/) imports it.
"$PYTHON" -c "import expecttest" 2>/dev/null || pip_missing+=("expecttest")
if [ ${#pip_missing[@]} -gt 0 ]; then
  echo "install_deps: installing Python packages: ${pip_missing[*]}"
  "$PYTHON" -m pip install --quiet "${pip_missing[@]}" "torch==2.13.0"
fi

# Hugging Face transformers and accelerate, for tests/test_huggingface.py.
# Installed with --no-deps so pip never resolves torch again; their runtime
# dependencies are listed here instead (what importing them, Trainer,
# Accelerator, generate() and save/from_pretrained of a local directory
# need). "name==version" must be installed at exactly that version;
# "name>=minimum==version" keeps any installed version from the minimum on
# (common libraries other tools may share) and installs the pin otherwise.
# Left out on purpose, since nothing here downloads from a hub or runs their
# command-line tools: hf-xet (hub transfers), click and typer (CLIs), anyio
# (httpx2's async client).
hf_packages=(
  transformers==5.24.0 accelerate==1.15.0 huggingface-hub==2.4.0
  tokenizers==0.23.3 safetensors==0.8.0 regex==2026.11.19
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
  "tqdm>=4.60==4.70.1" "pyyaml>=5.1==6.0.4" "psutil>=5.0==7.2.2"
  "packaging>=20.9==26.4" "h11>=0.16==0.16.0" "idna>=3.0==3.20"
)
# One interpreter start lists the pins to install.
hf_missing=$("$PYTHON" - "${hf_packages[@]}" <<'PY'
import re
import sys
from importlib.metadata import PackageNotFoundError, version

def numbers(v):
    return tuple(int(n) for n in re.findall(r"\d+", v.split("+")[0])[:4])

for spec in sys.argv[1:]:
    name, _, pinned = spec.partition("==")
    name, _, minimum = name.partition(">=")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    ok = have is not None and (numbers(have) >= numbers(minimum) if minimum else have == pinned)
    if not ok:
        print(f"{name}=={pinned}")
PY
)
if [ -n "$hf_missing" ]; then
  echo "install_deps: installing Python packages without their dependencies:" $hf_missing
  # shellcheck disable=SC2086
  "$PYTHON" -m pip install --quiet --no-deps $hf_missing
fi
