"""`ctxext search --method longrope`: monotone per-pair factors, CMA-ES, and a checkpoint plain transformers loads."""

import json

import numpy as np
import pytest
import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ctxext.cli import main
from ctxext.search.longrope import factors_from, is_monotone, knot_positions, start_factors
from ctxext.search.loop import best_trial, longrope_search
from ctxext.search.store import TrialStore
from tests.helpers import assert_reloads_in_plain_transformers_as_patched, save_tiny_checkpoint, tiny_model

pytest.importorskip("optuna")
pytest.importorskip("cma")


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A 6-trial LongRoPE search on a tiny LLaMA (L = 64, head_dim 16: 8 pairs) at 256 tokens, s = 4."""
    root = tmp_path_factory.mktemp("longrope")
    source = save_tiny_checkpoint(root / "tiny", tiny_model("llama"))
    g = torch.Generator().manual_seed(0)
    (root / "docs").mkdir()
    for index in range(2):
        (root / "docs" / f"doc{index}.txt").write_text(
            " ".join(f"w{int(i)}" for i in torch.randint(0, 256, (300,), generator=g))
        )
    out = root / "out"
    code = main(
        [
            str(a)
            for a in [
                "search",
                source,
                "--method",
                "longrope",
                "--factor",
                4,
                "--lengths",
                256,
                "--text-file",
                root / "docs",
                "--trials",
                6,
                "--longrope-knots",
                4,
                "--longrope-popsize",
                4,
                "--dtype",
                "fp32",
                "--no-progress",
                "-o",
                out,
            ]
        ]
    )
    assert code == 0
    trials = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    return source, out, trials


def yarn_divisors(factor, head_dim, base, L):
    """θ_i/θ'_i of transformers' own yarn: the oracle for LongRoPE's starting curve."""
    config = PretrainedConfig()
    config.head_dim, config.hidden_size, config.num_attention_heads = head_dim, head_dim, 1
    config.max_position_embeddings = int(L * factor)
    config.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": base,
        "factor": factor,
        "original_max_position_embeddings": L,
    }
    scaled, _ = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    plain = 1.0 / base ** (torch.arange(0, head_dim, 2).double() / head_dim)
    return (plain / scaled.double()).numpy()


def test_trial_0_is_the_defaults_and_trial_1_starts_from_yarn(searched):
    _, _, trials = searched
    assert trials[0]["role"] == "defaults" and trials[0]["params"] == {"long_factor": [4.0] * 8}
    assert trials[1]["role"] == "start" and trials[1]["z"] == [0.0] * 4
    np.testing.assert_allclose(trials[1]["params"]["long_factor"], yarn_divisors(4.0, 16, 10000.0, 64), rtol=1e-6)


def test_every_trial_is_monotone_and_within_bounds(searched):
    _, _, trials = searched
    assert len(trials) == 6
    for trial in trials:
        factors = np.array(trial["params"]["long_factor"])
        assert np.all(np.diff(factors) >= 0), trial["number"]
        assert factors.min() >= 1.0 and factors.max() <= 8.0 + 1e-9  # [1, 2s]
    assert len({tuple(t["params"]["long_factor"]) for t in trials}) == 6  # CMA-ES moved


def test_the_checkpoint_loads_in_plain_transformers_with_the_patched_models_logits(searched, tmp_path):
    source, out, trials = searched
    best = best_trial(trials)
    config = json.loads((out / "checkpoint" / "config.json").read_text())
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["long_factor"] == best["params"]["long_factor"]
    assert rope["short_factor"] == [1.0] * 8 and rope["original_max_position_embeddings"] == 64
    assert_reloads_in_plain_transformers_as_patched(out / "checkpoint", best["params"]["long_factor"], tmp_path)


def test_factors_from_is_monotone_starts_exactly_at_the_start_and_stays_in_bounds():
    start = np.maximum.accumulate(yarn_divisors(8.0, 64, 1e5, 2048))  # float32 noise can dip by 1e-8
    knots = knot_positions(32, 6)
    np.testing.assert_allclose(factors_from(np.zeros(6), start, knots, 16.0), start, rtol=1e-12)
    rng = np.random.default_rng(0)
    for _ in range(200):
        factors = factors_from(rng.normal(0, 1.5, 6), start, knots, 16.0)
        assert is_monotone(factors) and factors.min() >= 1.0 and factors.max() <= 16.0 + 1e-12
    assert not is_monotone([1.0, 2.0, 1.5])


def test_start_factors_of_ctxext_yarn_match_transformers_yarn():
    np.testing.assert_allclose(start_factors("yarn", 4.0, 64, 1e5, 2048), yarn_divisors(4.0, 64, 1e5, 2048), rtol=1e-6)


def target_objective(target):
    def objective(params):
        return {"value": float(np.sum((np.log(params["long_factor"]) - np.log(target)) ** 2))}

    return objective


def test_cma_es_finds_the_planted_curve_and_resumes_exactly(tmp_path):
    start = np.maximum.accumulate(yarn_divisors(4.0, 64, 1e5, 2048))
    target = factors_from(np.array([0.3, 0.5, 0.0, -0.4, 0.2, 0.6]), start, knot_positions(32, 6), 8.0)
    objective = target_objective(target)
    whole = longrope_search(
        start,
        [4.0] * 32,
        objective,
        TrialStore.open(str(tmp_path / "whole.journal"), "test", {}),
        trials=90,
        seed=0,
        knots=6,
        upper=8.0,
    )
    # 90 trials are 10 generations of 9: not convergence, but 4x closer than the start for any seed tried (the
    # squared log distance fell to 0.03-0.22 of the start's), and 25x for this one.
    assert best_trial(whole)["value"] < 0.25 * whole[1]["value"]
    calls = []

    def counting(params):
        calls.append(1)
        return objective(params)

    log = TrialStore.open(str(tmp_path / "parts.journal"), "test", {})
    longrope_search(start, [4.0] * 32, counting, log, trials=13, seed=0, knots=6, upper=8.0)  # stops mid-generation
    resumed = longrope_search(start, [4.0] * 32, counting, log, trials=90, seed=0, knots=6, upper=8.0)
    assert len(calls) == 90  # nothing scored twice
    assert [(t["params"], t["value"]) for t in resumed] == [(t["params"], t["value"]) for t in whole]
    with pytest.raises(Exception, match="does not match this search"):
        longrope_search(start, [4.0] * 32, counting, log, trials=91, seed=1, knots=6, upper=8.0)
