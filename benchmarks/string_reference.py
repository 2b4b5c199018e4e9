"""ctxext's string against STRING's reference code (HKUNLP/STRING, string_for_llama.py).

The reference runs unmodified in a child process under transformers 4.43.3 (the version its README pins), on the
same checkpoint and token ids; ctxext's string runs in another child under the installed transformers (fp32,
CPU, the same thread count), so that each side's peak RSS is its own. Stubs, each named:
  - `flash_attn` does not install on a CPU machine. The reference imports `flash_attn_func` and
    `flash_attn_with_kvcache` from `flash_attn`, `CrossEntropyLoss` from `flash_attn.losses.cross_entropy`
    (used only with labels) and the CUDA module `flash_attn_2_cuda`, whose `fwd_kvcache` its decoding calls for
    the softmax_lse that the kernel's Python wrapper does not return. The stand-ins are benchmarks/
    chunkllama_reference.py's FLASH_ATTN_STUB (explicit fp32 softmax, flash-attn 2's window rule
    [i + sk - sq - left, i + sk - sq + right] and bottom-right causal alignment, softmax_lse as (batch, heads,
    queries)), on the child's PYTHONPATH only, held to torch's SDPA by tests/test_chunkllama_reference.py. The
    reference's two attentions (the window and the shifted triangle) and their merge through the lse run
    unmodified; every cost figure for the reference measures its code over this stub;
  - the model is loaded with attn_implementation="eager": `replace_with_string` replaces the forward of
    LlamaAttention and LlamaFlashAttention2, not LlamaSdpaAttention's;
  - transformers 4.x reads `rope_theta` at the top of config.json (--reference-checkpoint, as for ChunkLlama).
Settings: `replace_with_string(max_test_length, shifted_offset=S, small_local_value=W)`: S = int(0.33 L) = 2703 and
W = 128 for SmolLM2 (L = 8192), the README's values, at every length (its RULER/NIAH scripts take S = 0.33 of
the test length instead; the comparison holds S fixed so both sides see one setting); max_test_length is the
prompt's length (it only sizes the reference's preallocated KV cache, which holds it + 1024). ctxext gets string
with shifted_offset = S, local_value = W and its default attention_factor 0.1 ln 2 + 1 (the reference's).

--stepwise (the tiny fixture, and --stepwise-lengths at full size) runs the same reference code with the prompt
fed as its first S - 1 tokens and then one token per forward, so that every position goes through its decoding path
(window of S keys, r' = r for r < S) instead of its prefill (window_size = [S, 0]: S + 1 keys, so the key at
r = S is attended twice, once at r' = S and once at r' = W).

    git -C MIRROR archive 216cc2f04cee147e8c3cfaa15723b182ecbe321e string_for_llama.py | tar -x -C REF
    pip install --target TF4433 transformers==4.43.3 'tokenizers<0.20,>=0.19' 'huggingface_hub<1.0' --no-deps
    python benchmarks/string_reference.py --reference-dir REF --reference-pythonpath TF4433 \
        --checkpoint .cache/smollm2-135m-instruct --reference-checkpoint SMOLLM2_WITH_ROPE_THETA \
        --lengths 4096,8192,16384
    python benchmarks/string_reference.py ... --make-fixture tests/fixtures/string_reference.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.chunkllama_reference as shared
from benchmarks.chunkllama_reference import (
    CHILD_COMMON,
    CTXEXT_CHILD,
    TINY_PROMPT,
    compare_answers,
    compare_prefill,
    ctxext_env,
    machine,
    passkey_prompts,
    play_ids,
    reference_env,
    run_child,
    save_tiny,
    scratch_dir,
    tiny_ids,
)

REFERENCE = "HKUNLP/STRING"
REFERENCE_COMMIT = "216cc2f04cee147e8c3cfaa15723b182ecbe321e"
RESULTS = Path(__file__).parent / "results" / "string_reference.json"
PLAY = "hamlet_gut"

REFERENCE_CHILD = (
    CHILD_COMMON
    + r"""
