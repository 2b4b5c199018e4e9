"""`ctxext search` on tiny models: trial 0, a planted optimum, resume, the search loop, bad input."""

import json
import math
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ctxext
from ctxext.errors import CtxextError
from ctxext.methods import METHODS, get_method
from ctxext.search.loop import best_trial, propose_tpe, scalar_search
from ctxext.search.space import Range, build_space, searchable_fields
from ctxext.search.store import TrialStore
from tests.helpers import run_cli, save_tiny_checkpoint, tiny_model, trials_of, write_documents

pytest.importorskip("optuna")
pytest.importorskip("cma")

WORDS = 256


def naive_perplexity(model, documents, window):
    """exp(mean NLL) of the first `window` tokens of each document, from the full logits (no ctxext eval code)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in documents:
            ids = torch.as_tensor(ids[:window]).unsqueeze(0)
            logits = model(ids).logits[0, :-1].double()
            total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            count += ids.shape[1] - 1
    return math.exp(total / count)


def new_store(path, settings=None):
    """A study in a journal file: what the loops record their trials in."""
    return TrialStore.open(str(path), "test", settings or {})


def read_trials(out):
    return [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny LLaMA (L = 64) and four random 300-token documents."""
    root = tmp_path_factory.mktemp("search")
    source = save_tiny_checkpoint(root / "tiny", tiny_model("llama"))
    g = torch.Generator().manual_seed(0)
    docs = write_documents(root / "docs", [torch.randint(0, WORDS, (300,), generator=g) for _ in range(4)])
    return source, docs


# --------------------------------------------------------------------------------------------- trial 0
def test_trial_0_is_the_defaults_and_scores_what_the_patched_model_scores(tiny, tmp_path, capsys):
    source, docs = tiny
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        capsys,
        "search",
        source,
        "--method",
        "yarn",
        "--factor",
        4,
        "--lengths",
        256,
        "--text-file",
        docs,
        "--trials",
        3,
        "--dtype",
        "fp32",
        "--no-progress",
        "-o",
        out,
    )
    assert code == 0, err
    trials = read_trials(out)
    assert trials[0]["role"] == "defaults"
    defaults = {f.name: f.default for f in searchable_fields(get_method("yarn")).values()}
    assert trials[0]["params"] == {k: defaults[k] for k in ("beta_fast", "beta_slow", "attention_factor")}
    # Oracle: the defaults applied with ctxext.patch, scored from full logits in float64.
    model = ctxext.patch(tiny_model("llama"), "yarn", factor=4.0)
    ids = [torch.tensor([int(w[1:]) for w in (docs / "doc0.txt").read_text().split()])]
    assert trials[0]["value"] == pytest.approx(naive_perplexity(model, ids, 256), rel=1e-5)
    results = json.loads((out / "results.json").read_text())
    assert results["calibration"]["defaults"] == trials[0]["value"]
    assert results["calibration"]["best"] <= trials[0]["value"]
    assert results["held_out"]["documents"] == [str(docs / f"doc{i}.txt") for i in (1, 2, 3)]
    assert {p.name for p in out.iterdir()} >= {
        "search.json",
        "trials.jsonl",
        "results.json",
        "objective.png",
        "checkpoint",
    }


def test_a_flag_for_a_searched_parameter_sets_trial_0_and_other_flags_stay_fixed(tiny, tmp_path, capsys):
    source, docs = tiny
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys,
        "search",
        source,
        "--method",
        "yarn",
        "--factor",
        4,
        "--lengths",
        256,
        "--params",
        "beta_fast",
        "--beta-fast",
        16,
        "--beta-slow",
        2,
        "--text-file",
        docs,
        "--trials",
        4,
        "--dtype",
        "fp32",
        "--no-progress",
        "-o",
        out,
    )
    assert code == 0, err
    trials = read_trials(out)
    assert trials[0]["params"] == {"beta_fast": 16}
    assert all(set(t["params"]) == {"beta_fast"} for t in trials)
    settings = json.loads((out / "search.json").read_text())
    assert settings["fixed"] == {"beta_slow": 2} and settings["start"] == {"beta_fast": 16}


