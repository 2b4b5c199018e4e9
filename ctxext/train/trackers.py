"""Experiment trackers for `ctxext finetune --report-to`: TensorBoard, Weights & Biases, MLflow.

They run through accelerate's tracking API (`Accelerator(log_with=..., project_dir=...)`, `init_trackers`,
`log`, `end_training`), on the main process only. Every record the run writes to metrics.jsonl goes to the
trackers too, as flat scalars at its step (`tracker_metrics`), and the resolved recipe is the run's config.

- TensorBoard writes its event files to OUTPUT/trackers/ctxext-finetune/; a resumed run hides what the killed
  run logged after its checkpoint (TensorBoard's purge_step), as metrics.jsonl drops it.
- W&B and MLflow log to the project / experiment `ctxext-finetune` and where their own settings point
  (`wandb login`, WANDB_*; MLFLOW_TRACKING_URI); the run is named after the output directory. A resumed run
  is a new run there unless their settings say to continue one (WANDB_RUN_ID + WANDB_RESUME, MLFLOW_RUN_ID).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from accelerate.utils import is_mlflow_available, is_tensorboard_available, is_wandb_available

from ..errors import CtxextError, did_you_mean

PROJECT = "ctxext-finetune"  # the W&B project, the MLflow experiment, TensorBoard's folder
TRACKERS_DIR = "trackers"  # under the run's output directory
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # tracker -> what to pip install


def tracker_names(report_to: str | Sequence[str] | None) -> tuple[str, ...]:
    """'tensorboard,wandb' (or a list of names) -> ('tensorboard', 'wandb'); None, '' and 'none' -> ().

    An unknown name, or a tracker whose package is not installed, is a one-line CtxextError.
    """
    if report_to is None:
        return ()
    items = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names = [item.strip().lower() for item in items if item.strip()]
    if names == ["none"]:
        return ()
    for name in names:
        if name not in PACKAGES:
            raise CtxextError(
                f"--report-to: unknown tracker '{name}'{did_you_mean(name, list(PACKAGES))}; "
                f"choose from {', '.join(PACKAGES)} (comma-separated), or none"
            )
        if not installed(name):
            raise CtxextError(
                f"--report-to {name} needs the {PACKAGES[name]} package: pip install {PACKAGES[name]} "
                "(or pip install 'ctxext[trackers]' for all three)"
            )
    return tuple(dict.fromkeys(names))


def installed(tracker: str) -> bool:
    """Whether accelerate finds the tracker's package (it would leave the tracker out, silently, otherwise)."""
    available = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available, "mlflow": is_mlflow_available}
    return bool(available[tracker]())


def tracker_config(mapping: dict, prefix: str = "") -> dict:
    """A nested recipe mapping as the flat {'lora.r': 4, ...} every tracker takes (TensorBoard's hparams want
    scalars: lists, mappings left after flattening and None are written as JSON text)."""
    flat = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(tracker_config(value, prefix=f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value)
    return flat


def tracker_metrics(record: dict) -> dict[str, float]:
    """One metrics.jsonl record as tracker scalars: train/loss, train/lr, ..., eval/perplexity_<length>."""
    kind = record["kind"]
    if kind == "train":
        keys = ("loss", "last_loss", "lr", "tokens", "tokens_per_second")
        return {f"train/{key}": record[key] for key in keys}
    if kind == "eval":
        return {f"eval/perplexity_{length}": value for length, value in record["perplexity"].items()}
    if kind == "base_reference":
        return {f"eval/base_perplexity_{record['length']}": record["perplexity"]}
    return {}


def tracker_options(output: Path, resume_step: int | None) -> dict:
    """accelerate's init_kwargs: the run named after the output directory; on resume, TensorBoard hides the
    events the killed run logged after `resume_step` (the checkpoint's step)."""
    options = {"wandb": {"name": output.name}, "mlflow": {"run_name": output.name}}
    if resume_step is not None:
        options["tensorboard"] = {"purge_step": resume_step + 1}
    return options


def start_trackers(accelerator, recipe_mapping: dict, output: Path, resume_step: int | None) -> None:
    """Open the trackers the Accelerator was made with (`log_with`), with the recipe as the run's config."""
    accelerator.init_trackers(
        PROJECT, config=tracker_config(recipe_mapping), init_kwargs=tracker_options(output, resume_step)
    )
