"""A serving engine's own rotary-embedding code, run on a checkpoint's config.json beside plain transformers.

vLLM and SGLang build their rotary embedding from config.json in their model code (LlamaAttention, Qwen2Attention:
`get_rope(...)`) and rotate the queries and keys of a whole batch at once, by a positions tensor flattened across its
requests. This module runs that code, their `get_rope` and their torch path (`forward_native`, or `forward` where a
layer has no other), unmodified, in a child process, and compares the rotated q and k with plain transformers' load
of the same checkpoint (its rotary embedding, applied with `apply_rotary_pos_emb`), one request at a time as
transformers serves it, in another child process that never imports ctxext. An engine that raises is a one-line
finding (the error's last line); one whose process dies is a one-line finding for the job it was on, and the child
goes on with the next job.

Only the rotary modules are imported. The imports they make that have nothing to do with the rotation are replaced
by the stand-ins in STUBS, each with the reason; the engine's configuration is read with its own code where that
imports (vLLM's `get_config`), else as its model code reads it (SGLang: transformers' AutoConfig, which its
`get_config` calls for these families).

Used by `ctxext export --check` where vLLM or SGLang is installed, and by benchmarks/engine_parity.py, which runs it
from the engines' wheels (ENGINE_VERSIONS) on any machine. Run as a script, by path so that the child never imports
ctxext, it is the child: `python engine_rope.py ENGINE JOBS.json [ENGINE_ROOT]`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

ENGINE_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}
ENGINES = tuple(ENGINE_VERSIONS)
# q and k are unit-normal; an engine and transformers that compute the same angles agree to float32 rounding: most
# exact rows are bit-identical, the largest |dq| on one is 4.8e-5 (linear at 5.5: t/5.5 and theta/5.5 round apart;
# an angle of a few hundred radians has an ulp of 3e-5). A real difference is orders above: a factor set swapped, a
# pair rotated by the wrong position or a base from another length moves |dq| by 0.4-10.
EXACT_TOLERANCE = 1e-4
CHILD_TIMEOUT_S = 900

# ------------------------------------------------------------------------------------------- stand-ins
# Each stub is a module put in sys.modules before the engine's rotary package is imported. None computes anything
# the rotation uses: the rotary math, the cos/sin caches and get_rope are the engine's own code.
STUBS = {
    "vllm": {
        "vllm.config": (
            "the engine's configuration package; its __init__ imports the configuration of every subsystem (cbor2 "
            "and the v1 engine among them). The rotary code reads two things from it: get_cached_compilation_config() "
            "(CustomOp dispatch), here custom_ops=['none'], Inductor's default, with which every rotary layer runs "
            "forward_native; and get_current_vllm_config().model_config.max_model_len (the longrope layer's choice "
            "of factor set), here the --max-model-len being served. Its submodules load from the engine as they are"
        ),
        "vllm._aiter_ops": (
            "ROCm AITER kernels; it imports the v1 attention backends. The stub reports them off "
            "(is_triton_rotary_embed_enabled() is False), as on every machine that is not ROCm"
        ),
    },
    "sglang": {
        "sglang": (
            "the package shell only (__path__): sglang/__init__.py patches transformers globally "
            "(hf_transformers_patches) and imports the frontend language (sglang.lang)"
        ),
        "sglang.srt.utils": (
            "platform detection and server helpers; its __init__ imports the server's dependencies (orjson, "
            "pybase64, zmq, ...). The rotary modules take 12 names from it; the stub answers as a CPU without AMX "
            "(is_cpu True, is_cuda/is_hip/is_npu/is_xpu/is_musa/is_mps/cpu_has_amx_support/support_triton False, "
            "get_bool_env_var False, get_device 'cpu', get_compiler_backend 'inductor'). Submodules load as they are"
        ),
        "sglang.kernels.ops.attention.rotary_triton": (
            "Triton kernels of the multimodal rotary (M-RoPE), imported at module level by mrope.py and "
            "bailing_mrope.py; Triton is not installed on a CPU and no case builds an M-RoPE (a call would raise)"
        ),
        "sglang.kernels.ops.attention.mrope": "as rotary_triton: M-RoPE's Triton kernel (a call would raise)",
    },
}


class _Unavailable(ModuleType):
    """A kernel module stand-in: every attribute is a function that raises if called."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} is a stubbed kernel (benchmarks/engine_parity.py, STUBS)")

        return unavailable


