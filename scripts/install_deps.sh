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
"$PYTHON" -c "import numpy" 2>/dev/null || pip_missing+=("numpy")
# torch.testing._internal (OpInfo, ModuleInfo: tests/conformance/) imports it.
"$PYTHON" -c "import expecttest" 2>/dev/null || pip_missing+=("expecttest")
if [ ${#pip_missing[@]} -gt 0 ]; then
  echo "install_deps: installing Python packages: ${pip_missing[*]}"
  "$PYTHON" -m pip install --quiet "${pip_missing[@]}" "torch==2.13.0"
fi
