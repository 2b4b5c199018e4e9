"""One peak-memory meter for `ctxext check` and `ctxext compare`: the most memory a block of work held above what
was in use when it started.

What it measures, by device (the `kind` it reports):
- "cuda allocated": CUDA's caching allocator, `max_memory_allocated` after `reset_peak_memory_stats` (tensors
  only; the allocator's reserved slack and other processes are not counted);
- "cpu resident high-water mark": Linux's VmHWM, reset to the current resident set at the start (by writing 5 to
  /proc/self/clear_refs), so every allocation counts however short-lived;
- "cpu resident (sampled)": where that reset is not allowed (other systems, some containers), VmRSS (or the
  peak resident set from getrusage) sampled every millisecond: an allocation freed between samples is missed.

On the CPU it is the whole process: freed memory that the allocator reuses is not counted again, so a small block
of work may show nothing.
"""

from __future__ import annotations

import gc
import platform
import threading

import torch

try:
    import resource
except ImportError:  # Windows: no getrusage
    resource = None

SAMPLE_SECONDS = 0.001


class PeakMemory:
    """`with PeakMemory(device) as peak: ...` then `peak.bytes` (above the start, >= 0), `peak.megabytes` and
    `peak.kind` (see the module's docstring)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._sampler = None

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            self.kind = "cuda allocated"
            return self
        self.start = self._highest = resident_bytes("VmRSS")
        if reset_high_water_mark():
            self.kind = "cpu resident high-water mark"
            return self
        self.kind = "cpu resident (sampled)"
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self._highest = max(self._highest, resident_bytes("VmRSS"))
            self._stop.wait(SAMPLE_SECONDS)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            highest = torch.cuda.max_memory_allocated(self.device)
        elif self._sampler is None:
            highest = resident_bytes("VmHWM")
        else:
            self._stop.set()
            self._sampler.join()
            highest = max(self._highest, resident_bytes("VmRSS"))
        self.bytes = max(0, highest - self.start)
        self.megabytes = self.bytes / 2**20
        return False


def reset_high_water_mark() -> bool:
    """Reset Linux's VmHWM to the current resident set; False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def resident_bytes(field: str) -> int:
    """VmRSS or VmHWM from /proc/self/status (Linux); elsewhere the peak resident set from getrusage."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if resource is None:
        return 0
    scale = 1 if platform.system() == "Darwin" else 1024  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