def _stub(name: str, module: ModuleType | None = None, **attributes) -> ModuleType:
    module = module or ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def _package_dir(name: str) -> Path:
    """Where package `name` is, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"No module named '{name}'")
    return Path(list(spec.submodule_search_locations)[0])


def _install_vllm_stubs() -> SimpleNamespace:
    """STUBS['vllm']; returns the model_config whose max_model_len each job sets."""
    compilation = SimpleNamespace(custom_ops=["none"], enabled_custom_ops=set(), disabled_custom_ops=set())
    model_config = SimpleNamespace(max_model_len=None)
    current = SimpleNamespace(model_config=model_config, compilation_config=compilation)
    _stub(
        "vllm.config",
        __path__=[str(_package_dir("vllm") / "config")],
        get_cached_compilation_config=lambda: compilation,
        get_current_vllm_config=lambda: current,
    )
    _stub("vllm._aiter_ops", rocm_aiter_ops=SimpleNamespace(is_triton_rotary_embed_enabled=lambda: False))
    return model_config


def _install_sglang_stubs() -> None:
    root = _package_dir("sglang")
    no = lambda *args, **kwargs: False  # noqa: E731
    _stub("sglang", __path__=[str(root)])
    _stub(
        "sglang.srt.utils",
        __path__=[str(root / "srt" / "utils")],
        is_cpu=lambda: True,
        is_cuda=no,
        is_hip=no,
        is_npu=no,
        is_xpu=no,
        is_musa=no,
        is_mps=no,
        cpu_has_amx_support=no,
        support_triton=no,
        get_bool_env_var=no,
        get_device=lambda *args, **kwargs: "cpu",
        get_compiler_backend=lambda *args, **kwargs: "inductor",
    )
    for name in ("sglang.kernels.ops.attention.rotary_triton", "sglang.kernels.ops.attention.mrope"):
        _stub(name, _Unavailable(name))


# ------------------------------------------------------------------------------------------- the child
def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _torch_path(rope):
    """The engine layer's torch path: forward_native where it has one (vLLM's CustomOp with custom ops off runs
    it; SGLang's CUDA kernel reads the same cos/sin cache), else its only forward (the longrope layers)."""
    return getattr(rope, "forward_native", None) or rope.forward


def vllm_builder():
    """A function job -> rotate(positions, q, k), with vLLM's get_config and get_rope, built as its model code does."""
    model_config = _install_vllm_stubs()
    from vllm.model_executor.layers import rotary_embedding  # noqa: PLC0415 (optional: vLLM is no dependency; imported once STUBS are in place)
    from vllm.transformers_utils.config import get_config, set_default_rope_theta  # noqa: PLC0415 (optional: vLLM is no dependency; imported once STUBS are in place)

    def build(job: dict):
        serving = job["serving"]["vllm"]
        config = get_config(job["checkpoint"], False, hf_overrides_kw=serving["hf_overrides"] or None)
        model_config.max_model_len = serving["length"]
        rotary_embedding._ROPE_DICT.clear()  # get_rope's cache lives as long as a server: one job, one server
        if config.model_type == "qwen2":  # vllm/model_executor/models/qwen2.py: Qwen2DecoderLayer, Qwen2Attention
            set_default_rope_theta(config, default_theta=1000000)
            rope = rotary_embedding.get_rope(
                config.hidden_size // config.num_attention_heads,
                max_position=config.max_position_embeddings,
                rope_parameters=config.rope_parameters,
            )
        elif config.model_type == "qwen3":  # vllm/model_executor/models/qwen3.py: Qwen3DecoderLayer, Qwen3Attention
            set_default_rope_theta(config, default_theta=1000000)
            rope = rotary_embedding.get_rope(
                _head_dim(config),
                max_position=config.max_position_embeddings,
                rope_parameters=config.rope_parameters,
                dual_chunk_attention_config=getattr(config, "dual_chunk_attention_config", None),
            )
        elif config.model_type == "gpt_oss":  # vllm/model_executor/models/gpt_oss.py: OAIAttention builds yarn
            parameters = config.rope_parameters
            rope = rotary_embedding.get_rope(
                config.head_dim,
                max_position=config.max_position_embeddings,
                dtype=torch.float32,
                rope_parameters={
                    "rope_theta": parameters["rope_theta"],
                    "rope_type": "yarn",
                    "factor": parameters["factor"],
                    "original_max_position_embeddings": parameters["original_max_position_embeddings"],
                    "beta_fast": parameters["beta_fast"],
                    "beta_slow": parameters["beta_slow"],
                    "truncate": parameters.get("truncate", True),
                },
                is_neox_style=True,
            )
        else:  # vllm/model_executor/models/llama.py: LlamaDecoderLayer, LlamaAttention._init_rotary_emb (phi3.py's
            # Phi3ForCausalLM is LlamaForCausalLM; its partial_rotary_factor is in rope_parameters after get_config)
            rope = rotary_embedding.get_rope(
                _head_dim(config),
                max_position=getattr(config, "max_position_embeddings", 8192),
                rope_parameters=getattr(config, "rope_parameters", None),
                is_neox_style=True,
            )
        return _torch_path(rope)

    return build


