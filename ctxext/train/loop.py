"""The fine-tuning loop: a patched model, LoRA, packed data, AdamW with the PI warm-up, in-loop perplexity.

Read it top to bottom: `finetune(recipe)` calls `prepare` (setup.py: checks all input before anything is written),
then `train`, whose loop is the whole story of a step: learning rate, `train_step` (micro-batches, backward, clip,
AdamW), log, evaluate (evaluation.py), checkpoint (checkpoints.py). It runs as one process, or under
`accelerate launch` (DDP, FSDP, DeepSpeed) with the same numbers: the global batch is fixed by the recipe, and
every process takes its share of every step's samples by index (batches.py).

The output directory:

    recipe.yaml          the resolved recipe          metrics.jsonl   one JSON line per log / evaluation
    run.json             environment, sizes, timing   metrics.png     perplexity against step
    checkpoints/step-N/  resumable state              adapter/        the PEFT adapter (+ ctxext.yaml)
    trackers/            TensorBoard's event files    merged/         base + LoRA folded in, rope config included
                         (--report-to tensorboard)

records.py writes the first column's files and metrics.*; checkpoints.py the checkpoints, adapter/ and merged/.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..patching.rotary import whole_sequence_length
from .batches import micro_batch
from .checkpoints import RunState, restore, save_checkpoint, save_results
from .evaluation import evaluate_before_training, log_evaluation
from .mixed_window import rotary_switch
from .recipe import Recipe
from .records import LossWindow, MetricsLog, open_run, plot_metrics, plot_title, start_trackers, write_run_record
from .sequence_parallel import sequence_parallel_group, slice_loss, slice_of_sequence, zero3_gradient_factor
from .setup import prepare, prepare_training
from .state import Setup


def finetune(
    recipe: Recipe, resume: bool = False, progress: bool = True, after_step=None, report_to=None
) -> tuple[Setup, list[dict]]:
    """Run a recipe end to end; returns the setup and the metrics records (on the main process).

    `after_step`: see `train`. `report_to`: trackers to log to as well, e.g. 'tensorboard' or
    ['wandb', 'mlflow'] (ctxext.train.trackers).
    """
    setup = prepare(recipe, resume, progress, report_to)
    records = train(setup, resume, progress, after_step)
    return setup, records


def train(setup: Setup, resume: bool, progress: bool = True, after_step=None) -> list[dict]:
    """Run the steps; `after_step(step)`, if given, is called after each optimizer step is logged, evaluated and
    checkpointed (1-based step)."""
    recipe, runtime = setup.recipe, setup.runtime
    max_steps = recipe.train.max_steps
    log = open_run(setup, resume)
    model, optimizer = prepare_training(setup)
    state = restore(setup, model, optimizer, log) if resume else RunState()
    start_trackers(setup, resume_step=state.step if resume else None)
    write_run_record(setup, model, resume, state.step)
    if state.step == 0 and recipe.eval.every:
        evaluate_before_training(setup, model, log)

    bar = progress_bar(setup, state.step, progress)
    window = LossWindow(recipe.train.global_batch_size * recipe.train_sequence_length)
    state.start_clock()
    model.train()
    for step in range(state.step, max_steps):
        lr = set_learning_rate(optimizer, recipe, step)
        loss = train_step(setup, model, optimizer, step)
        state.step, state.tokens = step + 1, state.tokens + window.tokens_per_step
        window.add(loss)
        bar.update(1)
        if due(state.step, recipe.train.log_every, max_steps):
            record = window.record(state.step, loss, lr, state.tokens)
            log.write(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}")
        with window.paused():  # evaluation and checkpoints do not count in the training tokens/s
            if recipe.eval.every and due(state.step, recipe.eval.every, max_steps):
                log_evaluation(setup, model, log, state.step, bar)
                model.train()
            every = recipe.train.checkpoint_every
            if every and state.step % every == 0 and state.step < max_steps:
                save_checkpoint(setup, model, optimizer, state.step, state.tokens, state.seconds())
                if runtime.is_main:
                    plot_metrics(log.read(), setup.output / "metrics.png", plot_title(setup))
        if after_step is not None:
            after_step(state.step)
    bar.close()
    return finish(setup, model, optimizer, log, state)


def train_step(setup: Setup, model, optimizer, step: int) -> float:
    """One optimizer step over the global batch, in micro-steps; its loss, the mean of every process's mean.
    Under mixed_window, a short micro-batch (at most L tokens a sequence) runs with the original rotary."""
    recipe, runtime = setup.recipe, setup.runtime
    accelerator = runtime.accelerator
    step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    unwrapped = accelerator.unwrap_model(model)
    for micro in range(runtime.accumulation):
        inputs = micro_batch(setup, step, micro)
        switched = rotary_switch(setup.mixed_window, unwrapped, setup.method_length)
        with accelerator.accumulate(model), switched:
            loss, sequence_loss = forward_loss(setup, model, unwrapped, inputs)
            accelerator.backward(loss)
            if accelerator.sync_gradients and recipe.optim.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), recipe.optim.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step_loss += sequence_loss.double() / runtime.accumulation
        del loss, inputs  # free this micro-step's graph remnants before the next forward
    return float(accelerator.reduce(step_loss, reduction="mean"))


def forward_loss(setup: Setup, model, unwrapped, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to backpropagate, the micro-batch's mean token loss, detached). Under sequence parallelism this
    process runs its slice of each sequence, with the whole sequence's length for the rotary's length rules, and
    backpropagates its share of the mean (ctxext.train.sequence_parallel)."""
    sp = setup.runtime.sp_size
    if sp == 1:
        loss = model(**inputs, use_cache=False).loss
        return loss, loss.detach()
    accelerator = setup.runtime.accelerator
    local, length = slice_of_sequence(inputs, accelerator.process_index % sp, sp)
    with whole_sequence_length(unwrapped, length):
        return slice_loss(model, local, sequence_parallel_group(), zero3_gradient_factor(accelerator, sp))