# ---------------------------------------------------------------------------------------- planted optimum
@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A sharp tiny model and text sampled from it patched with NTK alpha = 10: the expected NLL of that text is
    lowest at alpha = 10, so the search's optimum is planted there."""
    root = tmp_path_factory.mktemp("planted")
    teacher = tiny_model("llama", seed=1)
    with torch.no_grad():  # peaked outputs and sharp attention: the positions matter
        teacher.lm_head.weight.mul_(20)
        for layer in teacher.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    source = save_tiny_checkpoint(root / "teacher", teacher)
    ctxext.patch(teacher, "ntk", factor=4, alpha=10.0)
    torch.manual_seed(0)
    documents = []
    with torch.no_grad():
        for _ in range(6):
            start = torch.randint(0, WORDS, (1, 1))
            documents.append(
                teacher.generate(
                    start,
                    max_new_tokens=255,
                    min_new_tokens=255,
                    do_sample=True,
                    top_k=0,
                    top_p=1.0,
                    temperature=1.0,
                    pad_token_id=0,
                )[0]
            )
    ctxext.unpatch(teacher)
    return source, teacher, documents, write_documents(root / "docs", documents)


def test_the_search_finds_an_optimum_planted_in_a_tiny_model(planted, tmp_path, capsys):
    source, teacher, documents, folder = planted
    # The oracle: the objective on a grid, from full logits, with ctxext.patch.
    grid = {}
    for alpha in range(4, 17):
        ctxext.patch(teacher, "ntk", factor=4, alpha=float(alpha))
        grid[alpha] = naive_perplexity(teacher, documents, 256)
    ctxext.unpatch(teacher)
    planted_alpha = min(grid, key=grid.get)
    assert planted_alpha == 10  # the plant took: the grid's optimum is where the text came from

    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys,
        "search",
        source,
        "--method",
        "ntk",
        "--factor",
        4,
        "--lengths",
        256,
        "--text-file",
        folder,
        "--calibration-docs",
        6,
        "--held-out-docs",
        0,
        "--trials",
        24,
        "--dtype",
        "fp32",
        "--no-progress",
        "-o",
        out,
    )
    assert code == 0, err
    best = best_trial(read_trials(out))
    assert best["params"]["alpha"] == pytest.approx(10.0, rel=0.08)
    assert best["value"] <= grid[10] * 1.01  # within 1% of the optimum the grid found
    assert best["value"] < read_trials(out)[0]["value"]  # and better than the defaults (alpha = s = 4)


def test_tpe_finds_a_planted_minimum_through_the_search_loop(tmp_path):
    space = build_space(get_method("yarn"), {"factor": 4, "L": 64, "base": 1e4}, ["beta_fast", "beta_slow"])

    def objective(params):
        return {"value": math.log(params["beta_fast"] / 20) ** 2 + math.log(params["beta_slow"] / 1.5) ** 2}

    history = scalar_search(
        space, {"beta_fast": 32.0, "beta_slow": 1.0}, objective, new_store(tmp_path / "t.journal"), trials=40, seed=0
    )
    best = best_trial(history)
    # The minimum is 0 at (20, 1.5); trial 0 (32, 1) scores 0.39.
    assert best["value"] < 0.05
    assert best["params"]["beta_fast"] == pytest.approx(20, rel=0.2)
    assert best["params"]["beta_slow"] == pytest.approx(1.5, rel=0.2)


