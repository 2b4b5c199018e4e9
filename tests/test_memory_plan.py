"""`ctxext finetune --plan` (ctxext.train.memory_plan) against independent counts.

Oracles: transformers' own parameter count of tiny random models (Llama with GQA, tied embeddings, Qwen2's
biases, Qwen3's q/k norms), PEFT's own count of trainable parameters after ctxext's add_lora, the bytes autograd
saves for backward in a real forward (saved_tensors_hooks), Llama-3-8B's published 8.03B parameters, and
hand-written arithmetic for the sharding rules (sp, tp, ZeRO)."""

import dataclasses
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ctxext.train import memory_plan as mp
from ctxext.train.lora import add_lora
from tests.helpers import run_cli

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
SMALL = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
LLAMA3_8B = mp.ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)


def small_llama(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=tied, attn_implementation="sdpa"))


def settings(**changes) -> mp.PlanSettings:
    base = mp.PlanSettings(
        micro_batch=2, seq_len=256, precision="fp32", gradient_checkpointing=False, lora_r=8, lora_targets=ATTENTION
    )
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    "model",
    [
        lambda: small_llama(),
        lambda: small_llama(tied=True),
        lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=False)),
        lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, tie_word_embeddings=True)),
    ],
    ids=["llama-gqa", "llama-tied", "qwen2-bias", "qwen3-qk-norm"],
)
def test_the_parameter_count_is_the_real_models(model):
    built = model()
    assert mp.model_parameters(mp.shape_from_config(built.config)) == built.num_parameters()


def test_llama3_8b_has_its_published_parameter_count():
    assert mp.model_parameters(LLAMA3_8B) == 8_030_261_248


@pytest.mark.parametrize("targets", [ATTENTION, ALL_LINEAR])
@pytest.mark.parametrize("full", [True, False])
def test_trainable_parameters_are_peft_s_count(targets, full):
    base = small_llama()
    shape = mp.shape_from_config(base.config)
    peft_model = add_lora(base, 4, 8, 0.05, list(targets), full)
    trainable, _ = peft_model.get_nb_trainable_parameters()
    adapters = sum(p.numel() for name, p in peft_model.named_parameters() if "lora_" in name)
    assert mp.trainable_parameters(shape, 4, targets, full) == trainable
    assert mp.lora_parameters(shape, 4, targets) == adapters


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_activations_are_what_autograd_saves(precision):
    """The per-layer formula, the saved log-softmax and autocast's bf16 weight copies against the bytes of every
    storage autograd keeps for backward (parameters excluded), in fp32 and under bf16 autocast."""
    model = add_lora(small_llama(), 8, 16, 0.05, list(ATTENTION), True)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, SMALL["vocab_size"], (2, 256), generator=torch.Generator().manual_seed(0))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")
    with autocast, torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    del loss
    plan = settings(precision=precision)
    shape = mp.shape_from_config(model.config)
    log_softmax = 2 * 256 * shape.vocab * 4
    expected = mp.activations(shape, plan, False) + log_softmax + mp.autocast_weight_copies(shape, plan)
    assert sum(saved.values()) == pytest.approx(expected, rel=0.04)  # 1.6% more than the formula here


def test_sequence_parallel_splits_activations_and_logits_not_weights():
    one, four = mp.estimate(LLAMA3_8B, settings(seq_len=65536)), mp.estimate(LLAMA3_8B, settings(seq_len=65536, sp=4))
    for piece in ("activations", "logits_and_loss"):
        assert four[piece] == pytest.approx(one[piece] / 4)
    assert four["weights"] == one["weights"] and four["optimizer"] == one["optimizer"]


def test_tensor_parallel_and_zero_shard_as_documented():
    trainable = mp.trainable_parameters(LLAMA3_8B, 8, ATTENTION, True)
    plain = mp.estimate(LLAMA3_8B, settings(precision="bf16"))
    assert plain["weights"] == 8_030_261_248 * 2
    assert plain["optimizer"] == trainable * 8 and plain["gradients"] == trainable * 4
    tp2 = mp.estimate(LLAMA3_8B, settings(precision="bf16", tp=2))
    assert tp2["weights"] == plain["weights"] / 2
    zero2 = mp.estimate(LLAMA3_8B, settings(precision="bf16", sp=4, zero=2))
    assert zero2["weights"] == plain["weights"] and zero2["optimizer"] == trainable * 8 / 4
    zero3 = mp.estimate(LLAMA3_8B, settings(precision="bf16", sp=4, zero=3))
    assert zero3["weights"] == plain["weights"] / 4


def test_logits_are_the_full_vocabulary_in_fp32_with_gradients():
    """b s V: the fp32 logits (or log-softmax), the NLL's gradient and the logits' gradient, 4 bytes each."""
    assert mp.estimate(LLAMA3_8B, settings(seq_len=8192))["logits_and_loss"] == 2 * 8192 * 128256 * 12


def test_checkpointing_keeps_one_input_per_layer_and_one_layer():
    shape, plan = LLAMA3_8B, settings(seq_len=4096)
    per_layer = mp.layer_bytes_per_token(shape, plan)
    assert mp.activations(shape, plan, True) == 2 * 4096 * (32 * 4096 * 4 + per_layer)
    assert mp.activations(shape, plan, False) == 32 * 2 * 4096 * per_layer


def test_the_table_marks_what_does_not_divide_the_heads():
    rows = mp.parallel_table(LLAMA3_8B, settings(precision="bf16", seq_len=65536, micro_batch=1))
    invalid = {(r["sp"], r["tp"]) for r in rows if r["peak_bytes"] is None}
    assert invalid == {(8, 8)}
    peaks = {(r["sp"], r["tp"]): r["peak_bytes"] for r in rows if r["peak_bytes"] is not None}
    assert peaks[(8, 1)] < peaks[(4, 1)] < peaks[(2, 1)] < peaks[(1, 1)]


def test_the_cli_prints_the_plan_and_rejects_bad_input(capsys, tmp_path):
    config = tmp_path / "model"
    small_llama().config.save_pretrained(config)
    recipe = ["--recipe", "configs/recipes/tiny-cpu.yaml", f"model={config}", "seq_len=1024"]
    code, out, err = run_cli(capsys, "finetune", *recipe, "--plan", "--zero", "2")
    assert code == 0, err
    assert "logits + loss" in out and "sp=8" in out and "tp=8" in out and "zero=2" in out
    code, out, _ = run_cli(capsys, "finetune", *recipe, "--plan", "--json")
    plan = json.loads(out)
    assert plan["parameters"]["total"] == small_llama().num_parameters() and len(plan["table"]) == 16
    code, out, err = run_cli(capsys, "finetune", *recipe, "--plan", "--tp", "3")
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and "does not divide" in err
    code, _, err = run_cli(capsys, "finetune", *recipe, "--tp", "2")
    assert code == 2 and "--plan" in err


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_peak_is_the_larger_moment(checkpointing):
    """At the loss: what is saved (every layer, or only each layer's input) plus the logits; in the layers'
    backward: the activations plus one layer's attention working set. Static state adds to both."""
    plan = settings(seq_len=8192, micro_batch=1, gradient_checkpointing=checkpointing, precision="bf16")
    pieces = mp.estimate(LLAMA3_8B, plan)
    static = pieces["weights"] + pieces["trainable"] + pieces["gradients"] + pieces["optimizer"]
    kept = 32 * 8192 * 4096 * 2 if checkpointing else pieces["activations"]
    at_loss = kept + 8192 * 128256 * 14
    assert pieces["peak"] == max(at_loss, pieces["activations"] + pieces["attention_working_set"]) + static
