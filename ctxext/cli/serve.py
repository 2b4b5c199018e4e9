"""`ctxext serve`: an OpenAI-compatible server for a patched checkpoint, on transformers' own server."""

from __future__ import annotations

from .common import HelpFormatter

HELP = "serve a patched checkpoint over an OpenAI-compatible API (transformers serve, with ctxext's methods)"
DESCRIPTION = """\
Serve a checkpoint written by `ctxext patch` (or any checkpoint) over an OpenAI-compatible HTTP API:
POST /v1/chat/completions and /v1/completions (streaming too), GET /v1/models. The server is transformers'
own (`transformers serve`: FastAPI and uvicorn); ctxext is loaded in the serving process, so every method
ctxext runs is served as ctxext runs it, including those no other engine serves (self_extend, dual_chunk,
gali, rerope, leaky_rerope, dpe, string, logn, the dynamic methods).

The request's "model" field is the checkpoint path as given here. Methods that only change the rotary
frequencies may use --continuous-batching (transformers' paged cache); attention-level methods are served
one request at a time. The checkpoint, its method record, the port and the serving packages are checked
before the weights load. Each request is checked before any work: a bad field gets HTTP 400 naming it, and a
prompt plus max_tokens past the checkpoint's context (or --max-context) gets HTTP 400 with both numbers; a
request without max_tokens generates at most to the end of the context."""
EPILOG = (
    "examples:\n"
    "  ctxext patch SmolLM2 --method self_extend --factor 2 -o smollm2-se\n"
    "  ctxext serve smollm2-se --port 8000\n"
    '  curl localhost:8000/v1/completions -d \'{"model": "smollm2-se", "prompt": "...", "max_tokens": 16}\'\n'
    "  # Python: openai.OpenAI(base_url='http://localhost:8000/v1', api_key='none')"
)
FORMATTER_CLASS = HelpFormatter


def add_arguments(parser) -> None:
    parser.add_argument("model", help="the checkpoint directory to serve (e.g. one `ctxext patch` wrote)")
    parser.add_argument("--host", default="localhost", help="address to listen on (default: localhost)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps (default: auto)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 on GPU and on CPUs with fast native bf16, else fp32), fp32, bf16, fp16",
    )
    parser.add_argument(
        "--max-context",
        type=int,
        default=None,
        metavar="N",
        help="the most tokens a request may hold, prompt plus max_tokens (default: the context the checkpoint "
        "declares, the length `ctxext export` starts engines with); a longer request gets HTTP 400 at once",
    )
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="transformers' continuous batching on a paged cache: for methods that only change the rotary "
        "frequencies; refused for attention-level methods, which are served one request at a time",
    )


def run(args) -> int:
    from ..serve import plan_serve, start_server  # torch and transformers: not at --help

    plan = plan_serve(
        args.model, args.host, args.port, args.device, args.dtype, args.continuous_batching, args.max_context
    )
    print(plan.describe(), flush=True)
    start_server(plan)
    return 0
