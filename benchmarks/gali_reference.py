"""ctxext's gali against GALI's reference code (AcademyCityL/GALI, models/DPI), greedy answers and their logits.

The reference runs unmodified in a child process under transformers 4.46.2 (its pinned release), on the same
checkpoint and token ids; ctxext's gali runs in this process (fp32, CPU). Stubs, each named:
  - the six methods the reference's `get_model_and_tokenizer` (models/DPI/dpi.py) binds to a Llama are bound here
    the same way, without its `config.num_hidden_layers = 1` override and without importing dpi.py, which imports
    the flash-attention modules of its other baselines;
  - `output_scores` fails inside the reference's chunked prefill (dpi_sample), so each answer token's logits are
    read from a hook on lm_head (the last position of each forward);
  - `config.output_attentions` is False (its loader sets True, which keeps every layer's full score matrix: 30
    layers of 10k x 10k scores ran out of 24 GB), and the config says "eager" after loading (the modules stay the
    SDPA class its code is bound to), so that transformers 4.46 still builds the explicit causal mask that True
    made it build;
  - transformers 4.46 reads `rope_theta` at the top of config.json: a checkpoint written by transformers 5 keeps it
    in `rope_parameters`, so pass --reference-checkpoint with the key copied up (SmolLM2: 1e5).
Settings: the reference's `chunk_coe` (its prefill shares one position list per chunk; 1 = one list per token,
ctxext's rule), `local_window` w, `noise_type` ("no"; "gaussian" as its LongBench settings ship).

    git -C MIRROR archive 5a3e9474d1cedddac05f8c64ecee35fe7588ba13 models | tar -x -C REF
    pip install --target TF446 transformers==4.46.2 'tokenizers<0.21' 'huggingface_hub<1.0' --no-deps
    python benchmarks/gali_reference.py --reference-dir REF --reference-pythonpath TF446 \
        --checkpoint .cache/smollm2-135m-instruct --reference-checkpoint SMOLLM2_WITH_ROPE_THETA \
        --prompt p10k.pt --chunk-coe 1,3000 --local-window 1
    python benchmarks/gali_reference.py ... --make-fixture tests/fixtures/gali_reference.json   # the tiny model
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ctxext
from ctxext.runtime import machine_description

REFERENCE_COMMIT = "5a3e9474d1cedddac05f8c64ecee35fe7588ba13"
RESULTS = Path(__file__).parent / "results" / "gali_reference.json"
RUNNER = r"""
import sys
from types import MethodType
import torch
from transformers import LlamaForCausalLM
import models.DPI.patches.Llama as P

checkpoint, ids_path, out_path, chunk_coe, window, new_tokens, noise = sys.argv[1:8]
torch.set_num_threads(int(sys.argv[8]))
model = LlamaForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa", torch_dtype=torch.float32).eval()
model.config.dpi_config = dict(use_chunk_softmax=False, chunk_coe=int(chunk_coe), appro_attn=True,
                               local_window=int(window), noise_type=noise, addon_relcoef=1, std_base=1.0,
                               scale_mean=0, scale_std=1)
model.config.output_attentions = False  # its loader sets True: every layer's scores kept (OOM at 10k on 24 GB)
model.config._attn_implementation = "eager"  # so 4.46 still builds the explicit causal mask its forward reads
model.config.return_dict_in_generate = True
for cls, name, fn in [("LlamaSdpaAttention", "forward", P.dpi_llamaattn_forward),
                      ("LlamaRotaryEmbedding", "forward", P.rope_forward_dpi_with_pi),
                      ("LlamaForCausalLM", "_sample", P.dpi_sample),
                      ("LlamaForCausalLM", "prepare_inputs_for_generation", P.dpi_prepare_inputs_for_generation),
                      ("LlamaForCausalLM", "_update_model_kwargs_for_generation",
                       P.dpi_update_model_kwargs_for_generation),
                      ("LlamaModel", "forward", P.dpi_llamamodel_forward)]:
    found = [m for m in model.modules() if type(m).__name__ == cls]
    assert found, cls
    for m in found:
        setattr(m, name, MethodType(fn, m))
