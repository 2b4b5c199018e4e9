"""Where and how a model runs: device, dtype (or training precision), attention implementation, and the
`accelerate` processes. Evaluation, fine-tuning and the tiny-model pretraining all choose through here.

The automatic choices: bf16 where it is fast (a GPU that supports it; a CPU with AMX or AVX512-BF16), else
fp16 on an older GPU for inference and fp32 everywhere else; FlashAttention-2 on a GPU in half precision
where it is installed, else SDPA.
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object, parse_flag_from_env
from transformers.utils import is_flash_attn_2_available

from .compat import reset_accelerate_state
from .dispatch import Placement, check_machine, check_tensor_parallel, execution_device
from .errors import CtxextError, first_line

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# ----------------------------------------------------------------------------------------------- device
def read_cpuinfo() -> str:
    """/proc/cpuinfo, or '' where there is none (macOS, Windows)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has_native_bf16() -> bool:
    """True where the CPU has bf16 matrix instructions (AMX or AVX512-BF16), so bf16 is faster than fp32."""
    flags = read_cpuinfo()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def machine_description(cpuinfo: str | None = None, gpus: list[str] | None = None) -> str:
    """The machine a number came from, in one line: CPU model, cores, its bf16 instructions, and the GPUs, e.g.
    'Intel(R) Xeon(R) Processor, 2 cores, bf16: amx_bf16, no GPU'. Every benchmark and report names it."""
    cpuinfo = read_cpuinfo() if cpuinfo is None else cpuinfo
    if gpus is None:
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    lines = cpuinfo.splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    bf16 = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags]
    return (
        f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"bf16: {', '.join(bf16) or 'none'}, " + (", ".join(gpus) if gpus else "no GPU")
    )


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bf16 is the fast choice on `device`: a GPU with bf16, or a CPU with native bf16."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_native_bf16()


