"""The OpenAI-compatible API of the front end: ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (streamed or not), sampled by the cluster's rollout engines from a
job's published policy, a Tinker sampler's weights, or a base model.

A model is named as ``PolicyBackend.policy`` reads it: a job of the caller's by name or id (its
latest published policy), ``JOB@VERSION``, a ``tinker://`` sampler path (the caller's, or one its
owner published to all), or a served base model.
The API key (``Authorization: Bearer``, as the ``openai`` SDK sends it, or ``X-API-Key``) is the
user's Tinker key: a user sees and samples only their own jobs and what others published. Every
refusal has OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``: 401 for a
missing or refused key, 404 for a model the user has not, 400 naming the field for a bad request
(a prompt and ``max_tokens`` past the model's context included). A streamed answer comes as
server-sent events: one choice of plain text as its tokens are sampled (``token_stream``), else
each choice's text in one chunk once it is sampled, then its finish reason, then ``[DONE]``. A
forced tool call (``tool_choice`` "required" or named) and a JSON ``response_format`` are held by
the engine's structured decoding (``Sampling.json_schema``): such a sample that ended is JSON of
the schema.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from msgspec import Meta

from plexctl.common import calls as C
from plexctl.tinker.backend import UserError

MAX_N = 16  # choices per request
MAX_BATCH_CHOICES = 64  # the choices of a completions request of several prompts, all told
MAX_BODY_BYTES = 4 << 20  # a request's body
MAX_STOPS = 4  # stop strings, as OpenAI allows
MAX_TOOLS = 128  # tools a request offers, as OpenAI allows
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's likeliest tokens a position, as OpenAI allows


class NotFound(UserError):
    """A model the caller has not (no such job of theirs, sampler or base model): a 404."""


class Policy(msgspec.Struct, frozen=True):
    """What a model name means: sample ``job_id``'s policy ``version`` ("" and 0: the base model at
    ``model_path``), or with ``latest`` its latest when the request is served (``version``: the
    latest when it was named; a running job publishes on); ``context``: the model's context in tokens."""

    name: str
    model_path: str
    context: int
    job_id: str = ""
    version: int = 0
    created: int = 0
    latest: bool = False


class PolicyBackend(abc.ABC):
    """What the OpenAI routes ask of the cluster. Methods block (called on a thread)."""

    choices_apart = True  # a streamed request's n choices may be sampled as n requests of one each

    @abc.abstractmethod
    def authenticate(self, api_key: str) -> str | None:
        """The user an API key is, None if it is no user's."""

    @abc.abstractmethod
    def policies(self, user: str) -> list[Policy]:
        """The models ``user`` may sample: the served base models, their jobs with a published
        policy, and the sampler weights other users published to all (by ``tinker://`` path)."""

    @abc.abstractmethod
    def policy(self, user: str, model: str) -> Policy:
        """What ``model`` names for ``user``; ``NotFound`` if nothing of theirs, ``UserError`` if malformed."""

    @abc.abstractmethod
    def generate(
        self,
        user: str,
        policy: Policy,
        prompt_tokens: list[int],
        sampling: C.Sampling,
        on_tokens: Callable[[C.SampleTokens], None] | None = None,
    ) -> list[C.Completion]:
        """``sampling.n`` completions of the prompt from ``policy``; ``on_tokens`` (``sampling.stream``,
        one sample) gets each run of tokens sampled, with their log-probs, as it comes, where the
        backend streams (else nothing)."""

    def end_idle(self, now: float, idle_s: float) -> list[str]:
        """End what serves requests and has served none for ``idle_s``; what was ended (by default
        nothing: a backend that holds nothing between requests)."""
        return []


# ---------------------------------------------------------------- requests


class ToolFunction(msgspec.Struct):
    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class Tool(msgspec.Struct):
    type: Literal["function"]
    function: ToolFunction


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: CalledFunction
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None


class JsonSchema(msgspec.Struct):
    name: str = "response"
    schema: dict[str, Any] = msgspec.field(default_factory=dict)
    description: str = ""
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _Sampled(msgspec.Struct, kw_only=True):
    model: str
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: str | Annotated[list[str], Meta(max_length=MAX_STOPS)] | None = None
    seed: int | None = None
    stream: bool = False
    user: str | None = None  # OpenAI's end-user tag: accepted, not used
    ignore_eos: bool = False  # vLLM's extension: the end-of-sequence token does not end a choice