def sglang_builder():
    """A function job -> rotate(positions, q, k), with SGLang's get_rope, built as its model code does."""
    _install_sglang_stubs()
    from sglang.srt.layers.rotary_embedding import factory  # noqa: PLC0415 (optional: SGLang is no dependency; imported once STUBS are in place)

    def build(job: dict):
        config = AutoConfig.from_pretrained(job["checkpoint"])
        factory._ROPE_DICT.clear()  # as vLLM's: one job, one server
        # sglang/srt/models/llama.py LlamaDecoderLayer; qwen2.py get_rope_config: (rope_theta, rope_parameters)
        rope_parameters = getattr(config, "rope_parameters", None)
        if rope_parameters is not None:
            rope_theta, rope_scaling = rope_parameters.get("rope_theta", 10000), rope_parameters
        else:
            rope_theta, rope_scaling = getattr(config, "rope_theta", 10000), getattr(config, "rope_scaling", None)
        # llama.py (LlamaForCausalLM, and Phi3ForCausalLM, its subclass) reads the top-level L and partial rotary
        # factor; qwen2.py, qwen3.py and gpt_oss.py (GptOssDecoderLayer: config.rope_parameters) rotate the whole head
        own_code = config.model_type in ("qwen2", "qwen3", "gpt_oss")
        llama_reads_top_level_l = not own_code and rope_scaling is not None
        if llama_reads_top_level_l and getattr(config, "original_max_position_embeddings", None):
            rope_scaling["original_max_position_embeddings"] = config.original_max_position_embeddings
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary_dim = head_dim if own_code else int(getattr(config, "partial_rotary_factor", 1) * head_dim)
        defaults = {"qwen3": (1000000, 32768), "gpt_oss": (10000, 8192)}.get(config.model_type, (10000, 8192))
        if config.model_type == "qwen3" and rope_parameters is None:
            rope_theta = getattr(config, "rope_theta", defaults[0])
        rope = factory.get_rope(
            head_dim,
            rotary_dim=rotary_dim,
            max_position=getattr(config, "max_position_embeddings", defaults[1]),
            base=rope_theta,
            rope_scaling=rope_scaling,
            is_neox_style=True if own_code else getattr(config, "rope_is_neox_style", True),
        )
        return _torch_path(rope)

    return build


def transformers_builder():
    """A function job -> rotate(positions, q, k) for one request, with plain transformers' rotary embedding of the
    checkpoint's model class, a fresh one per request (its dynamic and longrope state are per sequence)."""

    def build(job: dict):
        config = AutoConfig.from_pretrained(job.get("reference") or job["checkpoint"])
        modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
        prefix = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type].removesuffix("ForCausalLM")
        rotary_class = getattr(modeling, f"{prefix}RotaryEmbedding")
        head_dim = _head_dim(config)

        def rotate(positions, q, k):
            heads = lambda x: x.view(len(positions), -1, head_dim).transpose(0, 1)[None]  # noqa: E731
            cos, sin = rotary_class(config=config)(heads(q), positions[None])
            q_out, k_out = modeling.apply_rotary_pos_emb(heads(q), heads(k), cos, sin)
            return q_out[0].transpose(0, 1).reshape(q.shape), k_out[0].transpose(0, 1).reshape(k.shape)

        def rotate_each_request(positions, q, k, requests):
            out_q, out_k, at = [], [], 0
            for start, end in requests:
                n = end - start
                rq, rk = rotate(positions[at : at + n], q[at : at + n], k[at : at + n])
                out_q.append(rq)
                out_k.append(rk)
                at += n
            return torch.cat(out_q), torch.cat(out_k)

        return rotate_each_request

    return build


