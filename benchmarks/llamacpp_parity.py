"""llama.cpp against ctxext on SmolLM2's GGUF at 16k (2x its L = 8192): the perplexity llama.cpp computes on the file
`ctxext patch model.gguf` writes, next to the perplexity of the same method applied by ctxext in transformers.

Data: the first N tokens (default 16384) of Hamlet followed by Richard III, one window, every token scored:
- llama.cpp: the patched file written with --outtype f32 (the Q4_1 weights dequantised, so that quantisation
  does not blur the comparison), scored by llama-cpp-python (`ctxext.verification.llamacpp.llama_cpp_nll`);
- ctxext: the transformers checkpoint converted from the same GGUF (identical weights), patched with the same
  method, fp32, one forward (`sliding_window_nll` with window = stride = N), as `ctxext eval --stride window`.
The unpatched file is scored too: at 2x past L it should be far worse, which shows that the keys took effect.

--shipped llama3 does the same for an already-scaled file, the route `ctxext patch MODEL.gguf` takes for Llama
3.1: SmolLM2's GGUF given a shipped llama3 x2 over L0 = L/2 = 4096 (C = 8192) as llama.cpp's converter stores it,
a rope_freqs tensor (theta_i / theta'_i of transformers' own llama3), and the transformers checkpoint given the
same llama3 rope_parameters. The methods then compose with the shipped scaling on both sides (in the GGUF's
rope_freqs, in transformers as the composed longrope `ctxext patch` writes); "none" is the shipped llama3 alone.

llama-cpp-python is built once if missing (`--install`: pip install llama-cpp-python, about 10 min on 2 cores) and
the build time is printed. Results go to --output (results.json, a table); cells are cached there as they finish.

    CTXEXT_CACHE_DIR=.cache HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/llamacpp_parity.py --install
    CTXEXT_CACHE_DIR=.cache HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/llamacpp_parity.py --shipped llama3 \
        --methods none,yarn,linear
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = {
    "none": {},
    "yarn": {"factor": 2},
    "ntk": {"factor": 2},
    "ntk_by_parts": {"factor": 2},
    "linear": {"factor": 2},
}
LLAMA_CPP_SPEC = "llama-cpp-python==0.3.36"
SHIPPED_LLAMA3 = {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def with_shipped_llama3(model, gguf_source: Path, gguf_path: Path):
    """`model` reloaded with SHIPPED_LLAMA3 over L0 = L/2, and a copy of `gguf_source` at `gguf_path` carrying
    the same scaling as llama.cpp's converter writes it (rope_freqs: theta_i / theta'_i, transformers' own)."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ctxext.serving.gguf import RECORD_KEY  # the f32 copy's record of its "none" patch is not carried over

    config = model.config
    L = config.max_position_embeddings
    config.rope_parameters = {
        **SHIPPED_LLAMA3,
        "rope_theta": config.rope_parameters["rope_theta"],
        "original_max_position_embeddings": L // 2,
    }
    shipped = AutoModelForCausalLM.from_pretrained(model.name_or_path, config=config, dtype=torch.float32).eval()
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
    dim = scaled.numel() * 2
    plain = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    reader = gguf.GGUFReader(gguf_source)
    writer = gguf.GGUFWriter(gguf_path, arch=reader.get_field("general.architecture").contents())
    for found in reader.fields.values():
        if found.name not in ("general.architecture", RECORD_KEY) and not found.name.startswith("GGUF."):
            sub_type = found.types[-1] if found.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(found.name, found.contents(), found.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.ascontiguousarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.add_tensor("rope_freqs.weight", (plain.double() / scaled.double()).float().numpy())
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    return shipped, gguf_path


def install_llama_cpp() -> float | None:
    """Build and install llama-cpp-python into this Python if it is missing; the wall time of the build."""
    from ctxext.verification.llamacpp import llama_cpp_available

    if llama_cpp_available():
        return None
    print(f"building {LLAMA_CPP_SPEC} from source (about 10 min on 2 cores) ...", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "install", LLAMA_CPP_SPEC], check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="N, the tokens scored (default 16384)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from " + ", ".join(METHODS))
    parser.add_argument("--install", action="store_true", help="build llama-cpp-python first if it is missing")
    parser.add_argument(
        "--shipped",
        choices=("llama3",),
        help="score an already-scaled file: the methods composed with a shipped llama3",
    )
    parser.add_argument("--output", default=str(REPO / "outputs" / "llamacpp_parity"))
    args = parser.parse_args()

    build_seconds = install_llama_cpp() if args.install else None
    import torch
    from transformers import AutoModelForCausalLM

    from ctxext import assets
    from ctxext.config import load_method_config
    from ctxext.eval.perplexity import sliding_window_nll
    from ctxext.loading import load_tokenizer
    from ctxext.outputs import atomic_write_text
    from ctxext.serving.gguf import patch_gguf
    from ctxext.verification.llamacpp import llama_cpp_nll

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    cells_path = out / "results.json"
    cells = json.loads(cells_path.read_text()) if cells_path.exists() else {}
    if build_seconds is not None:
        cells["llama_cpp_build_seconds"] = build_seconds
    source, checkpoint = assets.smollm2_gguf(), assets.smollm2_checkpoint()
    text = assets.shakespeare_text(assets.HAMLET_RICHARD3)
    ids = load_tokenizer(str(checkpoint))(text)["input_ids"][: args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has only {len(ids)} tokens")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    if args.shipped:  # from the f32 file (as every patched file is written), so both sides hold the same weights
        f32 = out / "source.f32.gguf"
        patch_gguf(source, load_method_config(None, {"method": "none"}), f32, overwrite=True, outtype="f32")
        model, source = with_shipped_llama3(model, f32, out / "shipped-llama3.f32.gguf")
    for method in args.methods.split(","):
        key = f"{method} @ {args.tokens}" + (f" on a shipped {args.shipped}" if args.shipped else "")
        if key in cells.get("cells", {}):
            continue
        config = load_method_config(None, {"method": method, **METHODS[method]})
        as_shipped = args.shipped and method == "none"  # the shipped file and model, unpatched
        gguf_path = source if as_shipped else out / f"{method}.f32.gguf"
        if not as_shipped:
            patch_gguf(source, config, gguf_path, overwrite=True, outtype="f32")
        start = time.perf_counter()
        lcpp_sum, n = llama_cpp_nll(gguf_path, ids)
        lcpp_seconds = time.perf_counter() - start
        if not as_shipped:
            gguf_path.unlink()
            config.apply(model)
        start = time.perf_counter()
        hf_sum, hf_n = sliding_window_nll(model, torch.tensor(ids), len(ids), len(ids))
        hf_seconds = time.perf_counter() - start
        import ctxext

        if not as_shipped:
            ctxext.unpatch(model)
        cell = {
            "llama_cpp_ppl": math.exp(lcpp_sum / n),
            "ctxext_ppl": math.exp(hf_sum / hf_n),
            "tokens_scored": n,
            "llama_cpp_seconds": lcpp_seconds,
            "ctxext_seconds": hf_seconds,
        }
        cell["relative_difference"] = cell["llama_cpp_ppl"] / cell["ctxext_ppl"] - 1
        cells.setdefault("cells", {})[key] = cell
        atomic_write_text(cells_path, json.dumps(cells, indent=2) + "\n")
        print(
            f"{key}: llama.cpp {cell['llama_cpp_ppl']:.3f}  ctxext {cell['ctxext_ppl']:.3f}  "
            f"({100 * cell['relative_difference']:+.3f}%)",
            flush=True,
        )

    print(f"\n| method (x2, {args.tokens} tokens) | llama.cpp ppl | ctxext ppl | difference |")
    print("|---|---|---|---|")
    for key, cell in cells.get("cells", {}).items():
        print(
            f"| {key} | {cell['llama_cpp_ppl']:.3f} | {cell['ctxext_ppl']:.3f} | "
            f"{100 * cell['relative_difference']:+.3f}% |"
        )
    if "llama_cpp_build_seconds" in cells:
        print(f"\nllama-cpp-python build: {cells['llama_cpp_build_seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