class CompletionReq(_Sampled, kw_only=True):
    # a text, token ids, or a batch of either (``prompts_of``): msgspec takes one array type in a union
    prompt: str | Annotated[list[Any], Meta(min_length=1)]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None  # and the k likeliest at each
    echo: bool = False  # the prompt before each choice's text (with logprobs, its tokens' log-probs first)


class ChatReq(_Sampled, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=C.MAX_TOPK)] | None = None  # the k likeliest at each position
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None  # where the chat template has them
    # "auto" (the default with tools), "none", "required" or {"type": "function", "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None


class ApiRefusal(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    code = {401: "invalid_api_key", 404: "model_not_found"}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def decode(raw: bytes, kind: type[Any]) -> Any:
    """The request body as ``kind``; a 400 naming the field where it does not fit."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        param = text.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0] if "at `$." in text else None
        raise ApiRefusal(400, f"invalid request: {text}", param) from None
    except msgspec.DecodeError as e:
        raise ApiRefusal(400, f"invalid JSON: {e}") from None


# ---------------------------------------------------------------- tokens


def context_of(model_path: str) -> int:
    """A model's context in tokens: its ``max_position_embeddings`` (4096 where it does not say)."""
    try:
        return int(json.loads((Path(model_path) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError):
        return 4096


_LOADING = threading.Lock()  # one thread imports transformers and loads a tokenizer at a time


def tokenizer(model_path: str) -> Any:
    with _LOADING:
        return _tokenizer(model_path)


@lru_cache(maxsize=8)
def _tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def chat_prompt(
    model_path: str, messages: list[ChatMessage], tools: list[Tool] | None = None, rendered: bool = True
) -> list[int]:
    """The prompt's tokens: the model's chat template with the assistant's turn opened (and the
    ``tools``, which only a template that renders tools takes: with ``rendered`` a template without
    them refuses them, else they are left out of the prompt); a model without a template gets the
    messages' contents, one per line."""
    tok = tokenizer(model_path)
    turns = [_turn(m) for m in messages]
    if tools and "tools" not in (tok.chat_template or ""):
        if rendered:
            raise ApiRefusal(400, "the model's chat template has no tools: this model cannot be given tools", "tools")
        tools = None
    if tok.chat_template:
        offered = {"tools": [msgspec.to_builtins(t) for t in tools]} if tools else {}
        ids = tok.apply_chat_template(turns, tokenize=True, add_generation_prompt=True, return_dict=True, **offered)
        return list(ids["input_ids"])
    return list(tok("\n".join(t["content"] for t in turns))["input_ids"])


def _turn(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: an assistant's calls with their arguments as objects."""
    turn: dict[str, Any] = {"role": m.role, "content": _text(m.content)}
    if m.tool_calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c)}}
            for c in m.tool_calls
        ]
    for key in ("tool_call_id", "name"):
        if getattr(m, key) is not None:
            turn[key] = getattr(m, key)
    return turn


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        raise ApiRefusal(400, f"tool call {call.id}: arguments are not JSON", "messages") from None


TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)  # Hermes' form: Qwen2.5's, and others'


