"""ctxext's dual_chunk against Dual Chunk Attention's reference code (HKUNLP/ChunkLlama, chunkllama_attn_replace.py).

The reference runs unmodified in a child process under transformers 4.37.2 (the version its README and
requirements.txt pin), on the same checkpoint and token ids; ctxext's dual_chunk runs in another child under the
installed transformers (fp32, CPU, the same thread count), so that each side's peak RSS is its own. Stubs, each
named:
  - `flash_attn` does not install on a CPU machine and the reference imports it at the top of the file and calls
    `flash_attn_func(..., return_attn_probs=True)` for every chunk of the prefill (its decoding path is plain
    torch). A pure-torch stand-in (FLASH_ATTN_STUB below: an explicit fp32 softmax over blocks of queries,
    flash-attn 2's bottom-right causal alignment and window rule, `softmax_lse` returned as (batch, heads,
    queries)) is put on the child's PYTHONPATH only; tests/test_chunkllama_reference.py holds it to torch's SDPA
    and to a direct log-sum-exp. The reference's merge of the chunk attentions through softmax_lse
    (`merge_attn_outputs`) runs unmodified; every cost figure for the reference measures its code over this stub;
  - the model is loaded with attn_implementation="eager": `replace_with_chunkllama` replaces the forward of
    LlamaAttention and LlamaFlashAttention2, not of LlamaSdpaAttention, and transformers 4.37 refuses
    "flash_attention_2" without flash-attn installed;
  - transformers 4.x reads `rope_theta` at the top of config.json: a checkpoint written by transformers 5 keeps it
    in `rope_parameters`, so pass --reference-checkpoint with the key copied up (SmolLM2: 1e5).
Settings: `replace_with_chunkllama(pretraining_length=L, local_window_size=w)` sets chunk_size = 3L/4 and the
local window w (default L // 8 in its code); ctxext gets dual_chunk with chunk_size = 3L/4 and local_window = w,
so the chunk length c = chunk_size - w is the same on both sides.

--no-mscale runs the reference from a copy of the checkpoint whose config says max_position_embeddings = 1 << 20:
its rotary class multiplies cos and sin by get_mscale(T / max_position_embeddings) = 0.05 ln(T / L) + 1 once a
sequence is longer than max_position_embeddings (ctxext's dual_chunk does not), and this isolates that one rule
without touching its code (chunk_size and w come from the call, not from the config).

    git -C MIRROR archive 2add4d7c99d24dcc1ab03414cc602abb2e28cf2c chunkllama_attn_replace.py | tar -x -C REF
    pip install --target TF4372 transformers==4.37.2 'tokenizers<0.19,>=0.14' 'huggingface_hub<1.0' --no-deps
    python benchmarks/chunkllama_reference.py --reference-dir REF --reference-pythonpath TF4372 \
        --checkpoint .cache/smollm2-135m-instruct --reference-checkpoint SMOLLM2_WITH_ROPE_THETA \
        --lengths 4096,8192,16384
    python benchmarks/chunkllama_reference.py ... --make-fixture tests/fixtures/chunkllama_reference.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REFERENCE = "HKUNLP/ChunkLlama"
REFERENCE_COMMIT = "2add4d7c99d24dcc1ab03414cc602abb2e28cf2c"
RESULTS = Path(__file__).parent / "results" / "chunkllama_reference.json"
PLAY = "hamlet_gut"
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)  # ctxext compare's depths (ctxext/compare/request.py), keys seeded by 0
PASSKEY_SEED = 0

# ------------------------------------------------------------------------------------------------ the stub
# A stand-in for the three names of flash-attn 2 the two references call, written as a plain reference (not a
# copy of flash-attn): fp32 scores, an explicit softmax, per block of queries over the keys the mask can reach.
FLASH_ATTN_STUB = {
    "flash_attn/__init__.py": '''"""STUB, not flash-attn: pure-torch stand-ins for flash_attn_func / flash_attn_with_kvcache (fp32)."""
__version__ = "0.0.0+ctxext-stub"
from .flash_attn_interface import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_with_kvcache  # noqa
''',
    "flash_attn/losses/__init__.py": "",
    "flash_attn/losses/cross_entropy.py": "from torch.nn import CrossEntropyLoss  # noqa  (imported, used with labels)\n",
    "flash_attn/flash_attn_interface.py": '''"""STUB, not flash-attn (see benchmarks/chunkllama_reference.py)."""
import math
import os

import torch

BLOCK = 256


def attend(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """q (b, sq, h, d), k and v (b, sk, hk, d), hk dividing h. flash-attn 2's masks: query i sees the keys j
    with i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded; causal sets right = 0). Returns out
    (b, sq, h, d) in q's dtype and softmax_lse (b, h, sq) in fp32 (+inf, out 0 where a row sees no key)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    off = sk - sq
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    out = torch.zeros(b, h, sq, d, dtype=torch.float32, device=q.device)
    # a row that sees no key: out 0 and lse +inf, flash-attn 2's value; CTXEXT_STUB_EMPTY_LSE=-inf gives the
    # log of an empty sum instead (string_reference.py's --stepwise diagnostic, named there)
    empty = float(os.environ.get("CTXEXT_STUB_EMPTY_LSE", "inf"))
    lse = torch.full((b, h, sq), empty, dtype=torch.float32, device=q.device)
    for a in range(0, sq, BLOCK):
        e = min(a + BLOCK, sq)
        lo = 0 if left < 0 else max(0, a + off - left)
        hi = sk if right < 0 else min(sk, e - 1 + off + right + 1)
        if hi <= lo:
            continue
        i = torch.arange(a, e, device=q.device)[:, None] + off
        j = torch.arange(lo, hi, device=q.device)[None, :]
        keep = torch.ones(e - a, hi - lo, dtype=torch.bool, device=q.device)
        if right >= 0:
            keep &= j <= i + right
        if left >= 0:
            keep &= j >= i - left
        s = torch.matmul(qf[:, :, a:e], kf[:, :, lo:hi].transpose(-1, -2)) * scale
        s = s.masked_fill(~keep, -math.inf)
        m = s.amax(-1, keepdim=True)
        seen = torch.isfinite(m)
        m = torch.where(seen, m, torch.zeros_like(m))
        p = torch.exp(s - m)
        total = p.sum(-1, keepdim=True)
        o = torch.matmul(p, vf[:, :, lo:hi]) / total.clamp(min=1e-38)
        out[:, :, a:e] = torch.where(seen, o, torch.zeros_like(o))
        lse[:, :, a:e] = torch.where(seen, m + total.clamp(min=1e-38).log(), torch.full_like(m, empty))[..., 0]
    return out.transpose(1, 2).to(q.dtype), lse


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    assert dropout_p == 0.0 and alibi_slopes is None, "the stub covers what the references call"
    out, lse = attend(q, k, v, softmax_scale, causal, window_size)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), rotary_interleaved=True, alibi_slopes=None,
                            num_splits=0):
    out, _ = fwd_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                         block_table, alibi_slopes, None, softmax_scale, causal, window_size[0], window_size[1],
                         rotary_interleaved, num_splits)
    return out


