"""Dynamic methods through `ctxext eval`, each cell against an independent sliding-window computation.

A dynamic method rescales from the length l of the forward pass it is in: every eval window is a fresh
forward, so its frequencies are the method's static ones at s = max(1, l/L), l the window's own length
(shorter than the cell's length for the last window of a document, and for a short document scored with
`--short-docs truncate`). The oracles, per window:
- dynamic_ntk: transformers' own `dynamic` rope type, set in the config, in a fresh model each window (its
  cached frequencies only grow, which a fresh model keeps out of the picture);
- dynamic_yarn and `yarn --dynamic true`: the model patched with static yarn at s = max(1, l/L).
Windows and scored tokens follow the HF-docs loop, written out here.
"""

import copy
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import ctxext
from ctxext.cli import main
from tests.helpers import DYNAMIC_DOC_TOKENS, DYNAMIC_FACTOR, DYNAMIC_STRIDE, save_tiny_checkpoint, tiny_model

L = 64
LENGTHS = (64, 160)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny LLaMA (L = 64) with sharpened attention, so that frequencies change the loss well above fp32 noise
    (a random init attends almost uniformly)."""
    model = tiny_model("llama", max_position_embeddings=L)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return save_tiny_checkpoint(tmp_path_factory.mktemp("sharp-llama"), model)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    generator = torch.Generator().manual_seed(0)
    for name, n in DYNAMIC_DOC_TOKENS.items():
        ids = torch.randint(0, 256, (n,), generator=generator)
        (folder / name).write_text(" ".join(f"w{int(i)}" for i in ids))
    return folder


@pytest.fixture(scope="module")
def results(checkpoint, texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "out"
    code = main(
        [
            "eval",
            str(checkpoint),
            "--method",
            "dynamic_ntk",
            "--method",
            "dynamic_yarn",
            "--method",
            "yarn",
            "--dynamic",
            "true",
            "--factor",
            str(DYNAMIC_FACTOR),
            "--lengths",
            ",".join(map(str, LENGTHS)),
            "--stride",
            str(DYNAMIC_STRIDE),
            "--short-docs",
            "truncate",
            "--text-file",
            str(texts),
            "--dtype",
            "fp32",
            "--no-progress",
            "-o",
            str(out),
        ]
    )
    assert code == 0
    return json.loads((out / "results.json").read_text())


def windows(n, window, stride):
    """(begin, end, scored) per forward pass: the HF-docs loop; a document shorter than the window is one pass."""
    if n < window:
        return [(0, n, n - 1)]
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        out.append((begin, end, end - max(prev_end, 1)))  # the first token has nothing to predict it
        prev_end = end
        if end == n:
            break
    return out


def window_nll(model, ids, begin, end, scored):
    inputs = ids[begin:end].unsqueeze(0)
    labels = inputs.clone()
    labels[:, :-scored] = -100
    with torch.no_grad():
        return float(model(inputs, labels=labels).loss) * scored


def oracle(docs, window, model_for_length):
    """Summed NLL and scored tokens over all documents, `model_for_length(l)` giving the model for a pass of l."""
    total, count = 0.0, 0
    for ids in docs:
        for begin, end, scored in windows(len(ids), window, DYNAMIC_STRIDE):
            total += window_nll(model_for_length(end - begin), ids, begin, end, scored)
            count += scored
    return total, count


def transformers_dynamic_ntk(checkpoint):
    config = AutoConfig.from_pretrained(checkpoint)
    config.rope_parameters = {
        "rope_type": "dynamic",
        "factor": DYNAMIC_FACTOR,
        "rope_theta": config.rope_parameters["rope_theta"],
    }
    template = AutoModelForCausalLM.from_pretrained(checkpoint, config=config, dtype=torch.float32).eval()
    return lambda length: copy.deepcopy(template)


def static_yarn_at_window_length(checkpoint):
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def model_for_length(length):
        return ctxext.patch(
            copy.deepcopy(plain), "yarn", factor=max(1.0, length / L), original_max_position_embeddings=L
        )

    return model_for_length


def test_dynamic_methods_in_eval_match_per_window_oracles(results, checkpoint, texts):
    assert [m["label"] for m in results["methods"]] == ["none", "dynamic_ntk x4", "dynamic_yarn x4", "yarn x4"]
    assert results["methods"][3]["dynamic"] is True
    assert results["protocol"]["bos"]["windows_start_with_bos"] is False
    rows = {(r["method"], r["length"]): r for r in results["results"]}

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    docs = [
        torch.tensor(tokenizer((texts / name).read_text(), add_special_tokens=False).input_ids)
        for name in sorted(DYNAMIC_DOC_TOKENS)
    ]
    assert [len(d) for d in docs] == [DYNAMIC_DOC_TOKENS[name] for name in sorted(DYNAMIC_DOC_TOKENS)]

    ntk = transformers_dynamic_ntk(checkpoint)
    yarn = static_yarn_at_window_length(checkpoint)
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = {}
    for length in LENGTHS:
        expected[("none", length)] = oracle(docs, length, lambda _: plain)
        expected[("dynamic_ntk x4", length)] = oracle(docs, length, ntk)
        expected[("dynamic_yarn x4", length)] = expected[("yarn x4", length)] = oracle(docs, length, yarn)
    for key, (nll, count) in expected.items():
        row = rows[key]
        assert row["tokens_scored"] == count, key
        assert row["nll_sum"] == pytest.approx(nll, rel=1e-6), key

    # Up to L the dynamic methods are plain RoPE; past it they differ from it, and from each other.
    for label in ("dynamic_ntk x4", "dynamic_yarn x4"):
        assert rows[(label, 64)]["nll_sum"] == pytest.approx(rows[("none", 64)]["nll_sum"], rel=1e-6)
    past = [rows[(label, 160)]["nll_sum"] for label in ("none", "dynamic_ntk x4", "dynamic_yarn x4")]
    assert min(abs(a - b) / a for a in past for b in past if a != b) > 1e-4 and len(set(past)) == 3


def test_the_oracle_tells_window_lengths_apart(checkpoint, texts):
    """The truncated short document and the last window are checked at their own length: scoring them at the
    cell's length (s = 160/L) would be off by far more than the tolerance above."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    docs = [
        torch.tensor(tokenizer((texts / name).read_text(), add_special_tokens=False).input_ids)
        for name in sorted(DYNAMIC_DOC_TOKENS)
    ]
    yarn = static_yarn_at_window_length(checkpoint)
    own, _ = oracle(docs, 160, yarn)
    at_cell_length, _ = oracle(docs, 160, lambda length: yarn(160))
    assert abs(own - at_cell_length) / own > 1e-5


