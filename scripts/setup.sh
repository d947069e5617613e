#!/usr/bin/env bash
# Sets up a virtual environment with xshard and its dependencies (CPU build of PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_DIR="${VENV_DIR:-.venv}"
if [ ! -x "$VENV_DIR/bin/python" ]; then
  python3 -m venv "$VENV_DIR"
fi
. "$VENV_DIR/bin/activate"
python -m pip install -q --upgrade pip
# Pin the CPU build explicitly: an unpinned torch pulls a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
