#!/usr/bin/env bash
# The main job: GRPO on SmolLM2-135M-Instruct (CPU), basic arithmetic; prints held-out
# greedy accuracy before and after. Extra arguments are dotted config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/hybridrl train configs/demo_cpu.yaml "$@"
