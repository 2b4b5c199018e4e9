"""`ctxext serve` under load, through the real `openai` client: 12 concurrent requests, each answered exactly as
the same request alone, for a frequency method (yarn, continuous batching) and an attention-level one
(self_extend, one request at a time); the bad requests each a 4xx and the server alive after them; an operator's
--max-context lets a longer prompt through. The oracle for every answer is the same server's sequential answer,
and for one of them the checkpoint's own `generate`. The times of 12 concurrent and 12 sequential requests are
printed (run with -s), never asserted.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ctxext.cli import main
from tests.helpers import free_port, save_tiny_checkpoint, tiny_model

openai = pytest.importorskip("openai", reason="the serve extra: pip install 'ctxext[serve]'")
pytestmark = pytest.mark.slow

NEW_TOKENS = 6
PROMPTS = [" ".join(f"w{(i * step) % 256}" for i in range(100)) for step in range(3, 15)]  # 12 prompts, 100 tokens
BAD_REQUESTS = [{"max_tokens": -1}, {"temperature": "hot"}, {"n": 2}, {"max_tokens": 10_000}]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-load")
    source = save_tiny_checkpoint(root / "plain", tiny_model("llama", seed=3))
    written = {}
    for name, flags in {"yarn": ["--factor", "2"], "self_extend": ["--factor", "2", "--window", "16"]}.items():
        written[name] = root / name
        assert main(["patch", str(source), "--method", name, *flags, "-o", str(written[name])]) == 0
    return written


def started(model, continuous_batching=False, max_context=None):
    from ctxext.serve import plan_serve, start_server

    plan = plan_serve(str(model), "localhost", free_port("localhost"), "cpu", "fp32", continuous_batching, max_context)
    running = start_server(plan, blocking=False)
    client = openai.OpenAI(base_url=f"http://localhost:{plan.port}/v1", api_key="none", max_retries=20)
    return running, client


def complete(client, model, prompt, **fields) -> str:
    reply = client.completions.create(model=str(model), prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, **fields)
    return reply.choices[0].text


def generate(model, prompt) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = (
            AutoModelForCausalLM.from_pretrained(model).eval().generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        )
    return tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.parametrize("method,continuous_batching", [("yarn", True), ("self_extend", False)])
def test_concurrent_requests_get_their_sequential_answers(checkpoints, method, continuous_batching):
    model = checkpoints[method]
    running, client = started(model, continuous_batching)
    try:
        complete(client, model, PROMPTS[0])  # the first request warms the model up
        began = time.perf_counter()
        alone = [complete(client, model, prompt) for prompt in PROMPTS]
        sequential = time.perf_counter() - began
        began = time.perf_counter()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda prompt: complete(client, model, prompt), PROMPTS))
        concurrent = time.perf_counter() - began
        for fields in BAD_REQUESTS:
            with pytest.raises(openai.BadRequestError):
                complete(client, model, PROMPTS[0], extra_body=fields)
        after = complete(client, model, PROMPTS[1])
    finally:
        running.kill_server()
    print(f"{method}: 12 sequential {sequential:.2f} s, 12 concurrent {concurrent:.2f} s")
    assert together == alone
    assert after == alone[1] == generate(model, PROMPTS[1])
    assert len(set(alone)) > 1  # the prompts are told apart


def test_max_context_lets_the_operator_serve_past_the_declared_length(checkpoints):
    model = checkpoints["self_extend"]  # declares 128 tokens; this prompt is 300
    long_prompt = " ".join(PROMPTS[:3])
    running, client = started(model)
    try:
        with pytest.raises(openai.BadRequestError, match="exceeds the context the checkpoint declares, 128"):
            complete(client, model, long_prompt)
    finally:
        running.kill_server()
    running, client = started(model, max_context=1024)
    try:
        answer = complete(client, model, long_prompt)
    finally:
        running.kill_server()
    assert answer == generate(model, long_prompt)
