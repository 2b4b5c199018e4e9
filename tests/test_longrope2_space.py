"""`ctxext search --method longrope --space critical`: LongRoPE2's critical-dimension space (arXiv 2502.20082).

Oracles written out here, not imported: the wavelength of pair i is 2π b^(2i/D); the theoretical critical dimension
is the first pair whose wavelength reaches L; below the critical dimension d, NTK with the base b' for which
pair d's factor (b'/b)^(2d/D) is the factor searched there."""

import json
import math

import numpy as np
import pytest
import torch

from ctxext.errors import CtxextError
from ctxext.search.longrope import (
    CriticalSpace,
    critical_factors,
    critical_pair,
    critical_space,
    ntk_base_at,
    ntk_factors_below,
    recorded_critical_dim,
)
from ctxext.search.loop import best_trial
from tests.helpers import assert_reloads_in_plain_transformers_as_patched, run_cli, save_tiny_checkpoint, tiny_model

pytest.importorskip("optuna")
pytest.importorskip("cma")

# (rotary dim D, base b, L): SmolLM2, LLaMA3-8B, Phi3-mini, a LLaMA2-style 4k model, the tiny LLaMA of the tests
MODELS = [(64, 1e5, 8192), (128, 5e5, 8192), (96, 1e4, 2048), (128, 1e4, 4096), (16, 1e4, 64)]


