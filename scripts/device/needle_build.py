"""Seconds lm-eval takes to build RULER's niah_single_1 prompts at a length, on this machine's CPU: what every
`ctxext tasks` cell does on the host before its first token is generated (one sample to check the data, then
the cell's LIMIT samples; a resumed cell builds them all again, answered ones included).

    python3 scripts/device/needle_build.py MODEL 65536,131072 [--samples 1,10]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="checkpoint directory whose tokenizer RULER sizes its prompts with")
    parser.add_argument("lengths", help="comma-separated lengths in tokens")
    parser.add_argument("--samples", default="1,10", help="comma-separated sample counts (default 1,10)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from ctxext.tasks.harness import (
        TaskManagers,
        TaskSpec,
        _seed_like_simple_evaluate,
        needle_samples_up_to,
        task_metadata,
    )

    spec, managers = TaskSpec("niah_single_1", "ruler"), TaskManagers(["niah_single_1"])
    began = time.perf_counter()
    managers.any()
    print(f"lm-eval's task index: {time.perf_counter() - began:.1f} s", flush=True)
    for length in (int(x) for x in args.lengths.split(",")):
        manager = managers.get(task_metadata(spec, length, args.model))
        for samples in (int(x) for x in args.samples.split(",")):
            _seed_like_simple_evaluate()
            began = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()), needle_samples_up_to(spec, samples):
                docs = manager.load([spec.name])["tasks"][spec.name].eval_docs
            seconds = time.perf_counter() - began
            print(f"{length} tokens, {len(docs)} samples: {seconds:.1f} s ({seconds / len(docs):.1f} s a sample)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
