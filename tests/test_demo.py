"""scripts/demo.py: its native reference is the unpatched model in sliding windows over the tokens the eval
scores (checked against a naive per-token loop), and its ratio panel keeps outliers from squashing the rest."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ctxext.eval.data import tokens_fingerprint
from tests.helpers import save_bpe_llama, tiny_model

REPO = Path(__file__).resolve().parents[1]


def load_demo():
    spec = importlib.util.spec_from_file_location("demo_script", REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def naive_sliding_nll(model, ids: torch.Tensor, window: int, stride: int) -> tuple[float, int]:
    """Press et al.'s loop written out: full logits per window, each token scored once, the first never."""
    total, scored_up_to = 0.0, 1
    with torch.no_grad():
        for begin in range(0, len(ids), stride):
            end = min(begin + window, len(ids))
            logits = model(ids[begin:end].unsqueeze(0)).logits[0].double()
            for position in range(scored_up_to, end):
                total -= F.log_softmax(logits[position - 1 - begin], -1)[ids[position]].item()
            scored_up_to = end
            if end == len(ids):
                break
    return total, len(ids) - 1


def test_native_reference_is_the_unpatched_model_in_sliding_windows_over_the_evals_tokens():
    demo = load_demo()
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
    nlls, tokens, targets = demo.native_window_nlls(model, ids, 128, None, window=64, stride=32)
    total, count = naive_sliding_nll(model, ids[:128], 64, 32)
    assert len(nlls) == 3  # [0, 64), [32, 96), [64, 128)
    assert tokens == count == 127
    assert math.isclose(sum(nlls), total, rel_tol=1e-5)
    # The first window is the unpatched model's one pass at the window length (the eval's `none` row there).
    assert math.isclose(nlls[0], naive_sliding_nll(model, ids[:64], 64, 64)[0], rel_tol=1e-5)
    assert targets == tokens_fingerprint([ids[1:128]])  # what `ctxext eval` hashes for one pass at 128


def test_the_ratio_panel_spans_the_good_methods_and_marks_the_outliers():
    demo = load_demo()
    lengths = (2048, 4096, 8192, 16384)
    ratios = {
        "none": {2048: 1.0, 4096: 1.0, 8192: 1.0, 16384: 1.88},
        "yarn x2": {2048: 1.035, 4096: 1.023, 8192: 1.03, 16384: 1.012},
        "self_extend G4 w1024": {2048: 1.006, 4096: 1.003, 8192: 0.997, 16384: 0.985},
    }
    ax = demo.ratio_figure(ratios, lengths, "test").axes[0]
    bottom, top = ax.get_ylim()
    assert bottom < 0.985 and 1.035 < top < 1.2  # yarn's 3% and SelfExtend's -1.5% apart on the axis
    marked = [t.get_text() for t in ax.texts if "1.88" in t.get_text()]
    assert marked == ["none: 1.88"]


# What `make setup`'s test extra adds over ctxext's core (`make demo-setup` installs the core only).
EXTRAS_ONLY = ("deepspeed", "optuna", "cma", "lm_eval", "trl", "fastapi", "uvicorn", "openai", "tensorboard", "evaluate",
               "wonderwords", "nbclient", "pytest")  # fmt: skip
WITHOUT_EXTRAS = f"""
import sys
for name in {EXTRAS_ONLY!r}:
    sys.modules[name] = None  # as if not installed: import fails, importlib.util.find_spec says None
from ctxext.cli import main
sys.argv = ["ctxext", *sys.argv[1:]]
sys.exit(main())
"""


@pytest.mark.slow  # two fresh processes (about 40 s idle, 150 s at load 10)
def test_the_demos_commands_run_on_ctxexts_core_alone(tmp_path):
    """`make demo` installs ctxext's core only: the commands scripts/demo.py runs (patch, then eval of none, yarn
    and self_extend from a methods file) work with every module of the test extra unimportable."""
    model = save_bpe_llama(tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 200)
    sweep = tmp_path / "methods.yaml"
    sweep.write_text("factor: 2\nmethods: [none, yarn, {method: self_extend}]\n")
    commands = [
        ["patch", str(model), "--method", "yarn", "--factor", "2", "-o", str(tmp_path / "patched")],
        ["eval", str(model), "--config", str(sweep), "--lengths", "64,128", "--stride", "window", "--text-file",
         str(text), "-o", str(tmp_path / "eval"), "--no-progress"],
    ]  # fmt: skip
    for command in commands:
        done = subprocess.run(
            [sys.executable, "-c", WITHOUT_EXTRAS, *command], capture_output=True, text=True, cwd=REPO, timeout=600
        )
        assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "eval" / "results.json").is_file()
    assert load_demo().demo_methods() == ["none", "yarn", {"method": "self_extend"}]  # what the sweep above runs
