"""Shared fixtures: tiny random models of every supported family, and the offline SmolLM2 checkpoint."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs one pytest-xdist worker per core: each worker's torch (and the processes its tests launch)
# gets its share of the cores instead of all of them, which would oversubscribe every core.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # The cores this process may run on (a cpuset can hold fewer than the host has), as pytest-xdist counts them.
    usable_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny_config(family: str, **overrides):
    config_cls, _ = FAMILIES[family]
    values = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    if family == "mistral":
        values["sliding_window"] = None
    values.update(overrides)
    return config_cls(**values)


def tiny_model(family: str, seed: int = 0, **overrides):
    """A random 2-layer model of `family` in fp32 eval mode (deterministic for a seed)."""
    _, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(tiny_config(family, **overrides)).eval()


def save_tiny_checkpoint(path, model):
    """Save `model` with a 256-word word-level tokenizer (w0..w255): a complete checkpoint directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(path)
    return path


# The longest files on 2 cores (45-100 s each). `make test` runs pytest-xdist with --dist loadfile, which hands
# out whole files in collection order: collected first, they start early instead of one of them (test_tasks.py,
# late in the alphabet) running alone at the end.
SLOW_FILES = ("test_tasks.py", "test_search_distributed.py", "test_serving_gguf.py", "test_check.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in SLOW_FILES)  # stable: each file's tests stay together


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test, as the processes the tests launch (OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="session")
def smollm2_path():
    from ctxext import assets

    return assets.smollm2_checkpoint()
