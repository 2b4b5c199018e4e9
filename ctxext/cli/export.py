"""`ctxext export`: which engines serve a patched model and how, with the parity checks this machine can run;
and a copy of the checkpoint written for one engine."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..errors import CtxextError
from .common import HelpFormatter

HELP = "which engines (vLLM, SGLang, llama.cpp, transformers) serve a patched model, checked"
DESCRIPTION = (
    "For MODEL (a checkpoint directory or a GGUF file written by ctxext), print a table of the serving engines: exact "
    "(the engine computes what ctxext computes), approximate (what differs is said), or no (and what to do instead). "
    "--check also runs the parity checks this machine can run: plain transformers in a subprocess that never imports "
    "ctxext, and llama.cpp where llama-cpp-python is installed (in a child process: a crash of llama.cpp is a line in "
    "the table and exit status 1), and vLLM's and SGLang's own rotary code where they are installed (in child "
    "processes; benchmarks/engine_parity.py runs it from their wheels). --engine E -o OUT writes a copy of the "
    "checkpoint whose config E reads exactly, or refuses in one line where E has no exact form (--allow-approximate "
    "writes it anyway, labelled: for dual_chunk on a Qwen2-family model, --engine sglang --allow-approximate writes "
    "SGLang's dual_chunk_attention_config)."
)
FORMATTER_CLASS = HelpFormatter  # wraps prose, keeps the examples one a line
EPILOG = (
    "examples:\n"
    "  ctxext export ./llama-16k --check\n"
    "  ctxext export ./llama-16k-ctxext-format --engine vllm -o ./llama-16k-vllm\n"
    "  ctxext export ./qwen2-dual-chunk --engine sglang --allow-approximate -o ./qwen2-dca-sglang\n"
    "  ctxext export model-32k.gguf --check"
)


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a checkpoint directory or a .gguf file")
    parser.add_argument("--check", action="store_true", help="run the parity checks this machine can run")
    parser.add_argument(
        "--tokens", type=int, default=256, metavar="N", help="random tokens per parity check (default 256)"
    )
    parser.add_argument(
        "--engine",
        choices=("transformers", "vllm", "sglang", "llama.cpp"),
        help="write a copy of the checkpoint for this engine to -o",
    )
    parser.add_argument("-o", "--output", help="where --engine writes the copy")
    parser.add_argument(
        "--allow-approximate",
        action="store_true",
        help="with --engine: write the copy even where that engine serves it only approximately (the verdict says "
        "what differs); without it export refuses there",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace -o if it already exists")
    parser.add_argument("--json", metavar="FILE", help="also write the table as JSON")


def run(args) -> int:
    from ..serving.engines import engine_table, evidence, export_checkpoint, read_served_model

    if (args.engine is None) != (args.output is None):
        raise CtxextError("--engine and -o go together: --engine ENGINE -o OUT writes a copy for that engine")
    if args.tokens < 2:
        raise CtxextError(f"--tokens must be at least 2, got {args.tokens}")
    model = read_served_model(args.model)
    if args.engine:
        how = export_checkpoint(model, args.engine, args.output, args.overwrite, args.allow_approximate)
        print(f"wrote {args.output} for {args.engine}: {how}")
        model = read_served_model(args.output)
    rows = engine_table(model)
    failed = _run_checks(model, rows, args.tokens) if args.check else False
    applied = f"{model.method}" + (f" (L={model.record['original_max_position_embeddings']})" if model.record else "")
    print(f"{model.path} ({model.kind}, {model.family}): {applied}")
    width = max(len(r.engine) for r in rows)
    for row in rows:
        print(f"  {row.engine:<{width}}  {row.level:<11}  {row.how}")
        print(f"  {'':<{width}}  {'':<11}  evidence: {evidence(row.engine, row.level)}")
        if args.check:
            print(f"  {'':<{width}}  {'':<11}  checked: {row.checked}")
    lengths = _print_lengths(model) if args.check else []
    if args.json:
        from ..outputs import atomic_write_text

        engines = [{**asdict(r), "evidence": evidence(r.engine, r.level)} for r in rows]
        report = {"model": str(model.path), "method": model.method, "engines": engines}
        atomic_write_text(Path(args.json), json.dumps({**report, "lengths": lengths}, indent=2) + "\n")
    return 1 if failed else 0


def _print_lengths(model) -> list[dict]:
    """Print the 'lengths' table of a checkpoint (the length each engine derives from its config.json, and what to
    pass to serve N = its max_position_embeddings); its rows, as dicts."""
    from ..serving.engines import declared_max_position_embeddings
    from ..serving.lengths import engine_lengths, table_lines

    target = declared_max_position_embeddings(model)
    if model.kind != "checkpoint" or target < 1:
        return []
    print(f"lengths (N = max_position_embeddings = {target}):")
    print("\n".join(table_lines(model.config, target)))
    return [asdict(row) for row in engine_lengths(model.config, target)]


def _run_checks(model, rows, n_tokens) -> bool:
    """Run what can run here; fill each row's `checked`. True when a check disagreed."""
    from ..verification.llamacpp import INSTALL_HINT, JudgeCrashed, llama_cpp_available
    from ..verification.parity import engine_rope_parity, llama_cpp_parity, transformers_parity

    failed = False
    for row in rows:
        if row.engine in ("vllm", "sglang"):
            agrees, row.checked = engine_rope_parity(model, row)
            if agrees is not None:
                row.checked += "" if agrees else "  DISAGREES"
                failed |= not agrees
            continue
        if row.level != "exact" or model.record is None:
            row.checked = "nothing to check" if row.level == "no" else "not checked (no exact form)"
            continue
        if row.engine == "transformers" and model.kind == "checkpoint":
            agrees, row.checked = transformers_parity(model, n_tokens)
        elif row.engine == "llama.cpp" and model.kind == "gguf":
            if not llama_cpp_available():
                row.checked = f"not run: llama.cpp is not installed ({INSTALL_HINT})"
                continue
            try:
                agrees, row.checked = llama_cpp_parity(model, n_tokens)
            except JudgeCrashed as crash:  # a finding about this machine's llama.cpp, not about the file
                row.checked, failed = str(crash), True
                continue
        else:
            row.checked = "not run: checked on the other format (GGUF for llama.cpp, checkpoint for transformers)"
            continue
        row.checked += "" if agrees else "  DISAGREES"
        failed |= not agrees
    return failed