def tool_calls_of(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The calls in a sampled text (``<tool_call>{"name", "arguments"}</tool_call>``, as the
    chat templates that render tools ask for them), as OpenAI's ``tool_calls``, and the text
    before the first (None where there is none); no call: the text, unchanged, and []."""
    calls, first = [], None
    for m in TOOL_CALL.finditer(text):
        try:
            called = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(called, dict) or not isinstance(called.get("name"), str):
            continue
        arguments = called.get("arguments", {})
        first = m.start() if first is None else first
        calls.append(_call(called["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    if first is None:
        return text, []
    return text[:first].strip() or None, calls


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = [p.get("text", "") for p in content if p.get("type") == "text"]
    if len(parts) != len(content):
        raise ApiRefusal(400, "only text content parts are served", "messages")
    return "".join(parts)


class Structure(msgspec.Struct, frozen=True):
    """How a chat request's answer is held and read: ``schema`` (JSON text) the JSON every sample
    is decoded to, token by token (None: free text); ``call`` the function a sample's JSON is the
    arguments of (a named ``tool_choice``); ``calls`` whether it is a list of calls (``"required"``)."""

    schema: str | None = None
    call: str = ""
    calls: bool = False


def chat_structure(req: ChatReq) -> tuple[list[Tool] | None, bool, Structure]:
    """The tools the model is given, whether they must be rendered by the chat template (with
    ``"auto"``: the model calls in its template's form, or not at all), and how the answer is held.

    A forced call (``"required"``, a named function) and ``response_format`` JSON are held by
    structured decoding: every sample is JSON of the schema, whatever the model, its template
    rendering the tools where it can."""
    choice, tools = req.tool_choice, req.tools or []
    forced: Structure | None = None
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ApiRefusal(400, 'tool_choice: give {"type": "function", "function": {"name": ...}}', "tool_choice")
        named = [t for t in tools if t.function.name == name]
        if not named:
            raise ApiRefusal(400, f"tool_choice names {name!r}, not one of the request's tools", "tool_choice")
        forced = Structure(json.dumps(named[0].function.parameters or {"type": "object"}), call=name)
    elif choice == "required":
        if not tools:
            raise ApiRefusal(400, 'tool_choice "required" needs tools', "tool_choice")
        forced = Structure(json.dumps(_calls_schema(tools)), calls=True)
    elif choice not in (None, "auto", "none"):
        raise ApiRefusal(
            400, f'tool_choice {choice!r}: use "auto", "none", "required" or a named function', "tool_choice"
        )
    fmt = req.response_format
    wanted = None if fmt is None or fmt.type == "text" else _format_schema(fmt)
    if forced is not None and wanted is not None:
        raise ApiRefusal(400, "a forced tool_choice and a JSON response_format: give one", "response_format")
    if forced is not None:
        return tools, False, forced
    return (tools or None) if choice != "none" else None, True, Structure(wanted)


def _calls_schema(tools: list[Tool]) -> dict[str, Any]:
    """One call or more, each of one of the tools: ``[{"name": ..., "arguments": {...}}, ...]``."""
    one = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": one}}


def _format_schema(fmt: ResponseFormat) -> str:
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    if fmt.json_schema is None or not fmt.json_schema.schema:
        raise ApiRefusal(400, 'response_format "json_schema" needs json_schema.schema', "response_format")
    return json.dumps(fmt.json_schema.schema)


def read_structured(text: str, how: Structure) -> tuple[str | None, list[dict[str, Any]]]:
    """A forced call's sample as (content, ``tool_calls``); a sample cut before its JSON ended
    (``max_tokens``) is its text, with no call."""
    if how.call:
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [_call(how.call, text)]
    try:
        listed = json.loads(text)
    except ValueError:
        return text, []
    return None, [_call(c["name"], json.dumps(c["arguments"])) for c in listed]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def sampling_of(
    req: _Sampled,
    prompt_len: int,
    context: int,
    max_tokens: int | None,
    topk: int = 0,
    schema: str | None = None,
    field: str = "messages",
) -> C.Sampling:
    """The engine's sampling of a request, its prompt and completion held to the model's context;
    ``topk``: the likeliest tokens asked for at each sampled position; ``schema``: the JSON
    schema each sample is decoded to; ``field``: the request's field the prompt came in."""
    if prompt_len >= context:
        raise ApiRefusal(400, f"the prompt has {prompt_len} tokens; the model's context is {context}", field)
    room = context - prompt_len
    if max_tokens is not None and max_tokens > room:
        raise ApiRefusal(
            400,
            f"max_tokens {max_tokens} with a prompt of {prompt_len} tokens is past the model's context of {context}",
            "max_tokens",
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return C.Sampling(
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=max_tokens or room,
        n=req.n,
        seed=req.seed,
        stop=stop,
        ignore_eos=req.ignore_eos,
        topk_logprobs=topk,
        json_schema=schema,
    )


# ---------------------------------------------------------------- answers


def _token_texts(model_path: str, ids: list[int]) -> list[str]:
    tok = tokenizer(model_path)
    return [tok.decode([i]) for i in ids]


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def completion_logprobs(policy: Policy, c: C.Completion, offset: int = 0) -> dict[str, Any]:
    """A completion's tokens' log-probs as the completions API gives them; ``offset``: where its
    first token's text starts in the choice's text."""
    texts = _token_texts(policy.model_path, c.token_ids)
    offsets = [offset + sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    top = [{text: lp for text, lp in _top_texts(policy, row)} for row in c.topk_logprobs] if c.topk_logprobs else None
    return {"tokens": texts, "token_logprobs": c.logprobs, "top_logprobs": top, "text_offset": offsets}


def completion_answer(
    policy: Policy, done: list[C.Completion], logprobs: bool, rid: str, prompts: int = 1, echo: list[str] | None = None
) -> dict[str, Any]:
    """``done``: the choices of ``prompts`` prompts, a prompt's together (index ``p * n + j``);
    ``echo``: each prompt's text, put before its choices' (their log-probs after its tokens')."""
    choices = []
    per_prompt = max(1, len(done) // prompts)
    for i, c in enumerate(done):
        head = echo[i // per_prompt] if echo is not None else ""
        lp = completion_logprobs(policy, c, len(head)) if logprobs else None
        if lp is not None and echo is not None:
            lp = _joined_logprobs(echoed_logprobs(policy, c), lp)
        text = head + c.text
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": _finish(c.finish_reason)})
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": policy.name,
        "choices": choices,
        "usage": _usage(done, prompts),
    }


def echoed_logprobs(policy: Policy, c: C.Completion) -> dict[str, Any]:
    """The prompt's tokens' log-probs as the completions API gives them (None at the first: nothing
    comes before it), for ``echo``."""
    texts = _token_texts(policy.model_path, c.prompt_token_ids)
    offsets = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    top = (
        [None if row is None else dict(_top_texts(policy, row)) for row in c.topk_prompt_logprobs]
        if c.topk_prompt_logprobs
        else None
    )
    return {"tokens": texts, "token_logprobs": list(c.prompt_logprobs), "top_logprobs": top, "text_offset": offsets}


def _joined_logprobs(prompt: dict[str, Any], sampled: dict[str, Any]) -> dict[str, Any]:
    """The prompt's log-probs then the sampled tokens' (``echo``)."""
    top = None
    if prompt["top_logprobs"] is not None or sampled["top_logprobs"] is not None:
        top = (prompt["top_logprobs"] or [None] * len(prompt["tokens"])) + (
            sampled["top_logprobs"] or [None] * len(sampled["tokens"])
        )
    return {key: prompt[key] + sampled[key] for key in ("tokens", "token_logprobs", "text_offset")} | {
        "top_logprobs": top
    }


def _top_texts(policy: Policy, row: list[C.TokenLogprob]) -> list[tuple[str, float]]:
    """A position's likeliest tokens as (text, log-prob), most likely first."""
    return list(zip(_token_texts(policy.model_path, [t.token for t in row]), (t.logprob for t in row), strict=True))


def chat_logprobs(policy: Policy, c: C.Completion) -> dict[str, Any]:
    texts = _token_texts(policy.model_path, c.token_ids)
    rows = c.topk_logprobs or [[] for _ in texts]
    return {
        "content": [
            {
                "token": t,
                "logprob": lp,
                "bytes": list(t.encode()),
                "top_logprobs": [
                    {"token": text, "logprob": v, "bytes": list(text.encode())} for text, v in _top_texts(policy, row)
                ],
            }
            for t, lp, row in zip(texts, c.logprobs, rows, strict=True)
        ]
    }


def chat_answer(
    policy: Policy,
    done: list[C.Completion],
    logprobs: bool,
    rid: str,
    tools: bool = False,
    how: Structure | None = None,
) -> dict[str, Any]:
    """The chat answer; with ``tools``, each text's calls as ``tool_calls`` (finish reason
    ``tool_calls``), read as ``how`` held them where a call was forced, else in the template's form."""
    choices = []
    for i, c in enumerate(done):
        if how is not None and (how.call or how.calls):
            content, calls = read_structured(c.text, how)
        else:
            content, calls = tool_calls_of(c.text) if tools else (c.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(policy, c) if logprobs else None,
                "finish_reason": "tool_calls" if calls else _finish(c.finish_reason),
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": policy.name,
        "choices": choices,
        "usage": _usage(done),
    }


def prompts_of(req: CompletionReq) -> list[str | list[int]]:
    """A completions request's prompts: a text, token ids, or a batch of texts or of token-id
    lists (OpenAI's four forms); a 400 naming ``prompt`` for anything else."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if all(type(t) is int for t in p):
        return [list(p)]
    if all(isinstance(t, str) for t in p):
        batch: list[str | list[int]] = list(p)
    elif all(isinstance(ids, list) and ids and all(type(t) is int for t in ids) for ids in p):
        batch = [list(ids) for ids in p]
    else:
        raise ApiRefusal(400, "prompt must be a string, a list of token ids, or a list of either (a batch)", "prompt")
    if len(batch) * req.n > MAX_BATCH_CHOICES:
        many = f"{len(batch)} prompts of n={req.n} choices each: over {MAX_BATCH_CHOICES} choices in one request"
        raise ApiRefusal(400, many, "prompt")
    return batch


def token_ids(model_path: str, prompts: list[str | list[int]]) -> list[list[int]]:
    """Each prompt as token ids (a text tokenized as the model's tokenizer does)."""
    return [p if isinstance(p, list) else list(tokenizer(model_path)(p)["input_ids"]) for p in prompts]


def prompt_texts(model_path: str, prompts: list[str | list[int]]) -> list[str]:
    """Each prompt as text (token ids decoded), for ``echo``."""
    return [p if isinstance(p, str) else tokenizer(model_path).decode(p) for p in prompts]


def _usage(done: list[C.Completion], prompts: int = 1) -> dict[str, int]:
    """Tokens counted: each of the ``prompts`` prompts once (``done``: their choices, a prompt's together)."""
    prompt = sum(len(c.prompt_token_ids) for c in done[:: max(1, len(done) // prompts)]) if done else 0
    completion = sum(len(c.token_ids) for c in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def stream_of(answer: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
    """An answer as server-sent events: each choice's text, then its finish reason, then [DONE]."""

    async def events() -> AsyncIterator[bytes]:
        head = {k: answer[k] for k in ("id", "created", "model")}
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        for choice in answer["choices"]:
            i = choice["index"]
            if chat:
                delta = {"role": "assistant", "content": choice["message"]["content"]}
                if "tool_calls" in choice["message"]:  # each call whole, at its index
                    delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(choice["message"]["tool_calls"])]
                parts = [
                    {"index": i, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None},
                    {"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]},
                ]
            else:
                parts = [
                    {"index": i, "text": choice["text"], "logprobs": choice["logprobs"], "finish_reason": None},
                    {"index": i, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]},
                ]
            for part in parts:
                yield f"data: {json.dumps({**head, 'choices': [part]})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return events()


def streams_tokens(backend: PolicyBackend, req: _Sampled, how: Structure, tools: bool) -> bool:
    """Whether a streamed request gets its tokens as they are sampled: plain text (no tools or
    JSON schema, whose answers are read whole), of one choice or of several where the backend
    samples them apart; else each choice comes whole once sampled (``stream_of``)."""
    return how.schema is None and not tools and (req.n == 1 or backend.choices_apart)


@dataclasses.dataclass
class _Streamed:
    """One choice of a streamed answer: its tokens so far, the text sent, the positions whose
    log-probs are not sent yet."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    sent: str = ""
    told: int = 0  # positions whose log-probs went out
    offset: int = 0  # where the next told position's token text starts (the completions API's text_offset)
    unsent: list[C.SampleTokens] = dataclasses.field(default_factory=list)


def token_stream(
    backend: PolicyBackend,
    run: Callable[..., Any],
    user: str,
    policy: Policy,
    prompt: list[int],
    sampling: C.Sampling,
    chat: bool,
    logprobs: bool,
) -> AsyncIterator[bytes]:
    """Each of ``sampling.n`` choices' text as server-sent events as the engine samples it. A
    choice is a request of one sample (the j-th seeded ``seed + j``, as the engine seeds a
    request's j-th sample), the n side by side and batched by the engine. The text decoded so far,
    less what a ``stop`` string could still take back, goes out as it grows, with the log-probs
    of the tokens sampled since (``logprobs``); each choice's own text ends it (its rest, its last
    log-probs, its finish reason), then ``[DONE]``. A failure once streaming has begun is an
    ``error`` event."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue[tuple[int, C.SampleTokens]] = asyncio.Queue()
    one = msgspec.structs.replace(sampling, n=1, stream=True)

    def sample(j: int) -> asyncio.Future[list[C.Completion]]:
        def told(tokens: C.SampleTokens) -> None:
            loop.call_soon_threadsafe(arrived.put_nowait, (j, tokens))

        seeded = one if sampling.seed is None else msgspec.structs.replace(one, seed=sampling.seed + j)
        return asyncio.ensure_future(run(backend.generate, user, policy, prompt, seeded, told))

    works = [sample(j) for j in range(sampling.n)]
    choices = [_Streamed() for _ in works]
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    head = {"id": rid, "created": int(time.time()), "model": policy.name}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    hold = max((len(s) for s in sampling.stop), default=0)  # a stop string's start is not sent: it may be cut
    tok = tokenizer(policy.model_path)

    def event(j: int, text: str | None, finish: str | None = None, final: C.Completion | None = None) -> bytes:
        ch = choices[j]
        lp = None
        if logprobs:  # the positions sampled since the last piece (at the end: the answer's own rest)
            told = _joined(ch.unsent) if final is None else _past(final, ch.told)
            ch.unsent = []
            if told.token_ids:
                lp = chat_logprobs(policy, told) if chat else completion_logprobs(policy, told, ch.offset)
                ch.told += len(told.token_ids)
                ch.offset += sum(len(t) for t in _token_texts(policy.model_path, told.token_ids))
        if chat:
            delta = {} if text is None else {"content": text}
            part: dict[str, Any] = {"index": j, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            part = {"index": j, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return f"data: {json.dumps({**head, 'choices': [part]})}\n\n".encode()

    async def events() -> AsyncIterator[bytes]:
        if chat:
            for j in range(len(works)):
                role = {
                    "index": j,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield f"data: {json.dumps({**head, 'choices': [role]})}\n\n".encode()
        while not all(w.done() for w in works) or not arrived.empty():
            waiting = asyncio.ensure_future(arrived.get())
            busy: set[asyncio.Future[Any]] = {waiting, *(w for w in works if not w.done())}
            await asyncio.wait(busy, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                waiting.cancel()
                continue
            j, tokens = waiting.result()
            ch = choices[j]
            ch.tokens += tokens.token_ids
            ch.unsent.append(tokens)
            text = tok.decode(ch.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            ready = text[: max(0, len(text) - hold)].rstrip("\ufffd")  # not half a character
            if len(ready) > len(ch.sent) and ready.startswith(ch.sent):
                yield event(j, ready[len(ch.sent) :])
                ch.sent = ready
        try:
            done = [w.result()[0] for w in works]
        except (UserError, NotFound) as e:
            yield f"data: {json.dumps(error_body(400, str(e)))}\n\n".encode()
            yield b"data: [DONE]\n\n"
            return
        made = chat_answer(policy, done, False, rid) if chat else completion_answer(policy, done, False, rid)
        for j, (choice, c) in enumerate(zip(made["choices"], done, strict=True)):
            final, sent = choice["message"]["content"] if chat else choice["text"], choices[j].sent
            rest = final[len(sent) :] if final.startswith(sent) and len(final) > len(sent) else ""
            if rest or (logprobs and len(c.token_ids) > choices[j].told):
                yield event(j, rest, final=c)
            yield event(j, None, choice["finish_reason"])
        yield b"data: [DONE]\n\n"

    return events()


def _past(c: C.Completion, told: int) -> C.Completion:
    """A completion's positions from ``told`` on."""
    return msgspec.structs.replace(
        c, token_ids=c.token_ids[told:], logprobs=c.logprobs[told:], topk_logprobs=c.topk_logprobs[told:]
    )


def _joined(runs: list[C.SampleTokens]) -> C.Completion:
    """Runs of one sample's tokens as one completion's positions (for their log-probs)."""
    return C.Completion(
        prompt_index=0,
        text="",
        prompt_token_ids=[],
        token_ids=[t for r in runs for t in r.token_ids],
        logprobs=[lp for r in runs for lp in r.logprobs],
        finish_reason="",
        topk_logprobs=[row for r in runs for row in r.topk_logprobs],
    )


# ---------------------------------------------------------------- routes


def add_routes(app: Any, backend: PolicyBackend, run: Callable[..., Any]) -> None:
    """The OpenAI routes on ``app`` (FastAPI); ``run(fn, *args)`` awaits a blocking call on a thread."""

    async def refuse(status: int, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(status, message, param), status_code=status)

    async def user_of(request: Request) -> str:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not key:
            raise ApiRefusal(401, "no API key: pass api_key= (Authorization: Bearer KEY)")
        user = await run(backend.authenticate, key)
        if user is None:
            raise ApiRefusal(401, "API key refused")
        return str(user)

    async def body_of(request: Request) -> bytes:
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise ApiRefusal(413, f"request body over the limit of {MAX_BODY_BYTES} bytes")
            parts.append(part)
        return b"".join(parts)

    async def answer(request: Request, chat: bool) -> Any:
        try:
            user = await user_of(request)
            req = decode(await body_of(request), ChatReq if chat else CompletionReq)
            try:
                policy = await run(backend.policy, user, req.model)
            except NotFound as e:
                raise ApiRefusal(404, str(e), "model") from None
            except UserError as e:
                raise ApiRefusal(400, str(e), "model") from None
            how = Structure()
            echo: list[str] | None = None
            if chat:
                tools, rendered, how = chat_structure(req)
                prompt = await run(chat_prompt, policy.model_path, req.messages, tools, rendered)
                limit = req.max_completion_tokens or req.max_tokens
                want_logprobs, topk = req.logprobs, req.top_logprobs or 0
                if topk and not want_logprobs:
                    raise ApiRefusal(400, "top_logprobs needs logprobs: true", "top_logprobs")
                prompts = [prompt]
            else:
                texts = prompts_of(req)
                prompts = await run(token_ids, policy.model_path, texts)
                if req.echo:
                    echo = await run(prompt_texts, policy.model_path, texts)
                limit, want_logprobs, topk = req.max_tokens, req.logprobs is not None, req.logprobs or 0
            samplings = [
                sampling_of(req, len(p), policy.context, limit, topk, how.schema, "messages" if chat else "prompt")
                for p in prompts
            ]
            if echo is not None and want_logprobs:  # the prompt's own log-probs, scored by the same engine
                samplings = [
                    msgspec.structs.replace(x, prompt_logprobs=True, topk_prompt_logprobs=topk) for x in samplings
                ]
            whole = len(prompts) > 1 or echo is not None  # streamed a choice at a time, each whole
            if req.stream and not whole and streams_tokens(backend, req, how, bool(chat and tools)):
                await run(tokenizer, policy.model_path)  # loaded before the first token comes
                return StreamingResponse(
                    token_stream(backend, run, user, policy, prompts[0], samplings[0], chat, want_logprobs),
                    media_type="text/event-stream",
                )
            try:  # a batch's prompts side by side, batched by the engine; a prompt's choices together
                parts = await asyncio.gather(
                    *(run(backend.generate, user, policy, p, sampling) for p, sampling in zip(prompts, samplings))
                )
                done = [c for part in parts for c in part]
            except UserError as e:
                raise ApiRefusal(400, str(e), "response_format" if how.schema else None) from None
            if how.schema is not None and any(c.finish_reason == "error" for c in done):
                raise ApiRefusal(
                    400,
                    "the model cannot write JSON of this schema: no token of its vocabulary may come next",
                    "tool_choice" if how.call or how.calls else "response_format",
                )
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            if chat:
                made = chat_answer(policy, done, want_logprobs, rid, tools=bool(tools), how=how)
            else:
                made = completion_answer(policy, done, want_logprobs, rid, len(prompts), echo)
        except ApiRefusal as e:
            return await refuse(e.status, str(e), e.param)
        if req.stream:
            return StreamingResponse(stream_of(made, chat), media_type="text/event-stream")
        return JSONResponse(made)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        try:
            user = await user_of(request)
            listed = await run(backend.policies, user)
        except ApiRefusal as e:
            return await refuse(e.status, str(e), e.param)
        except UserError as e:
            return await refuse(400, str(e))
        data = [{"id": p.name, "object": "model", "created": p.created, "owned_by": user} for p in listed]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await answer(request, chat=True)