BUILDERS = {"vllm": vllm_builder, "sglang": sglang_builder, "transformers": transformers_builder}


def _last_line(error: BaseException) -> str:
    return traceback.format_exception_only(type(error), error)[-1].strip()


def _run_job(build, engine: str, job: dict) -> dict:
    """{scenario name: (q, k) rotated} for one job."""
    inputs = torch.load(job["inputs"], weights_only=True)
    rotate = build(job)
    out = {}
    with torch.no_grad():
        for scenario in job["scenarios"]:
            q, k = inputs[scenario["name"]]
            positions = torch.cat([torch.arange(start, end) for start, end in scenario["requests"]])
            if engine == "transformers":
                out[scenario["name"]] = rotate(positions, q.clone(), k.clone(), scenario["requests"])
            else:  # the engine's batch: one positions tensor flattened across the requests
                q_out, k_out = rotate(positions, q.clone(), k.clone())
                out[scenario["name"]] = (q_out.reshape(q.shape).float(), k_out.reshape(k.shape).float())
    return out


def child(engine: str, jobs_file: str, root: str = "") -> int:
    """The child process: load `engine` (from `root` when given, else as installed), then run every job without an
    output; `JOBS.ready` says the engine loaded, each job's `.pt` (or `.error`, one line) that it ran."""
    if root:
        sys.path.insert(0, root)
    try:
        build = BUILDERS[engine]()
    except Exception as error:  # noqa: BLE001 - the child reports any failure to load as one line
        print(f"could not load {engine}: {_last_line(error)}", file=sys.stderr)
        return 3
    Path(jobs_file + ".ready").write_text("ok\n")
    for job in json.loads(Path(jobs_file).read_text()):
        output, error_file = _outputs(job, engine)
        if output.exists() or error_file.exists():
            continue
        try:
            result = _run_job(build, engine, job)
        except Exception as error:  # noqa: BLE001 - an engine's error is a finding, not the end of the run
            error_file.write_text(_last_line(error) + "\n")
            continue
        torch.save(result, str(output) + ".tmp")
        os.replace(str(output) + ".tmp", output)
    return 0


def _outputs(job: dict, engine: str) -> tuple[Path, Path]:
    return Path(f"{job['stem']}.{engine}.pt"), Path(f"{job['stem']}.{engine}.error")


# ------------------------------------------------------------------------------------------- the parent
@dataclass(frozen=True)
class Scenario:
    """One batch: its requests, each a run of consecutive positions [start, end): a prefill from 0, or one decode
    step with the earlier keys in the cache."""

    name: str
    requests: tuple[tuple[int, int], ...]


def scenarios(L: int, length: int, L0: int | None = None) -> list[Scenario]:
    """The batches every job rotates: below L, at L and L+1 (the first positions past it), at 3L (or the last served
    position), and a short request batched beside a long one; those within the served length. Where the rope counts
    from a shorter L0 than L (a composed form: the shipped scaling's own original length, below the trained context),
    a prefill of L0 and of L0+1 tokens too (a longrope's short set serves requests of at most L0 tokens)."""
    far = min(3 * L, length - 1)
    half = L // 2
    batches = [
        Scenario("prefill of L tokens", ((0, L),)),
        Scenario("prefill of L+1 tokens", ((0, L + 1),)),
        Scenario("decode at L", ((L, L + 1),)),
        Scenario("decode at L+1", ((L + 1, L + 2),)),
        Scenario("decode at 3L", ((far, far + 1),)),
        Scenario("prefill of 3L+1 tokens", ((0, far + 1),)),
        Scenario("prefill of L/2 beside a decode at 3L", ((0, half), (far, far + 1))),
        Scenario("decode at L/2 beside a decode at L+1", ((half, half + 1), (L + 1, L + 2))),
    ]
    if L0 is not None and L0 < L:
        batches += [Scenario("prefill of L0 tokens", ((0, L0),)), Scenario("prefill of L0+1 tokens", ((0, L0 + 1),))]
    return [batch for batch in batches if max(end for _, end in batch.requests) <= length]


