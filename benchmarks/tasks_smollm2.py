"""RULER retrieval on SmolLM2 under ctxext's methods, through `ctxext tasks` (lm-evaluation-harness).

Stages, each one `ctxext tasks` command (the commands are printed; BENCHMARKS.md, "Long-context tasks (lm-eval)",
has the results):
  1. niah_single_1 at 4k, 8k, 16k: none, yarn x2, ntk x2, rerope w1024 +logn; 20 samples per cell
  2. niah_multikey_2, the same
  3. niah_single_1 at 32k (4x): none, yarn x4, dual_chunk (defaults); 10 samples per cell
  4. niah_single_1 at 4k-16k for the remapping methods (string, self_extend, dual_chunk, leaky_rerope)
  5. the moonshot's needle half: niah_single_1 at 64k (8x) for dual_chunk, self_extend (G 16 and 12) and dpe, 10
     samples a cell, no baseline there; and the unpatched model at 4k, 20 samples, the accuracy to keep 90% of
  6. niah_single_1 at 32k for dpe at its defaults and as searched at 32k with needle-ppl, 10 samples per cell, no
     baseline (stage 3 has it): does the needle-ppl search keep RULER's needle?
Every (method, task, length) cell is cached in $CTXEXT_CACHE_DIR/tasks (--cache-dir moves it) as soon as it is
done, and inside a cell every answered sample, so the stages can be interrupted and run again: finished cells and
samples are read back. The cache is keyed by the model's content, so a cache folder committed to the repository
resumes in a fresh clone on another machine (how stage 5, hours a sample on a CPU, is meant to be run), provided
it runs in the same dtype: stage 5 pins bf16, the dtype of its committed cells (on a CPU without native bf16, such
as an AVX2-only EPYC, that is about 3x slower than fp32 but keeps the cache).
`--cached-only` writes every stage's table from the cells cached so far, running nothing (use it while a run is
going on).

    nice -n 10 env OMP_NUM_THREADS=1 CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/tasks_smollm2.py [--stages 1,2]
    nice -n 19 env CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/tasks_smollm2.py --stages 5 \\
        --cache-dir benchmarks/moonshot_cells/tasks
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "benchmarks" / "tasks_sweeps"
# stage -> its `ctxext tasks` runs: (task, lengths, samples per cell, sweep or None for the baseline alone, baseline)
STAGES = {
    1: [("niah_single_1", "4k,8k,16k", 20, "smollm2-x2.yaml", True)],
    2: [("niah_multikey_2", "4k,8k,16k", 20, "smollm2-x2.yaml", True)],
    3: [("niah_single_1", "32k", 10, "smollm2-32k.yaml", True)],
    4: [("niah_single_1", "4k,8k,16k", 20, "smollm2-remap.yaml", True)],
    5: [("niah_single_1", "4k", 20, None, True), ("niah_single_1", "64k", 10, "smollm2-64k.yaml", False)],
    6: [("niah_single_1", "32k", 10, "smollm2-dpe-32k.yaml", False)],
}
# A cell's cache key holds the dtype it ran in, and `--dtype auto` picks bf16 only on CPUs with fast native bf16,
# so a committed cache resumes on another machine only with its dtype pinned: stage 5's cells ran in bf16.
STAGE_DTYPES = {5: "bf16"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="1,2,3,4", help="which stages, in order (default 1,2,3,4)")
    parser.add_argument("--cached-only", action="store_true", help="write the tables from the cached cells only")
    parser.add_argument("--output", default=str(REPO / "outputs" / "tasks"), help="parent of each stage's output")
    parser.add_argument("--cache-dir", default=None, help="ctxext tasks' --cache-dir (default $CTXEXT_CACHE_DIR/tasks)")
    parser.add_argument("--dtype", default=None, help="ctxext tasks' --dtype (default: bf16 for stage 5, else auto)")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ctxext import assets

    model = assets.smollm2_checkpoint()
    for stage in [int(s) for s in args.stages.split(",")]:
        for task, lengths, limit, sweep, baseline in STAGES[stage]:
            output = Path(args.output) / f"smollm2-{task}-{lengths.replace(',', '-')}-{Path(sweep or 'none').stem}"
            command = [sys.executable, "-m", "ctxext", "tasks", str(model), "--tasks", task, "--lengths", lengths]
            command += ["--limit", str(limit), "--no-progress", "--overwrite", "-o", str(output)]
            command += ["--dtype", args.dtype or STAGE_DTYPES.get(stage, "auto")]
            command += ["--config", str(SWEEPS / sweep)] if sweep else []
            command += [] if baseline else ["--no-baseline"]
            command += ["--cache-dir", args.cache_dir] if args.cache_dir else []
            command += ["--cached-only"] if args.cached_only else []
            print(f"stage {stage}: {shlex.join(command)}", flush=True)
            started = time.perf_counter()
            code = subprocess.run(command, cwd=REPO).returncode
            print(f"stage {stage}: exit {code} after {time.perf_counter() - started:.0f} s", flush=True)
            if code != 0:
                return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
