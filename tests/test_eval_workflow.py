"""The evaluation workflows as library calls: what `ctxext eval` and `ctxext passkey` write is what
`evaluate_perplexity` and `evaluate_passkey` return, protocol included."""

import json

import pytest

from ctxext.cli import main
from ctxext.errors import CtxextError
from ctxext.eval import (
    DataOptions,
    MethodSelection,
    PasskeyRequest,
    PerplexityRequest,
    RuntimeOptions,
    evaluate_passkey,
    evaluate_perplexity,
)
from tests.helpers import eval_sweep_argv, save_tiny_checkpoint, tiny_model, write_random_words


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_model("llama"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return write_random_words(tmp_path_factory.mktemp("texts"))


def test_evaluate_perplexity_returns_what_ctxext_eval_writes(checkpoint, texts, tmp_path):
    assert main(eval_sweep_argv(checkpoint, texts, tmp_path / "cli", "--no-cache")) == 0
    written = json.loads((tmp_path / "cli" / "results.json").read_text())
    request = PerplexityRequest(
        model=str(checkpoint),
        data=DataOptions(text_files=[str(texts)]),
        lengths=[32, 48],
        stride=16,
        methods=MethodSelection(methods=["linear", "ntk", "yarn"], overrides={"factor": 2}),
        runtime=RuntimeOptions(dtype="fp32", progress=False),
    )
    result = evaluate_perplexity(request)
    assert result.complete and result.labels == [m["label"] for m in written["methods"]]
    assert result.protocol == written["protocol"] and result.protocol["stride_per_length"] == {"32": 16, "48": 16}
    assert [(r["method"], r["length"], r["nll_sum"]) for r in result.rows] == [
        (r["method"], r["length"], r["nll_sum"]) for r in written["results"]
    ]
    assert result.table == (tmp_path / "cli" / "table.txt").read_text().rstrip("\n")
    assert not any(tmp_path.glob(".*cells"))  # no output, no cache unless asked for


def test_requests_are_checked_before_any_model_loads(tmp_path):
    data = DataOptions(text_files=["missing.txt"])
    with pytest.raises(CtxextError, match="--short-docs must be one of skip, truncate"):
        evaluate_perplexity(PerplexityRequest(model="no-such-model", data=data, short_docs="cut"))
    with pytest.raises(CtxextError, match="has a parameter 'beta-fast'"):
        evaluate_perplexity(
            PerplexityRequest(
                model="no-such-model", data=data, methods=MethodSelection(["linear"], overrides={"beta_fast": 3})
            )
        )
    with pytest.raises(CtxextError, match="--passkey-trials must be at least 1"):
        evaluate_passkey(PasskeyRequest(model="no-such-model", trials=0))


def test_evaluate_passkey_returns_what_ctxext_passkey_writes(checkpoint, tmp_path):
    common = [
        "--lengths",
        "160",
        "--passkey-depths",
        "0,1",
        "--passkey-trials",
        "2",
        "--dtype",
        "fp32",
        "--no-progress",
    ]
    assert (
        main(["passkey", str(checkpoint), "--method", "yarn", "--factor", "2", *common, "-o", str(tmp_path / "o")]) == 0
    )
    written = json.loads((tmp_path / "o" / "results.json").read_text())
    request = PasskeyRequest(
        model=str(checkpoint),
        lengths=[160],
        depths=[0.0, 1.0],
        trials=2,
        methods=MethodSelection(["yarn"], overrides={"factor": 2}),
        runtime=RuntimeOptions(dtype="fp32", progress=False),
    )
    result = evaluate_passkey(request)
    assert result.protocol == written["protocol"] and result.labels == ["none", "yarn x2"]
    assert result.payload["trials"] == written["trials"]
