"""Models larger than one device (ctxext.dispatch): a tiny LLaMA placed by accelerate over "cpu" and "disk" scores
the perplexity of the same model on one device, under every kind of ctxext method, through the library and
`ctxext eval --device-map`; bad maps are one-line errors with exit code 2 that write nothing.

On this CPU-only machine accelerate's main device is the CPU: "cpu" modules stay in memory, "disk" ones sit on
the meta device and are read from the checkpoint's safetensors for each forward (by accelerate's hooks).
"""

import json

import pytest
import torch

import ctxext
from ctxext.dispatch import Placement, parse_device_map, parse_max_memory, placement_from_flags, uncovered_modules
from ctxext.errors import CtxextError
from ctxext.eval.perplexity import LM_HEAD_CHUNK, sliding_window_nll
from ctxext.loading import load_model
from tests.helpers import run_cli, save_tiny_checkpoint, tiny_model, write_documents

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")

# Every module of the 4-layer tiny LLaMA somewhere: the embeddings, two layers, the norm and the head on disk.
CPU_AND_DISK = {
    "model.embed_tokens": "disk",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.norm": "disk",
    "lm_head": "disk",
}
METHODS = [
    ("none", {}),
    ("yarn", {"factor": 2}),
    ("self_extend", {"factor": 2, "group_size": 2, "window": 16}),
    ("dual_chunk", {"factor": 2}),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random 4-layer LLaMA (hidden 64, 4 heads over 2 KV heads, vocabulary 256, L = 64) with a word tokenizer."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_model("llama", num_hidden_layers=4))


@pytest.fixture(scope="module")
def models(checkpoint):
    """(the model on one device, the same checkpoint dispatched over cpu and disk by accelerate), fp32."""
    plain = load_model(str(checkpoint), dtype=torch.float32, device="cpu")
    dispatched = load_model(str(checkpoint), dtype=torch.float32, placement=Placement(CPU_AND_DISK))
    return plain, dispatched


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1))


def scored(model, tokens, method, params, window=128, stride=64):
    """(NLL sum, tokens scored) of `model` patched with `method`, sliding windows as `ctxext eval` scores them."""
    if method != "none":
        ctxext.patch(model, method, **params)
    try:
        return sliding_window_nll(model, tokens, window, stride)
    finally:
        ctxext.unpatch(model)


def test_the_map_is_what_accelerate_placed(models):
    _, dispatched = models
    assert dispatched.hf_device_map == CPU_AND_DISK
    # disk-offloaded weights wait on the meta device; "cpu" ones stay in memory
    assert dispatched.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    assert dispatched.lm_head.weight.device.type == "meta"
    assert dispatched.model.layers[2].self_attn.q_proj.weight.device.type == "cpu"


@pytest.mark.parametrize("method,params", METHODS, ids=[m for m, _ in METHODS])
def test_perplexity_over_cpu_and_disk_equals_the_model_on_one_device(models, tokens, method, params):
    plain, dispatched = models
    want_nll, want_count = scored(plain, tokens, method, params)
    got_nll, got_count = scored(dispatched, tokens, method, params)
    assert got_count == want_count == 299
    assert got_nll == pytest.approx(want_nll, rel=1e-5, abs=0)
    if method != "none":  # the method changed the numbers: the patch was in place on the dispatched model
        assert got_nll != pytest.approx(scored(dispatched, tokens, "none", {})[0], rel=1e-6)


def test_a_patched_dispatched_models_rotary_stays_off_the_meta_device(models):
    _, dispatched = models
    ctxext.patch(dispatched, "dual_chunk", factor=2)
    try:
        rotary = dispatched.model.rotary_emb
        assert all(t.device.type == "cpu" for t in rotary.original.buffers())
    finally:
        ctxext.unpatch(dispatched)
    assert dispatched.model.rotary_emb.inv_freq.device.type == "cpu"  # unpatched: the model's own, still real