import os
import string_for_llama as S
S.replace_with_string(job["max_test_length"], shifted_offset=job["S"], small_local_value=job["W"])
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained(job["checkpoint"], attn_implementation="eager", torch_dtype=torch.float32)
assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"


def stepwise(model):
    # the prompt's first S - 1 tokens in one forward (its prefill with T < S returns the window's attention
    # alone; T = S would take [:, -0:] of the queries for the shifted part), then one token per forward, each
    # through its decoding path; then greedy tokens the same way
    # each query at position p < S attends keys 0..p only, but its decoding path still calls the shifted attention
    # with kv_seq_len - S = 0 keys for the query at S - 1: the stub returns lse = -inf there (an empty sum), so
    # that the merge gives that part weight 0; flash-attn 2 returns +inf, which would give it weight 1 (output 0)
    os.environ["CTXEXT_STUB_EMPTY_LSE"] = "-inf"
    ids, s = job["prefill"], job["S"] - 1
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids[:, :s], use_cache=True)
        logits.append(out.logits[0].float())
        past = out.past_key_values
        for t in range(s, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], position_ids=torch.tensor([[t]]), past_key_values=past,
                        use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0].float())
        prefill = torch.cat(logits)
        tokens, answer = [], []
        nxt = prefill[-1]
        for t in range(ids.shape[1], ids.shape[1] + job["new_tokens"]):
            answer.append(nxt)
            tokens.append(int(nxt.argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[t]]),
                        past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[0, -1].float()
    torch.save({"prefill_logits": prefill[None], "prefill_hidden": None,
                "passkey": [{"tokens": torch.tensor(tokens), "logits": torch.stack(answer)}]}, sys.argv[2])