# -------------------------------------------------------------------------------------------------- resume
def test_a_resumed_search_continues_the_study_and_matches_an_uninterrupted_one(tmp_path):
    space = [Range("x", -5.0, 5.0), Range("n", 1, 50, integer=True, log=True)]
    calls = []

    def objective(params):
        calls.append(params)
        return {"value": (params["x"] - 1.2) ** 2 + abs(math.log(params["n"] / 7))}

    whole = scalar_search(
        space, {"x": 0.0, "n": 3}, objective, new_store(tmp_path / "whole.journal"), trials=14, seed=3
    )
    calls.clear()
    store = new_store(tmp_path / "parts.journal")
    scalar_search(space, {"x": 0.0, "n": 3}, objective, store, trials=6, seed=3)
    # A worker that died in the middle of trial 6 (its process is gone), then one stopped by Ctrl-C retrying it.
    claim = store.claim(14)
    store.begin(claim, "search", propose_tpe(space, store.history(), 3, 6, 5), {})
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    claim.trial.set_user_attr("worker", {"host": socket.gethostname(), "pid": gone.pid, "token": "gone"})

    def interrupted(params):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scalar_search(space, {"x": 0.0, "n": 3}, interrupted, store, trials=14, seed=3)
    resumed = scalar_search(space, {"x": 0.0, "n": 3}, objective, store, trials=14, seed=3)
    assert len(calls) == 6 + 8 - sum("repeat_of" in t for t in resumed)  # no finished trial scored again
    assert [t["number"] for t in resumed] == list(range(14))
    strip = [{k: v for k, v in t.items() if k != "seconds"} for t in resumed]
    assert strip == [{k: v for k, v in t.items() if k != "seconds"} for t in whole]
    # The lost trials are in the study as failures with their reason, and their slot was run again.
    failed = [t for t in store.frozen() if t.state.name == "FAIL" and "state" not in t.user_attrs]
    assert [t.user_attrs["slot"] for t in failed] == [6, 6]
    assert "KeyboardInterrupt" in failed[1].user_attrs["error"]
    retries = {t.user_attrs["retry_of"]: t.user_attrs["reason"] for t in store.frozen() if "retry_of" in t.user_attrs}
    assert f"{gone.pid} ended without finishing" in retries[failed[0].number]
    # The parameters are the Optuna trials' own too (for Optuna's plots): each finished trial's, as scored.
    finished = sorted((t for t in store.frozen() if "state" in t.user_attrs), key=lambda t: t.user_attrs["slot"])
    assert [t.params for t in finished] == [t["params"] for t in resumed]
    assert [t.value for t in finished] == [t["value"] for t in resumed]
    with pytest.raises(CtxextError, match="does not match this search"):
        scalar_search(space, {"x": 0.0, "n": 3}, objective, store, trials=14, seed=4)


def test_a_worker_that_loses_the_race_for_the_last_slot_queues_it_for_a_longer_search(tmp_path):
    space = [Range("x", -5.0, 5.0)]

    def objective(params):
        return {"value": (params["x"] - 1.2) ** 2}

    whole = scalar_search(space, {"x": 0.0}, objective, new_store(tmp_path / "whole.journal"), trials=5, seed=1)
    store = new_store(tmp_path / "parts.journal")
    scalar_search(space, {"x": 0.0}, objective, store, trials=3, seed=1)
    # A second worker read the study before the last slot was taken (both saw a free slot), then asked for a trial.
    racer = new_store(tmp_path / "parts.journal")
    racer.frozen = lambda: []
    assert racer.claim(3) is None
    leftovers = [t for t in store.frozen() if t.user_attrs["slot"] >= 3]
    assert [(t.state.name, t.user_attrs["slot"]) for t in leftovers] == [("FAIL", 3), ("WAITING", 3)]
    assert "not needed" in leftovers[0].user_attrs["error"] and "params" not in leftovers[1].user_attrs
    assert len(store.history()) == 3  # the 3-trial search is whole; nothing was scored for slot 3
    # A search resumed with 5 trials fills slot 3 from the queue, then slot 4: the trials of an uninterrupted one.
    resumed = scalar_search(space, {"x": 0.0}, objective, store, trials=5, seed=1)
    strip = [{k: v for k, v in t.items() if k != "seconds"} for t in resumed]
    assert strip == [{k: v for k, v in t.items() if k != "seconds"} for t in whole]


