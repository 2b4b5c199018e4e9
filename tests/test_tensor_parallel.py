"""ctxext's methods on a model split by transformers' own tensor parallelism (`DistributedConfig(tp_plan="auto")`
under torchrun), 2 CPU processes over gloo.

Every attention-level method is here, with log-n and a query temperature, and four frequency methods: none is
refused under `--tp`.

The oracle: the same checkpoint, one process, no split, the same method: the loss and the logits of 100 tokens
(past L = 64, so every method acts) must be the same on both ranks to 1e-5 (fp32). The split is real: the
projections are DTensors (each rank holds half of each).
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

import ctxext
from tests.helpers import REPO, child_process_env, free_port, save_tiny_checkpoint, tiny_model

CASES = {  # label -> (method, parameters); small windows, so that each attention-level method remaps at 100 tokens
    "none": ("none", {}),
    "yarn": ("yarn", {"factor": 2}),
    "self_extend": ("self_extend", {"factor": 2, "group_size": 4, "window": 8}),
    "dual_chunk": ("dual_chunk", {"factor": 2, "chunk_size": 24, "local_window": 4}),
    "rerope": ("rerope", {"factor": 2, "window": 8}),
    "gali": ("gali", {"factor": 2, "local_window": 3}),
    "dpe": ("dpe", {"factor": 2}),
    "string": ("string", {"factor": 2, "local_value": 8}),
    "leaky_rerope": ("leaky_rerope", {"window": 6, "k": 4.0}),
    "cope": ("cope", {"factor": 2}),
    "longrope": ("longrope", {"factor": 2}),
    "dynamic_yarn": ("dynamic_yarn", {"factor": 2}),
    "rerope+logn": ("rerope", {"window": 8, "logn": True}),
    "yarn+query_temperature": ("yarn", {"factor": 2, "query_temperature": 0.1}),
}
TOKENS = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(0))

RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from transformers import AutoModelForCausalLM, DistributedConfig
    import ctxext

    checkpoint, tokens_path, out, cases = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    tokens = torch.load(tokens_path)
    results = {}
    for label, (method, params) in cases.items():
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto")
        )
        ctxext.patch(model, method, **params)
        with torch.no_grad():
            result = model(tokens, labels=tokens)
        results[label] = {
            "loss": float(result.loss),
            "logits": result.logits[0, -3:].tolist(),
            "weight": type(model.model.layers[0].self_attn.q_proj.weight).__name__,
        }
    with open(f"{out}.{os.environ['RANK']}", "w") as f:
        json.dump(results, f)
""")


@pytest.fixture(scope="module")
def tensor_parallel_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    checkpoint = save_tiny_checkpoint(folder / "llama", tiny_model("llama"))
    torch.save(TOKENS, folder / "tokens.pt")
    (folder / "rank.py").write_text(RANK_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), str(folder / "rank.py"), str(checkpoint),
               str(folder / "tokens.pt"), str(folder / "out"), json.dumps(CASES)]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, env=child_process_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((folder / f"out.{rank}").read_text()) for rank in (0, 1)]
    return checkpoint, ranks


@pytest.mark.parametrize("label", list(CASES))
def test_two_tensor_parallel_ranks_give_the_single_process_numbers(tensor_parallel_results, label):
    checkpoint, ranks = tensor_parallel_results
    method, params = CASES[label]
    model = ctxext.patch(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), method, **params)
    with torch.no_grad():
        single = model(TOKENS, labels=TOKENS)
    for rank in ranks:
        assert rank[label]["weight"] == "DTensor"  # the projections really are split
        assert rank[label]["loss"] == pytest.approx(float(single.loss), abs=1e-5)
        torch.testing.assert_close(torch.tensor(rank[label]["logits"]), single.logits[0, -3:], atol=1e-5, rtol=1e-5)
    if label != "none":  # the method acts on these 100 tokens: a patch lost under the split would show
        plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        with torch.no_grad():
            assert (plain(TOKENS).logits - single.logits).abs().max() > 1e-5
