"""`ctxext serve`: transformers' OpenAI-compatible server with ctxext's method in the serving process.

The oracle is the patched checkpoint itself: loaded with plain `from_pretrained` after `import ctxext`, its greedy
continuation is what the server must answer, through the real `openai` client (completion, chat completion,
streaming). The prompt is chosen so that the unpatched model answers differently, so a server that lost the
method fails. Bad input is one line and exit code 2, before any weights load.
"""

import json
import shutil
import socket

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ctxext.cli import main
from tests.helpers import free_port, requires_transformers, save_tiny_checkpoint, tiny_model

openai = pytest.importorskip("openai", reason="the serve extra: pip install 'ctxext[serve]'")

# self_extend with a window well inside the tiny model's L = 64: a 120-token prompt is remapped, and for this
# prompt (seed 1) the greedy answers of the patched and the plain model differ.
PROMPT = " ".join(f"w{(i * 17) % 256}" for i in range(120))
NEW_TOKENS = 8
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    source = save_tiny_checkpoint(root / "plain", tiny_model("llama", seed=1))
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(source)
    patched = root / "self_extend"
    args = ["patch", source, "--method", "self_extend", "--factor", "2", "--window", "16", "-o", patched]
    assert main([str(a) for a in args]) == 0
    return source, patched


def greedy_answer(path) -> str:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :])


@pytest.fixture(scope="module")
def server(checkpoints):
    from ctxext.serve import plan_serve, start_server

    _, patched = checkpoints
    plan = plan_serve(str(patched), "localhost", free_port("localhost"), "cpu", "fp32")
    running = start_server(plan, blocking=False)
    client = openai.OpenAI(base_url=f"http://localhost:{plan.port}/v1", api_key="none", max_retries=20)
    yield client, str(patched)
    running.kill_server()


def test_the_prompt_tells_the_patched_model_from_the_plain_one(checkpoints):
    source, patched = checkpoints
    assert greedy_answer(patched) != greedy_answer(source)


def test_completion_is_the_patched_models_greedy_answer(server, checkpoints):
    client, model = server
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert reply.choices[0].text == greedy_answer(checkpoints[1])


def test_chat_completion_and_streaming_give_the_same_answer(server, checkpoints):
    client, model = server
    expected = greedy_answer(checkpoints[1])
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=NEW_TOKENS, temperature=0
    )
    assert chat.choices[0].message.content == expected
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == expected


def serve_cli(capsys, *argv) -> tuple[int, str]:
    code = main(["serve", *map(str, argv)])
    return code, capsys.readouterr().err


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    code, err = serve_cli(capsys, tmp_path / "nowhere", "--port", free_port("localhost"))
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err


def test_a_port_in_use_is_one_line_before_loading(checkpoints, capsys):
    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        taken.listen()
        code, err = serve_cli(capsys, checkpoints[1], "--port", taken.getsockname()[1])
    assert code == 2 and err.count("\n") == 1 and "already in use" in err


def unknown_attention_method(config: dict) -> None:
    config["ctxext_attention"]["method"] = "no_such_method"


def unknown_rope_type(config: dict) -> None:
    for key in ("rope_parameters", "rope_scaling"):  # ctxext writes both spellings
        config[key]["rope_type"] = "ctxext_no_such_method"