@dataclass
class Finding:
    """What one engine computed on one checkpoint, against plain transformers."""

    engine: str
    level: str  # exact | approximate | fails | not run
    max_dq: float | None = None  # the largest |dq| or |dk| over every scenario
    where: str = ""  # the scenario and position of max_dq
    error: str = ""  # fails / not run: the error's last line
    per_scenario: dict = field(default_factory=dict)  # scenario -> largest |dq| or |dk|

    def describe(self) -> str:
        if self.level in ("fails", "not run"):
            return f"{self.level}: {self.error}"
        if self.level == "exact":
            return f"exact (max |dq| {self.max_dq:.1e})"
        return f"approximate: max |dq| {self.max_dq:.2g} at {self.where}"


@dataclass(frozen=True)
class Target:
    """A checkpoint to run, and how each engine is started on it (engines.Serving as a dict)."""

    id: str
    checkpoint: str
    L: int
    serving: dict  # engine -> {"length": N, "hf_overrides": {...}}
    L0: int | None = None  # the rope's own original length, where it is below L (a composed form's shipped L0)
    reference: str = ""  # the checkpoint plain transformers loads as the reference ("": this one)


def target_for(checkpoint, id: str | None = None, flags: bool = True, reference=None) -> Target:
    """The target for a checkpoint ctxext wrote: L from its ctxext.yaml, L0 the smallest rope original length below
    it (config.json's or ctxext.yaml's: an export copy may have moved its own), each engine started as `ctxext
    export` prints (flags=False: with only the context length, none of the printed overrides); `reference`: the
    checkpoint plain transformers loads instead (an export copy against the checkpoint it was exported from)."""
    from ..serving.engines import read_served_model, serving  # noqa: PLC0415 (this file also runs as a script outside the package; only the parent needs ctxext.serving.engines)

    model = read_served_model(checkpoint)
    L = (
        int(model.record["original_max_position_embeddings"])
        if model.record
        else int(model.config["max_position_embeddings"])
    )
    settings = {}
    for engine in ENGINES:
        serve = serving(model, engine)
        settings[engine] = {"length": serve.length, "hf_overrides": serve.hf_overrides if flags else {}}
    ropes = [model.rope_parameters, (model.record or {}).get("rope_parameters")]
    lengths = [
        int(rope["original_max_position_embeddings"])
        for rope in ropes
        if isinstance(rope, dict) and isinstance(rope.get("original_max_position_embeddings"), int)
    ]
    L0 = min([n for n in lengths if n < L], default=None)
    return Target(id or Path(checkpoint).name, str(checkpoint), L, settings, L0, str(reference or ""))


