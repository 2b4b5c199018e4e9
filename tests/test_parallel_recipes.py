"""The recipes for models larger than one device, run as their files stand on a tiny model of the same family.

configs/recipes/llama3.1-70b-eval-256k.sh (`ctxext eval` of Llama-3.1-70B with yarn x2 from its shipped 128k,
dispatched by accelerate over two GPUs and CPU memory): run with a tiny LLaMA of Llama 3.1's rope (llama3, x8 over
L = 16, so C = 128) in place of the model and the lengths scaled down, through the same dispatch (`--device-map
auto` with a memory limit that leaves part of the model offloaded; on this CPU-only machine "cpu" and "disk"), its
perplexities must be those of the undispatched model. (The Llama-3-8B sequence-parallel fine-tuning recipe is
run in tests/test_sequence_parallel.py.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import child_process_env, run_cli, save_tiny_checkpoint, tiny_model, write_documents

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "recipes" / "llama3.1-70b-eval-256k.sh"
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}
TOLERANCE = 1e-5  # relative, fp32


def perplexities(output: Path) -> dict:
    results = json.loads((output / "results.json").read_text())
    return {(r["method"], r["length"]): r["perplexity"] for r in results["results"]}


@pytest.mark.slow  # two evaluations of 3 lengths, one through the recipe script (about 30 s on 2 cores)
def test_the_70b_eval_recipe_on_a_tiny_llama31_equals_the_undispatched_model(tmp_path, capsys):
    model = tiny_model("llama", num_hidden_layers=4, rope_parameters=LLAMA31_ROPE, max_position_embeddings=128)
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny-llama3.1", model)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    texts = write_documents(
        tmp_path / "texts", torch.randint(0, 256, (2, 600), generator=torch.Generator().manual_seed(0))
    )
    data = f"--text-file {texts} --no-progress"
    env = {"MODEL": str(checkpoint), "OUTPUT": str(tmp_path / "dispatched"), "LENGTHS": "64,128,256"}
    env |= {"MAX_MEMORY": f"cpu={size // 2}", "DTYPE": "fp32", "DATA": data}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # this environment's ctxext
    ran = subprocess.run(
        ["bash", str(RECIPE)],
        cwd=REPO,
        env=child_process_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "on disk" in ran.stdout  # half the model fits the limit: the rest is offloaded
    code, _, err = run_cli(
        capsys,
        "eval",
        checkpoint,
        "--method",
        "yarn",
        "--factor",
        "2",
        "--lengths",
        "64,128,256",
        "--stride",
        "window",
        "--dtype",
        "fp32",
        "--text-file",
        texts,
        "--no-progress",
        "-o",
        tmp_path / "plain",
    )
    assert code == 0, err
    got, want = perplexities(tmp_path / "dispatched"), perplexities(tmp_path / "plain")
    assert got.keys() == want.keys() and ("yarn x2", 256) in want
    for cell, value in want.items():
        assert abs(got[cell] - value) <= TOLERANCE * value, cell
