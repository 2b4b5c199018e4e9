"""The one peak-memory meter (ctxext.memory) that `ctxext check` and `ctxext compare` both report.

Oracle: the bytes of a tensor the measured block allocates and touches (torch.ones of a known size). Each
measurement runs in a fresh Python process: what a long-lived test process freed earlier stays resident and would
be reused, unseen by any resident-set meter."""

import json
import subprocess
import sys
import textwrap

import pytest

from ctxext import memory
from ctxext.compare import cells
from ctxext.verification import check
from tests.helpers import REPO, child_process_env

MB = 2**20
SIZE = 160 * MB

MEASURE = textwrap.dedent("""
    import json, sys
    import torch
    from ctxext.memory import PeakMemory
    size, freed = int(sys.argv[1]), sys.argv[2] == "freed"
    with PeakMemory("cpu") as peak:
        if freed:
            for _ in range(3):
                torch.ones(size // 4, dtype=torch.float32).sum()  # allocated, touched, freed at once
        elif size:
            held = torch.ones(size // 4, dtype=torch.float32)  # ones: every page touched
    print(json.dumps({"bytes": peak.bytes, "megabytes": peak.megabytes, "kind": peak.kind}))
""")


def measured(size: int, freed: bool = False) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(size), "freed" if freed else "held"],
        cwd=REPO,
        env=child_process_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_check_and_compare_measure_with_the_same_meter():
    assert check.PeakMemory is memory.PeakMemory and cells.PeakMemory is memory.PeakMemory


def test_a_tensor_held_to_the_end_is_counted_once():
    peak = measured(SIZE)
    assert SIZE * 0.95 <= peak["bytes"] <= SIZE * 1.5, peak
    assert peak["megabytes"] == peak["bytes"] / MB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the high-water mark is Linux's VmHWM")
def test_a_tensor_freed_inside_the_block_still_counts_on_linux():
    """A sampler could miss a short-lived allocation; the reset high-water mark cannot."""
    peak = measured(SIZE, freed=True)
    if peak["kind"] != "cpu resident high-water mark":
        pytest.skip(f"this system refuses to reset VmHWM ({peak['kind']})")
    assert peak["bytes"] >= SIZE * 0.95, peak


def test_nothing_allocated_is_near_zero():
    peak = measured(0)
    assert peak["bytes"] < 16 * MB and peak["kind"].startswith("cpu resident"), peak
