"""What a fine-tuning run holds once it is set up (ctxext.train.setup builds both): the accelerate runtime and the
run itself. Every other module of ctxext.train reads these; none of them needs the module that builds them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from ..runtime import Processes
from .recipe import Recipe


@dataclass
class Runtime:
    accelerator: object
    processes: Processes
    precision: str  # fp32 | bf16-mixed | bf16
    weights_dtype: torch.dtype
    attn_implementation: str
    accumulation: int  # micro-steps per optimizer step, per process
    trackers: tuple[str, ...] = ()  # --report-to: tensorboard, wandb, mlflow (ctxext.train.trackers)
    sp_size: int = 1  # processes to a sequence (parallel.sp_size; ctxext.train.sequence_parallel)

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def sharded(self) -> bool:
        """FSDP and DeepSpeed shard parameters: every process must take part in every forward."""
        return self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


@dataclass
class Setup:
    recipe: Recipe
    runtime: Runtime
    model: object  # PeftModel, patched
    tokenizer: object
    train_data: object  # PackedSequences
    data_info: dict
    eval_documents: list
    eval_lengths: list[int]
    bos_token_id: int | None
    method_length: int
    output: Path
    model_path: str
    short_length: int | None = None  # mixed_window: tokens per short sequence (None: mixed-window is off)

    @property
    def mixed_window(self) -> bool:
        return self.short_length is not None