def test_resume_from_the_command_line(tiny, tmp_path, capsys):
    source, docs = tiny
    common = [
        "search",
        source,
        "--method",
        "leaky_rerope",
        "--lengths",
        256,
        "--text-file",
        docs,
        "--dtype",
        "fp32",
        "--no-progress",
        "--held-out-docs",
        1,
    ]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run_cli(capsys, *common, "--trials", 7, "-o", whole)[0] == 0
    assert run_cli(capsys, *common, "--trials", 3, "-o", parts)[0] == 0
    legacy = tmp_path / "legacy"  # a search from before the studies: search.json and trials.jsonl only
    shutil.copytree(parts, legacy, ignore=shutil.ignore_patterns("study.*"))
    code, _, err = run_cli(capsys, *common, "--trials", 3, "-o", parts)  # the output exists: resume or overwrite
    assert code == 2 and "--resume" in err
    code, stdout, err = run_cli(capsys, *common, "--trials", 7, "-o", parts, "--resume")
    assert code == 0, err
    assert "(resumed)" in stdout
    a, b = read_trials(whole), read_trials(parts)
    assert [t["number"] for t in b] == list(range(7))
    assert [(t["params"], t["value"]) for t in a] == [(t["params"], t["value"]) for t in b]
    results = json.loads((parts / "results.json").read_text())
    assert results["best"]["number"] == best_trial(a)["number"]
    # Resuming the old kind of search imports its trials.jsonl into a new study and goes on from there.
    assert run_cli(capsys, *common, "--trials", 7, "-o", legacy, "--resume")[0] == 0
    assert read_trials(legacy)[:3] == read_trials(parts)[:3]  # imported as they were, seconds included
    assert [(t["params"], t["value"]) for t in read_trials(legacy)] == [(t["params"], t["value"]) for t in a]
    # A resume with other settings is refused, and changes nothing.
    before = (parts / "trials.jsonl").read_bytes()
    code, _, err = run_cli(capsys, *common, "--trials", 9, "-o", parts, "--resume", "--seed", 1)
    assert code == 2 and "seed" in err and len(err.strip().splitlines()) == 1
    assert (parts / "trials.jsonl").read_bytes() == before


@pytest.mark.parametrize("method", ["self_extend", "dual_chunk"])
def test_a_remapping_method_is_searched_like_any_other(tiny, tmp_path, capsys, method):
    """Every trial of an attention-level search scores what `ctxext.patch` with its parameters scores, and the
    best is written as a checkpoint whose attention settings reload (after import ctxext) to the same model."""
    from transformers import AutoModelForCausalLM

    source, docs = tiny
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys,
        "search",
        source,
        "--method",
        method,
        "--lengths",
        256,
        "--text-file",
        docs,
        "--trials",
        4,
        "--held-out-docs",
        1,
        "--dtype",
        "fp32",
        "--no-progress",
        "-o",
        out,
    )
    assert code == 0, err
    trials = [t for t in read_trials(out) if t["state"] == "complete"]
    assert len(trials) >= 3 and len({t["value"] for t in trials}) > 1  # the parameters reach the attention
    calibration = [torch.tensor([int(w[1:]) for w in (docs / "doc0.txt").read_text().split()])]
    for trial in trials:
        params = {k: v for k, v in trial["params"].items() if v is not None}
        model = ctxext.patch(tiny_model("llama"), method, factor=4.0, **params)
        assert trial["value"] == pytest.approx(naive_perplexity(model, calibration, 256), rel=1e-5), trial
    best = best_trial(read_trials(out))
    reloaded = AutoModelForCausalLM.from_pretrained(out / "checkpoint").eval()
    assert reloaded.config.ctxext_attention["method"] == method
    assert naive_perplexity(reloaded, calibration, 256) == pytest.approx(best["value"], rel=1e-5)


def test_invalid_combinations_are_logged_and_avoided(tmp_path):
    space = build_space(get_method("dual_chunk"), {"factor": 4, "L": 64, "base": 1e4}, None)

    def objective(params):
        if params["chunk_size"] <= params["local_window"]:
            from ctxext.search.loop import InvalidParams

            raise InvalidParams("chunk_size must be larger than local_window")
        return {"value": float(params["chunk_size"])}

    history = scalar_search(
        space, {"chunk_size": 48, "local_window": 4}, objective, new_store(tmp_path / "t.journal"), trials=12, seed=0
    )
    assert all(t["state"] in ("complete", "invalid") for t in history)
    assert all((t["state"] == "invalid") == (t["params"]["chunk_size"] <= t["params"]["local_window"]) for t in history)


