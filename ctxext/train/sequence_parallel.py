"""Sequence parallelism for `ctxext finetune` (recipe key `parallel.sp_size: N`): DeepSpeed's ALST/Ulysses, set up
by accelerate (`ParallelismConfig(sp_backend="deepspeed")`), for sequences longer than one device holds.

A step under it, with N processes to a sequence (an SP group: N consecutive ranks, as DeepSpeed groups them):

- every process of a group takes the same samples (batches.py: its data-parallel rank is rank // N) and keeps
  slice r of each sequence: its tokens, their global position ids, and the labels shifted by one *before* the
  sequence is cut (`slice_of_sequence`);
- the rotary runs on each slice at its global positions, and every length-dependent rule (dynamic NTK's base,
  longrope's short or long factors, the mixed window, PoSE's longest position) reads the whole sequence's length
  (`ctxext.patching.rotary.whole_sequence_length`), not the slice's;
- in every layer Ulysses trades sequence for heads (all-to-all): each process attends over the whole sequence for
  1/N of the heads, with the attention function the model is registered with. For an attention-level method that
  is ctxext's own (SelfExtend, Dual Chunk, ReRoPE...; `ctxext_sdpa`), so those run on whole sequences, unchanged;
  accelerate accepts only sdpa/flash names, so the model's own name is handed to DeepSpeed here
  (`hand_attention_to_ulysses`);
- each process's loss is its slice's summed token loss over the whole sequence's token count (`slice_loss`), so
  that DeepSpeed's sum of the group's gradients is the gradient of the sequence's mean loss.

Evaluation runs without it: accelerate registers Ulysses with disable_in_eval, so in eval mode every process
scores whole windows itself.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig

from ..compat import attention_implementation
from ..errors import CtxextError
from ..extras import require
from ..patching.families import rotary_host
from ..patching.record import model_rope_record
from ..patching.rotary import ScaledRotaryEmbedding
from ..runtime import launched_deepspeed

IGNORE = -100  # the label of a token that is not scored


def parallelism_config(sp_size: int, world_size: int) -> ParallelismConfig | None:
    """accelerate's config for DeepSpeed Ulysses over groups of `sp_size` processes (None when off)."""
    if sp_size == 1:
        return None
    check_launch(sp_size, world_size)
    # accelerate validates the attention's name against sdpa/flash only; the model's own (ctxext's wrapper, for
    # an attention-level method) replaces it before `prepare` (`hand_attention_to_ulysses`)
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    return ParallelismConfig(
        sp_backend="deepspeed", sp_size=sp_size, dp_shard_size=world_size // sp_size, sp_handler=handler
    )


def check_launch(sp_size: int, world_size: int) -> None:
    """Ulysses runs inside DeepSpeed, over a whole number of groups of sp_size processes."""
    require("deepspeed", f"parallel.sp_size={sp_size}")
    if not launched_deepspeed():
        raise CtxextError(
            f"parallel.sp_size={sp_size} runs under DeepSpeed: launch with `accelerate launch --config_file "
            "configs/accelerate/deepspeed-zero2.yaml` (deepspeed-zero2-cpu.yaml without GPUs) and "
            f"a multiple of {sp_size} processes"
        )
    if world_size % sp_size:
        raise CtxextError(
            f"parallel.sp_size={sp_size} must divide the number of processes ({world_size}): each sequence is "
            f"split over {sp_size} of them"
        )


def check_model(model, sp_size: int, attn_implementation: str) -> None:
    """Refuse, before anything is written, what Ulysses or the whole-length rule cannot honour for this model."""
    if sp_size == 1:
        return
    heads, kv_heads = head_counts(model)
    if heads % sp_size or not (kv_heads % sp_size == 0 or sp_size % kv_heads == 0):
        raise CtxextError(
            f"parallel.sp_size={sp_size} must divide the model's {heads} attention heads and divide (or be a "
            f"multiple of) its {kv_heads} key/value heads: Ulysses gives each process a share of the heads"
        )
    if attn_implementation in ("eager", "ctxext_eager"):
        raise CtxextError(
            "parallel.sp_size needs train.attn_implementation sdpa or flash_attention_2 (Ulysses builds no "
            "attention mask, and eager attention needs one)"
        )
    own = model_rope_record(model).full.parameters.get("rope_type", "default")
    if not isinstance(rotary_host(model).rotary_emb, ScaledRotaryEmbedding) and ("dynamic" in own or own == "longrope"):
        raise CtxextError(
            f"parallel.sp_size: the model's own '{own}' rotary reads the length from each process's slice of the "
            f"sequence; patch it with ctxext's method (method: {own.replace('dynamic', 'dynamic_ntk')}), whose rotary "
            "is told the whole length"
        )


