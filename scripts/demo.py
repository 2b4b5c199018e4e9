"""The offline demo: fetch SmolLM2-135M and Shakespeare once, patch the model with YaRN x2, show what changed."""

import subprocess
import sys
from pathlib import Path

from ctxext import assets


def main() -> int:
    checkpoint = assets.smollm2_checkpoint()
    output = assets.cache_dir() / "demo" / "smollm2-yarn-x2"
    command = ["patch", str(checkpoint), "--method", "yarn", "--factor", "2", "-o", str(output), "--overwrite"]
    print("$ ctxext " + " ".join(command), flush=True)
    return subprocess.call([sys.executable, "-m", "ctxext", *command])


if __name__ == "__main__":
    sys.exit(main())