# ------------------------------------------------------------------------------------------------ ranges
def test_every_declared_range_resolves_to_a_non_empty_range():
    scales = {"factor": 4.0, "L": 4096, "base": 1e4}
    searched = 0
    for method in METHODS.values():
        for name, field in searchable_fields(method).items():
            if "search" not in field.metadata:
                continue
            r, *elements = build_space(method, scales, [name])
            if r.choices is not None:  # a list parameter: one range of powers of two per element
                assert r.name == f"{name}[0]" and len(elements) + 1 == field.metadata["elements"]
                assert field.metadata["element_default"] in r.choices and r.choices == (1, 2, 4, 8, 16, 32, 64)
                searched += 1
                continue
            assert not elements and r.low < r.high, (method.name, name)
            if field.default is not None and not isinstance(field.default, bool):
                assert r.low <= field.default <= r.high or name == "alpha", (method.name, name, field.default)
            searched += 1
    assert searched >= 15
    (window,) = build_space(get_method("rerope"), scales, ["window"])
    assert (window.to_dict()["low"], window.to_dict()["high"]) == (128, 4096)  # 1/32 L to L, whole numbers
    # STRING's offset is a share of N = s L, so it reaches S = (N + W) / 2, the offset whose largest shifted
    # distance N - S + W is smallest (it is above L at any S once s >= 2)
    (offset,) = build_space(get_method("string"), scales, ["shifted_offset"])
    N, W = 4.0 * 4096, 128
    assert (offset.to_dict()["low"], offset.to_dict()["high"]) == (N // 16, 3 * N // 4)
    assert offset.contains((N + W) // 2) and not offset.contains(N)


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "yarn", "--params", "beta_fst"], "did you mean 'beta_fast'"),
        (["--method", "yarn", "--params", "ramp"], "declares no search range"),
        (["--method", "linear"], "no parameter to search"),
        (["--method", "yarn", "--space", "EMPTY"], "is empty"),
        (["--method", "yarn", "--lengths", 64], "not above the model's context L = 64"),
        (["--method", "yarn", "--original-max-position-embeddings", 512], "not above the model's context L = 512"),
        (["--method", "longrope", "--params", "long_factor"], "do not apply"),
        (["--method", "longrope", "--longrope-knots", 99], "--longrope-knots"),
        (["--method", "theta"], "needs 'new_base'"),
        (["--method", "yarn", "--calibration-docs", 9], "--calibration-docs wants 9"),
        (["--method", "yarn", "--resume"], "holds no search to resume"),
        (["--method", "yarn", "--workers", 0], "--workers must be at least 1"),
        (["--method", "yarn", "--storage", "nosuchdb://x"], "--storage 'nosuchdb://x' cannot be opened"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tiny, tmp_path, capsys, extra, message):
    source, docs = tiny
    space = tmp_path / "space.yaml"
    space.write_text("beta_fast: {low: 64, high: 8}\n")
    extra = [str(space) if e == "EMPTY" else e for e in extra]
    argv = [
        "search",
        source,
        "--lengths",
        256,
        "--text-file",
        docs,
        "--dtype",
        "fp32",
        "--no-progress",
        "-o",
        tmp_path / "out",
        *extra,
    ]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_without_optuna_the_command_says_how_to_install(tiny, tmp_path, capsys, monkeypatch):
    source, docs = tiny
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna now raises ImportError
    code, _, err = run_cli(
        capsys,
        "search",
        source,
        "--method",
        "yarn",
        "--factor",
        4,
        "--lengths",
        256,
        "--text-file",
        docs,
        "-o",
        tmp_path / "out",
    )
    assert code == 2 and "pip install 'ctxext[search]'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_ranges_reject_bad_specifications():
    with pytest.raises(CtxextError, match="is empty"):
        Range("x", 2.0, 2.0)
    with pytest.raises(CtxextError, match="log range needs low > 0"):
        Range("x", 0.0, 2.0, log=True)
    with pytest.raises(CtxextError, match="no whole number"):
        Range("x", 2.2, 2.8, integer=True)
    with pytest.raises(CtxextError, match="has no searchable parameter 'windw'.*did you mean 'window'"):
        build_space(get_method("rerope"), {"factor": 2, "L": 64, "base": 1e4}, space={"windw": [1, 2]})
    assert np.isclose(Range("x", 1.0, 8.0, log=True).distribution().high, 8.0)


