"""Served tokens per second of SmolLM2 with a method against the unpatched model, under the same server.

Two `ctxext serve` servers (transformers' OpenAI-compatible server, ctxext in the process) run side by side in
this process, one on the plain checkpoint and one on the checkpoint `ctxext patch` wrote; requests alternate
(plain, patched, plain, ...) on the same Shakespeare prompt, streamed through the `openai` client, so machine
noise hits both alike. Per request: the time to the first token (the prefill) and the decode rate after it.
The result is the ratio of medians, patched / plain.

    CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/serve_throughput.py [--method self_extend]
        [--tokens 4096] [--new-tokens 32] [--repeats 3] [--dtype fp32]
"""

import argparse
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

import openai
from transformers import AutoTokenizer

from ctxext import assets
from ctxext.cli import main as ctxext_main
from ctxext.runtime import machine_description
from ctxext.serve import plan_serve, start_server

RESULTS = Path(__file__).parent / "results" / "serve_throughput.json"
TEXTS = ("hamlet_gut", "macbeth_gut")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def prompt_of(tokenizer, tokens: int) -> str:
    ids = tokenizer(assets.shakespeare_text(TEXTS), add_special_tokens=False).input_ids[:tokens]
    return tokenizer.decode(ids)


def streamed_request(client, model: str, prompt: str, new_tokens: int) -> dict:
    """Seconds to the first streamed token, and decoded tokens per second after it."""
    start = time.perf_counter()
    stamps = []
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return {"first_token_s": stamps[0] - start, "decode_tokens_per_s": decode, "chunks": len(stamps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="self_extend")
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="fp32")
    args = parser.parse_args()

    plain = str(assets.smollm2_checkpoint())
    with tempfile.TemporaryDirectory() as scratch:
        patched = str(Path(scratch) / args.method)
        patch_argv = ["patch", plain, "--method", args.method, "--factor", str(args.factor), "-o", patched]
        if ctxext_main(patch_argv) != 0:
            raise SystemExit("ctxext patch failed")
        prompt = prompt_of(AutoTokenizer.from_pretrained(plain), args.tokens)
        servers, clients = [], {}
        for name, path in (("plain", plain), ("patched", patched)):
            plan = plan_serve(path, "localhost", free_port(), "cpu", args.dtype)
            servers.append(start_server(plan, blocking=False))
            clients[name] = (openai.OpenAI(base_url=f"http://localhost:{plan.port}/v1", api_key="none"), path)
        try:
            runs = {"plain": [], "patched": []}
            for client, path in clients.values():  # warm-up
                streamed_request(client, path, prompt, 4)
            for _ in range(args.repeats):
                for name, (client, path) in clients.items():
                    runs[name].append(streamed_request(client, path, prompt, args.new_tokens))
        finally:
            for server in servers:
                server.kill_server()

    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    summary = {
        "method": args.method,
        "factor": args.factor,
        "prompt_tokens": args.tokens,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "machine": machine_description(),
        "first_token_ratio": median("patched", "first_token_s") / median("plain", "first_token_s"),
        "decode_rate_ratio": median("patched", "decode_tokens_per_s") / median("plain", "decode_tokens_per_s"),
        "runs": runs,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{summary['machine']}; SmolLM2-135M {args.dtype}, {args.tokens}-token prompt, {args.repeats} repeats")
    for name in runs:
        print(
            f"  {name:8s} first token {median(name, 'first_token_s'):.2f} s, "
            f"decode {median(name, 'decode_tokens_per_s'):.1f} tokens/s"
        )
    print(
        f"  {args.method} / plain: first token x{summary['first_token_ratio']:.2f}, "
        f"decode rate x{summary['decode_rate_ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
