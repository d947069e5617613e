#!/usr/bin/env bash
# Sets up (if needed) and runs the main demo: a GPT-style model trained under FSDP on 8 virtual CPU devices.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_DIR="${VENV_DIR:-.venv}" bash scripts/setup.sh
. "${VENV_DIR:-.venv}/bin/activate"
XSHARD_CPU_DEVICES="${XSHARD_CPU_DEVICES:-8}" python examples/train_gpt_fsdp.py "$@"
