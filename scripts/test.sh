#!/usr/bin/env bash
# The test suite: lint, then pytest (tiny random models, plus one real-SmolLM2 smoke test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/pytest -q "$@"
