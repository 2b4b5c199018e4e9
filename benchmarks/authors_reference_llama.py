"""ctxext's self_extend, rerope and leaky_rerope against their authors' own code, side by side on one checkpoint.

Each side runs in its own child process on the same token ids, fp32, CPU, with the same thread count; a child
reports the greedy tokens, the logits of every answer step (and, for the held-out text, of every prefill
position), the prefill and per-step decode seconds, and its peak RSS after the prefill (ru_maxrss). The authors'
code runs unmodified under the transformers release it was written for, installed apart and put on PYTHONPATH:

- SelfExtend: datamllab/LongLM `self_extend_patch/Llama.py` bound by its own `SelfExtend.apply(model, G, w)`
  (the non-flash path, `LlamaAttention.forward`), under transformers 4.38.2 (the README's release). Stubs, each
  named: `flash_attn`, `self_extend_patch.selfextend_flash_attn` and `self_extend_patch.selfextend_flash_attn_triton`
  are empty modules whose functions raise (Llama.py imports them at the top; the non-flash path calls none of
  them), and the package `self_extend_patch` is a bare module over its folder, so that its `__init__` does not
  import Gemma/Mistral/Qwen2/Phi (each imports flash_attn as well). Transformers 4.38's LlamaModel keeps a causal-
  mask buffer of max_position_embeddings^2 and indexes it by cache_position, so decoding past 8192 tokens raises
  IndexError: the runner re-registers that buffer (the same triu of ones) at (longest prompt + new tokens)^2.
- ReRoPE / Leaky ReRoPE: bojone/rerope `rerope_patch.py` / `leaky_rerope_patch.py`, imported (each sets
  `LlamaAttention.forward`, the leaky one `_init_rope` too), under transformers 4.31.0 (its requirements.txt).
  Their settings are module constants, set after the import as the files intend: `window` (w), `training_length`
  (L of their always-on log-n query scaling) and, for Leaky, `scaling_factor` (k). Stub: transformers 4.31 builds
  LlamaRotaryEmbedding without the config's rope_theta (it predates the key), and the leaky file's `_init_rope`
  builds both rotary embeddings without a base, so the runner rebuilds `rotary_emb` (and `rotary_emb2`, the
  linear-scaling one of factor k) of every attention with base = rope_theta; without that SmolLM2 (1e5) runs at
  base 1e4 and its plain logits differ by 18 from transformers 5's.

Mapping to ctxext: SelfExtend `group_size_1` = G = ctxext `group_size`, `group_size_2` = w = `window`, its
`scale_base` left at -1 (off); ReRoPE `window` = `window`, `training_length` = L with `logn=True` (ctxext's log-n is
the same max(1, ln(n) / ln L) on the query at 1-based position n); Leaky `scaling_factor` = `k`.

Both sides decode with the same greedy loop: the base model's forward over the prompt (hidden states, the cache),
the LM head on the last position, then one token per forward with the cache (no attention mask passed, as the
authors' examples). transformers 4.x's causal-LM forward computes the logits of every position, transformers 5's
`generate` only the last: calling the base model keeps a 1.6 GB logits tensor out of both sides' prefill peaks.

The committed results came from (1 thread: 2 threads ran 4x slower on the loaded 2-core machine):
    pip install --target TF438 transformers==4.38.2 'tokenizers<0.19' 'huggingface_hub<1.0' --no-deps
    pip install --target TF431 transformers==4.31.0 'tokenizers<0.14' 'huggingface_hub<1.0' --no-deps
    C="--checkpoint .cache/smollm2-135m-instruct --reference-checkpoint SMOLLM2_WITH_ROPE_THETA --threads 1 \
       --decode-tokens 8"
    python benchmarks/authors_reference_llama.py --method self_extend --reference-dir REF_LONGLM \
        --reference-pythonpath TF438 $C --lengths 4096
    python benchmarks/authors_reference_llama.py --method self_extend ... $C --lengths "" --ctxext-only-lengths 8192,16384
    python benchmarks/authors_reference_llama.py --method rerope --reference-dir REF_REROPE --reference-pythonpath TF431 \
        $C --lengths 4096
    python benchmarks/authors_reference_llama.py --method leaky_rerope ... $C --lengths 4096 --no-passkey
    python benchmarks/authors_reference_llama.py --method self_extend ... --window 16 --group-size 4 \
        --make-fixture tests/fixtures/selfextend_reference.json   # the tiny model (also G 3; rerope, leaky_rerope)
REF_* are the trees of the mirrors' commits (REFERENCES below), file by file with `git show COMMIT:PATH`;
SMOLLM2_WITH_ROPE_THETA is the checkpoint with rope_parameters.rope_theta (1e5) copied to the top of config.json.
The authors' prefill keeps about four (heads, T, T) fp32 score tensors alive per layer: 4.1 GiB peak at 4096
tokens measured, about 10.5 GiB at 8192 and 38 GiB at 16384 by that count, which did not fit beside the shared
machine's other jobs (a 4096 run was OOM-killed once); `--table` prints a results file as Markdown.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ctxext.runtime import machine_description  # noqa: E402

REFERENCES = {
    "self_extend": ("datamllab/LongLM", "cdbbb061dc76438c46d7e1ddc500f8e4bf255574", "4.38.2"),
    "rerope": ("bojone/rerope", "acfe78840357a94d0bb504cb8865eeaa752df1a6", "4.31.0"),
    "leaky_rerope": ("bojone/rerope", "acfe78840357a94d0bb504cb8865eeaa752df1a6", "4.31.0"),
}
RESULTS = {
    "self_extend": ROOT / "benchmarks" / "results" / "selfextend_reference.json",
    "rerope": ROOT / "benchmarks" / "results" / "rerope_reference.json",
    "leaky_rerope": ROOT / "benchmarks" / "results" / "rerope_reference.json",
}
HELD_OUT_PLAY = "othello_gut"  # not in the Hamlet + Richard III stream the demo and METHODS.md tune on
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)  # ctxext compare's page: one key per depth, seeded by 0

RUNNER = r"""
import json, os, resource, sys, time, types
import torch

