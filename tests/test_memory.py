"""The one peak-memory meter (ctxext.memory) that `ctxext check` and `ctxext compare` both report.

Oracle: the bytes of a tensor the block allocates and touches (torch.ones of a known size), and Linux's own
VmRSS before and after."""

import sys

import pytest
import torch

from ctxext import check, memory
from ctxext.compare import cells

MB = 2**20
SIZE = 160 * MB


def test_check_and_compare_measure_with_the_same_meter():
    assert check.PeakMemory is memory.PeakMemory and cells.PeakMemory is memory.PeakMemory


def test_a_tensor_held_to_the_end_is_counted_once():
    with memory.PeakMemory("cpu") as peak:
        held = torch.ones(SIZE // 4, dtype=torch.float32)  # ones: every page touched
    assert SIZE * 0.95 <= peak.bytes <= SIZE * 1.5, peak.bytes / MB
    assert peak.megabytes == peak.bytes / MB
    del held


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the high-water mark is Linux's VmHWM")
def test_a_tensor_freed_inside_the_block_still_counts_on_linux():
    """A sampler could miss a short-lived allocation; the reset high-water mark cannot."""
    with memory.PeakMemory("cpu") as peak:
        for _ in range(3):
            torch.ones(SIZE // 4, dtype=torch.float32).sum()  # allocated, touched, freed at once
    if peak.kind != "cpu resident high-water mark":
        pytest.skip(f"this system refuses to reset VmHWM ({peak.kind})")
    assert peak.bytes >= SIZE * 0.95, peak.bytes / MB
    assert memory.resident_bytes("VmHWM") >= memory.resident_bytes("VmRSS")


def test_nothing_allocated_is_near_zero():
    with memory.PeakMemory("cpu") as peak:
        pass
    assert peak.bytes < 16 * MB and peak.kind.startswith("cpu resident")
