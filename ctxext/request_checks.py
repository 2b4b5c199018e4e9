"""What `ctxext serve` checks of each request before any work: every field it accepts, and the context.

transformers' server (5.24) converts request fields as it goes (`int(body["max_tokens"])`, a GenerationConfig built
from them), so a negative `max_tokens` or a string temperature ends as HTTP 500, and a prompt far past the context
the checkpoint declares is computed for minutes. Here each field is checked first, with a 400 that names it, and
the prompt's tokens (as the server's own handler counted them) plus `max_tokens` are held to the declared context:
past it, a 400 that says both numbers at once. A request without `max_tokens` generates at most to the end of the
context. Fields a request may send but the server cannot answer (`n` > 1, `echo`, `logprobs`, `best_of` > 1) are
refused rather than silently ignored.

The checks are pure functions of the request (`field_problem`, `context_problem`); `checked_server` puts them in
front of transformers' handlers (`ctxext.compat.serving_build_server` names the private API it wraps).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from transformers import GenerationConfig

from . import compat

# The field that carries the number of new tokens, per endpoint (chat accepts both, the first winning)
MAX_TOKENS_FIELDS = {
    "completions": ("max_tokens",),
    "chat": ("max_completion_tokens", "max_tokens"),
    "responses": ("max_output_tokens",),
}
STATUS = 400  # OpenAI's invalid_request_error, as vLLM answers a prompt past its context


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _whole(minimum: int) -> Callable:
    return lambda v: None if _is_int(v) and v >= minimum else f"must be a whole number >= {minimum}"


def _between(lo: float, hi: float, open_low: bool = False) -> Callable:
    def check(v):
        if not _is_number(v) or v > hi or (v <= lo if open_low else v < lo):
            return f"must be a number in {'(' if open_low else '['}{lo:g}, {hi:g}]"
        return None

    return check


def _is(kind: type, name: str) -> Callable:
    return lambda v: None if isinstance(v, kind) else f"must be {name}"


def _only(allowed, why: str) -> Callable:
    return lambda v: None if any(v is a or (not isinstance(v, bool) and v == a) for a in allowed) else why


def _stop(v) -> str | None:
    if isinstance(v, str) or (isinstance(v, list) and 0 < len(v) <= 4 and all(isinstance(s, str) for s in v)):
        return None
    return "must be a string or a list of at most 4 strings"


def _logit_bias(v) -> str | None:
    if not isinstance(v, dict):
        return "must be an object of token ids to numbers in [-100, 100]"
    for token, bias in v.items():
        if not str(token).isdigit() or not _is_number(bias) or not -100 <= bias <= 100:
            return f"entry {token!r}: keys are token ids, values numbers in [-100, 100]"
    return None


def _generation_config(v) -> str | None:
    try:
        values = json.loads(v) if isinstance(v, str) else None
        if not isinstance(values, dict):
            return "must be a JSON object in a string"
        GenerationConfig(**values).validate(strict=True)
    except (ValueError, TypeError) as error:
        return f"is not a generation config transformers accepts ({str(error).splitlines()[0]})"
    return None


def _messages(v) -> str | None:
    if not isinstance(v, list) or not v:
        return "must be a non-empty list of messages"
    for i, message in enumerate(v):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"[{i}] must be an object with a 'role' string"
    return None


def _responses_input(v) -> str | None:
    return None if isinstance(v, str) or (isinstance(v, list) and v) else "must be a string or a non-empty list"


COMMON_RULES = {
    "model": _is(str, "a string"),
    "stream": _is(bool, "true or false"),
    "temperature": _between(0, 2),
    "top_p": _between(0, 1, open_low=True),
    "seed": lambda v: None if _is_int(v) else "must be a whole number",
    "frequency_penalty": _between(-2, 2),
    "presence_penalty": _between(-2, 2),
    "stop": _stop,
    "logit_bias": _logit_bias,
    "generation_config": _generation_config,
    "user": _is(str, "a string"),
}
ENDPOINT_RULES = {
    "completions": {
        "prompt": _is(str, "a string (one prompt a request)"),
        "max_tokens": _whole(1),
        "suffix": _is(str, "a string"),
        "n": _only((1, None), "must be 1: the server answers one choice a request; send n requests"),
        "best_of": _only((1, None), "must be 1: the server answers one choice a request"),
        "echo": _only((False, None), "must be false: the server does not echo the prompt"),
        "logprobs": _only((None,), "is not served: the server returns no log probabilities"),
    },
    "chat": {
        "messages": _messages,
        "max_tokens": _whole(1),
        "max_completion_tokens": _whole(1),
        "n": _only((1, None), "must be 1: the server answers one choice a request; send n requests"),
        "logprobs": _only((False, None), "is not served: the server returns no log probabilities"),
        "top_logprobs": _only((None,), "is not served: the server returns no log probabilities"),
        "chat_template_kwargs": _is(dict, "an object"),
        "tools": _is(list, "a list"),
    },
    "responses": {
        "input": _responses_input,
        "instructions": _is(str, "a string"),
        "max_output_tokens": _whole(1),
    },
}


class RequestRefused(Exception):
    """A request the server will not start: its message for the client, and the field it names (or None)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def refusal_response(refused: RequestRefused):
    """HTTP 400 in OpenAI's error shape, which the `openai` client shows as the error's message."""
    from fastapi.responses import JSONResponse  # noqa: PLC0415 (optional: the serve extra)

    error = {"message": str(refused), "type": "invalid_request_error", "param": refused.field, "code": None}
    return JSONResponse({"error": error}, status_code=STATUS)


