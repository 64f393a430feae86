#!/usr/bin/env bash
# The main job: GRPO on SmolLM2-135M-Instruct (CPU), basic arithmetic; prints held-out
# greedy accuracy before and after. Extra arguments are dotted config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the vLLM environment only when this run's rollout uses it (preset, environment, overrides)
overrides=()
for a in "$@"; do [[ "$a" == *=* && "$a" != -* ]] && overrides+=("$a"); done
name=$(.venv/bin/python -c 'import sys; from hybrid_engine.config import load_config
print(load_config("configs/demo_cpu.yaml", sys.argv[1:]).rollout.name)' "${overrides[@]}")
if [ "$name" = vllm ]; then bash scripts/setup_vllm.sh; fi
exec .venv/bin/hybridrl train configs/demo_cpu.yaml "$@"