def _write_inputs(target: Target, stem: Path) -> list[Scenario]:
    """Seeded unit-normal q and k for every scenario, shaped as the engines take them: [tokens, heads x head_dim]."""
    config = json.loads((Path(target.checkpoint) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    length = min(settings["length"] for settings in target.serving.values())
    batches = scenarios(target.L, length, target.L0)
    generator = torch.Generator().manual_seed(0)
    inputs = {}
    for scenario in batches:
        tokens = sum(end - start for start, end in scenario.requests)
        q = torch.randn(tokens, heads * head_dim, generator=generator)
        inputs[scenario.name] = (q, torch.randn(tokens, kv_heads * head_dim, generator=generator))
    torch.save(inputs, str(stem) + ".inputs.pt")
    return batches


def _child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def run_child(engine: str, jobs: list[dict], workdir: Path, root: str | None, timeout: float = CHILD_TIMEOUT_S) -> None:
    """Run `engine`'s child until every job has an output or a one-line error. A child that dies leaves the job it was
    on (the first without an output: jobs run in order) with the cause, and a new child goes on with the rest."""
    pending = list(jobs)
    attempt = 0
    while pending:
        attempt += 1
        jobs_file = workdir / f"{engine}.jobs{attempt}.json"
        jobs_file.write_text(json.dumps(pending))
        command = [sys.executable, str(Path(__file__).resolve()), engine, str(jobs_file), root or ""]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_child_env())
            cause = _exit_cause(engine, result.returncode, result.stderr)
        except subprocess.TimeoutExpired:
            cause = f"{engine} process timed out after {timeout:.0f} s"
        pending = [job for job in pending if not any(path.exists() for path in _outputs(job, engine))]
        if not pending:
            return
        if not Path(str(jobs_file) + ".ready").exists():  # the engine did not load: nothing ran
            for job in pending:
                Path(f"{job['stem']}.{engine}.notrun").write_text(cause + "\n")
            return
        _outputs(pending[0], engine)[1].write_text(cause + "\n")
        pending = pending[1:]


def _exit_cause(engine: str, returncode: int, stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "no message"
    if returncode < 0:
        return f"{engine} process died ({signal.Signals(-returncode).name}): {last}"
    return last if returncode == 3 else f"{engine} process exited with status {returncode}: {last}"


def compare(reference: dict, measured: dict, batches: list[Scenario], engine: str) -> Finding:
    """The largest |dq| or |dk| over the scenarios and where: exact within EXACT_TOLERANCE, else approximate."""
    worst, where, per_scenario = -1.0, "", {}
    for scenario in batches:
        positions = [p for start, end in scenario.requests for p in range(start, end)]
        (q_ref, k_ref), (q, k) = reference[scenario.name], measured[scenario.name]
        per_token = ((q - q_ref).abs().amax(dim=1)).maximum((k - k_ref).abs().amax(dim=1))
        value, index = per_token.max(dim=0)
        per_scenario[scenario.name] = float(value)
        if float(value) > worst:
            worst, where = float(value), f"position {positions[int(index)]} ({scenario.name})"
    level = "exact" if worst <= EXACT_TOLERANCE else "approximate"
    return Finding(engine, level, worst, where, per_scenario=per_scenario)


def run_parity(
    targets: list[Target],
    engines: tuple[str, ...],
    workdir,
    roots: dict | None = None,
    timeout: float = CHILD_TIMEOUT_S,
) -> dict[str, dict[str, Finding]]:
    """{target id: {engine: Finding}}: each engine's child (from roots[engine], else as installed) and plain
    transformers' child over every target, compared."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    roots = roots or {}
    jobs, batches = [], {}
    for index, target in enumerate(targets):
        stem = workdir / f"{index:03d}"
        batches[target.id] = _write_inputs(target, stem)
        jobs.append(
            {
                "id": target.id,
                "checkpoint": target.checkpoint,
                "reference": target.reference,
                "serving": target.serving,
                "stem": str(stem),
                "inputs": str(stem) + ".inputs.pt",
                "scenarios": [asdict(scenario) for scenario in batches[target.id]],
            }
        )
    children = [("transformers", None)] + [(engine, roots.get(engine)) for engine in engines]
    with ThreadPoolExecutor(len(children)) as pool:  # side by side: most of a child's time is importing its engine
        for done in [pool.submit(run_child, name, jobs, workdir, root, timeout) for name, root in children]:
            done.result()
    findings = {}
    for job in jobs:
        reference_file, reference_error = _outputs(job, "transformers")
        reference = torch.load(reference_file, weights_only=True) if reference_file.exists() else None
        findings[job["id"]] = {}
        for engine in engines:
            output, error_file = _outputs(job, engine)
            not_run = Path(f"{job['stem']}.{engine}.notrun")
            if not_run.exists():
                finding = Finding(engine, "not run", error=not_run.read_text().strip())
            elif error_file.exists():
                finding = Finding(engine, "fails", error=error_file.read_text().strip())
            elif reference is None:
                why = reference_error.read_text().strip() if reference_error.exists() else "no output"
                finding = Finding(engine, "not run", error=f"plain transformers failed: {why}")
            else:
                measured = torch.load(output, weights_only=True)
                finding = compare(reference, measured, batches[job["id"]], engine)
            findings[job["id"]][engine] = finding
    return findings


def engine_importable(engine: str) -> bool:
    """Whether `engine` is installed in this Python (found without importing it)."""
    return importlib.util.find_spec(engine) is not None


if __name__ == "__main__":
    # Run by path: the script's folder (ctxext/serving, with gguf.py among its files) must not shadow packages
    # (torch and transformers, imported above, import none of its names; the engines and their imports come after).
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.exit(child(*sys.argv[1:]))
