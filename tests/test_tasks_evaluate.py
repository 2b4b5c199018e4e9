"""The `evaluate` module ctxext ships computes exactly what `ctxext eval` computes, for a checkpoint path with a
method and for a loaded model as it is."""

import json
import random

import pytest

evaluate = pytest.importorskip("evaluate")

from ctxext.cli import main  # noqa: E402
from ctxext.tasks.perplexity import evaluate_module_path  # noqa: E402
from tests.helpers import (  # noqa: E402
    DYNAMIC_DOC_TOKENS,
    DYNAMIC_FACTOR,
    DYNAMIC_STRIDE,
    save_tiny_checkpoint,
    tiny_model,
)

WINDOW, STRIDE = 48, 16


def test_evaluate_module_gives_ctxext_evals_numbers(tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny", tiny_model("llama"))
    rng = random.Random(0)
    texts = [" ".join(f"w{rng.randrange(256)}" for _ in range(n)) for n in (130, 75, 30)]  # the last is too short
    folder = tmp_path / "texts"
    folder.mkdir()
    for index, text in enumerate(texts):
        (folder / f"{index}.txt").write_text(text)
    assert (
        main(
            [
                "eval",
                str(checkpoint),
                "--method",
                "yarn",
                "--factor",
                "2",
                "--lengths",
                str(WINDOW),
                "--stride",
                str(STRIDE),
                "--text-file",
                str(folder),
                "--dtype",
                "fp32",
                "--no-progress",
                "-o",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    rows = {r["method"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["results"]}

    module = evaluate.load(evaluate_module_path())
    patched = module.compute(
        predictions=texts,
        model=str(checkpoint),
        window=WINDOW,
        stride=STRIDE,
        method={"method": "yarn", "factor": 2},
        dtype="fp32",
    )
    from transformers import AutoTokenizer

    loaded = tiny_model("llama")
    plain = module.compute(
        predictions=texts,
        model=loaded,
        tokenizer=AutoTokenizer.from_pretrained(checkpoint),
        window=WINDOW,
        stride=STRIDE,
    )
    for ours, label in ((patched, "yarn x2"), (plain, "none")):
        row = rows[label]
        for key in ("tokens_scored", "windows", "documents", "documents_skipped"):
            assert ours[key] == row[key], (label, key)
        assert ours["documents_skipped"] == 1
        assert ours["nll_sum"] == pytest.approx(row["nll_sum"], rel=1e-6)
        assert ours["perplexity"] == pytest.approx(row["perplexity"], rel=1e-6)
    assert patched["nll_sum"] != pytest.approx(plain["nll_sum"], rel=1e-6)  # the method was applied


@pytest.mark.parametrize("method", ["dynamic_ntk", "dynamic_yarn"])
def test_evaluate_module_scores_a_saved_dynamic_checkpoint_as_ctxext_eval_does(method, tmp_path):
    """A dynamic checkpoint evaluated as loaded: every window at its own length in both (transformers' own
    dynamic update would score the short document after the long one at the long one's scale)."""
    import torch

    model = tiny_model("llama", max_position_embeddings=64)
    with torch.no_grad():
        for layer in model.model.layers:  # sharp attention: frequencies change the loss well above fp32 noise
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    checkpoint = save_tiny_checkpoint(tmp_path / "sharp", model)
    patched = tmp_path / "patched"
    patch_argv = ["patch", str(checkpoint), "--method", method, "--factor", str(DYNAMIC_FACTOR), "-o", str(patched)]
    assert main(patch_argv) == 0
    generator = torch.Generator().manual_seed(0)
    folder = tmp_path / "texts"
    folder.mkdir()
    texts = []
    for name, n in DYNAMIC_DOC_TOKENS.items():  # the second is shorter than the window: scored in one shorter window
        texts.append(" ".join(f"w{int(i)}" for i in torch.randint(0, 256, (n,), generator=generator)))
        (folder / name).write_text(texts[-1])
    window = 160
    eval_argv = ["eval", str(patched), "--lengths", str(window), "--stride", str(DYNAMIC_STRIDE)]
    eval_argv += ["--short-docs", "truncate", "--text-file", str(folder), "--dtype", "fp32", "--no-baseline"]
    eval_argv += ["--no-progress"]
    assert main([*eval_argv, "-o", str(tmp_path / "out")]) == 0
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["results"]

    module = evaluate.load(evaluate_module_path())
    ours = module.compute(
        predictions=texts, model=str(patched), window=window, stride=DYNAMIC_STRIDE, short_docs="truncate", dtype="fp32"
    )
    assert (ours["windows"], ours["tokens_scored"]) == (row["windows"], row["tokens_scored"])
    assert ours["nll_sum"] == pytest.approx(row["nll_sum"], rel=1e-6)