def test_dpe_searches_one_power_of_two_scale_per_group(tiny, tmp_path, capsys):
    """A list parameter is searched element by element: trial 0 is the defaults ([4] x 8, or the list given),
    every proposal is a power of two in 1-64, and the checkpoint holds the best trial's list."""
    source, docs = tiny
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys,
        "search",
        source,
        "--method",
        "dpe",
        "--factor",
        4,
        "--lengths",
        256,
        "--params",
        "group_scales",
        "--group-scales",
        "[2, 8, 2, 8]",
        "--window",
        8,
        "--text-file",
        docs,
        "--trials",
        4,
        "--dtype",
        "fp32",
        "--no-progress",
        "-o",
        out,
    )
    assert code == 0, err
    trials = read_trials(out)
    assert trials[0]["params"] == {
        "group_scales[0]": 2,
        "group_scales[1]": 8,
        "group_scales[2]": 2,
        "group_scales[3]": 8,
    }
    assert all(v in (1, 2, 4, 8, 16, 32, 64) for t in trials for v in t["params"].values())
    best = min((t for t in trials if t["state"] == "complete"), key=lambda t: t["value"])
    saved = json.loads((out / "checkpoint" / "config.json").read_text())["ctxext_attention"]
    assert saved["group_scales"] == [best["params"][f"group_scales[{i}]"] for i in range(4)]
    assert saved["window"] == 8
    # Oracle for trial 0: dpe at [2, 8, 2, 8] patched by hand, scored from full logits.
    model = ctxext.patch(tiny_model("llama"), "dpe", factor=4.0, window=8, group_scales=[2, 8, 2, 8])
    ids = [torch.tensor([int(w[1:]) for w in (docs / "doc0.txt").read_text().split()])]
    assert trials[0]["value"] == pytest.approx(naive_perplexity(model, ids, 256), rel=1e-5)


# ------------------------------------------------------------------------------------ errors at patch time
def test_a_parameter_the_model_rejects_is_an_invalid_trial_and_any_other_patch_error_stops(tiny, tmp_path, capsys):
    from ctxext.eval.data import Document
    from ctxext.search.loop import InvalidParams
    from ctxext.search.objective import Objective

    docs = [Document("d", torch.randint(0, WORDS, (300,), generator=torch.Generator().manual_seed(0)))]
    base = {"method": "dpe", "factor": 4.0, "original_max_position_embeddings": 64, "logn": False, "window": 8}
    objective = Objective("ppl", base, tiny_model("llama"), None, docs, 256)
    assert objective({"group_scales": [2, 2, 2, 2]})["value"] > 0
    with pytest.raises(InvalidParams, match="group"):  # 3 groups do not divide the 8 rotary pairs
        objective({"group_scales": [2, 2, 2]})
    # A model the method cannot run on is not a parameter's fault: the search stops at once, with one line.
    source = save_tiny_checkpoint(tmp_path / "windowed", tiny_model("mistral", sliding_window=32))
    capsys.readouterr()  # the checkpoint's progress bars
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys, "search", source, "--method", "self_extend", "--lengths", 256, "--text-file", tiny[1], "--trials", 4,
        "--dtype", "fp32", "--no-progress", "-o", out,
    )  # fmt: skip
    lines = err.strip().splitlines()  # --no-progress: transformers' loading bar is off too
    assert code == 2 and len(lines) == 1 and "error: self_extend cannot run with sliding-window" in lines[0], err
    trials = trials_of(out / "study.journal")
    assert len(trials) == 2 and trials[0].state.name == "FAIL" and "sliding-window" in trials[0].user_attrs["error"]
    assert "state" not in trials[0].user_attrs and trials[1].state.name == "WAITING"  # queued for a resume


def test_reading_a_trial_log_leaves_the_file_as_it_is(tmp_path):
    from ctxext.search.store import read_trials

    path = tmp_path / "trials.jsonl"
    whole = json.dumps({"number": 0, "state": "complete", "value": 1.0}) + "\n"
    path.write_text(whole + '{"number": 1, "sta')  # an old search killed mid-write
    assert read_trials(path) == [json.loads(whole)]
    assert path.read_text() == whole + '{"number": 1, "sta'


