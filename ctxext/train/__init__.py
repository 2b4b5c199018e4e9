"""Fine-tuning for longer contexts: LoRA recipes (PEFT + accelerate), PoSE positions, and the tiny model of the
miniature Position Interpolation experiment. The command line is `ctxext finetune` (see `cli.py`)."""

__all__: list[str] = []  # nothing at the package level: its modules are the surface
