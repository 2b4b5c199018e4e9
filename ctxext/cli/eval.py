"""`ctxext eval`: sliding-window perplexity at several lengths, several methods on the same tokens."""

from __future__ import annotations

from .common import DEFAULT_LENGTHS, add_data_arguments, add_method_arguments, add_runtime_arguments

HELP = "sliding-window perplexity at several lengths, for several methods on the same tokens"
DESCRIPTION = (
    "Perplexity of MODEL at each --lengths value, per the protocol in docs/METHODS.md: windows of that "
    "length advance by --stride; each token is scored once (earlier targets get label -100); "
    "exp(token-weighted mean NLL) over all documents; documents are evaluated separately and one "
    "shorter than a window is skipped (reported) or, with --short-docs truncate, scored in one "
    "shorter window. --stride window is one pass per document (YaRN's tables). Every method is "
    "scored on exactly the same tokens; 'none' (plain RoPE) is always included as the baseline. "
    "Without --method/--config the model is evaluated as loaded. Writes results.json (with "
    "provenance), results.csv, table.txt and perplexity.png to --output. "
    "Under `accelerate launch -m ctxext eval ...` the windows are shared among the processes."
)
EPILOG = (
    "example: ctxext eval my-model --method linear --method yarn --factor 2 --lengths 2k,4k,8k,16k "
    "--dataset pg19 --max-docs 20 -o eval-out"
)


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a local checkpoint directory or a hub id")
    parser.add_argument(
        "--lengths",
        default=DEFAULT_LENGTHS,
        metavar="N,N,...",
        help=f"windows (evaluated contexts) in tokens, e.g. 2048,4096 or 2k,4k (default {DEFAULT_LENGTHS})",
    )
    parser.add_argument(
        "--stride",
        default="256",
        metavar="S",
        help="how far each window advances (default 256; a window not longer than it advances by "
        "half its length); 'window' = one pass per document",
    )
    parser.add_argument(
        "--short-docs",
        choices=("skip", "truncate"),
        default="skip",
        help="a document shorter than the window: skip it (default; reported) or score it in one "
        "window of its own length",
    )
    parser.add_argument("--no-baseline", action="store_true", help="do not add the 'none' (plain RoPE) baseline")
    parser.add_argument("-o", "--output", required=True, help="directory for results.json, results.csv, perplexity.png")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it already holds something")
    add_data_arguments(parser)
    add_runtime_arguments(parser)
    add_method_arguments(parser, multiple=True)


def run(args) -> int:
    import time
    from pathlib import Path

    from ..errors import CtxextError
    from ..eval.data import load_documents
    from ..eval.report import environment, perplexity_table, plot_perplexity, write_csv, write_json
    from ..eval.runner import plan_lengths, run_perplexity
    from ..outputs import atomic_output_dir
    from ..runtime import Processes, cpu_processes
    from .common import method_mappings, parse_lengths, parse_stride
    from .evaluation import (
        arguments,
        bos_choice,
        build_methods,
        check_outputs,
        command_line,
        load,
        model_description,
        original_length,
        progress_bar,
    )

    started = time.perf_counter()
    lengths = parse_lengths(args.lengths)
    stride = parse_stride(args.stride)
    if args.short_docs not in ("skip", "truncate"):
        raise CtxextError("--short-docs must be skip or truncate")
    method_mappings(args)  # bad method flags fail before anything is loaded
    protected = check_outputs(args)
    processes = Processes(cpu=cpu_processes(args.device))

    model, tokenizer, runtime = load(args, processes)
    methods = build_methods(args, model)
    bos_id, bos_info = bos_choice(args, tokenizer)
    docs = load_documents(
        tokenizer,
        text_files=args.text_file,
        dataset=args.dataset,
        split=args.split,
        dataset_config=args.dataset_config,
        text_field=args.text_field,
        max_docs=args.max_docs,
        min_doc_tokens=args.min_doc_tokens,
    )
    plans = plan_lengths(docs.documents, lengths, stride, bos_id, args.short_docs)

    if processes.is_main:
        mode = "one pass per document (stride = window)" if stride is None else f"sliding window, stride {stride}"
        halved = [f"{p.stride} at {p.length}" for p in plans if stride is not None and p.stride != stride]
        if halved:
            mode += f" ({', '.join(halved)}: half of a window not longer than the stride)"
        print(
            f"ctxext eval: {len(docs.documents)} documents ({sum(len(d) for d in docs.documents)} tokens), "
            f"{mode}, {len(methods)} methods x {len(lengths)} lengths; {runtime['dtype']} "
            f"({runtime['dtype_reason']}) on {runtime['device']}, {runtime['attn_implementation']}"
            f"{f', {processes.world_size} processes' if processes.world_size > 1 else ''}",
            flush=True,
        )
    total = sum(w.length for p in plans for w in p.windows[processes.rank :: processes.world_size]) * len(methods)
    progress = progress_bar(args, processes, total, "tok")
    try:
        scores = run_perplexity(model, docs.documents, plans, methods, bos_id, processes, progress)
    finally:
        if progress is not None:
            progress.close()
    if not processes.is_main:
        return 0

    rows = [s.to_dict() for s in scores]
    labels = [m.label for m in methods]
    table = perplexity_table(rows, labels, lengths)
    payload = {
        "command": command_line(),
        "arguments": arguments(args),
        "model": model_description(args, model, runtime),
        "protocol": {
            "name": "sliding-window perplexity (Press et al.; HF docs 'Perplexity of fixed-length models'); "
            "ctxext docs/METHODS.md 'Perplexity protocol'",
            "mode": "truncate: one pass per document over its first window" if stride is None else "sliding window",
            "stride": "window" if stride is None else stride,
            "stride_per_length": {str(p.length): p.stride for p in plans},
            "stride_rule": "a window not longer than the stride slides by half its length (ctxext.eval.perplexity."
            "stride_at)",
            "scoring": "each token is scored once; tokens scored by an earlier window get label -100",
            "averaging": "token-weighted: exp(sum of NLL / tokens scored) over all documents",
            "documents": "evaluated separately",
            "short_documents": args.short_docs,
            "bos": bos_info,
        },
        "dataset": docs.describe(),
        "methods": [{"label": m.label, **m.description} for m in methods],
        "lengths": lengths,
        "results": rows,
        "runtime": {"processes": processes.world_size, "seconds": time.perf_counter() - started},
        "environment": environment(),
    }
    with atomic_output_dir(args.output, protected, args.overwrite) as staging:
        write_json(staging / "results.json", payload)
        write_csv(
            staging / "results.csv",
            rows,
            [
                "method",
                "length",
                "stride",
                "perplexity",
                "mean_nll",
                "nll_sum",
                "tokens_scored",
                "windows",
                "documents",
                "documents_skipped",
                "seconds",
                "tokens_sha256",
            ],
        )
        (staging / "table.txt").write_text(table + "\n")
        plot_perplexity(
            rows,
            labels,
            staging / "perplexity.png",
            f"{Path(args.model).name}, {docs.source.get('name') or docs.source.get('kind')}\n"
            f"{'one pass per document (stride = window)' if stride is None else f'stride {stride}'}, "
            f"{payload['model']['dtype']}",
            original_length(model),
        )
    print()
    print(table)
    skipped = {n: p.skipped for n, p in zip(lengths, plans) if p.skipped}
    for length, names in skipped.items():
        print(
            f"skipped at {length}: {len(names)} documents shorter than the window ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''})"
        )
    print(f"\nresults: {Path(args.output).resolve()} (results.json, results.csv, perplexity.png)")
    return 0