def flash_attn_qkvpacked_func(*args, **kwargs):
    raise NotImplementedError("imported by the reference, never called on its paths; not stubbed")


def fwd_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx, block_table,
                alibi_slopes, out, softmax_scale, causal, window_left, window_right, rotary_interleaved, num_splits):
    """flash_attn_2_cuda.fwd_kvcache without appending k/v or rotating: attention over k_cache[:, :seqlen]."""
    assert k is None and v is None and rotary_cos is None and block_table is None and cache_batch_idx is None
    assert alibi_slopes is None
    lengths = torch.as_tensor(cache_seqlens).reshape(-1)
    assert bool((lengths == lengths[0]).all()), "one cache length for the batch"
    n = int(lengths[0])
    o, lse = attend(q, k_cache[:, :n], v_cache[:, :n], softmax_scale, causal, (window_left, window_right))
    return [o, lse]
''',
    "flash_attn_2_cuda.py": '"""STUB, not flash-attn\'s CUDA module."""\n'
    "from flash_attn.flash_attn_interface import fwd_kvcache  # noqa\n",
}


def write_stub(folder: Path) -> Path:
    for name, text in FLASH_ATTN_STUB.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


# ----------------------------------------------------------------------------------------- the children
# One child per (side, length). It loads the model, patches it (reference: the authors' call; ctxext: patch), runs
# the base model over the play prefix (the final norm's output is kept: the logits are lm_head of it, computed by
# the parent for both sides the same way), then greedy passkey answers with the logits of each step read from a
# hook on lm_head. Peak RSS is read right after the prefill (before any passkey).
CHILD_COMMON = r"""
import json, resource, sys, time
import torch
job = torch.load(sys.argv[1])
torch.set_num_threads(job["threads"])
torch.manual_seed(0)

def run(model, use_cache_for_prefill=True):
    model.eval()
    out = {"seconds": {}, "steps": []}
    kept = {}
    model.model.norm.register_forward_hook(lambda m, i, o: kept.__setitem__("h", o.float().clone()))
    if job.get("prefill") is not None:
        ids = job["prefill"]
        started = time.perf_counter()
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=use_cache_for_prefill)
        out["prefill_seconds"] = time.perf_counter() - started
        out["prefill_hidden"] = kept["h"].to(torch.float32)
    out["peak_rss_after_prefill_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step_times, last = [], []

    def on_logits(module, inputs, output):  # returns None: the output stays
        last.append(output[0, -1].float().clone())
        step_times.append(time.perf_counter())

    model.lm_head.register_forward_hook(on_logits)
    out["passkey"] = []
    for ids in job.get("passkey", []):
        last.clear(); step_times.clear()
        started = time.perf_counter()
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=job["new_tokens"],
                                 do_sample=False, num_beams=1, pad_token_id=job["pad"], temperature=None,
                                 top_p=None, top_k=None)
        new = seq[0, ids.shape[1]:]
        out["passkey"].append({"tokens": new, "logits": torch.stack(last[-len(new):]),
                               "prefill_seconds": step_times[0] - started,
                               "decode_step_seconds": [b - a for a, b in zip(step_times, step_times[1:])]})
    if job.get("prefill_logits"):
        out["prefill_logits"] = model.lm_head(out["prefill_hidden"])
    out["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.save(out, sys.argv[2])
"""

REFERENCE_CHILD = (
    CHILD_COMMON
    + r"""
import transformers
import chunkllama_attn_replace as C
from chunkllama_attn_replace import replace_with_chunkllama
if job.get("fp32_merge"):  # diagnostic only: merge_attn_outputs with its one cast of the weights to bf16 removed
    import inspect
    source = inspect.getsource(C.merge_attn_outputs)
    assert source.count("lse_s = lse_s.to(torch.bfloat16)") == 1
    exec(source.replace("lse_s = lse_s.to(torch.bfloat16)", "pass"), C.__dict__)
replace_with_chunkllama(pretraining_length=job["L"], local_window_size=job["local_window"])
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained(job["checkpoint"], attn_implementation="eager", torch_dtype=torch.float32)
assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"
run(model)
"""
)

CTXEXT_CHILD = (
    CHILD_COMMON
    + r"""
import ctxext
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(job["checkpoint"], dtype=torch.float32, attn_implementation="sdpa")
ctxext.patch(model, job["method"], **job["params"])
run(model)
"""
)


ONLY = None  # --only: run just this side's children (their outputs kept in --keep-dir), build no row


def run_child(script: str, job: dict, env: dict, scratch: Path, name: str) -> dict:
    job_path, out_path = scratch / f"{name}-job.pt", scratch / f"{name}-out.pt"
    if out_path.exists():  # --keep-dir: a child that ran already (the same job) is not run again
        return {**torch.load(out_path), "wall_seconds": None}
    side = "ctxext" if "ctxext" in name else "reference"
    if ONLY is not None and side != ONLY:
        return None
    torch.save(job, job_path)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", script, str(job_path), str(out_path)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    out = torch.load(out_path)
    out["wall_seconds"] = time.perf_counter() - started
    return out


def reference_env(args, scratch: Path) -> dict:
    stub = write_stub(scratch / "stub")
    path = os.pathsep.join([str(args.reference_pythonpath), str(args.reference_dir), str(stub)])
    return {**os.environ, "PYTHONPATH": path}


def ctxext_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return env


# ------------------------------------------------------------------------------------------- the inputs
def play_ids(tokenizer, length: int) -> torch.Tensor:
    from ctxext import assets

    ids = tokenizer(assets.shakespeare_text([PLAY]), add_special_tokens=False).input_ids
    if len(ids) < length:
        raise SystemExit(f"{PLAY} has {len(ids)} tokens, fewer than {length}")
    return torch.tensor(ids[:length])[None]


def passkey_prompts(tokenizer, length: int) -> list[dict]:
    from ctxext.eval.data import tokenizer_adds_bos
    from ctxext.eval.passkey import build_prompt, plan_trials

    bos = tokenizer.bos_token_id if tokenizer_adds_bos(tokenizer) else None
    return [
        {"depth": t.depth, "key": t.key, "ids": build_prompt(tokenizer, length, t.depth, t.key, bos)[None]}
        for t in plan_trials([length], list(PASSKEY_DEPTHS), 1, seed=PASSKEY_SEED)
    ]


def machine() -> dict:
    import transformers

    from ctxext.runtime import machine_description

    model_name, flags = "", ""
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model_name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if "Model name" in ln), "")
        flags = next((ln for ln in info.splitlines() if ln.startswith("Flags")), "")
    except OSError:
        pass
    return {
        "description": machine_description(),
        "cpu": model_name,
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": any(f in flags for f in ("amx_bf16", "amx_tile")),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers_ctxext_side": transformers.__version__,
    }


# ----------------------------------------------------------------------------------------- comparison
def compare_prefill(theirs: torch.Tensor, ours: torch.Tensor, lm_head: torch.Tensor, plain_up_to: int) -> dict:
    """Next-token logits over every prefill position, lm_head applied here to both sides' final hidden states."""
    worst, worst_plain, same, worst_at = 0.0, 0.0, 0, -1
    total = theirs.shape[1]
    for a in range(0, total, 1024):
        lt = theirs[0, a : a + 1024] @ lm_head.T
        lo = ours[0, a : a + 1024] @ lm_head.T
        diff = (lt - lo).abs().amax(-1)
        if float(diff.max()) > worst:
            worst, worst_at = float(diff.max()), a + int(diff.argmax())
        plain = max(0, min(plain_up_to - a, diff.shape[0]))
        if plain:
            worst_plain = max(worst_plain, float(diff[:plain].max()))
        same += int((lt.argmax(-1) == lo.argmax(-1)).sum())
    return {
        "positions": total,
        "max_abs_logit_difference": worst,
        "at_position": worst_at,
        "max_abs_logit_difference_plain_positions": worst_plain,
        "plain_positions": min(plain_up_to, total),
        "argmax_equal_positions": same,
        "argmax_equal_everywhere": same == total,
    }


def compare_answers(theirs: dict, ours: dict) -> dict:
    steps = min(len(theirs["tokens"]), len(ours["tokens"]))
    same = int((theirs["tokens"][:steps] == ours["tokens"][:steps]).long().cumprod(0).sum())
    return {
        "reference_tokens": theirs["tokens"].tolist(),
        "ctxext_tokens": ours["tokens"].tolist(),
        "agreeing_prefix": same,
        "tokens_equal": theirs["tokens"].tolist() == ours["tokens"].tolist(),
        "max_abs_logit_difference_first_token": float((theirs["logits"][0] - ours["logits"][0]).abs().max()),
        "max_abs_logit_difference_agreeing_tokens": float((theirs["logits"][:same] - ours["logits"][:same]).abs().max())
        if same
        else None,
    }


def reference_checkpoint_without_mscale(source: Path, scratch: Path) -> Path:
    """A copy (links) of the reference checkpoint whose config says max_position_embeddings = 1 << 20."""
    target = scratch / "no-mscale"
    target.mkdir()
    for item in source.iterdir():
        if item.name != "config.json":
            os.symlink(item.resolve(), target / item.name)
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = 1 << 20
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def length_rows(args, scratch: Path, tokenizer, lm_head) -> list[dict]:
    L = args.original_length
    w = args.local_window or L // 8
    params = {"chunk_size": 3 * L // 4, "local_window": w}
    rows = []
    ref_ckpt = Path(args.reference_checkpoint or args.checkpoint)
    if args.no_mscale:
        ref_ckpt = reference_checkpoint_without_mscale(ref_ckpt, scratch)
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
            {**base, "checkpoint": str(ref_ckpt), "L": L, "local_window": w},
            reference_env(args, scratch),
            scratch,
            f"ref-{length}",
        )
        print(f"reference @ {length}: {theirs and theirs['wall_seconds']} s", flush=True)
        ours = run_child(
            CTXEXT_CHILD,
            {**base, "checkpoint": str(args.checkpoint), "method": "dual_chunk", "params": params},
            ctxext_env(),
            scratch,
            f"ctxext-{length}",
        )
        print(f"ctxext @ {length}: {ours and ours['wall_seconds']} s", flush=True)
        if theirs is None or ours is None:  # --only: one side's output is kept for a later run
            continue
        row = {
            "length": length,
            "settings": {**params, "chunk_length": params["chunk_size"] - w, "reference_mscale": not args.no_mscale},
            "play": {
                "text": PLAY,
                **compare_prefill(theirs["prefill_hidden"], ours["prefill_hidden"], lm_head, 3 * L // 4 - w),
            },
            "passkey": [
                {"depth": p["depth"], "key": p["key"], "prompt_tokens": p["ids"].shape[1], **compare_answers(t, o)}
                for p, t, o in zip(prompts, theirs["passkey"], ours["passkey"])
            ],
            "cost": {
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
            },
        }
        c = row["cost"]
        c["ratios_reference_over_ctxext"] = {
            k: c[k]["reference"] / c[k]["ctxext"]
            for k in ("prefill_seconds", "peak_rss_after_prefill_bytes", "decode_seconds_per_token")
            if c[k]["ctxext"]
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "passkey"}), flush=True)
        print(
            json.dumps(
                [{k: v for k, v in p.items() if "tokens" not in k or k == "agreeing_prefix"} for p in row["passkey"]]
            ),
            flush=True,
        )
        save_rows(args, [row])
    return rows


def save_rows(args, rows):
    kept = json.loads(args.out.read_text()) if args.out.exists() else {}
    kept.update(
        {
            "reference": f"{REFERENCE} chunkllama_attn_replace.py, commit {REFERENCE_COMMIT}, under transformers 4.37.2, "
            "over the flash_attn stub of benchmarks/chunkllama_reference.py",
            "reference_commit": REFERENCE_COMMIT,
            "model": str(args.checkpoint),
            "dtype": "float32",
            "machine": machine(),
        }
    )
    key = "rows_no_mscale" if args.no_mscale else "rows"
    old = [r for r in kept.get(key, []) if r["length"] not in {r2["length"] for r2 in rows}]
    kept[key] = sorted(old + rows, key=lambda r: r["length"])
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(kept, indent=1) + "\n")


# ------------------------------------------------------------------------------------------- the fixture
TINY_PROMPT = "torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(7))"


def tiny_ids() -> torch.Tensor:
    return torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(7))


def save_tiny(scratch: Path) -> Path:
    """tests/helpers.py tiny_model('llama', seed=3) saved with rope_theta at the top of config.json for 4.x."""
    from tests.helpers import tiny_model

    path = scratch / "tiny"
    tiny_model("llama", seed=3).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    config["rope_scaling"] = None
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def make_fixture(args, scratch: Path) -> None:
    tiny = save_tiny(scratch)
    L, w = 64, 8  # chunk_size 48, local window L // 8 (the reference's default), c = 40: 150 tokens = 4 chunks
    job = {"threads": args.threads, "prefill": tiny_ids(), "passkey": [tiny_ids()], "new_tokens": 4, "pad": 0}
    job["prefill_logits"] = True
    found = {}
    no_mscale = reference_checkpoint_without_mscale(tiny, scratch)
    for name, ckpt, fp32_merge in (
        ("as_shipped", tiny, False),
        ("no_mscale", no_mscale, False),
        ("no_mscale_fp32_merge", no_mscale, True),
    ):
        out = run_child(
            REFERENCE_CHILD,
            {**job, "checkpoint": str(ckpt), "L": L, "local_window": w, "fp32_merge": fp32_merge},
            reference_env(args, scratch),
            scratch,
            f"tiny-{name}",
        )
        found[name] = {
            "prefill_logits": [[round(x, 6) for x in row] for row in out["prefill_logits"][0].tolist()],
            "tokens": out["passkey"][0]["tokens"].tolist(),
            "logits": [[round(x, 6) for x in row] for row in out["passkey"][0]["logits"].tolist()],
        }
    fixture = {
        "reference": f"{REFERENCE} chunkllama_attn_replace.py, commit {REFERENCE_COMMIT}, run under transformers "
        "4.37.2 by benchmarks/chunkllama_reference.py's child over its flash_attn stub, fp32, CPU",
        "model": "tests/helpers.py tiny_model('llama', seed=3): 2 layers, hidden 64, 4 heads, 2 KV heads, L = 64",
        "prompt": TINY_PROMPT,
        "settings": {"pretraining_length": L, "local_window_size": w, "chunk_size": 3 * L // 4, "new_tokens": 4},
        "runs": found,
        "run_notes": {
            "as_shipped": "config max_position_embeddings = 64: the reference scales cos and sin by "
            "0.05 ln(T/64) + 1 (T = 150 in the prefill, T = 151.. in decoding)",
            "no_mscale": "config max_position_embeddings = 1 << 20: the same code, its mscale is 1",
            "no_mscale_fp32_merge": "as no_mscale, and (diagnostic, the one change made to the reference's code) "
            "merge_attn_outputs without its cast of the merge weights to bfloat16",
        },
    }
    Path(args.make_fixture).write_text(json.dumps(fixture) + "\n")
    print(f"wrote {args.make_fixture}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reference-dir", required=True, help="the exported reference tree (chunkllama_attn_replace.py)"
    )
    parser.add_argument("--reference-pythonpath", required=True, help="where transformers 4.37.2 is installed")
    parser.add_argument("--checkpoint", type=Path, required=True, help="the model, as ctxext loads it")
    parser.add_argument("--reference-checkpoint", help="the same model with rope_theta at the top of config.json")
    parser.add_argument("--original-length", type=int, default=8192, help="L (SmolLM2-135M: 8192)")
    parser.add_argument("--local-window", type=int, help="w (default L // 8, the reference's default)")
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--passkey-depths", default="0.1,0.5,0.9", help="which of the depths 0.1, 0.5, 0.9 to run")
    parser.add_argument("--new-tokens", type=int, default=10, help="greedy tokens per passkey answer (default 10)")
    parser.add_argument("--no-mscale", action="store_true", help="the reference with its mscale rule off (see above)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--make-fixture", help="write the tiny-model fixture here instead")
    parser.add_argument("--keep-dir", help="keep the children's inputs and outputs here; reuse outputs found there")
    parser.add_argument(
        "--only", choices=("reference", "ctxext"), help="run one side's children only (with --keep-dir)"
    )
    args = parser.parse_args()
    args.passkey_depths = [float(d) for d in args.passkey_depths.split(",") if d]
    args.lengths = [int(n) for n in args.lengths.split(",")]
    random.seed(0)
    global ONLY
    ONLY = args.only
    with scratch_dir(args.keep_dir) as scratch:
        if args.make_fixture:
            make_fixture(args, Path(scratch))
            return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
        lm_head = model.get_output_embeddings().weight.detach().float()
        del model
        length_rows(args, Path(scratch), tokenizer, lm_head)


def scratch_dir(keep: str | None):
    """A temporary folder, or --keep-dir (kept, so that its children's outputs are reused by a later run)."""
    if keep is None:
        return tempfile.TemporaryDirectory()
    Path(keep).mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(keep)


if __name__ == "__main__":
    main()