def test_the_head_sees_at_most_one_chunk_of_positions_under_dispatch(models):
    """A 600-token window scores 599 tokens: the LM head (offloaded to disk) gets them LM_HEAD_CHUNK at a time,
    never the whole window's logits, and the sum is the undispatched model's."""
    plain, dispatched = models
    long = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(2))
    rows = []
    hook = dispatched.lm_head.register_forward_hook(lambda module, args, output: rows.append(output.shape))
    try:
        got = scored(dispatched, long, "yarn", {"factor": 2}, window=600, stride=600)
    finally:
        hook.remove()
    assert [shape[0] for shape in rows] == [LM_HEAD_CHUNK, LM_HEAD_CHUNK, 599 - 2 * LM_HEAD_CHUNK]
    assert got[0] == pytest.approx(scored(plain, long, "yarn", {"factor": 2}, window=600, stride=600)[0], rel=1e-5)


# --------------------------------------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(3))
    return write_documents(tmp_path_factory.mktemp("texts"), ids)


def eval_cli(capsys, checkpoint, texts, out, *extra):
    return run_cli(
        capsys,
        "eval",
        checkpoint,
        "--method",
        "yarn",
        "--method",
        "dual_chunk",
        "--factor",
        "2",
        "--lengths",
        "64,128",
        "--stride",
        "32",
        "--text-file",
        texts,
        "--dtype",
        "fp32",
        "--no-progress",
        "--no-cache",
        "-o",
        out,
        *extra,
    )


def result_rows(out) -> dict:
    results = json.loads((out / "results.json").read_text())
    return {(r["method"], r["length"]): r for r in results["results"]}


def test_eval_with_a_device_map_gives_the_numbers_of_eval_without(checkpoint, texts, tmp_path, capsys):
    code, _, err = eval_cli(capsys, checkpoint, texts, tmp_path / "one")
    assert code == 0, err
    code, printed, err = eval_cli(capsys, checkpoint, texts, tmp_path / "map", "--device-map", json.dumps(CPU_AND_DISK))
    assert code == 0, err
    assert "device map: 2 modules on cpu, 5 modules on disk" in printed
    want, got = result_rows(tmp_path / "one"), result_rows(tmp_path / "map")
    assert set(got) == set(want) and len(want) == 6  # none, yarn, dual_chunk at 64 and 128
    for key, row in want.items():
        assert got[key]["tokens_scored"] == row["tokens_scored"]
        assert got[key]["nll_sum"] == pytest.approx(row["nll_sum"], rel=1e-5, abs=0), key
    model = json.loads((tmp_path / "map" / "results.json").read_text())["model"]
    assert model["placement"]["device_map"] == CPU_AND_DISK and model["placement"]["placed"] == CPU_AND_DISK


def test_eval_with_auto_and_a_tiny_memory_limit_offloads_everything_to_disk(checkpoint, texts, tmp_path, capsys):
    """--device-map auto with 200 kB of CPU memory: transformers' strategy puts the whole model on disk."""
    code, _, err = eval_cli(capsys, checkpoint, texts, tmp_path / "one")
    assert code == 0, err
    code, printed, err = eval_cli(
        capsys, checkpoint, texts, tmp_path / "auto", "--device-map", "auto", "--max-memory", "cpu=200000"
    )
    assert code == 0, err
    assert "device map: 1 module on disk" in printed
    model = json.loads((tmp_path / "auto" / "results.json").read_text())["model"]
    assert model["placement"] == {"device_map": "auto", "max_memory": {"cpu": 200000}, "placed": {"": "disk"}}
    want, got = result_rows(tmp_path / "one"), result_rows(tmp_path / "auto")
    for key, row in want.items():
        assert got[key]["nll_sum"] == pytest.approx(row["nll_sum"], rel=1e-5, abs=0), key


def without(name: str) -> str:
    return json.dumps({k: v for k, v in CPU_AND_DISK.items() if k != name})