def finish(setup: Setup, model, optimizer, log: MetricsLog, state: RunState) -> list[dict]:
    """The last checkpoint, adapter/ and merged/, the plot; the trackers closed. Returns the metrics records."""
    save_checkpoint(setup, model, optimizer, state.step, state.tokens, state.seconds())
    save_results(setup, model)
    records = log.read() if setup.runtime.is_main else []
    if setup.runtime.is_main:
        plot_metrics(records, setup.output / "metrics.png", plot_title(setup))
    accelerator = setup.runtime.accelerator
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return records


# --------------------------------------------------------------------------------------- the schedule
def set_learning_rate(optimizer, recipe: Recipe, step: int) -> float:
    """Set and return the learning rate of optimizer step `step` (0-based)."""
    optim = recipe.optim
    lr = optim.lr * lr_factor(
        step, optim.warmup_steps, optim.warmup_start_factor, optim.schedule, recipe.train.max_steps
    )
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def lr_factor(step: int, warmup_steps: int, warmup_start_factor: float, schedule: str, max_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): PI's linear warm-up from 10%, then constant.

    PI: "linear learning rate warm-up of 20 steps beginning from 10% of the maximum learning rate".
    `cosine` decays to 10% of the peak at the last step instead of staying constant.
    """
    if warmup_steps and step < warmup_steps:
        return warmup_start_factor + (1.0 - warmup_start_factor) * step / warmup_steps
    if schedule == "cosine":
        progress = (step - warmup_steps) / max(1, max_steps - 1 - warmup_steps)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def due(step: int, every: int, max_steps: int) -> bool:
    """Whether something done every `every` steps (and after the last one) is due after 1-based `step`."""
    return step % every == 0 or step == max_steps


def progress_bar(setup: Setup, start_step: int, progress: bool):
    """The steps' progress bar, shown by the main process only."""
    return tqdm(
        total=setup.recipe.train.max_steps,
        initial=start_step,
        desc="fine-tuning",
        unit="step",
        disable=not (progress and setup.runtime.is_main),
        mininterval=2,
    )
