"""`ctxext passkey`: passkey retrieval accuracy per length and depth (Landmark/YaRN format)."""

from __future__ import annotations

from .common import DEFAULT_LENGTHS, add_method_arguments, add_runtime_arguments

HELP = "passkey retrieval accuracy per length and depth (Landmark/YaRN format)"
DESCRIPTION = (
    "Hide a random 1-50000 pass key at each --depths fraction of a filler text of each --lengths "
    "size, decode 10 tokens greedily, and count a success when the first integer of the output is "
    "the key. The keys are seeded, so every method sees the same prompts. Writes results.json "
    "(every trial's output), results.csv, table.txt and a heat map passkey.png to --output."
)
EPILOG = "example: ctxext passkey my-model --method yarn --factor 2 --lengths 4k,8k,16k --trials 5 -o pk-out"


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a local checkpoint directory or a hub id")
    parser.add_argument(
        "--lengths",
        default=DEFAULT_LENGTHS,
        metavar="N,N,...",
        help=f"prompt lengths in tokens (default {DEFAULT_LENGTHS})",
    )
    parser.add_argument(
        "--depths",
        default="0,0.25,0.5,0.75,1",
        metavar="D,D,...",
        help="where the key sits: 0 = start, 1 = just before the question (default 0,0.25,0.5,0.75,1)",
    )
    parser.add_argument("--trials", type=int, default=5, metavar="N", help="trials per length and depth (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the keys (default 0)")
    parser.add_argument("--no-baseline", action="store_true", help="do not add the 'none' (plain RoPE) baseline")
    parser.add_argument("-o", "--output", required=True, help="directory for results.json, results.csv, passkey.png")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it already holds something")
    add_runtime_arguments(parser)
    add_method_arguments(parser, multiple=True)
    parser.set_defaults(text_file=None, dataset=None)


def run(args) -> int:
    import time
    from pathlib import Path

    from ..errors import CtxextError
    from ..eval.passkey import NEW_TOKENS, accuracy_rows, plan_trials, run_passkey
    from ..eval.report import environment, passkey_table, plot_passkey_heatmap, write_csv, write_json
    from ..outputs import atomic_output_dir
    from ..runtime import Processes, cpu_processes
    from .common import method_mappings, parse_depths, parse_lengths
    from .evaluation import (
        arguments,
        bos_choice,
        build_methods,
        check_outputs,
        command_line,
        load,
        model_description,
        progress_bar,
    )

    started = time.perf_counter()
    lengths = parse_lengths(args.lengths)
    depths = parse_depths(args.depths)
    if args.trials < 1:
        raise CtxextError(f"--trials must be at least 1, got {args.trials}")
    method_mappings(args)  # bad method flags fail before anything is loaded
    protected = check_outputs(args)
    processes = Processes(cpu=cpu_processes(args.device))
    model, tokenizer, runtime = load(args, processes)
    methods = build_methods(args, model)
    bos_id, bos_info = bos_choice(args, tokenizer)
    trials = plan_trials(lengths, depths, args.trials, args.seed)
    if processes.is_main:
        print(
            f"ctxext passkey: {args.trials} trials x {len(depths)} depths x {len(lengths)} lengths x "
            f"{len(methods)} methods; {runtime['dtype']} ({runtime['dtype_reason']}) on {runtime['device']}",
            flush=True,
        )
    progress = progress_bar(
        args, processes, len(trials[processes.rank :: processes.world_size]) * len(methods), "trial"
    )
    try:
        records = run_passkey(model, tokenizer, trials, methods, bos_id, processes, progress)
    finally:
        if progress is not None:
            progress.close()
    if not processes.is_main:
        return 0
    by_depth, by_length = accuracy_rows(records)
    labels = [m.label for m in methods]
    table = passkey_table(by_length, labels, lengths)
    payload = {
        "command": command_line(),
        "arguments": arguments(args),
        "model": model_description(args, model, runtime),
        "protocol": {
            "name": "passkey retrieval (Landmark / YaRN format), ctxext docs/METHODS.md",
            "decoding": f"greedy, {NEW_TOKENS} new tokens",
            "success": "first integer in the output == key",
            "key_range": [1, 50000],
            "depths": depths,
            "trials_per_cell": args.trials,
            "seed": args.seed,
            "bos": bos_info,
        },
        "methods": [{"label": m.label, **m.description} for m in methods],
        "lengths": lengths,
        "accuracy_by_length": by_length,
        "accuracy_by_depth": by_depth,
        "trials": records,
        "runtime": {"processes": processes.world_size, "seconds": time.perf_counter() - started},
        "environment": environment(),
    }
    with atomic_output_dir(args.output, protected, args.overwrite) as staging:
        write_json(staging / "results.json", payload)
        write_csv(
            staging / "results.csv",
            sorted(by_depth, key=lambda r: (labels.index(r["method"]), r["length"], r["depth"])),
            ["method", "length", "depth", "trials", "correct", "accuracy"],
        )
        (staging / "table.txt").write_text(table + "\n")
        plot_passkey_heatmap(
            by_depth,
            labels,
            lengths,
            depths,
            staging / "passkey.png",
            f"{Path(args.model).name}: passkey accuracy, {args.trials} trials per cell",
        )
    print()
    print(table)
    print(f"\nresults: {Path(args.output).resolve()} (results.json, results.csv, passkey.png)")
    return 0
