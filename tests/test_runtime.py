"""ctxext.runtime: the automatic choices and the accelerate processes.

The processes test starts 2 real processes joined with gloo (as `accelerate launch` would), without
torchrun, so that nothing kills a blocked process for us: rank 0 fails inside `on_main_first` with an error
that is not a CtxextError, and rank 1 must be told and stop, while rank 0 is still alive.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ctxext.errors import CtxextError
from ctxext.runtime import (
    Processes,
    attention_implementation,
    cpu_processes,
    on_main_first,
    resolve_dtype,
    training_precision,
)
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[1]

RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from ctxext.runtime import Processes, on_main_first

    folder = Path(sys.argv[1])
    processes = Processes(cpu=True)

    def build():
        raise KeyError("boom")  # any error, not only a CtxextError

    try:
        on_main_first(processes, build)
        outcome = "continued"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    (folder / f"rank{processes.rank}.txt").write_text(outcome)
    if processes.is_main:  # stay alive until rank 1 is done (or 20 s): a blocked rank 1 cannot finish first
        deadline = time.time() + 20
        while not (folder / "rank1.txt").exists() and time.time() < deadline:
            time.sleep(0.1)
        (folder / "rank1_done_first.txt").write_text(str((folder / "rank1.txt").exists()))
    os._exit(0)  # no process-group teardown: rank 1 must not depend on it
""")


def test_an_error_on_the_main_process_stops_the_others(tmp_path):
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT, str(tmp_path)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        for proc in procs:
            proc.wait(timeout=120)
    finally:
        for proc in procs:
            proc.kill()
    errors = [proc.stderr.read()[-2000:] for proc in procs]
    assert (tmp_path / "rank0.txt").read_text() == "KeyError: 'boom'", errors  # its own error, re-raised
    assert (tmp_path / "rank1.txt").read_text() == "CtxextError: the main process failed: KeyError: 'boom'", errors
    assert (tmp_path / "rank1_done_first.txt").read_text() == "True"


def test_on_main_first_in_one_process_runs_and_raises():
    ran = []
    on_main_first(Processes(), lambda: ran.append(1))
    assert ran == [1]
    with pytest.raises(CtxextError, match="bad input"):
        on_main_first(Processes(), lambda: (_ for _ in ()).throw(CtxextError("bad input")))
    with pytest.raises(ZeroDivisionError):
        on_main_first(Processes(), lambda: 1 / 0)


def test_automatic_choices(monkeypatch):
    import ctxext.runtime as runtime

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for native in (True, False):
        monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda native=native: native)
        assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
        assert training_precision("auto", cpu, sharded=False) == ("bf16-mixed" if native else "fp32")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", gpu) == torch.bfloat16
    assert training_precision("auto", gpu, sharded=False) == "bf16"
    assert training_precision("auto", gpu, sharded=True) == "bf16-mixed"  # FSDP/DeepSpeed cast themselves
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", gpu) == torch.float16 and training_precision("auto", gpu, False) == "fp32"
    assert resolve_dtype("fp32", gpu) == torch.float32 and training_precision("bf16", cpu, False) == "bf16"
    assert attention_implementation("auto", cpu, half_precision=True) == "sdpa"
    assert attention_implementation("eager", gpu, half_precision=True) == "eager"
    with pytest.raises(CtxextError, match="unknown dtype"):
        resolve_dtype("fp8", cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cpu_processes("auto") and cpu_processes("cpu") and not cpu_processes("mps")


def test_machine_description_names_the_cpu_model_its_bf16_instructions_and_the_gpus():
    from ctxext.runtime import machine_description

    cpuinfo = (
        "processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu avx512f amx_tile amx_bf16\n\n"
        "processor\t: 1\nmodel name\t: Example CPU 9000\nflags\t\t: fpu avx512f amx_tile amx_bf16\n"
    )
    assert machine_description(cpuinfo, gpus=[]) == f"Example CPU 9000, {os.cpu_count()} cores, bf16: amx_bf16, no GPU"
    older = cpuinfo.replace(" amx_tile amx_bf16", "")
    assert machine_description(older, gpus=["NVIDIA H100"]).endswith("bf16: none, NVIDIA H100")