stepwise(model) if job.get("stepwise") else run(model)
"""
)


def length_rows(args, scratch: Path, tokenizer, lm_head) -> list[dict]:
    S, W = args.shifted_offset or int(0.33 * args.original_length), args.local_value
    params = {"shifted_offset": S, "local_value": W}
    rows = []
    for length in args.lengths:
        prompts = [p for p in passkey_prompts(tokenizer, length) if p["depth"] in args.passkey_depths]
        base = {
            "threads": args.threads,
            "prefill": play_ids(tokenizer, length),
            "passkey": [p["ids"] for p in prompts],
            "new_tokens": args.new_tokens,
            "pad": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        }
        theirs = run_child(
            REFERENCE_CHILD,
            {
                **base,
                "checkpoint": str(args.reference_checkpoint or args.checkpoint),
                "S": S,
                "W": W,
                "max_test_length": length,
            },  # fmt: skip
            reference_env(args, scratch),
            scratch,
            f"ref-{length}",
        )
        print(f"reference @ {length}: {theirs and theirs['wall_seconds']} s", flush=True)
        ours = run_child(
            CTXEXT_CHILD,
            {**base, "checkpoint": str(args.checkpoint), "method": "string", "params": params},
            ctxext_env(),
            scratch,
            f"ctxext-{length}",
        )
        print(f"ctxext @ {length}: {ours and ours['wall_seconds']} s", flush=True)
        if theirs is None or ours is None:  # --only: one side's output is kept for a later run
            continue
        cost = {
            "prefill_seconds": {"reference": theirs["prefill_seconds"], "ctxext": ours["prefill_seconds"]},
            "peak_rss_after_prefill_bytes": {
                "reference": theirs["peak_rss_after_prefill_kib"] * 1024,
                "ctxext": ours["peak_rss_after_prefill_kib"] * 1024,
            },
            "decode_seconds_per_token": {
                side: sum(s for p in out["passkey"] for s in p["decode_step_seconds"])
                / max(1, sum(len(p["decode_step_seconds"]) for p in out["passkey"]))
                for side, out in (("reference", theirs), ("ctxext", ours))
            },
            "threads": args.threads,
        }
        cost["ratios_reference_over_ctxext"] = {
            k: cost[k]["reference"] / cost[k]["ctxext"]
            for k in ("prefill_seconds", "peak_rss_after_prefill_bytes", "decode_seconds_per_token")
            if cost[k]["ctxext"]
        }
        row = {
            "length": length,
            "settings": {**params, "attention_factor": 0.1 * 0.6931471805599453 + 1},
            "play": {"text": PLAY, **compare_prefill(theirs["prefill_hidden"], ours["prefill_hidden"], lm_head, S)},
            "passkey": [
                {"depth": p["depth"], "key": p["key"], "prompt_tokens": p["ids"].shape[1], **compare_answers(t, o)}
                for p, t, o in zip(prompts, theirs["passkey"], ours["passkey"])
            ],
            "cost": cost,
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "passkey"}), flush=True)
        print(json.dumps([{k: v for k, v in p.items() if "tokens" not in k} for p in row["passkey"]]), flush=True)
        save(args, "rows", [row])
    return rows


def stepwise_rows(args, scratch: Path, tokenizer) -> None:
    """The play prefix through the reference's decoding path (see --stepwise) against ctxext's prefill logits."""
    S, W = args.shifted_offset or int(0.33 * args.original_length), args.local_value
    for length in args.stepwise_lengths:
        job = {"threads": args.threads, "prefill": play_ids(tokenizer, length), "new_tokens": 1, "pad": 0}
        theirs = run_child(
            REFERENCE_CHILD,
            {
                **job,
                "checkpoint": str(args.reference_checkpoint or args.checkpoint),
                "S": S,
                "W": W,
                "max_test_length": length,
                "stepwise": True,
            },  # fmt: skip
            reference_env(args, scratch),
            scratch,
            f"step-{length}",
        )
        ours = run_child(
            CTXEXT_CHILD,
            {
                **job,
                "checkpoint": str(args.checkpoint),
                "method": "string",
                "prefill_logits": True,
                "params": {"shifted_offset": S, "local_value": W},
            },  # fmt: skip
            ctxext_env(),
            scratch,
            f"step-ctxext-{length}",
        )
        diff = (theirs["prefill_logits"][0] - ours["prefill_logits"][0]).abs().amax(-1)
        row = {
            "length": length,
            "settings": {"shifted_offset": S, "local_value": W},
            "reference_path": "first S - 1 tokens in one forward, then one token per forward (its decoding path); stub lse -inf on empty rows",
            "max_abs_logit_difference": float(diff.max()),
            "max_abs_logit_difference_from_S": float(diff[S:].max()),
            "argmax_equal_everywhere": bool(
                (theirs["prefill_logits"][0].argmax(-1) == ours["prefill_logits"][0].argmax(-1)).all()
            ),
            "reference_seconds": theirs["wall_seconds"],
        }
        print(json.dumps(row), flush=True)
        save(args, "rows_stepwise", [row])


def save(args, key, rows):
    kept = json.loads(args.out.read_text()) if args.out.exists() else {}
    kept.update(
        {
            "reference": f"{REFERENCE} string_for_llama.py, commit {REFERENCE_COMMIT}, under transformers 4.43.3, "
            "over the flash_attn stub of benchmarks/chunkllama_reference.py",
            "reference_commit": REFERENCE_COMMIT,
            "model": str(args.checkpoint),
            "dtype": "float32",
            "machine": machine(),
        }
    )
    old = [r for r in kept.get(key, []) if r["length"] not in {r2["length"] for r2 in rows}]
    kept[key] = sorted(old + rows, key=lambda r: r["length"])
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(kept, indent=1) + "\n")


def make_fixture(args, scratch: Path) -> None:
    tiny = save_tiny(scratch)
    S, W = 21, 4  # int(0.33 L) for L = 64, and W = L / 16 (STRING's W = 128 is past S here)
    job = {"threads": args.threads, "prefill": tiny_ids(), "passkey": [tiny_ids()], "new_tokens": 4, "pad": 0}
    job.update({"checkpoint": str(tiny), "S": S, "W": W, "max_test_length": 150, "prefill_logits": True})
    found = {}
    for name, stepwise in (("as_shipped", False), ("stepwise", True)):
        out = run_child(REFERENCE_CHILD, {**job, "stepwise": stepwise}, reference_env(args, scratch), scratch, name)
        found[name] = {
            "prefill_logits": [[round(x, 6) for x in row] for row in out["prefill_logits"][0].tolist()],
            "tokens": out["passkey"][0]["tokens"].tolist(),
            "logits": [[round(x, 6) for x in row] for row in out["passkey"][0]["logits"].tolist()],
        }
    fixture = {
        "reference": f"{REFERENCE} string_for_llama.py, commit {REFERENCE_COMMIT}, run under transformers 4.43.3 by "
        "benchmarks/string_reference.py's child over the flash_attn stub of benchmarks/chunkllama_reference.py, "
        "fp32, CPU",
        "model": "tests/helpers.py tiny_model('llama', seed=3): 2 layers, hidden 64, 4 heads, 2 KV heads, L = 64",
        "prompt": TINY_PROMPT,
        "settings": {"shifted_offset": S, "small_local_value": W, "max_test_length": 150, "new_tokens": 4},
        "runs": found,
        "run_notes": {
            "as_shipped": "the 150 tokens in one forward (its prefill: window_size [S, 0], S + 1 keys), then "
            "model.generate",
            "stepwise": "the first S - 1 tokens in one forward, then one token per forward (its decoding path, S keys "
            "in the window) for the rest of the prompt and the 4 greedy tokens; the stub returns lse = -inf for the empty "
            "shifted part of the query at S - 1 (flash-attn 2: +inf, which would zero that output)",
        },
    }
    Path(args.make_fixture).write_text(json.dumps(fixture) + "\n")
    print(f"wrote {args.make_fixture}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference-dir", required=True, help="the exported reference tree (string_for_llama.py)")
    parser.add_argument("--reference-pythonpath", required=True, help="where transformers 4.43.3 is installed")
    parser.add_argument("--checkpoint", type=Path, required=True, help="the model, as ctxext loads it")
    parser.add_argument("--reference-checkpoint", help="the same model with rope_theta at the top of config.json")
    parser.add_argument("--original-length", type=int, default=8192, help="L (SmolLM2-135M: 8192)")
    parser.add_argument("--shifted-offset", type=int, help="S (default int(0.33 L))")
    parser.add_argument("--local-value", type=int, default=128, help="W (default 128)")
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--stepwise-lengths", default="", help="lengths to run through the reference's decoding path")
    parser.add_argument("--passkey-depths", default="0.1,0.5,0.9", help="which of the depths 0.1, 0.5, 0.9 to run")
    parser.add_argument("--new-tokens", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--make-fixture", help="write the tiny-model fixture here instead")
    parser.add_argument("--keep-dir", help="keep the children's inputs and outputs here; reuse outputs found there")
    parser.add_argument(
        "--only", choices=("reference", "ctxext"), help="run one side's children only (with --keep-dir)"
    )
    args = parser.parse_args()
    shared.ONLY = args.only
    args.passkey_depths = [float(d) for d in args.passkey_depths.split(",") if d]
    args.lengths = [int(n) for n in args.lengths.split(",") if n]
    args.stepwise_lengths = [int(n) for n in args.stepwise_lengths.split(",") if n]
    with scratch_dir(args.keep_dir) as scratch:
        if args.make_fixture:
            make_fixture(args, Path(scratch))
            return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
        lm_head = model.get_output_embeddings().weight.detach().float()
        del model
        if args.stepwise_lengths:
            stepwise_rows(args, Path(scratch), tokenizer)
        if args.lengths:
            length_rows(args, Path(scratch), tokenizer, lm_head)


if __name__ == "__main__":
    main()