def head_counts(model) -> tuple[int, int]:
    """(query heads, key/value heads) of the model's text config (a config without the latter: one per head)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def hand_attention_to_ulysses(accelerator, model) -> None:
    """Have accelerate register Ulysses around the attention function the model runs with (e.g. `ctxext_sdpa`,
    ctxext's own for an attention-level method), which its validator would not accept by name. Ulysses sets its
    groups up through deepspeed.comm before DeepSpeed's engine exists, so deepspeed.comm is joined to the
    processes' group here (accelerate does so only where it set the group up itself, on GPUs)."""
    import deepspeed  # noqa: PLC0415 (optional: the deepspeed extra)

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    parallelism = accelerator.parallelism_config
    parallelism.sp_handler.sp_attn_implementation = attention_implementation(model.config)
    if parallelism.sp_size > head_counts(model)[1]:  # Ulysses replicates the key/value heads
        keep_head_groups_for_evaluation(model)


def keep_head_groups_for_evaluation(model) -> None:
    """Where the SP group is larger than the model's key/value heads (the only case where this is installed),
    Ulysses replicates them and, in a training
    forward, sets each attention module's `num_key_value_groups` to the replicated ratio, for good (DeepSpeed
    0.19.8, UlyssesSPAttentionHF.forward); an evaluation forward, which bypasses Ulysses, would then pair 2 query
    heads with 1 key head. A pre-hook puts the model's own ratio back before every forward in eval mode."""
    for module in model.modules():
        groups = getattr(module, "num_key_value_groups", None)
        if isinstance(groups, int) and hasattr(module, "layer_idx"):
            module.register_forward_pre_hook(functools.partial(_own_head_groups, groups=groups))


def _own_head_groups(module, args, groups: int) -> None:
    if not module.training:
        module.num_key_value_groups = groups


def sequence_parallel_group():
    """The process group of this process's SP group (DeepSpeed's, set up by accelerate's `prepare`)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp  # noqa: PLC0415 (optional: the deepspeed extra)

    return parallel_state_sp.get_sequence_parallel_group()


def slice_of_sequence(inputs: dict, sp_rank: int, sp_size: int) -> tuple[dict, int]:
    """(this process's model inputs, the whole sequence's length) from a micro-batch's whole-sequence inputs
    {input_ids, labels[, position_ids, attention_mask]}: slice `sp_rank` of N of the tokens and of their global
    position ids, and `shift_labels`, the labels shifted by one over the whole sequence and then sliced (the
    label of a slice's last token is the next slice's first token). No attention mask: Ulysses drops it, and
    positions carry what it said (PoSE's gaps, one text)."""
    input_ids, labels = inputs["input_ids"], inputs["labels"]
    length = input_ids.shape[1]
    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=input_ids.device).expand_as(input_ids)
    shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    width = length // sp_size
    part = slice(sp_rank * width, (sp_rank + 1) * width)
    # contiguous: a column slice of several rows is a strided view, and the loss flattens its labels with view()
    local = {
        "input_ids": input_ids[:, part].contiguous(),
        "position_ids": positions[:, part].contiguous(),
        "shift_labels": shift_labels[:, part].contiguous(),
    }
    return local, int(positions.max()) + 1


def zero3_gradient_factor(accelerator, sp_size: int) -> int:
    """What the loss is multiplied by so that DeepSpeed's reduced gradient is the sequence's mean-loss gradient.

    ZeRO stages 0-2 sum the gradients of an SP group's processes (they divide by the data-parallel size only).
    ZeRO-3's default reduce-scatter divides by SP x DP processes (DeepSpeed 0.19.8: stage3.py `__avg_scatter_grads`
    through `reduce_scatter_coalesced`, with no SP term), which would make every gradient 1/sp of it; so there
    the loss is multiplied by sp. tests/test_sequence_parallel.py holds both stages to one process's gradients,
    so a DeepSpeed that changes this is caught."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    zero = plugin.deepspeed_config.get("zero_optimization", {}) if plugin is not None else {}
    return sp_size if zero.get("stage") == 3 and zero.get("reduce_scatter", True) else 1


def slice_loss(model, inputs: dict, group, factor: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to backpropagate, the sequence's mean token loss) of one process's slice: its summed token loss
    over the token count of the whole group, with the model's own loss function (it reads `shift_labels`), times
    `factor` (`zero3_gradient_factor`)."""
    shift_labels = inputs["shift_labels"]
    tokens = (shift_labels != IGNORE).sum()
    dist.all_reduce(tokens, group=group)
    logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False).logits
    unwrapped = getattr(model, "module", model)
    loss = unwrapped.loss_function(
        logits=logits,
        labels=None,
        shift_labels=shift_labels,
        vocab_size=unwrapped.config.get_text_config().vocab_size,
        num_items_in_batch=tokens,
    )
    whole = loss.detach().clone()
    dist.all_reduce(whole, group=group)
    return loss * factor, whole