def resolve_device(device: str = "auto") -> torch.device:
    """'auto': cuda > mps > cpu; otherwise the named device."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise CtxextError(f"unknown device '{device}'; use auto, cpu, cuda, cuda:N or mps") from None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto': bf16 where it is fast, fp16 on a GPU without bf16, else fp32."""
    if dtype == "auto":
        if bf16_is_fast(device):
            return torch.bfloat16
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise CtxextError(f"unknown dtype '{dtype}'; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def dtype_reason(requested: str, device: torch.device) -> str:
    """Why `resolve_dtype(requested, device)` chose what it chose, for the printed and recorded runtime."""
    if requested != "auto":
        return "given"
    if device.type == "cuda":
        return "auto: GPU"
    if device.type == "cpu":
        return "auto: CPU with fast native bf16" if cpu_has_native_bf16() else "auto: CPU without fast native bf16"
    return "auto"


def training_precision(precision: str, device: torch.device, sharded: bool) -> str:
    """'auto': bf16 weights with fp32 adapters on a GPU (bf16 autocast over fp32 weights under FSDP/DeepSpeed,
    which cast themselves); bf16 autocast over fp32 weights on a CPU with native bf16; else fp32."""
    if precision != "auto":
        return precision
    if not bf16_is_fast(device):
        return "fp32"
    return "bf16" if device.type == "cuda" and not sharded else "bf16-mixed"


def attention_implementation(requested: str, device: torch.device, half_precision: bool) -> str:
    """'auto': flash_attention_2 on a GPU in bf16/fp16 where it is installed, else sdpa."""
    if requested != "auto":
        return requested
    if device.type == "cuda" and half_precision and is_flash_attn_2_available():
        return "flash_attention_2"
    return "sdpa"


def inference_runtime(
    device: str, dtype: str, attn_implementation: str, processes: Processes, placement: Placement | None = None
) -> dict:
    """device, dtype and attention implementation for evaluation, with the reason for the dtype. With a
    `placement` (--device-map), the device is the one it runs on first (ctxext.dispatch.execution_device), and
    the placement rides along under "placement" for the load. Under `--tp N` (a `processes` with tp > 1) the
    device is this process's, where transformers puts its shard, and "tp" says to load the model split."""
    check_tensor_parallel(getattr(processes, "tp", 1), placement, device)
    check_machine(placement, device, processes.world_size)
    chosen = processes.device_for(device) if placement is None else execution_device(placement)
    torch_dtype = resolve_dtype(dtype, chosen)
    return {
        "device": chosen,
        "dtype": torch_dtype,
        "dtype_reason": dtype_reason(dtype, chosen),
        "attn_implementation": attention_implementation(
            attn_implementation, chosen, torch_dtype in (torch.bfloat16, torch.float16)
        ),
        "placement": placement,
        "tp": getattr(processes, "tp", 1),
    }


# -------------------------------------------------------------------------------------------- processes
def cpu_processes(device: str) -> bool:
    """Whether accelerate must join the processes on the CPU (gloo): asked for, or 'auto' without a GPU.
    Without cpu=True, accelerate ignores torchrun's WORLD_SIZE on a machine with no GPU."""
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


class Processes:
    """This process among those `accelerate launch` (or torchrun) started; one process when not launched.

    `cpu`: join the processes on the CPU (None: when there is no GPU). `always`: set up accelerate's state even
    for a single process (training needs it); a single process then starts from a fresh state, so one Python
    process can run several trainings (tests, the pretraining before a fine-tune).

    `tp` > 1 (`--tp N`): the launched processes hold one model split by tensor parallelism, so every one of them
    must run the same work: `rank`/`world_size` (how the work is shared) are then 0 and 1 on every process, while
    `is_main` (who writes and prints) is the first process alone, and `from_main` reaches all of them.
    """

    def __init__(self, cpu: bool | None = None, always: bool = False, tp: int = 1):
        self.state = None
        self.rank, self.world_size, self.tp, self.process_index, self.launched = 0, 1, 1, 0, 1
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        check_tensor_parallel_launch(tp, launched)
        if launched == 1 and not always:
            return
        self.state = PartialState(cpu=(not torch.cuda.is_available()) if cpu is None else cpu)
        self.rank, self.world_size = self.state.process_index, self.state.num_processes
        self.process_index, self.launched = self.rank, self.world_size
        if launched > self.world_size:
            raise CtxextError(
                f"launched as {launched} processes, but accelerate set up {self.world_size}: every process would "
                "write the same output. On a machine without GPUs use "
                "`accelerate launch --multi_gpu --num_processes N` (torchrun; ctxext joins with gloo)"
            )
        if self.world_size == 1:
            reset_accelerate_state()
        if tp > 1:  # one model over all the processes: each does all the work
            self.rank, self.world_size, self.tp = 0, 1, tp

    @property
    def is_main(self) -> bool:
        return self.process_index == 0

    @property
    def tensor_parallel(self) -> bool:
        return self.tp > 1

    @property
    def device(self) -> torch.device | None:
        """accelerate's device for this process (None when accelerate is not set up)."""
        return self.state.device if self.state is not None else None

    def device_for(self, requested: str) -> torch.device:
        """The device to run on: this process's own under several processes (or for 'auto' when accelerate is
        set up), else `resolve_device(requested)`."""
        if self.state is not None and (self.launched > 1 or requested == "auto"):
            return self.state.device
        return resolve_device(requested)

    def gather(self, items: list) -> list:
        """Every process's items, concatenated in rank order (on every process)."""
        if self.world_size == 1:
            return list(items)
        return gather_object(list(items))

    def from_main(self, value):
        """The main process's `value`, on every launched process (tensor-parallel ranks included)."""
        if self.launched == 1:
            return value
        box = [value if self.is_main else None]
        broadcast_object_list(box)
        return box[0]


TP_LAUNCH = "torchrun --nproc-per-node N -m ctxext COMMAND ... --tp N (or accelerate launch --num_processes N)"


def check_tensor_parallel_launch(tp: int, launched: int) -> None:
    """--tp N needs N processes started by a launcher (torchrun, accelerate launch): one shard of the model each."""
    if tp < 1:
        raise CtxextError(f"--tp must be a whole number >= 1, got {tp}")
    if tp == 1:
        return
    if launched == 1:
        raise CtxextError(
            f"--tp {tp} splits the model over {tp} processes, but this one was not launched: use {TP_LAUNCH}"
        )
    if launched != tp:
        raise CtxextError(
            f"--tp {tp}, but {launched} processes were launched (WORLD_SIZE): tensor parallelism splits the model over "
            f"all of them, so give --tp {launched} or launch {tp}"
        )


@contextlib.contextmanager
def alone():
    """Within: `Processes()` is this process alone (WORLD_SIZE=1), then as launched again (accelerate's state, already
    set up, is left as it is). What one process computes by itself (a compare's search on the main process; under
    --tp every rank's own copy of the same work) must not share its trials with the other processes."""
    launched = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = "1"
    try:
        yield
    finally:
        if launched is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = launched


def launched_sharded() -> bool:
    """Whether `accelerate launch` asked for FSDP or DeepSpeed (it says so in the environment)."""
    return parse_flag_from_env("ACCELERATE_USE_FSDP") or launched_deepspeed()


def launched_deepspeed() -> bool:
    """Whether `accelerate launch` asked for DeepSpeed."""
    return parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")


def on_main_first(processes: Processes, fn) -> None:
    """Run `fn` on the main process, then let the others continue (e.g. it builds a cache they then read).

    Any exception there stops every process: the others wait in the broadcast below, so the main process
    must always reach it. The main process re-raises its own exception; the others raise a CtxextError with
    its message (a CtxextError's as is, any other's first line with its type).
    """
    failure = [None]
    error = None
    if processes.is_main:
        try:
            fn()
        except BaseException as caught:  # noqa: BLE001  (re-raised below, after the others are told)
            error = caught
            failure = [
                str(caught)
                if isinstance(caught, CtxextError)
                else f"the main process failed: {type(caught).__name__}: {first_line(caught)}"
            ]
    if getattr(processes, "launched", processes.world_size) > 1:  # tensor-parallel ranks too
        broadcast_object_list(failure)
    if error is not None:
        raise error
    if failure[0] is not None:
        raise CtxextError(failure[0])
