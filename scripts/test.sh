#!/usr/bin/env bash
# Sets up (if needed) and runs the fast test suite on 8 virtual CPU devices.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_DIR="${VENV_DIR:-.venv}" bash scripts/setup.sh
. "${VENV_DIR:-.venv}/bin/activate"
python -m pytest -q "$@"
