#!/usr/bin/env bash
# The test suite: lint, then pytest (tiny random models, plus one real-SmolLM2 smoke test,
# plus real vLLM engines in tests/test_rollout_vllm.py, from the environment setup_vllm.sh builds).
# Test modules run on 2 pytest-xdist workers (a module's tests stay on one worker: its
# fixtures, Ray heads and runs are shared); HYBRIDRL_TEST_WORKERS=0 runs them in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_vllm.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/pytest -q -n "${HYBRIDRL_TEST_WORKERS:-2}" --dist loadfile "$@"
