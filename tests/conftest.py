"""The pytest fixtures every test file may ask for by name (the four tiny families, one torch thread, the offline
SmolLM2 checkpoint, the fine-tuning tests' tiny LLaMA and texts) and the collection order; the helpers tests
import are in tests/helpers.py."""

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

from ctxext import assets
from tests.helpers import FAMILIES, save_bpe_llama, torch_threads, write_finetune_texts

# The longest files on 2 cores (45-100 s each). `make test` runs pytest-xdist with --dist loadfile, which hands
# out whole files in collection order: collected first, they start early instead of one of them (test_tasks.py,
# late in the alphabet) running alone at the end.
SLOW_FILES = (
    "test_sequence_parallel.py",
    "test_tasks.py",
    "test_sharded_finetune.py",
    "test_search_distributed.py",
    "test_serving_gguf.py",
    "test_check.py",
)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in SLOW_FILES)  # stable: each file's tests stay together


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test, as the processes the tests launch (OMP_NUM_THREADS=1)."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def one_torch_thread_per_module():
    """torch on one thread for a whole file's tests: tiny models gain nothing from a second thread, and lose a lot
    when other jobs share the cores (`pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")`)."""
    with torch_threads(1):
        yield


@pytest.fixture(params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="session")
def smollm2_path():
    return assets.smollm2_checkpoint()


@pytest.fixture(scope="module")
def finetune_checkpoint(tmp_path_factory):
    """The fine-tuning tests' model: a random 2-layer LLaMA (L = 64) with a small BPE tokenizer, saved like any
    checkpoint (tests/helpers.save_bpe_llama)."""
    return save_bpe_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def finetune_texts(tmp_path_factory):
    """The fine-tuning tests' (train.txt, held_out.txt) (tests/helpers.write_finetune_texts)."""
    return write_finetune_texts(tmp_path_factory.mktemp("texts"))
