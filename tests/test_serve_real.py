"""`ctxext serve` on the real SmolLM2 (slow tier): a passkey prompt past its L = 8192, answered through the server
with self_extend, is the answer `ctxext passkey` gives for the same prompt."""

import json

import pytest
import torch

from ctxext.cli import main
from ctxext.eval.passkey import NEW_TOKENS, build_prompt
from tests.helpers import free_port

openai = pytest.importorskip("openai", reason="the serve extra: pip install 'ctxext[serve]'")

LENGTH = 9000  # past SmolLM2's L = 8192
DEPTH = 0.5


@pytest.mark.slow
def test_a_passkey_past_L_through_the_server_is_ctxext_passkeys_answer(smollm2_path, tmp_path):
    from transformers import AutoTokenizer

    from ctxext.serve import plan_serve, start_server

    patched = tmp_path / "self_extend"
    assert main(["patch", str(smollm2_path), "--method", "self_extend", "--factor", "2", "-o", str(patched)]) == 0
    report = tmp_path / "passkey"
    argv = [
        "passkey",
        patched,
        "--lengths",
        LENGTH,
        "--passkey-depths",
        DEPTH,
        "--passkey-trials",
        1,
        "--no-baseline",
        "--dtype",
        "fp32",
    ]
    argv += ["-o", report]
    assert main([str(a) for a in argv]) == 0
    (record,) = json.loads((report / "results.json").read_text())["trials"]

    tokenizer = AutoTokenizer.from_pretrained(patched)
    ids = build_prompt(tokenizer, LENGTH, DEPTH, record["key"])
    text = tokenizer.decode(ids)
    assert torch.equal(torch.tensor(tokenizer(text).input_ids), ids), "the prompt's text must give back its tokens"

    plan = plan_serve(str(patched), "localhost", free_port("localhost"), "cpu", "fp32")
    running = start_server(plan, blocking=False)
    try:
        client = openai.OpenAI(base_url=f"http://localhost:{plan.port}/v1", api_key="none", max_retries=20, timeout=900)
        reply = client.completions.create(model=str(patched), prompt=text, max_tokens=NEW_TOKENS, temperature=0)
    finally:
        running.kill_server()
    assert reply.choices[0].text.strip() == record["output"].strip()
