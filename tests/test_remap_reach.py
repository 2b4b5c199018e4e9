"""A remapping method's checkpoint declares the length its own parameters reach.

The oracle is the remapped relative position of every (query, key) pair of N tokens, computed by the naive
per-pair formulas of tests/helpers.py (docs/METHODS.md): the reach is the largest N whose every relative position
stays within 0..L-1, so N tokens fit and N + 1 do not. `ctxext patch` without --factor writes that length, and
says which wins where --factor asks for more than the parameters reach.
"""

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import ctxext
from ctxext.cli import main
from ctxext.methods import get_method
from tests.helpers import (
    dual_chunk_relative,
    rerope_relative,
    save_tiny_checkpoint,
    self_extend_relative,
    string_relative,
    tiny_model,
)


def largest_relative_position(relative, n: int) -> float:
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    r = relative(i.expand(n, n), j.expand(n, n)).double()
    return float(torch.where(j <= i, r, torch.zeros_like(r)).max())


BOUNDED = [  # (method, params, L, the naive relative position)
    ("self_extend", {"group_size": 4, "window": 16}, 64, lambda i, j: self_extend_relative(i, j, 4, 16)),
    ("self_extend", {"group_size": 3, "window": 10}, 64, lambda i, j: self_extend_relative(i, j, 3, 10)),
    ("self_extend", {"group_size": 4, "window": 1024}, 8192, None),  # the 29,696
    ("leaky_rerope", {"window": 16, "k": 8}, 64, lambda i, j: rerope_relative(i, j, 16, 8)),
    ("leaky_rerope", {"window": 10, "k": 2.5}, 48, lambda i, j: rerope_relative(i, j, 10, 2.5)),
    ("string", {"shifted_offset": 40, "local_value": 8}, 64, lambda i, j: string_relative(i, j, 40, 8)),
    ("dpe", {"window": 8, "group_scales": [8, 2, 4, 2]}, 64, lambda i, j: self_extend_relative(i, j, 2, 8)),
]
UNBOUNDED = [
    ("rerope", {"window": 16}, 64, lambda i, j: rerope_relative(i, j, 16)),
    ("dual_chunk", {"chunk_size": 48, "local_window": 4}, 64, lambda i, j: dual_chunk_relative(i, j, 48, 4)),
    ("gali", {}, 64, None),  # its positions lie in 0..R-1 by construction (tests/test_gali.py)
]


@pytest.mark.parametrize("method,params,L,relative", BOUNDED)
def test_the_reach_is_the_longest_input_whose_relative_positions_stay_within_l(method, params, L, relative):
    reach = get_method(method).make_params(**params).reach(L)
    if relative is None:  # too long to enumerate: the count, (8192 - 1024) x 4 + 1024
        assert reach == (L - 1024) * 4 + 1024 == 29_696
        return
    assert largest_relative_position(relative, reach) <= L - 1
    assert largest_relative_position(relative, reach + 1) > L - 1


@pytest.mark.parametrize("method,params,L,relative", UNBOUNDED)
def test_a_method_whose_positions_are_capped_reaches_any_length(method, params, L, relative):
    assert get_method(method).make_params(**params).reach(L) is None
    if relative is not None:
        assert largest_relative_position(relative, 8 * L) <= L - 1


def test_a_window_past_l_reaches_l_only():
    assert get_method("self_extend").make_params(window=64).reach(64) == 64
    assert get_method("rerope").make_params(window=80).reach(64) == 64


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("reach") / "plain", tiny_model("llama"))  # L = 64


def patch_cli(capsys, source, out, *flags) -> tuple[int, str]:
    code = main(["patch", str(source), "-o", str(out), *map(str, flags)])
    return code, capsys.readouterr().out


def declared(out) -> int:
    return AutoModelForCausalLM.from_pretrained(out).config.max_position_embeddings


def test_patch_without_a_factor_declares_the_reach(source, tmp_path, capsys):
    code, printed = patch_cli(
        capsys, source, tmp_path / "se", "--method", "self_extend", "--group-size", "4", "--window", "16"
    )
    assert code == 0
    reach = 4 * (64 - 16 + 16 // 4)
    assert declared(tmp_path / "se") == reach == 208
    assert f"max_position_embeddings: 64 -> {reach}" in printed and f"up to {reach} tokens" in printed


def test_a_factor_past_the_reach_wins_and_says_so(source, tmp_path, capsys):
    code, printed = patch_cli(
        capsys, source, tmp_path / "se8", "--method", "self_extend", "--window", "16", "--factor", "8"
    )
    assert code == 0 and declared(tmp_path / "se8") == 512
    said = re.search(r"only up to (\d+) tokens.*512 declared as asked \(group_size >= (\d+) reaches it\)", printed)
    assert said and int(said[1]) == 208
    G = int(said[2])  # the group size it names does reach 512, and one less does not
    assert get_method("self_extend").make_params(group_size=G, window=16).reach(64) >= 512
    assert get_method("self_extend").make_params(group_size=G - 1, window=16).reach(64) < 512


def test_a_method_that_reaches_any_length_asks_for_one(source, tmp_path, capsys):
    code, printed = patch_cli(capsys, source, tmp_path / "rerope", "--method", "rerope", "--window", "16")
    assert code == 0 and declared(tmp_path / "rerope") == 64
    assert "at any length" in printed and "give --factor or --target-length" in printed


def test_applied_method_reports_an_attention_only_checkpoint(source, tmp_path, capsys):
    assert patch_cli(capsys, source, tmp_path / "se", "--method", "self_extend", "--window", "16")[0] == 0
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "se")
    applied = ctxext.applied_method(reloaded)
    assert applied is not None and applied["method"] == "self_extend"
    assert applied["params"] == {"group_size": 4, "window": 16}
    assert applied["attention"] == reloaded.config.ctxext_attention
    assert ctxext.applied_method(AutoModelForCausalLM.from_pretrained(source)) is None  # the plain source