def naive_critical_pair(rotary_dim, base, L, periods=1):
    """The first pair whose wavelength 2π/θ_i, θ_i = b^(-2i/D), is at least L / periods (D/2 if none)."""
    for i in range(rotary_dim // 2):
        if 2 * math.pi / base ** (-2 * i / rotary_dim) >= L / periods:
            return i
    return rotary_dim // 2


def check_constraints(factors, critical, rotary_dim, base, s, upper):
    """LongRoPE2's constraints, written out: from d on at least s, non-decreasing and at most the cap; below d,
    NTK factors (b'/b)^(2i/D) with b' = b f_d^(D/2d), i.e. the base for which NTK's factor at d is f_d."""
    factors = np.asarray(factors)
    assert len(factors) == rotary_dim // 2
    above = factors[critical:]
    assert np.all(above >= s - 1e-12) and np.all(np.diff(above) >= 0) and above.max() <= upper + 1e-9
    ntk_base = base * above[0] ** (rotary_dim / (2 * critical))
    for i in range(critical):
        plain, scaled = base ** (-2 * i / rotary_dim), ntk_base ** (-2 * i / rotary_dim)
        assert factors[i] == pytest.approx(plain / scaled, rel=1e-12)
    assert np.all(np.diff(factors) >= 0)  # NTK below d rises to f_d: the whole vector is monotone


@pytest.mark.parametrize("rotary_dim, base, L", MODELS)
def test_the_theoretical_critical_dimension_is_the_first_pair_whose_wavelength_reaches_L(rotary_dim, base, L):
    assert critical_pair(rotary_dim, base, L) == naive_critical_pair(rotary_dim, base, L)
    assert critical_pair(rotary_dim, base, L, 10) == naive_critical_pair(rotary_dim, base, L, 10)


def test_the_critical_dimensions_the_paper_names():
    assert critical_pair(96, 1e4, 2048) == 31  # Phi3-mini: "the 31st cosine dimension" (d_tcd = 62 in dims)
    assert critical_pair(128, 5e5, 8192) == 35  # LLaMA3-8B: theoretical 35 (§1)
    assert critical_pair(64, 1e5, 8192) == 20  # SmolLM2-135M
    assert critical_pair(16, 1e4, 10**9) == 8  # no pair's wavelength reaches L


def test_ntk_below_the_critical_dimension_meets_the_factor_at_it():
    base = ntk_base_at(20, 2.5, 64, 1e5)
    assert (base / 1e5) ** (2 * 20 / 64) == pytest.approx(2.5, rel=1e-12)
    below = ntk_factors_below(20, 2.5, 64, 1e5)
    assert below[0] == 1.0 and len(below) == 20
    np.testing.assert_allclose(below, 2.5 ** (np.arange(20) / 20), rtol=1e-12)  # f_d^(i/d)
    with pytest.raises(CtxextError):
        ntk_base_at(0, 2.0, 64, 1e5)


@pytest.mark.parametrize("rotary_dim, base, L", MODELS[:4])
def test_every_sampled_vector_satisfies_longrope2s_constraints(rotary_dim, base, L):
    s = 4.0
    space = critical_space(rotary_dim, base, s, L, knots=6)
    theoretical = naive_critical_pair(rotary_dim, base, L)
    assert space.start == space.high == theoretical and space.low == naive_critical_pair(rotary_dim, base, L, 10)
    critical, factors = space.factors_of(np.zeros(space.dimension))  # the start: d_tcd, s above it
    assert critical == theoretical and np.all(factors[critical:] == s)
    check_constraints(factors, critical, rotary_dim, base, s, space.upper)
    rng = np.random.default_rng(0)
    seen = set()
    for scale in (0.3, 1.0, 3.0):
        for _ in range(150):
            critical, factors = space.factors_of(rng.normal(0, scale, space.dimension))
            assert space.low <= critical <= space.high
            check_constraints(factors, critical, rotary_dim, base, s, space.upper)
            seen.add(critical)
    assert seen == set(range(space.low, space.high + 1))  # every candidate critical dimension is reachable


def test_critical_factors_refuse_a_vector_breaking_the_constraints():
    with pytest.raises(CtxextError, match="at least s"):
        critical_factors(4, [2.0, 1.5, 3.0, 3.0], 16, 1e4, 2.0)
    with pytest.raises(CtxextError, match="at least s"):
        critical_factors(4, [2.0, 3.0, 2.5, 3.0], 16, 1e4, 2.0)
    with pytest.raises(CtxextError, match="do not make"):
        critical_factors(4, [2.0, 3.0], 16, 1e4, 2.0)
    with pytest.raises(CtxextError, match="no pair's wavelength"):
        critical_space(16, 1e4, 2.0, 10**9, knots=2)


def test_the_rises_reach_the_cap_at_z_1():
    space = CriticalSpace(64, 1e5, 2.0, 4.0, low=14, high=20, start=20, knots=4)
    critical, factors = space.factors_of([0.0, 1.0, 1.0, 1.0, 1.0])
    assert critical == 20 and factors[-1] == pytest.approx(4.0) and factors[20] == pytest.approx(2.0 * 2**0.25)
    assert space.critical_of(-1.0) == 14 and space.critical_of(-0.5) == 17 and space.critical_of(5.0) == 20


# ------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A 6-trial --space critical search on a tiny LLaMA (L = 64, head_dim 16: 8 pairs, d_tcd 3) at 256 tokens,
    with its default objective (needle-ppl)."""
    from ctxext.cli import main

    root = tmp_path_factory.mktemp("longrope2")
    source = save_tiny_checkpoint(root / "tiny", tiny_model("llama"))
    g = torch.Generator().manual_seed(0)
    (root / "docs").mkdir()
    for index in range(2):
        (root / "docs" / f"doc{index}.txt").write_text(
            " ".join(f"w{int(i)}" for i in torch.randint(0, 256, (300,), generator=g))
        )
    out = root / "out"
    argv = ["search", source, "--method", "longrope", "--space", "critical", "--factor", 4, "--lengths", 256]
    argv += ["--text-file", root / "docs", "--trials", 6, "--longrope-knots", 3, "--longrope-popsize", 4]
    argv += ["--passkey-trials", 1, "--passkey-depths", "0,1", "--dtype", "fp32", "--no-progress", "-o", out]
    assert main([str(a) for a in argv]) == 0
    trials = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    return source, out, trials


def test_the_search_records_its_space_and_defaults_to_needle_ppl(searched):
    _, out, trials = searched
    settings = json.loads((out / "search.json").read_text())
    assert settings["objective"] == "needle-ppl"
    lr = settings["longrope"]
    assert lr["space"] == "critical" and lr["theoretical_critical_dim"] == naive_critical_pair(16, 1e4, 64) == 3
    assert lr["critical_dims"] == [naive_critical_pair(16, 1e4, 64, 10) or 1, 3]
    assert [t["role"] for t in trials[:2]] == ["defaults", "start"] and len(trials) == 6
    assert trials[0]["params"] == {"long_factor": [4.0] * 8}
    assert "needle_nll" in trials[1]["metrics"]


def test_every_trial_of_the_search_satisfies_the_constraints(searched):
    _, out, trials = searched
    longrope = json.loads((out / "search.json").read_text())["longrope"]
    assert recorded_critical_dim(longrope, trials[0]) is None
    for trial in trials[1:]:
        critical = recorded_critical_dim(longrope, trial)
        assert 1 <= critical <= 3
        check_constraints(trial["params"]["long_factor"], critical, 16, 1e4, 4.0, 8.0)
    start = trials[1]
    assert recorded_critical_dim(longrope, start) == 3 and start["params"]["long_factor"][3:] == [4.0] * 5


def test_the_checkpoint_loads_in_plain_transformers_with_the_patched_models_logits(searched, tmp_path):
    source, out, trials = searched
    best = best_trial(trials)
    rope = json.loads((out / "checkpoint" / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["long_factor"] == best["params"]["long_factor"]
    assert rope["short_factor"] == [1.0] * 8 and rope["original_max_position_embeddings"] == 64
    assert_reloads_in_plain_transformers_as_patched(out / "checkpoint", best["params"]["long_factor"], tmp_path)


# ------------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny2")
    source = save_tiny_checkpoint(root / "tiny", tiny_model("llama"))
    (root / "docs").mkdir()
    (root / "docs" / "doc.txt").write_text(" ".join(f"w{i % 256}" for i in range(600)))
    return source, root / "docs"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "yarn", "--space", "critical"], "--space critical is a LongRoPE search space"),
        (["--method", "ntk", "--space", "cma"], "--space cma is a LongRoPE search space"),
        (["--method", "longrope", "--space", "evolution"], "--space 'evolution': --method longrope searches"),
        (["--method", "longrope", "--space", "ranges.yaml"], "not a YAML of ranges"),
        (["--method", "longrope", "--space", "critical", "--longrope-start", "ntk"], "--longrope-start does not"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_source, tmp_path, capsys, extra, message):
    source, docs = tiny_source
    code, _, err = run_cli(
        capsys, "search", source, *extra, "--lengths", 256, "--text-file", docs, "--no-progress", "-o", tmp_path / "o"
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "o").exists()


def test_the_library_refuses_an_unknown_space(tiny_source, tmp_path):
    from ctxext.search import LongropeOptions, SearchRequest, plan_search

    source, docs = tiny_source
    request = SearchRequest(source, {"method": "longrope"}, 256, tmp_path / "o", longrope=LongropeOptions(space="x"))
    with pytest.raises(CtxextError, match="unknown LongRoPE search space 'x'"):
        plan_search(request)
    request = SearchRequest(source, {"method": "yarn"}, 256, tmp_path / "o", longrope=LongropeOptions(space="critical"))
    with pytest.raises(CtxextError, match="needs --method longrope"):
        plan_search(request)


def test_a_cma_search_records_the_settings_of_before_the_spaces(tiny_source, tmp_path):
    """--space cma's search.json has no "space" key and the same longrope record as before, so a stored study
    resumes; its objective is still ppl by default."""
    from ctxext.run_options import DataOptions
    from ctxext.search import SearchRequest, plan_search

    source, docs = tiny_source
    request = SearchRequest(
        source, {"method": "longrope"}, 256, tmp_path / "o", data=DataOptions(text_files=[str(docs)])
    )
    settings = plan_search(request).settings.to_dict()
    assert settings["objective"] == "ppl"
    assert settings["longrope"] == {"start_method": "yarn", "knots": 8, "sigma": 0.5, "upper": None, "popsize": None}


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_the_critical_search_finds_a_planted_vector_and_resumes_exactly(tmp_path):
    from ctxext.search.loop import critical_search
    from ctxext.search.store import TrialStore

    space = critical_space(64, 1e5, 2.0, 8192, knots=4)
    _, target = space.factors_of([-0.5, 0.6, 0.0, 0.8, 0.3])  # d = 17, rising above it

    def objective(params):
        return {"value": float(np.sum((np.log(params["long_factor"]) - np.log(target)) ** 2))}

    def search(journal, trials, seed=0, evaluate=objective):
        store = TrialStore.open(str(tmp_path / journal), "test", {})
        return critical_search(space, evaluate, store, trials, seed=seed, popsize=4)

    whole = search("whole.journal", 30)
    assert best_trial(whole)["value"] < 0.5 * whole[1]["value"]  # 7 generations of 4 from the start
    calls = []

    def counting(params):
        calls.append(1)
        return objective(params)

    search("parts.journal", 9, evaluate=counting)  # stops mid-generation
    resumed = search("parts.journal", 30, evaluate=counting)
    assert len(calls) == 30  # nothing scored twice
    assert [(t["params"], t["value"]) for t in resumed] == [(t["params"], t["value"]) for t in whole]
    with pytest.raises(Exception, match="does not match this search"):
        search("parts.journal", 31, seed=1)
