"""The llama.cpp judge runs in a child process. A stand-in `llama_cpp` package (put first on the child's
PYTHONPATH) plays llama.cpp: one that returns known logits checks the scoring against cross-entropy computed here,
one that kills itself with SIGSEGV checks that a crash is a one-line finding, in the library and in
`ctxext export --check`, never the end of ctxext."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ctxext.verification.llamacpp import JudgeCrashed, llama_cpp_nll

VOCAB = 11
# Logits the stand-in returns for token t: a fixed function of (t, vocabulary index), so the test can recompute them.
STAND_IN = """
import os, signal
import numpy as np

class Llama:
    def __init__(self, model_path, n_ctx, **kwargs):
        self.n_ctx = n_ctx
    def eval(self, ids):
        if os.environ.get("STAND_IN_CRASH"):
            os.kill(os.getpid(), signal.SIGSEGV)
        t = np.arange(len(ids))[:, None]
        self.scores = np.sin(0.7 * t + 0.3 * np.arange({vocab})[None, :]) * 3
    def close(self):
        pass
"""


@pytest.fixture
def stand_in_llama_cpp(tmp_path, monkeypatch):
    package = tmp_path / "stand_in" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN.format(vocab=VOCAB))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")]))
    return package.parent


def test_the_child_scores_what_the_judge_returns(stand_in_llama_cpp, tmp_path):
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    nll, n = llama_cpp_nll(tmp_path / "any.gguf", ids)
    t = torch.arange(len(ids), dtype=torch.float64)[:, None]
    logits = torch.sin(0.7 * t + 0.3 * torch.arange(VOCAB, dtype=torch.float64)[None, :]) * 3
    expected = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum")
    assert n == len(ids) - 1
    assert nll == pytest.approx(float(expected), rel=1e-12)


def test_a_crashing_judge_is_a_one_line_finding(stand_in_llama_cpp, tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_CRASH", "1")
    with pytest.raises(JudgeCrashed) as crash:
        llama_cpp_nll(tmp_path / "model.gguf", [1, 2, 3])
    assert "\n" not in str(crash.value)
    assert "llama.cpp crashed (signal 11, SIGSEGV) on this machine while scoring model.gguf" in str(crash.value)


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_export_check_reports_the_crash_and_exits_1(stand_in_llama_cpp, tmp_path, monkeypatch):
    """The real command on SmolLM2's GGUF patched by ctxext: transformers' load of the file is the reference, the
    crashing stand-in is llama.cpp. The table is printed, the llama.cpp row says what happened, exit status 1."""
    from ctxext import assets
    from ctxext.config import load_method_config
    from ctxext.serving.gguf import patch_gguf

    patched = tmp_path / "yarn.gguf"
    patch_gguf(assets.smollm2_gguf(), load_method_config(None, {"method": "yarn", "factor": 2}), patched)
    monkeypatch.setenv("STAND_IN_CRASH", "1")
    command = [sys.executable, "-m", "ctxext", "export", str(patched), "--check", "--tokens", "16"]
    command += ["--json", str(tmp_path / "table.json")]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    rows = {row["engine"]: row for row in json.loads((tmp_path / "table.json").read_text())["engines"]}
    assert rows["llama.cpp"]["checked"].startswith("llama.cpp crashed (signal 11, SIGSEGV) on this machine")
    assert rows["llama.cpp"]["checked"] in done.stdout
