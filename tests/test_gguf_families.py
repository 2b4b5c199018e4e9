"""`ctxext patch model.gguf` beyond llama/qwen2/qwen3: one tiny GGUF file per architecture, its tensors named from
gguf's own tables (gguf.MODEL_TENSORS / TENSOR_NAMES: every tensor kind the architecture can have, two blocks), its
keys those llama.cpp's converter writes (with `rope.dimension_count` for partial rotary and `attention.sliding_window`
where the family has sliding layers). The patched file is read back with gguf's reader: the rope keys must be the
ones the method's formula gives (computed here, not by ctxext), and every other key and tensor byte-identical."""

import json
import re

import numpy as np
import pytest

from ctxext.serving.gguf import ARCHITECTURES, SLIDING_LAYERS_UNSCALED
from tests.helpers import run_cli

gguf = pytest.importorskip("gguf")

L, BASE, HEAD_DIM = 4096, 10000.0, 16
FACTOR_TENSORS = ("ROPE_FREQS", "ROPE_FACTORS_LONG", "ROPE_FACTORS_SHORT")


def arch_enum(name: str):
    return next(arch for arch, arch_name in gguf.MODEL_ARCH_NAMES.items() if arch_name == name)


def tiny_gguf(path, arch: str, rotary_dim=None, sliding_window=None, factor_tensor=None):
    """A two-block GGUF file of `arch` with small random tensors of every kind gguf lists for it (F32, and F16 for
    the 2-D ones), plus `factor_tensor` (e.g. phi3's rope_factors_long) where asked."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_context_length(L)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(HEAD_DIM)
    writer.add_rope_freq_base(BASE)
    if rotary_dim is not None:
        writer.add_rope_dimension_count(rotary_dim)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    kinds = [t for t in gguf.MODEL_TENSORS[arch_enum(arch)] if t.name not in FACTOR_TENSORS]
    for kind in kinds:
        pattern = gguf.TENSOR_NAMES[kind]
        for name in sorted({pattern.format(bid=b) for b in (0, 1)}):
            writer.add_tensor(f"{name}.weight", rng.standard_normal((4, 8)).astype(np.float16))
            writer.add_tensor(f"{name}.bias", rng.standard_normal(8).astype(np.float32))
    if factor_tensor is not None:
        writer.add_tensor(factor_tensor, np.ones((rotary_dim or HEAD_DIM) // 2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def contents(path):
    """(keys as stored, tensors as stored) of a GGUF file, GGUF.* counters left out."""
    reader = gguf.GGUFReader(path)
    keys = {
        f.name: b"".join(bytes(p) for p in f.parts) for f in reader.fields.values() if not f.name.startswith("GGUF.")
    }
    tensors = {
        t.name: (t.tensor_type, t.shape.tolist(), np.ascontiguousarray(t.data).tobytes()) for t in reader.tensors
    }
    return reader, keys, tensors


# The layout each architecture is tested with: (rotary dim or None for the whole head, sliding window or None).
LAYOUTS = {arch: (None, None) for arch in ARCHITECTURES}
LAYOUTS.update(
    stablelm=(HEAD_DIM // 4, None),  # partial rotary (StableLM's 0.25), as the converter writes it
    gemma2=(None, 8),
    gemma3=(None, 8),
    olmo2=(None, 8),  # OLMo 3 converts to olmo2 with a sliding window
)


def ntk_base(factor: float, dim: int) -> float:
    """The NTK-aware base b * s^(d / (d - 2)) (bloc97), computed here."""
    return BASE * factor ** (dim / (dim - 2))


def test_every_architecture_is_one_gguf_knows():
    assert set(ARCHITECTURES) <= set(gguf.MODEL_ARCH_NAMES.values())


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("method", ["yarn", "linear", "ntk"])
def test_each_architecture_gets_the_rope_keys_and_copies_everything_else(tmp_path, capsys, arch, method):
    rotary_dim, window = LAYOUTS[arch]
    if method == "ntk" and arch == "olmo2" and window:
        rotary_dim, window = None, None  # a base change reaches olmo2's sliding layers: refused, tested below
    source = tiny_gguf(tmp_path / "in.gguf", arch, rotary_dim, window)
    out = tmp_path / "out.gguf"
    code, _, err = run_cli(capsys, "patch", source, "--method", method, "--factor", "4", "-o", out)
    assert code == 0, err
    expected = {
        "yarn": {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": L},
        "linear": {
            "rope.scaling.type": "linear",
            "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": L,
        },
        "ntk": {"rope.freq_base": ntk_base(4.0, rotary_dim or HEAD_DIM)},
    }[method]
    reader, after, after_tensors = contents(out)
    for key, value in {**expected, "context_length": 4 * L}.items():
        got = reader.get_field(f"{arch}.{key}").contents()
        assert got == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key
    record = json.loads(reader.get_field("ctxext.patch").contents())
    unscaled_sliding = window is not None and arch in SLIDING_LAYERS_UNSCALED
    assert record["layers"] == ("full" if unscaled_sliding else "all")
    assert ("full-attention layers" in record["written_as"]) == unscaled_sliding

    _, before, before_tensors = contents(source)
    changed = {f"{arch}.{key}" for key in expected} | {f"{arch}.context_length", "ctxext.patch"}
    assert {k: v for k, v in after.items() if k not in changed} == {k: v for k, v in before.items() if k not in changed}
    assert after_tensors == before_tensors  # no rope_freqs on any of these for these methods


@pytest.mark.parametrize(
    "case,arch,flags,message",
    [
        ("per_pair", "gemma3", ["--method", "ntk_by_parts"], "only for the llama architecture .*not gemma3"),
        ("per_pair", "stablelm", ["--method", "llama3"], "only for the llama architecture .*not stablelm"),
        ("attn_factor", "gemma3", ["--method", "yarn", "--attention-factor", "1.3"], "gemma3 multiplies its sliding"),
        ("base", "olmo2", ["--method", "ntk"], "olmo2 rotates its sliding layers at the file's freq_base"),
        ("layer_types", "gemma3", ["--method", "yarn", "--layer-types", "all"], "full-attention layers only"),
        ("layer_types", "gemma2", ["--method", "yarn", "--layer-types", "full"], "scales every layer"),
        (
            "phi3_longrope",
            "phi3",
            ["--method", "yarn"],
            "cannot be extended exactly in llama.cpp: the file ships longrope.s two factor sets",
        ),
        ("unknown", "gptneox", ["--method", "yarn"], "'gptneox' model; ctxext supports .*gemma3.*smollm3"),
    ],
)
def test_what_llama_cpp_would_compute_otherwise_is_one_line_exit_2(tmp_path, capsys, case, arch, flags, message):
    rotary_dim, window = LAYOUTS.get(arch, (None, None))
    factor_tensor = "rope_factors_long.weight" if case == "phi3_longrope" else None
    source = tiny_gguf(tmp_path / "in.gguf", arch, rotary_dim, window, factor_tensor)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = run_cli(capsys, "patch", source, *flags, "--factor", "4", "-o", tmp_path / "out.gguf")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_gemma3_yarn_on_its_full_layers_and_layer_types_full_are_accepted(tmp_path, capsys):
    source = tiny_gguf(tmp_path / "in.gguf", "gemma3", None, 8)
    code, _, err = run_cli(
        capsys, "patch", source, "--method", "yarn", "--factor", "8", "--layer-types", "full", "-o", tmp_path / "o"
    )
    assert code == 0, err
    assert gguf.GGUFReader(tmp_path / "o").get_field("gemma3.rope.scaling.factor").contents() == 8.0


def test_the_engine_table_maps_families_to_architectures_ctxext_writes():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ctxext.serving.engines import GGUF_ARCH

    assert set(GGUF_ARCH.values()) == set(ARCHITECTURES)
    assert all(model_type in CONFIG_MAPPING for model_type in GGUF_ARCH)


def test_a_patched_gemma2_checkpoint_is_exact_in_llama_cpp_and_a_per_pair_stablelm_is_not(tmp_path, capsys):
    from ctxext.serving.engines import engine_table, read_served_model
    from tests.family_models import build
    from tests.helpers import save_tiny_checkpoint

    rows = {}
    for family, method in (("gemma2", "yarn"), ("stablelm", "ntk_by_parts")):
        model, why = build(family)
        assert model is not None, why
        source = save_tiny_checkpoint(tmp_path / family, model)
        out = tmp_path / f"{family}-out"
        code, _, err = run_cli(capsys, "patch", source, "--method", method, "--factor", "4", "-o", out)
        assert code == 0, err
        rows[family] = {row.engine: row for row in engine_table(read_served_model(out))}["llama.cpp"]
    assert rows["gemma2"].level == "exact" and "llama.cpp's yarn" in rows["gemma2"].how
    assert rows["stablelm"].level == "no" and "only for the llama architecture" in rows["stablelm"].how