def test_a_search_on_another_storage_resumes_only_with_that_storage(tiny, tmp_path, capsys):
    source, docs = tiny
    out, storage = tmp_path / "out", f"sqlite:///{tmp_path / 'trials.db'}"
    common = ["search", source, "--method", "yarn", "--factor", 4, "--lengths", 256, "--text-file", docs]
    common += ["--held-out-docs", 0, "--no-checkpoint", "--dtype", "fp32", "--no-progress", "-o", out]
    assert run_cli(capsys, *common, "--trials", 2, "--storage", storage)[0] == 0
    assert not (out / "study.journal").exists()
    code, _, err = run_cli(capsys, *common, "--trials", 3, "--resume")  # forgot --storage
    assert code == 2 and f"give --storage {storage} --study-name ctxext-search" in err, err
    assert not (out / "study.journal").exists() and len(read_trials(out)) == 2
    assert run_cli(capsys, *common, "--trials", 3, "--resume", "--storage", storage)[0] == 0
    assert [t["number"] for t in read_trials(out)] == [0, 1, 2]


def test_dpe_pairs_selected_at_search_time_are_measured_once_and_used_by_every_trial(
    tiny, tmp_path, capsys, monkeypatch
):
    """--select-pairs/--top-pairs in a search: the top k pairs per layer by mean |q_p||k_p| on the text (the measure
    test_dpe checks by hand), on the unpatched model; trial 0 scores what ctxext.patch with those pairs scores;
    search.json and the checkpoint record them; a resume takes them from the study instead of measuring again."""
    from ctxext.patching import pair_selection
    from ctxext.patching.pair_selection import pair_contributions

    source, docs = tiny
    words = torch.tensor([int(w[1:]) for w in (docs / "doc0.txt").read_text().split()])
    text = tmp_path / "calibration.txt"
    text.write_text((docs / "doc0.txt").read_text())
    out = tmp_path / "out"
    argv = [
        "search",
        source,
        "--method",
        "dpe",
        "--factor",
        4,
        "--lengths",
        256,
        "--text-file",
        docs,
        "--dtype",
        "fp32",
    ]
    argv += ["--params", "group_scales", "--select-pairs", text, "--top-pairs", 3, "--no-progress", "-o", out]
    code, _, err = run_cli(capsys, *argv, "--trials", 2)
    assert code == 0, err

    chosen = [
        sorted(torch.topk(row, 3).indices.tolist()) for row in pair_contributions(tiny_model("llama"), words[None, :64])
    ]
    assert len({tuple(p) for p in chosen}) > 1 or chosen[0] != list(range(3))  # a real choice, not the first pairs
    settings = json.loads((out / "search.json").read_text())
    assert settings["selected_pairs"] == chosen and settings["pair_selection"]["top_pairs"] == 3
    saved = json.loads((out / "checkpoint" / "config.json").read_text())["ctxext_attention"]
    assert saved["selected_pairs"] == chosen
    trial = read_trials(out)[0]
    scales = [trial["params"][f"group_scales[{i}]"] for i in range(len(trial["params"]))]
    model = ctxext.patch(tiny_model("llama"), "dpe", factor=4.0, group_scales=scales, selected_pairs=chosen)
    assert trial["value"] == pytest.approx(naive_perplexity(model, [words], 256), rel=1e-5)

    def measured_again(*args, **kwargs):
        raise AssertionError("a resume measured the pairs again")

    monkeypatch.setattr(pair_selection, "select_pairs", measured_again)
    code, _, err = run_cli(capsys, *argv, "--trials", 3, "--resume")
    assert code == 0, err
    assert len(read_trials(out)) == 3
    assert json.loads((out / "search.json").read_text())["selected_pairs"] == chosen


@pytest.mark.parametrize(
    "method,k,message",
    [("yarn", 2, "--select-pairs chooses DPE's pairs; it does not apply to yarn"), ("dpe", 9, "8 rotary pairs, got 9")],
)
def test_a_bad_pair_selection_in_a_search_is_one_line_exit_2(tiny, tmp_path, capsys, method, k, message):
    source, docs = tiny
    text = tmp_path / "calibration.txt"
    text.write_text("w1 w2 w3")
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys, "search", source, "--method", method, "--factor", 4, "--lengths", 256, "--text-file", docs,
        "--select-pairs", text, "--top-pairs", k, "--no-progress", "-o", out,
    )  # fmt: skip
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not out.exists()