@pytest.mark.parametrize("break_record", [unknown_attention_method, unknown_rope_type])
def test_an_unknown_method_record_is_one_line(break_record, checkpoints, tmp_path, capsys):
    broken = shutil.copytree(checkpoints[1], tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    break_record(config)
    (broken / "config.json").write_text(json.dumps(config))
    code, err = serve_cli(capsys, broken, "--port", free_port("localhost"))
    assert code == 2 and err.count("\n") == 1 and "no_such_method" in err


def test_continuous_batching_is_refused_for_an_attention_level_method(checkpoints, capsys):
    code, err = serve_cli(capsys, checkpoints[1], "--port", free_port("localhost"), "--continuous-batching")
    assert code == 2 and err.count("\n") == 1 and "self_extend" in err


@requires_transformers(
    "5.24",
    "under 5.16.1 its paged cache takes most of the free CPU memory: beside a second worker it was killed for memory "
    "(it passes alone); 5.19 and 5.20 not measured yet",
)
def test_continuous_batching_serves_a_frequency_method(checkpoints, tmp_path):
    """yarn only changes the rotary frequencies: transformers' paged cache serves it, with the same answer."""
    from ctxext.serve import plan_serve, start_server

    yarn = tmp_path / "yarn"
    assert main(["patch", str(checkpoints[0]), "--method", "yarn", "--factor", "2", "-o", str(yarn)]) == 0
    plan = plan_serve(str(yarn), "localhost", free_port("localhost"), "cpu", "fp32", continuous_batching=True)
    running = start_server(plan, blocking=False)
    try:
        client = openai.OpenAI(base_url=f"http://localhost:{plan.port}/v1", api_key="none", max_retries=20)
        reply = client.completions.create(model=str(yarn), prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    finally:
        running.kill_server()
    assert reply.choices[0].text == greedy_answer(yarn)


# ------------------------------------------------------------------------------ requests checked before work
# The fixture's checkpoint declares 128 tokens (L = 64, self_extend x2); PROMPT is 120 tokens of the tiny tokenizer.
DECLARED = 128
BAD_COMPLETION_FIELDS = [
    ({"max_tokens": -1}, "'max_tokens'"),  # HTTP 500 before these checks
    ({"max_tokens": 2.5}, "'max_tokens'"),
    ({"max_tokens": True}, "'max_tokens'"),
    ({"temperature": "hot"}, "'temperature'"),
    ({"temperature": 3}, "'temperature'"),
    ({"top_p": 0}, "'top_p'"),
    ({"seed": "x"}, "'seed'"),
    ({"stop": [1, 2]}, "'stop'"),
    ({"frequency_penalty": 9}, "'frequency_penalty'"),
    ({"logit_bias": {"a": 1}}, "'logit_bias'"),
    ({"generation_config": "{not json"}, "'generation_config'"),
    ({"generation_config": '{"max_new_tokens": -3}'}, "'generation_config'"),
    ({"n": 2}, "'n'"),  # answered with one choice, silently, before these checks
    ({"echo": True}, "'echo'"),
    ({"logprobs": 2}, "'logprobs'"),
    ({"stream": "yes"}, "'stream'"),
]


@pytest.mark.parametrize("fields,named", BAD_COMPLETION_FIELDS)
def test_a_bad_field_is_a_400_that_names_it(server, fields, named):
    client, model = server
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=PROMPT, extra_body=fields)
    assert named in str(refused.value)


@pytest.mark.parametrize(
    "fields,named",
    [({"messages": []}, "'messages'"), ({"max_completion_tokens": 0}, "'max_completion_tokens'"), ({"n": 3}, "'n'")],
)
def test_a_bad_chat_field_is_a_400_that_names_it(server, fields, named):
    client, model = server
    body = {"messages": [{"role": "user", "content": PROMPT}], **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=body.pop("messages"), extra_body=body)
    assert named in str(refused.value)


def test_a_prompt_past_the_declared_context_is_refused_with_both_numbers(server):
    client, model = server
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=PROMPT * 3, max_tokens=NEW_TOKENS, temperature=0)
    said = str(refused.value)
    assert f"{3 * 120 + NEW_TOKENS}" in said and f"{DECLARED}" in said
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT * 3}], max_tokens=4)
    assert f"{DECLARED}" in str(refused.value)


def test_max_tokens_past_the_context_is_refused_and_none_stops_at_its_end(server):
    client, model = server
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS + 1, temperature=0)
    assert f"{120 + NEW_TOKENS + 1} exceeds" in str(refused.value)
    reply = client.completions.create(model=model, prompt=PROMPT, temperature=0)  # the server's default: 1024
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= DECLARED


def test_the_server_answers_right_after_bad_requests(server, checkpoints):
    client, model = server
    for fields in ({"max_tokens": -1}, {"n": 2}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt=PROMPT, extra_body=fields)
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert reply.choices[0].text == greedy_answer(checkpoints[1])


def test_the_declared_context_is_the_checkpoints_and_an_override_replaces_it(checkpoints, capsys):
    from ctxext.serve import declared_context

    assert declared_context(str(checkpoints[1])).tokens == DECLARED
    assert declared_context(str(checkpoints[0])).tokens == 64  # the plain tiny model's max_position_embeddings
    assert declared_context(str(checkpoints[1]), 4096).tokens == 4096
    code, err = serve_cli(capsys, checkpoints[1], "--port", free_port("localhost"), "--max-context", "0")
    assert code == 2 and err.count("\n") == 1 and "--max-context" in err
