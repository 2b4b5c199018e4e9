"""`ctxext finetune` as a script, for launchers that want a file:

    python scripts/finetune.py --recipe configs/recipes/tiny-cpu.yaml [key=value ...] [--resume]
    accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/finetune.py --recipe RECIPE.yaml

Everything is in ctxext.train (recipe.py, data.py, lora.py, trackers.py; loop.py, with setup.py, evaluation.py,
checkpoints.py and records.py beside it); `--help` lists the options and `--show-keys` every recipe key.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ctxext.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["finetune", *sys.argv[1:]]))
