"""TRL's SFTTrainer on a model patched in memory (`ctxext.patch`, then `SFTTrainer(model=model, peft_config=...)`):
the adapter `trainer.save_model` writes reloads patched (ctxext/integrations/adapters.py).

The oracle is the trained model itself, in memory after `train()`: AutoPeftModelForCausalLM on the saved adapter,
and the merged model written by `ctxext.save_pretrained` and reloaded, must give its logits past L. fp32
(`bf16=False`): under bf16, accelerate leaves the trained model's forward in autocast, which no reload repeats.
"""

import pytest
import torch
from datasets import Dataset
from peft import AutoPeftModelForCausalLM, LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

import ctxext

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")

METHODS = {"yarn": {"factor": 4}, "self_extend": {"group_size": 4, "window": 16}}
MAX_LENGTH = 128  # twice L = 64: the patch matters


def documents(train_text: str) -> Dataset:
    """30 pieces of Hamlet of 60 to 400 characters (about 45 to 300 tokens): cut at MAX_LENGTH or padded to it."""
    sizes = [60 + (i * 97) % 340 for i in range(30)]
    starts = [sum(sizes[:i]) for i in range(30)]
    return Dataset.from_dict({"text": [train_text[s : s + n] for s, n in zip(starts, sizes)]})


def sft_run(checkpoint, texts, output, method: str, packing: bool) -> SFTTrainer:
    """4 steps of TRL's SFTTrainer with LoRA, batch 2, on the checkpoint patched in memory with `method`."""
    model = ctxext.patch(AutoModelForCausalLM.from_pretrained(checkpoint), method, **METHODS[method])
    args = SFTConfig(
        output_dir=str(output),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_length=MAX_LENGTH,
        packing=packing,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        seed=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=documents(texts[0].read_text()),
        processing_class=AutoTokenizer.from_pretrained(checkpoint),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    trainer.train()
    return trainer


def sample(checkpoint, texts) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return torch.tensor([tokenizer(texts[1].read_text()).input_ids[:200]])  # held-out text, past L


def logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens).logits


def assert_trained_model_reloads(trainer, checkpoint, texts, tmp_path):
    """The saved adapter (and a checkpoint-N/ one) reloads as the trained model; merged and reloaded too."""
    tokens = sample(checkpoint, texts)
    trainer.save_model(str(tmp_path / "adapter"))
    trained = logits(trainer.model, tokens)
    reloaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded, tokens), trained, rtol=0, atol=1e-5)
    assert (tmp_path / "out" / "checkpoint-2" / "ctxext.yaml").is_file()  # every checkpoint carries the patch

    merged = reloaded.merge_and_unload()
    torch.testing.assert_close(logits(merged, tokens), trained, rtol=0, atol=1e-5)
    ctxext.save_pretrained(merged, tmp_path / "merged")
    torch.testing.assert_close(
        logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), tokens), trained, rtol=0, atol=1e-5
    )
    # Training moved the model, and the unpatched base with the adapter is another model (what PEFT alone loads).
    (tmp_path / "adapter" / "ctxext.yaml").unlink()
    unpatched = logits(AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter"), tokens)
    assert (unpatched - trained).abs().max() > 1e-3  # 100 times the tolerance (measured: 3.6e-3 to 6.0e-3)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("method", list(METHODS))
def test_sft_on_a_patched_model_reloads_patched(finetune_checkpoint, finetune_texts, tmp_path, method, packing):
    trainer = sft_run(finetune_checkpoint, finetune_texts, tmp_path / "out", method, packing)
    assert_trained_model_reloads(trainer, finetune_checkpoint, finetune_texts, tmp_path)