def with_device(name: str, device) -> str:
    return json.dumps({**CPU_AND_DISK, name: device})


BAD_FLAGS = {
    "a layer missing": (["--device-map", without("model.layers.2")], "gives no device to 'model.layers.2'"),
    "a GPU not here": (["--device-map", with_device("model.layers.2", "cuda:3")], "'cuda:3' does not exist here"),
    "a GPU index not here": (["--device-map", with_device("lm_head", 3)], "GPU 3 does not exist here"),
    "no such module": (["--device-map", with_device("model.layer.2", "cpu")], "'model.layer.2' is not a module"),
    "not JSON": (["--device-map", '{"model.embed_tokens": cpu}'], "is not valid JSON"),
    "not a map": (["--device-map", "everywhere"], "is neither auto, balanced, sequential"),
    "more memory than exists": (["--device-map", "auto", "--max-memory", "cpu=100000GiB"], "which has"),
    "a size that is not one": (["--device-map", "auto", "--max-memory", "cpu=20G"], "'20G' for cpu is not a size"),
    "limits without pairs": (["--device-map", "auto", "--max-memory", "cpu:20GiB"], "is not DEVICE=SIZE"),
    "limits without a map": (["--max-memory", "cpu=1GiB"], "add --device-map auto"),
    "limits on an explicit map": (
        ["--device-map", json.dumps(CPU_AND_DISK), "--max-memory", "cpu=1GiB"],
        "drop --max-memory",
    ),
    "a device too": (["--device-map", "auto", "--device", "cpu"], "drop --device"),
}


@pytest.mark.parametrize("flags,message", BAD_FLAGS.values(), ids=list(BAD_FLAGS))
def test_a_bad_map_is_one_line_with_exit_2_and_writes_nothing(checkpoint, texts, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    code, _, err = eval_cli(capsys, checkpoint, texts, out, *flags)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("ctxext eval: error: "), err
    assert message in err
    assert not out.exists()


def test_check_checks_a_map_against_the_models_architecture(checkpoint, tmp_path, capsys):
    code, _, err = run_cli(capsys, "check", "--model", checkpoint, "--device-map", without("lm_head"), "--lengths", "")
    assert code == 2 and err.count("\n") == 1 and "gives no device to 'lm_head'" in err
    code, _, err = run_cli(capsys, "check", "--device-map", "auto", "--lengths", "")
    assert code == 2 and "give --model" in err


# ------------------------------------------------------------------------------------------ the parsing
def test_the_flags_parse_as_accelerate_takes_them(tmp_path):
    assert parse_max_memory("0=20GiB, cuda:1=512MiB,cpu=1000") == {0: 20 * 2**30, 1: 512 * 2**20, "cpu": 1000}
    assert parse_max_memory('{"0": "1GB", "cpu": 5}') == {0: 10**9, "cpu": 5}
    assert parse_device_map("sequential") == "sequential"
    path = tmp_path / "map.json"
    path.write_text(json.dumps(CPU_AND_DISK))
    assert parse_device_map(str(path)) == CPU_AND_DISK
    assert placement_from_flags(None, None) is None
    assert placement_from_flags("balanced", "cpu=1GiB") == Placement("balanced", {"cpu": 2**30})
    with pytest.raises(CtxextError, match="the device of 'lm_head' is true"):
        parse_device_map('{"lm_head": true}')


def test_the_uncovered_weights_are_named_by_their_outermost_module():
    weights = [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.up.weight",
        "model.layers.1.mlp.up.weight",
        "lm_head.weight",
    ]
    assert uncovered_modules({"model.embed_tokens": 0, "model.layers.0": 0}, weights) == ["model.layers.1", "lm_head"]
    assert uncovered_modules({"model": 0}, weights) == ["lm_head"]
    assert uncovered_modules({"": "cpu"}, weights) == []
