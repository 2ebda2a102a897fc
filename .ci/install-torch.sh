#!/usr/bin/env bash
# Install a CPU build of torch into the venv given as $1, within the project's range.
# Prefers a wheel already on this machine's disk; otherwise the CPU-only index.
# Never the default index: it serves multi-GB CUDA builds.
set -euo pipefail
venv_python="$1"
spec='torch>=2.4,<2.14'
if "$venv_python" -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if (2, 4) <= v < (2, 14) else 1)' 2>/dev/null; then
  exit 0
fi
wheel_dir="${TORCH_WHEELS:-/opt/wheels}"
local_wheel=$(ls "$wheel_dir"/torch-2.1[0-3].*cpu*.whl "$wheel_dir"/torch-2.[4-9].*cpu*.whl 2>/dev/null | sort -V | tail -n 1 || true)
if [ -n "$local_wheel" ]; then
  "$venv_python" -m pip install "$local_wheel"
else
  "$venv_python" -m pip install --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}" \
    --extra-index-url https://pypi.org/simple "$spec"
fi
