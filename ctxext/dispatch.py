"""Models larger than one device: accelerate's big-model dispatch (`--device-map`, `--max-memory`) for the commands
that load a model to evaluate it (eval, passkey, tasks, compare, search; `check --model` checks a map).

transformers' `from_pretrained(device_map=..., max_memory=..., offload_folder=...)` does the work: for a strategy
(auto, balanced, sequential) it computes the map with accelerate's `get_balanced_memory`/`infer_auto_device_map`,
then `dispatch_model` places the weights and hooks every module. A module mapped to "cpu" or "disk" is offloaded:
its weights wait in CPU memory or on disk (the checkpoint's own safetensors, or the offload folder) and are brought
to accelerate's main device (a GPU of the map) for each forward; where the map names no GPU the main device is the
CPU, so on a CPU-only machine "cpu" modules simply stay in memory and "disk" ones are read for each forward.
Inputs may start on any device: the hooks move them to each module's execution device.

Here: the flags parsed (`placement_from_flags`), a placement checked against the machine (`check_machine`) and an
explicit map against the model's architecture (`check_placement`) before any weight loads, the arguments for
`from_pretrained` (`Placement.loading_arguments`), and where the tensors of a dispatched model are (`held_device`,
`input_device`).
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil  # accelerate's own dependency: how much CPU memory exists
import torch
from accelerate import init_empty_weights
from accelerate.utils import check_device_map, convert_file_size_to_int
from torch import nn
from transformers import AutoModelForCausalLM

from .errors import CtxextError, did_you_mean

STRATEGIES = ("auto", "balanced", "sequential")  # transformers' strategies; auto is balanced
OFFLOADED = ("cpu", "disk")  # a map's devices whose modules run on the execution device (accelerate's offload)
MAP_EXAMPLE = '{"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": 0, "lm_head": 0}'
SIZE_EXAMPLE = "20GiB, 500MiB or 16GB"
SHOWN = 4  # names listed in an error before "... (N in all)"


@dataclass(frozen=True)
class Placement:
    """Where accelerate puts a model: a strategy (auto, balanced, sequential) with optional per-device limits
    (`max_memory`, bytes by device: GPU index, "cpu", "mps"), or an explicit map, module name -> device."""

    device_map: str | dict
    max_memory: dict | None = None

    @property
    def explicit(self) -> bool:
        return isinstance(self.device_map, dict)

    def loading_arguments(self, offload_folder: str) -> dict:
        """What `from_pretrained` takes: the map (or strategy), the limits and where offloaded weights may go."""
        return {"device_map": self.device_map, "max_memory": self.max_memory, "offload_folder": offload_folder}

    def describe(self) -> dict:
        """For results.json: the map or strategy as asked (the map placed is the model's `hf_device_map`)."""
        limits = None if self.max_memory is None else {str(k): v for k, v in self.max_memory.items()}
        return {"device_map": self.device_map, "max_memory": limits}


# ------------------------------------------------------------------------------------------------ the flags
def placement_from_flags(device_map: str | None, max_memory: str | None) -> Placement | None:
    """The Placement `--device-map` and `--max-memory` ask for (None: neither given: one device, `--device`)."""
    if device_map is None:
        if max_memory is not None:
            raise CtxextError(
                "--max-memory limits what --device-map auto/balanced/sequential puts on each device: add --device-map auto"
            )
        return None
    placement = Placement(parse_device_map(device_map), None if max_memory is None else parse_max_memory(max_memory))
    if placement.explicit and placement.max_memory is not None:
        raise CtxextError(
            "--max-memory applies to --device-map auto/balanced/sequential; an explicit map already says where each "
            "module goes: drop --max-memory, or use --device-map auto"
        )
    return placement


def parse_device_map(text: str) -> str | dict:
    """'auto', 'balanced', 'sequential', a JSON object (module name -> device) or the path of a JSON file."""
    text = text.strip()
    if text in STRATEGIES:
        return text
    if text.startswith("{"):
        return _map_from_json(text, "--device-map")
    path = Path(text).expanduser()
    if not path.is_file():
        raise CtxextError(
            f"--device-map '{text}' is neither auto, balanced, sequential, a JSON object nor a JSON file; "
            f"e.g. --device-map auto, or --device-map '{MAP_EXAMPLE}'"
        )
    return _map_from_json(path.read_text(), f"--device-map {path}")


def _map_from_json(text: str, source: str) -> dict:
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as error:
        raise CtxextError(
            f"{source} is not valid JSON ({error.msg}, line {error.lineno} column {error.colno}); write an object "
            f"of module name -> device, e.g. '{MAP_EXAMPLE}'"
        ) from None
    if not isinstance(mapping, dict) or not mapping:
        raise CtxextError(f"{source} must be a non-empty JSON object of module name -> device, e.g. '{MAP_EXAMPLE}'")
    for name, device in mapping.items():
        if isinstance(device, bool) or not isinstance(device, (str, int)):
            raise CtxextError(
                f"{source}: the device of '{name}' is {json.dumps(device)}; a device is a GPU index (0), a name "
                "(cuda:1, mps, cpu) or disk"
            )
    return dict(mapping)


def parse_max_memory(text: str) -> dict:
    """'0=20GiB,1=20GiB,cpu=60GiB' or the same as a JSON object -> {0: bytes, 1: bytes, 'cpu': bytes}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            pairs = json.loads(text)
        except json.JSONDecodeError as error:
            raise CtxextError(
                f'--max-memory is not valid JSON ({error.msg}); e.g. \'{{"0": "20GiB", "cpu": "60GiB"}}\''
            ) from None
        if not isinstance(pairs, dict):
            raise CtxextError('--max-memory as JSON must be an object of device -> size, e.g. \'{"0": "20GiB"}\'')
        items = [(str(key), value) for key, value in pairs.items()]
    else:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts or any("=" not in part for part in parts):
            raise CtxextError(f"--max-memory '{text}' is not DEVICE=SIZE,...; e.g. 0=20GiB,cpu=60GiB")
        items = [tuple(side.strip() for side in part.split("=", 1)) for part in parts]
    limits = {}
    for key, value in items:
        limits[memory_device(key)] = memory_size(key, value)
    return limits


def memory_device(key: str) -> int | str:
    """A --max-memory device as accelerate names it: a GPU index (from '0' or 'cuda:0'), 'cpu' or 'mps'."""
    if key.isdigit():
        return int(key)
    if key.startswith("cuda:") and key[5:].isdigit():
        return int(key[5:])
    if key in ("cpu", "mps"):
        return key
    raise CtxextError(
        f"--max-memory: '{key}' is not a device; use GPU indices (0, 1, ... or cuda:N), cpu or mps (what fits "
        "on none of them goes to disk)"
    )


def memory_size(key: str, value) -> int:
    """Bytes from a size such as 20GiB (accelerate's `convert_file_size_to_int`), or a whole number of bytes."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise CtxextError(f"--max-memory: the size for {key} is {json.dumps(value)}; write it like {SIZE_EXAMPLE}")
    try:
        return convert_file_size_to_int(value.strip() if isinstance(value, str) else value)
    except ValueError:
        raise CtxextError(f"--max-memory: '{value}' for {key} is not a size; write it like {SIZE_EXAMPLE}") from None


# ------------------------------------------------------------------------------------ the machine and the model
def check_machine(placement: Placement | None, device: str, world_size: int) -> None:
    """Refuse, in one line, a placement this machine or this run cannot take: --device given too (the map says
    where the model goes), several processes (each would place a copy on the same devices), a device that is
    not here, more memory than a device has. Nothing is loaded yet."""
    if placement is None:
        return
    if device != "auto":
        raise CtxextError(
            f"--device {device} and --device-map both say where the model goes; drop --device (the map places "
            "every module)"
        )
    if world_size > 1:
        raise CtxextError(
            f"--device-map spreads one model over this machine's devices, but {world_size} processes were "
            "launched (each would place its own copy on the same devices): run one process"
        )
    devices = list(placement.device_map.values()) if placement.explicit else list(placement.max_memory or {})
    for name in devices:
        problem = device_problem(name)
        if problem is not None:
            raise CtxextError(f"{'--device-map' if placement.explicit else '--max-memory'}: {problem}")
    for name, limit in (placement.max_memory or {}).items():
        check_fits(name, limit)


def check_placement(placement: Placement, config) -> None:
    """Refuse, in one line and before any weight loads, an explicit map that names no module of the model or
    leaves a weight without a device (`check_covers`); a strategy is transformers' to resolve."""
    if placement.explicit:
        check_covers(placement.device_map, config)


def device_problem(device: int | str) -> str | None:
    """Why `device` (a map's value, or a --max-memory key) is not a device of this machine; None if it is."""
    if device in OFFLOADED:
        return None
    if isinstance(device, int):  # a CUDA GPU's index
        count = torch.cuda.device_count()
        return None if 0 <= device < count else f"GPU {device} does not exist here ({_gpus_here(count)})"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        return f"'{device}' is not a device; use a GPU index (0), cuda:N, mps, cpu or disk"
    if parsed.type == "cuda":
        count = torch.cuda.device_count()
        return None if (parsed.index or 0) < count else f"'{device}' does not exist here ({_gpus_here(count)})"
    if parsed.type == "mps":
        return None if torch.backends.mps.is_available() else "'mps' is not available on this machine"
    return f"'{device}' is not a device ctxext places models on; use a GPU index (0), cuda:N, mps, cpu or disk"


def _gpus_here(count: int) -> str:
    return f"GPUs here: {', '.join(map(str, range(count)))}" if count else "torch sees no GPU; use cpu and disk"


def device_capacity(device: int | str) -> int:
    """The memory `device` has in all, in bytes (RAM for cpu and for mps, which shares it)."""
    if isinstance(device, int):
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def check_fits(device: int | str, limit: int) -> None:
    capacity = device_capacity(device)
    if limit > capacity:
        name = f"GPU {device}" if isinstance(device, int) else device
        raise CtxextError(
            f"--max-memory asks {limit / 2**30:.1f} GiB of {name}, which has {capacity / 2**30:.1f} GiB in all; "
            "ask less (leave room for activations)"
        )


def check_covers(device_map: dict, config) -> None:
    """Every key of the map names a module of the model, and every weight has a device (accelerate's
    `check_device_map`), on an empty-weight copy of the model built from its config."""
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    modules = dict(model.named_modules())
    unknown = [name for name in device_map if name and name not in modules]
    if unknown:
        raise CtxextError(
            f"--device-map: {_listed(unknown)} {'is' if len(unknown) == 1 else 'are'} not a module of this model"
            f"{did_you_mean(unknown[0], modules)}; its top modules are {_listed(_top_modules(model))}"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_device_map(model, device_map)
    except ValueError:
        missing = uncovered_modules(device_map, model.state_dict())
        raise CtxextError(
            f"--device-map gives no device to {_listed(missing)}: every weight needs one; add "
            f'"{missing[0]}": DEVICE (or use --device-map auto)'
        ) from None


def uncovered_modules(device_map: dict, weight_names: Iterable[str]) -> list[str]:
    """The outermost modules holding a weight the map places nowhere: for each such weight, its shortest
    prefix that is neither a key of the map nor an ancestor of one (e.g. 'model.layers.2')."""
    keys = [key for key in device_map if key]
    covered = lambda name: any(name == key or name.startswith(key + ".") for key in keys)
    ancestor = lambda prefix: any(key.startswith(prefix + ".") for key in keys)
    missing = []
    for weight in weight_names:
        if "" in device_map or covered(weight):
            continue
        parts = weight.split(".")
        prefixes = (".".join(parts[: i + 1]) for i in range(len(parts)))
        module = next(prefix for prefix in prefixes if not ancestor(prefix))
        if module not in missing:
            missing.append(module)
    return missing


def _top_modules(model: nn.Module) -> list[str]:
    """The modules an accelerate map usually names: the base model's children, layers by index, and the head."""
    names = [name for name, _ in model.named_modules() if name.count(".") <= 2 and name]
    return [name for name in names if not any(other.startswith(name + ".") for other in names)]


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"'{name}'" for name in names[:SHOWN])
    return shown if len(names) <= SHOWN else f"{shown}, ... ({len(names)} in all)"


def execution_device(placement: Placement) -> torch.device:
    """The device a placement runs on first (dtype 'auto' is chosen for it): accelerate's main device, the first
    GPU of an explicit map (the CPU where it names only cpu and disk), or, for a strategy, the first GPU it
    may use (--max-memory's, else any), else mps, else the CPU."""
    if placement.explicit:
        placed = [device for device in placement.device_map.values() if device not in OFFLOADED]
    elif placement.max_memory is not None:
        placed = sorted(d for d in placement.max_memory if isinstance(d, int)) or [
            d for d in placement.max_memory if d == "mps"
        ]
    elif torch.cuda.is_available():
        placed = [0]
    else:
        placed = ["mps"] if torch.backends.mps.is_available() else []
    if not placed:
        return torch.device("cpu")
    return torch.device(f"cuda:{placed[0]}" if isinstance(placed[0], int) else placed[0])


# ------------------------------------------------------------------------------------------ tensor parallel
def check_tensor_parallel(tp: int, placement: Placement | None, device: str, config=None) -> None:
    """Refuse, in one line and before any weight loads, what `--tp N` (transformers' tensor parallelism: each of
    the N launched processes holds 1/N of every layer's heads and MLP) cannot take: a --device-map (one model
    spread over devices by accelerate, where tensor parallelism spreads each layer), a --device other than the one
    transformers puts each shard on (the machine's accelerator, else the CPU), a family with no tensor-parallel
    plan, and query or key/value heads that do not split evenly over N processes. `config` None: the flags alone."""
    if tp <= 1:
        return
    if placement is not None:
        raise CtxextError(
            f"--tp {tp} and --device-map both say where the model goes: tensor parallelism splits every layer over "
            "the launched processes, a device map spreads the layers over one process's devices; give one"
        )
    accelerator = torch._C._get_accelerator().type  # where transformers puts each shard (LOCAL_RANK's device)
    if device != "auto" and device.split(":")[0] != accelerator:
        raise CtxextError(
            f"--tp {tp} puts each process's shard on this machine's {accelerator} (transformers' choice, by LOCAL_RANK); "
            f"--device {device} cannot be honoured: drop --device"
        )
    if config is not None:
        check_tensor_parallel_model(tp, config)


def check_tensor_parallel_model(tp: int, config) -> None:
    """The model's side of `check_tensor_parallel`: a tensor-parallel plan, and heads that split evenly."""
    if not getattr(config, "base_model_tp_plan", None):
        raise CtxextError(
            f"--tp {tp}: transformers has no tensor-parallel plan for model type '{config.model_type}' (its config's "
            "base_model_tp_plan is empty); run it on one device or with --device-map"
        )
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for name, count in (("query heads", heads), ("key/value heads", kv_heads)):
        if count is not None and count % tp:
            raise CtxextError(
                f"--tp {tp}: the model has {count} {name}, which do not split evenly over {tp} processes (each holds "
                f"whole heads); use a --tp that divides {count}"
            )


# ---------------------------------------------------------------------------------- a dispatched model
def offload_folder() -> str:
    """A fresh temporary folder for the weights offloaded to disk that the checkpoint cannot serve itself
    (transformers reads a safetensors checkpoint's offloaded weights where they are, and writes nothing here)."""
    return tempfile.mkdtemp(prefix="ctxext-offload-")


def remove_folder(folder: str) -> None:
    """Remove an `offload_folder` (when its model is gone, or its load failed)."""
    shutil.rmtree(folder, ignore_errors=True)


def placement_summary(model: nn.Module) -> str | None:
    """'device map: 4 modules on cpu, 3 modules on disk' for a dispatched model (None: on one device)."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return None
    counts = Counter(str(device) for device in device_map.values())
    return "device map: " + ", ".join(f"{n} module{'s' if n > 1 else ''} on {d}" for d, n in sorted(counts.items()))


def held_device(tensors: Iterable[torch.Tensor], default: str = "cpu") -> torch.device:
    """The device of the first tensor that holds data: not on the meta device, where accelerate leaves the
    weights it offloads to disk (its hooks bring them in for each forward); `default` where there is none."""
    for tensor in tensors:
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device(default)


def input_device(model: nn.Module) -> torch.device:
    """Where a forward's input ids go: the device of the model's first weight that is not offloaded to disk (on a
    dispatched model accelerate's hooks move them on to each module's execution device)."""
    return held_device(itertools.chain(model.parameters(), model.buffers()))
