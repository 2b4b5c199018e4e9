"""LoRA with PEFT, the LongLoRA way: adapters on the attention projections, embeddings and norms trained in full.

The adapter is a standard PEFT adapter: `PeftModel.from_pretrained(base, adapter_dir)` loads it, on a base
model patched with the same method (the rope change is not part of the adapter; `ctxext.yaml` says which).
Embeddings and norms are PEFT `modules_to_save`, so they are saved inside the adapter too.
"""

from __future__ import annotations

from peft import LoraConfig, get_peft_model
from torch import nn

from ..errors import CtxextError, did_you_mean


def check_target_modules(model: nn.Module, targets: list[str]) -> None:
    """Every LoRA target must name a Linear layer of the model, or the run stops before anything is written."""
    linear_leaves = sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear) and name}
    )
    for target in targets:
        if target not in linear_leaves:
            raise CtxextError(
                f"lora.target_modules: the model has no linear layer named '{target}'{did_you_mean(target, linear_leaves)};"
                f" its linear layers are: {', '.join(linear_leaves)}"
            )


def embedding_and_norm_names(model: nn.Module) -> list[str]:
    """Leaf names of the input embedding and of every normalisation layer (RMSNorm, LayerNorm, q/k norms)."""
    names = set()
    embeddings = model.get_input_embeddings()
    for name, module in model.named_modules():
        if module is embeddings or "norm" in type(module).__name__.lower() and name:
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def add_lora(
    model: nn.Module,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    train_embeddings_and_norms: bool = True,
):
    """Wrap `model` in a PeftModel; only the adapters (and embeddings/norms, if asked) require grad."""
    check_target_modules(model, target_modules)
    modules_to_save = embedding_and_norm_names(model) if train_embeddings_and_norms else None
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        modules_to_save=modules_to_save,
        # A tied LM head must stay tied to the embedding that is now trained.
        ensure_weight_tying=tied and bool(modules_to_save),
    )
    return get_peft_model(model, config)


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; PEFT's saved copies of embeddings/norms count once. Under DeepSpeed
    ZeRO-3 a parameter holds only this process's shard (numel() 0), and DeepSpeed keeps its full size in ds_numel."""
    trainable = sum(full_numel(p) for _, p in trainable_parameters(model))
    total = sum(full_numel(p) for name, p in model.named_parameters() if ".modules_to_save." not in name)
    return trainable, total


def full_numel(param) -> int:
    return getattr(param, "ds_numel", param.numel())
