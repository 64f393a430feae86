import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tokenizer():
    from hybrid_engine.config import ModelConfig
    from hybrid_engine.models import load_tokenizer

    return load_tokenizer(ModelConfig(path="tiny"))


@pytest.fixture(scope="session")
def tiny_cfg():
    from hybrid_engine.config import load_config

    return load_config("configs/grpo_tiny.yaml")