job = torch.load(sys.argv[1])
torch.set_num_threads(job["threads"])
p = job["params"]


def peak_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def unavailable(*args, **kwargs):
    raise RuntimeError("a stub: the non-flash path does not call it")


def stub(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


if job["side"] == "ctxext":
    from transformers import AutoModelForCausalLM
    import ctxext

    model = AutoModelForCausalLM.from_pretrained(job["checkpoint"], dtype=torch.float32).eval()
    ctxext.patch(model, job["method"], **job["ctxext_kwargs"])
elif job["method"] == "self_extend":
    import transformers.models.gpt_neox.modeling_gpt_neox  # before the flash_attn stub: 4.38 probes the package
    from transformers import LlamaForCausalLM

    stub("flash_attn", flash_attn_func=unavailable, flash_attn_varlen_func=unavailable)
    package = stub("self_extend_patch")
    package.__path__ = [os.path.join(job["reference_dir"], "self_extend_patch")]
    stub("self_extend_patch.selfextend_flash_attn", self_extend_flash_forward=unavailable)
    stub("self_extend_patch.selfextend_flash_attn_triton", self_extend_flash_forward_triton=unavailable)
    import self_extend_patch.Llama  # noqa: F401 (their file, unmodified)
    import SelfExtend

    model = LlamaForCausalLM.from_pretrained(job["checkpoint"], attn_implementation="eager",
                                             torch_dtype=torch.float32).eval()
    SelfExtend.apply(model, p["group_size"], p["window"])  # enable_flash_attention=False, scale_base=-1
    need = job["longest"]
    if need > model.model.causal_mask.shape[-1]:  # 4.38 cannot decode past its buffer: the same mask, larger
        full = torch.full((need, need), fill_value=True, dtype=torch.bool)
        model.model.register_buffer("causal_mask", torch.triu(full, diagonal=1), persistent=False)
else:
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaLinearScalingRotaryEmbedding, LlamaRotaryEmbedding

    sys.path.insert(0, job["reference_dir"])
    if job["method"] == "rerope":
        import rerope_patch as P
    else:
        import leaky_rerope_patch as P

        P.scaling_factor = p["k"]
    P.window = p["window"]
    P.training_length = p["training_length"]
    model = LlamaForCausalLM.from_pretrained(job["checkpoint"], torch_dtype=torch.float32).eval()
    base = model.config.rope_theta
    for layer in model.model.layers:  # 4.31 has no rope_theta: the same embeddings at the config's base
        a = layer.self_attn
        a.rotary_emb = LlamaRotaryEmbedding(a.head_dim, max_position_embeddings=a.max_position_embeddings, base=base)
        if hasattr(a, "rotary_emb2"):
            a.rotary_emb2 = LlamaLinearScalingRotaryEmbedding(
                a.head_dim, max_position_embeddings=a.max_position_embeddings, scaling_factor=P.scaling_factor,
                base=base)

out = {"rss_after_load_kib": peak_kib(), "prompts": []}
for prompt in job["prompts"]:
    ids = prompt["ids"][None]
    with torch.no_grad():
        started = time.perf_counter()
        base_out = model.model(input_ids=ids, use_cache=True)
        prefill_seconds = time.perf_counter() - started
        peak = peak_kib()
        hidden, cache = base_out.last_hidden_state, base_out.past_key_values
        logits = [model.lm_head(hidden[:, -1])[0].float()]
        tokens = [int(logits[-1].argmax())]
        steps = []
        for _ in range(prompt["new_tokens"] - 1):
            started = time.perf_counter()
            step = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            steps.append(time.perf_counter() - started)
            cache = step.past_key_values
            logits.append(step.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
        del cache, base_out
        record = {"name": prompt["name"], "tokens": tokens, "logits": torch.stack(logits),
                  "prefill_seconds": prefill_seconds, "decode_step_seconds": steps, "peak_rss_after_prefill_kib": peak}
        if prompt.get("full_logits"):
            record["full_logits"] = model.lm_head(hidden)[0].float()
        del hidden
    out["prompts"].append(record)
out["peak_rss_kib"] = peak_kib()
torch.save(out, sys.argv[2])
"""


def run_side(side: str, args, prompts: list[dict], scratch: Path) -> dict:
    """One child process: `side` is 'ctxext' or 'reference'."""
    job = {
        "side": side,
        "method": args.method,
        "params": method_params(args),
        "ctxext_kwargs": ctxext_kwargs(args),
        "checkpoint": str(args.checkpoint if side == "ctxext" else args.reference_checkpoint or args.checkpoint),
        "reference_dir": str(args.reference_dir),
        "threads": args.threads,
        "prompts": prompts,
        "longest": max(len(p["ids"]) + p["new_tokens"] for p in prompts),
    }
    tag = f"{side}-{len(prompts[0]['ids'])}"
    torch.save(job, scratch / f"{tag}-job.pt")
    env = dict(os.environ)
    if side == "ctxext":
        env["PYTHONPATH"] = str(ROOT)
    else:
        env["PYTHONPATH"] = f"{args.reference_pythonpath}{os.pathsep}{args.reference_dir}"
    argv = [sys.executable, "-c", RUNNER, str(scratch / f"{tag}-job.pt"), str(scratch / f"{tag}-out.pt")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {side} side failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return torch.load(scratch / f"{tag}-out.pt", mmap=True)  # file-backed: the full logits stay off the heap


def method_params(args) -> dict:
    if args.method == "self_extend":
        return {"group_size": args.group_size, "window": args.window}
    params = {"window": args.window, "training_length": args.training_length}
    if args.method == "leaky_rerope":
        params["k"] = args.k
    return params


def ctxext_kwargs(args) -> dict:
    """ctxext.patch's arguments for the same setting (factor only sizes the config's max_position_embeddings)."""
    kwargs = {"factor": args.factor, "window": args.window}
    if args.method == "self_extend":
        kwargs["group_size"] = args.group_size
    else:
        kwargs["logn"] = True  # the authors' log-n is always on, at L = training_length (the model's own L here)
        if args.method == "leaky_rerope":
            kwargs["k"] = float(args.k)
    return kwargs


def smollm2_prompts(args, length: int, held_out: bool, passkey: bool) -> list[dict]:
    """The held-out play's first `length` tokens (full logits kept, `decode_tokens` greedy tokens), then the
    comparison page's passkey prompts at `length` (ctxext.eval.passkey: the same builder, keys and depths)."""
    from transformers import AutoTokenizer

    from ctxext import assets
    from ctxext.eval.data import tokenizer_adds_bos
    from ctxext.eval.passkey import NEW_TOKENS, build_prompt, plan_trials

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    bos = tokenizer.bos_token_id if tokenizer_adds_bos(tokenizer) else None
    prompts = []
    if held_out:
        text = assets.shakespeare_text([HELD_OUT_PLAY])
        ids = tokenizer(text, add_special_tokens=False).input_ids
        ids = ([bos] if bos is not None else []) + ids
        if len(ids) < length:
            raise SystemExit(f"{HELD_OUT_PLAY} has {len(ids)} tokens, fewer than {length}")
        prompts.append(
            {
                "name": f"{HELD_OUT_PLAY}[:{length}]",
                "ids": torch.tensor(ids[:length]),
                "new_tokens": args.decode_tokens,
                "full_logits": True,
            }
        )
    if passkey:
        for trial in plan_trials([length], list(PASSKEY_DEPTHS), 1, seed=0):
            ids = build_prompt(tokenizer, length, trial.depth, trial.key, bos)
            name = f"passkey depth {trial.depth:g} key {trial.key}"
            prompts.append({"name": name, "ids": ids, "new_tokens": NEW_TOKENS, "key": trial.key})
    return prompts


def compare(ours: dict, theirs: dict, prompts: list[dict], tokenizer) -> list[dict]:
    rows = []
    for prompt, mine, ref in zip(prompts, ours["prompts"], theirs["prompts"], strict=True):
        steps = len(mine["tokens"])
        agreeing = 0
        while agreeing < steps and mine["tokens"][agreeing] == ref["tokens"][agreeing]:
            agreeing += 1
        answer_diff = (mine["logits"][: max(agreeing, 1)] - ref["logits"][: max(agreeing, 1)]).abs()
        row = {
            "prompt": prompt["name"],
            "prompt_tokens": len(prompt["ids"]),
            "new_tokens": steps,
            "ctxext_tokens": mine["tokens"],
            "reference_tokens": ref["tokens"],
            "agreeing_prefix": agreeing,
            "max_abs_logit_difference_answer": float(answer_diff.max()),
            "largest_abs_answer_logit": float(ref["logits"].abs().max()),
        }
        if "key" in prompt:
            text = tokenizer.decode(mine["tokens"], skip_special_tokens=True)
            row["ctxext_answer"] = text
            row["reference_answer"] = tokenizer.decode(ref["tokens"], skip_special_tokens=True)
            row["key"] = prompt["key"]
        if "full_logits" in mine:
            a, b = mine["full_logits"], ref["full_logits"]
            diff = (a - b).abs().amax(-1)
            row["prefill_positions"] = a.shape[0]
            row["max_abs_logit_difference_prefill"] = float(diff.max())
            row["max_abs_logit_difference_prefill_first_window"] = float(diff[: ctxext_window(prompt)].max())
            row["largest_abs_prefill_logit"] = float(b.abs().max())
            row["prefill_argmax_disagreements"] = int((a.argmax(-1) != b.argmax(-1)).sum())
            row["worst_prefill_position"] = int(diff.argmax())
        rows.append(row)
    return rows


def ctxext_window(prompt) -> int:
    return prompt.get("window", 0) or 1


def cost(side: dict) -> dict:
    held = side["prompts"][0]
    steps = held["decode_step_seconds"]
    return {
        "prefill_seconds": held["prefill_seconds"],
        "decode_seconds_per_token": sum(steps) / len(steps) if steps else None,
        "peak_rss_after_prefill_gib": held["peak_rss_after_prefill_kib"] / 2**20,
        "rss_after_load_gib": side["rss_after_load_kib"] / 2**20,
    }


def versions(args) -> dict:
    import transformers

    repo, commit, tf = REFERENCES[args.method]
    return {
        "torch": torch.__version__,
        "ctxext_side_transformers": transformers.__version__,
        "reference": f"{repo} commit {commit}",
        "reference_transformers": tf,
        "threads": args.threads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", required=True, choices=sorted(REFERENCES))
    parser.add_argument("--reference-dir", required=True, type=Path, help="the authors' extracted tree")
    parser.add_argument("--reference-pythonpath", required=True, help="where their transformers is installed")
    parser.add_argument("--checkpoint", required=True, type=Path, help="the model, as ctxext loads it")
    parser.add_argument("--reference-checkpoint", type=Path, help="the same model with rope_theta at the top")
    parser.add_argument("--lengths", default="4096,8192", help="prompt lengths run on both sides")
    parser.add_argument("--ctxext-only-lengths", default="", help="lengths run on ctxext's side only (cost)")
    parser.add_argument("--no-passkey", action="store_true", help="the held-out text only")
    parser.add_argument("--group-size", type=int, default=4, help="SelfExtend G (default 4)")
    parser.add_argument("--window", type=int, help="w (default: 1024 for self_extend, 512 for ReRoPE, Su's)")
    parser.add_argument("--k", type=int, default=16, help="Leaky ReRoPE's k, Su's scaling_factor (default 16)")
    parser.add_argument("--training-length", type=int, help="ReRoPE's log-n L (default: the model's L)")
    parser.add_argument("--factor", type=float, default=2.0, help="ctxext's factor (sizes the config only)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="greedy tokens after the held-out text")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="results JSON to add rows to (default: by method)")
    parser.add_argument("--make-fixture", type=Path, help="run the tiny model instead and write this fixture")
    parser.add_argument("--table", action="store_true", help="print the results JSON's rows as Markdown, run nothing")
    args = parser.parse_args()
    if args.table:
        return print_tables(json.loads((args.out or RESULTS[args.method]).read_text()))
    if args.window is None:
        args.window = 1024 if args.method == "self_extend" else 512
    torch.set_num_threads(args.threads)
    if args.make_fixture:
        return make_fixture(args)
    from transformers import AutoConfig, AutoTokenizer

    if args.training_length is None:
        args.training_length = AutoConfig.from_pretrained(args.checkpoint).max_position_embeddings
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    out_path = args.out or RESULTS[args.method]
    kept = json.loads(out_path.read_text()) if out_path.exists() else {"rows": [], "cost": []}
    setting = {"method": args.method, **method_params(args)}
    both = [int(n) for n in args.lengths.split(",") if n]
    alone = [int(n) for n in args.ctxext_only_lengths.split(",") if n]
    with tempfile.TemporaryDirectory() as scratch:
        for length in both + alone:
            prompts = smollm2_prompts(args, length, True, not args.no_passkey and length in both)
            for p in prompts:
                p["window"] = args.window
            ours = run_side("ctxext", args, prompts, Path(scratch))
            theirs = run_side("reference", args, prompts, Path(scratch)) if length in both else None
            record = {**setting, "length": length, "machine": machine_description(), **versions(args)}
            costs = {"ctxext": cost(ours), "reference": cost(theirs) if theirs else None}
            if theirs:
                for row in compare(ours, theirs, prompts, tokenizer):
                    kept["rows"] = [r for r in kept["rows"] if not same_row(r, {**record, **row})]
                    kept["rows"].append({**record, **row})
                    print(json.dumps({k: v for k, v in row.items() if "tokens" not in k}), flush=True)
            kept["cost"] = [c for c in kept["cost"] if not same_row(c, record)] + [{**record, **costs}]
            print(json.dumps({"length": length, **costs}), flush=True)
            out_path.parent.mkdir(exist_ok=True)
            out_path.write_text(json.dumps(kept, indent=1) + "\n")


def print_tables(kept: dict) -> None:
    """The agreement rows and the cost rows of a results JSON, as Markdown tables."""
    print(
        "| method | setting | prompt | tokens | greedy tokens equal | max abs logit diff (answer) | prefill: max abs "
        "logit diff / argmax disagreements |"
    )
    print("|---|---|---|---:|---|---:|---|")
    for r in kept["rows"]:
        setting = ", ".join(f"{k} {r[k]}" for k in ("group_size", "window", "k", "training_length") if k in r)
        equal = f"{r['agreeing_prefix']}/{r['new_tokens']}"
        prefill = "-"
        if "max_abs_logit_difference_prefill" in r:
            prefill = (
                f"{r['max_abs_logit_difference_prefill']:.2e} (first w: "
                f"{r['max_abs_logit_difference_prefill_first_window']:.1e}) / {r['prefill_argmax_disagreements']} of "
                f"{r['prefill_positions']}"
            )
        answer = f"{r['max_abs_logit_difference_answer']:.2e}"
        print(f"| {r['method']} | {setting} | {r['prompt']} | {r['prompt_tokens']} | {equal} | {answer} | {prefill} |")
    print()
    print(
        "| method | tokens | prefill s (theirs / ctxext, ratio) | peak RSS GiB after prefill (theirs / ctxext, ratio) "
        "| decode s/token (theirs / ctxext, ratio) |"
    )
    print("|---|---:|---|---|---|")
    for c in kept["cost"]:
        ours, ref = c["ctxext"], c["reference"]

        prefill = pair(ref, ours, "prefill_seconds", 1)
        peak = pair(ref, ours, "peak_rss_after_prefill_gib", 2)
        decode = pair(ref, ours, "decode_seconds_per_token", 3)
        print(f"| {c['method']} | {c['length']} | {prefill} | {peak} | {decode} |")


def pair(ref: dict | None, ours: dict, key: str, digits: int) -> str:
    """'theirs / ctxext (theirs/ctxext x)' for one cost, '- / ctxext' where the reference did not run."""
    if ref is None or ref[key] is None:
        return f"- / {ours[key]:.{digits}f}"
    text = f"{ref[key]:.{digits}f} / {ours[key]:.{digits}f}"
    return f"{text} ({ref[key] / ours[key]:.2f}x)"


def same_row(a: dict, b: dict) -> bool:
    keys = ("method", "group_size", "window", "k", "training_length", "length", "prompt")
    return all(a.get(k) == b.get(k) for k in keys)


def make_fixture(args) -> None:
    """The reference's numbers on tests/helpers.py's tiny LLaMA (seed 3, L = 64): 150 random ids (seed 7), the
    argmax of every prefill position, the logits of every 10th and of the last, and 4 greedy tokens with logits."""
    from tests.helpers import save_tiny_checkpoint, tiny_model

    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(scratch) / "tiny"
        save_tiny_checkpoint(checkpoint, tiny_model("llama", seed=3))
        config = json.loads((checkpoint / "config.json").read_text())
        config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
        (checkpoint / "config.json").write_text(json.dumps(config))
        args.checkpoint = args.reference_checkpoint = checkpoint
        if args.training_length is None:
            args.training_length = config["max_position_embeddings"]
        ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(7))
        prompts = [{"name": "tiny", "ids": ids, "new_tokens": 4, "full_logits": True}]
        fixture = json.loads(args.make_fixture.read_text()) if args.make_fixture.exists() else {"settings": {}}
        repo, commit, tf = REFERENCES[args.method]
        fixture["reference"] = f"{repo} commit {commit}, run under transformers {tf} by {Path(__file__).name}"
        fixture["model"] = "tests/helpers.py tiny_model('llama', seed=3): 2 layers, hidden 64, L = 64"
        fixture["prompt"] = "torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(7))"
        theirs = run_side("reference", args, prompts, Path(scratch))["prompts"][0]
        ours = run_side("ctxext", args, prompts, Path(scratch))["prompts"][0]
    every = list(range(0, 150, 10)) + [149]
    key = ",".join(f"{k}={v}" for k, v in method_params(args).items())
    fixture["settings"][key] = {
        "method": args.method,
        "params": method_params(args),
        "ctxext_kwargs": ctxext_kwargs(args),
        "prefill_argmax": theirs["full_logits"].argmax(-1).tolist(),
        "logit_positions": every,
        "prefill_logits": [[round(x, 6) for x in row] for row in theirs["full_logits"][every].tolist()],
        "tokens": theirs["tokens"],
        "logits": [[round(x, 6) for x in row] for row in theirs["logits"].tolist()],
        "ctxext_max_abs_difference_when_made": float((ours["full_logits"] - theirs["full_logits"]).abs().max()),
    }
    print(key, fixture["settings"][key]["ctxext_max_abs_difference_when_made"], theirs["tokens"], ours["tokens"])
    args.make_fixture.write_text(json.dumps(fixture) + "\n")


if __name__ == "__main__":
    main()