@pytest.mark.parametrize("method", ["dynamic_ntk", "dynamic_yarn"])
def test_a_saved_dynamic_checkpoint_scores_what_the_method_scores(method, results, checkpoint, texts, tmp_path):
    """transformers' dynamic update keeps the longest window's frequencies for shorter windows that follow;
    `ctxext eval` on the saved checkpoint must still score every window at its own length, as --method does."""
    patched = tmp_path / "patched"
    patch_argv = ["patch", str(checkpoint), "--method", method, "--factor", str(DYNAMIC_FACTOR), "-o", str(patched)]
    assert main(patch_argv) == 0
    out = tmp_path / "out"
    assert (
        main(
            [
                "eval",
                str(patched),
                "--lengths",
                ",".join(map(str, LENGTHS)),
                "--stride",
                str(DYNAMIC_STRIDE),
                "--short-docs",
                "truncate",
                "--text-file",
                str(texts),
                "--dtype",
                "fp32",
                "--no-baseline",
                "--no-progress",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    loaded = json.loads((out / "results.json").read_text())["results"]
    expected = {r["length"]: r for r in results["results"] if r["method"] == f"{method} x4"}
    for row in loaded:
        assert row["nll_sum"] == pytest.approx(expected[row["length"]]["nll_sum"], rel=1e-6)