def field_problem(endpoint: str, body) -> RequestRefused | None:
    """Why the request's fields cannot be answered, naming the first bad field, or None."""
    if not isinstance(body, dict):
        return RequestRefused("the request body must be a JSON object")
    rules = {**COMMON_RULES, **ENDPOINT_RULES[endpoint]}
    for field, value in body.items():
        rule = rules.get(field)
        problem = None if rule is None or value is None else rule(value)
        if problem:
            return RequestRefused(f"'{field}' {problem}, got {value!r}"[:300], field)
    return None


def requested_new_tokens(endpoint: str, body: dict) -> int | None:
    """The number of new tokens the request asks for, or None where it leaves it to the server."""
    return next((body[f] for f in MAX_TOKENS_FIELDS[endpoint] if body.get(f) is not None), None)


@dataclass(frozen=True)
class ContextLimit:
    """The most tokens a request may hold, prompt and new tokens together, and where that number comes from."""

    tokens: int
    source: str  # e.g. "the context this checkpoint declares" or "--max-context"


def context_problem(limit: ContextLimit, prompt_tokens: int, new_tokens: int | None) -> str | None:
    """Why a prompt of `prompt_tokens` (plus `new_tokens` asked for) does not fit the limit, with both numbers."""
    if new_tokens is None:
        if prompt_tokens < limit.tokens:
            return None
        return (
            f"the prompt is {prompt_tokens} tokens and {limit.source} is {limit.tokens}: shorten the prompt "
            f"(there is no room for a new token)"
        )
    if prompt_tokens + new_tokens <= limit.tokens:
        return None
    return (
        f"the prompt is {prompt_tokens} tokens and max_tokens asks for {new_tokens} more: "
        f"{prompt_tokens + new_tokens} exceeds {limit.source}, {limit.tokens}; shorten the prompt or lower max_tokens"
    )


def new_tokens_within(limit: ContextLimit, prompt_tokens: int, default: int) -> int:
    """The server's default number of new tokens, cut to what the context has left after the prompt."""
    return max(1, min(default, limit.tokens - prompt_tokens))


_REQUESTED = contextvars.ContextVar("ctxext_requested_new_tokens", default=None)


class _ContextCheckedManager:
    """A generation manager of transformers' server that holds each request to the context before generating:
    it sees the tokens exactly as the handler made them (chat template applied) and the generation config."""

    def __init__(self, manager, limit: ContextLimit):
        self._manager, self._limit = manager, limit

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def _check(self, inputs: dict, gen_config) -> None:
        ids = inputs["input_ids"]
        prompt_tokens = len(ids) if isinstance(ids, list) else int(ids.shape[-1])
        requested = _REQUESTED.get()
        problem = context_problem(self._limit, prompt_tokens, requested)
        if problem:
            raise RequestRefused(problem)
        if requested is None:
            gen_config.max_new_tokens = new_tokens_within(self._limit, prompt_tokens, gen_config.max_new_tokens)

    def generate_streaming(self, model, processor, inputs, gen_config, *args, **kwargs):
        self._check(inputs, gen_config)
        return self._manager.generate_streaming(model, processor, inputs, gen_config, *args, **kwargs)

    async def generate_non_streaming(self, model, processor, inputs, gen_config, *args, **kwargs):
        self._check(inputs, gen_config)
        return await self._manager.generate_non_streaming(model, processor, inputs, gen_config, *args, **kwargs)


def _checked_handler(handler, endpoint: str, refusal: str | None) -> None:
    """Put the field checks in front of one handler's `handle_request`, and tell the manager what was asked;
    `refusal` (the reason) refuses every request to the endpoint."""
    original = handler.handle_request

    async def handle_request(body, request_id):
        problem = RequestRefused(refusal) if refusal else field_problem(endpoint, body)
        if problem:
            return refusal_response(problem)
        token = _REQUESTED.set(requested_new_tokens(endpoint, body))
        try:
            return await original(body, request_id)
        except RequestRefused as refused:  # the context check, inside the handler's call to its manager
            return refusal_response(refused)
        finally:
            _REQUESTED.reset(token)

    handler.handle_request = handle_request


def _checked_generation_state(state, limit: ContextLimit) -> None:
    original = state.get_manager
    state.get_manager = lambda *args, **kwargs: _ContextCheckedManager(original(*args, **kwargs), limit)


@contextlib.contextmanager
def checked_server(limit: ContextLimit, refused: dict | None = None):
    """While transformers' `Serve` builds its app, every text endpoint's handler gets the field checks and every
    generation manager the context check; the endpoints in `refused` ({endpoint: reason}) answer 400 with it."""

    def build(handlers: dict, generation_state) -> None:
        for endpoint, handler in handlers.items():
            _checked_handler(handler, endpoint, (refused or {}).get(endpoint))
        _checked_generation_state(generation_state, limit)

    with compat.serving_build_server(build):
        yield