ids = torch.load(ids_path)
last = []
model.lm_head.register_forward_hook(lambda mod, inp, out: last.append(out[0, -1].float().clone()))
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(new_tokens), do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0, temperature=None, top_p=None)
new = out.sequences[0, ids.shape[1]:]
torch.save({"tokens": new, "scores": torch.stack(last[-len(new):])}, out_path)
"""


def run_reference(args, checkpoint: str, ids_path: Path, chunk_coe: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{args.reference_pythonpath}{os.pathsep}{args.reference_dir}"}
    argv = [str(checkpoint), str(ids_path), str(out), str(chunk_coe), str(args.local_window), str(args.new_tokens)]
    argv += [args.noise, str(args.threads)]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", RUNNER, *argv], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the reference failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return {**torch.load(out), "seconds": time.perf_counter() - started}


def run_ctxext(checkpoint: str, ids: torch.Tensor, window: int, new_tokens: int) -> dict:
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    ctxext.patch(model, "gali", factor=4, local_window=window)  # gali's range R is L at any factor
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    tokens = out.sequences[0, ids.shape[1] :]
    return {"tokens": tokens, "scores": torch.stack(out.scores)[:, 0], "seconds": time.perf_counter() - started}


def compare_rows(args) -> list[dict]:
    ids = torch.load(args.prompt)
    ours = run_ctxext(args.checkpoint, ids, args.local_window, args.new_tokens)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for chunk_coe in args.chunk_coe:
            theirs = run_reference(
                args,
                args.reference_checkpoint or args.checkpoint,
                Path(args.prompt),
                chunk_coe,
                Path(scratch) / f"ref-{chunk_coe}.pt",
            )
            steps = min(len(theirs["tokens"]), len(ours["tokens"]))
            same = int((theirs["tokens"][:steps] == ours["tokens"][:steps]).long().cumprod(0).sum())
            rows.append(
                {
                    "prompt": Path(args.prompt).name,
                    "prompt_tokens": ids.shape[1],
                    "chunk_coe": chunk_coe,
                    "local_window": args.local_window,
                    "noise": args.noise,
                    "reference_tokens": theirs["tokens"].tolist(),
                    "ctxext_tokens": ours["tokens"].tolist(),
                    "agreeing_prefix": same,
                    "max_logit_difference_first_token": float((theirs["scores"][0] - ours["scores"][0]).abs().max()),
                    "max_logit_difference_agreeing_tokens": float(
                        (theirs["scores"][:same] - ours["scores"][:same]).abs().max()
                    )
                    if same
                    else None,
                    "reference_seconds": theirs["seconds"],
                    "ctxext_seconds": ours["seconds"],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference-dir", required=True, help="the exported reference tree (holds models/DPI)")
    parser.add_argument("--reference-pythonpath", required=True, help="where transformers 4.46.2 is installed")
    parser.add_argument("--checkpoint", required=True, help="the model, as ctxext loads it")
    parser.add_argument("--reference-checkpoint", help="the same model with rope_theta at the top of config.json")
    parser.add_argument("--prompt", required=True, help="a .pt file of token ids (1, T)")
    parser.add_argument("--chunk-coe", default="1,3000", help="the reference's chunk sizes to run (default 1,3000)")
    parser.add_argument("--local-window", type=int, default=1, help="GALI's local window w (default 1)")
    parser.add_argument("--noise", default="no", help="the reference's noise_type: no (default) or gaussian")
    parser.add_argument("--new-tokens", type=int, default=10, help="greedy tokens per answer (default 10)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON to add the rows to (default {RESULTS})")
    args = parser.parse_args()
    args.chunk_coe = [int(c) for c in args.chunk_coe.split(",")]
    torch.set_num_threads(args.threads)
    rows = compare_rows(args)
    kept = json.loads(args.out.read_text()) if args.out.exists() else {"reference_commit": REFERENCE_COMMIT, "rows": []}
    for row in rows:
        row["machine"] = machine_description()
        kept["rows"] = [
            r
            for r in kept["rows"]
            if (r["prompt"], r["chunk_coe"], r["local_window"], r["noise"])
            != (row["prompt"], row["chunk_coe"], row["local_window"], row["noise"])
        ] + [row]
        print(json.dumps({k: v for k, v in row.items() if "tokens" not in k or k == "agreeing_prefix"}))
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(kept, indent=1) + "\n")


if __name__ == "__main__":
    main()
