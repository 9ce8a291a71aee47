import random

import pytest

# The model shapes the layouts must serve: (name, H, K, E).
MODELS = [
    ("deepseek-v3", 7168, 8, 256),
    ("qwen3-235b", 4096, 8, 128),
    ("gpt-oss-120b", 2880, 4, 128),
    ("mixtral", 4096, 2, 8),
]
RANKS = [2, 4, 8]


@pytest.fixture
def rng():
    return random.Random(1234)
