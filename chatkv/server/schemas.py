"""The request bodies ``chatkv serve`` accepts, validated strictly.

``POST /v1/chat/completions`` takes OpenAI's chat-completions body. Every field
is one of three kinds:

* supported: ``model``, ``messages``, ``temperature``, ``top_p``,
  ``max_tokens``/``max_completion_tokens``, ``stop``, ``seed``, ``n`` (1 only),
  ``stream``, ``stream_options.include_usage``, ``user`` (an end-user label;
  as in OpenAI's API it does not change the reply), and the session fields
  ``session_id`` and ``prompt_cache_key``; plus two of vLLM's extensions,
  ``top_k`` and ``ignore_eos``;
* accepted only with their neutral value (what a client library may send by
  default): ``frequency_penalty``/``presence_penalty`` 0, ``logprobs`` false,
  ``logit_bias`` empty, ``tools``/``functions`` empty, ``tool_choice`` "none",
  ``response_format`` ``{"type": "text"}``, ...; any other value is a 400 that
  names the field;
* anything else: a 400 naming the unknown field. Nothing is silently ignored.

Types are checked strictly (``"10"`` is not a number). Errors are
:class:`~chatkv.server.errors.APIError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chatkv.server.errors import APIError, bad_request

#: The most stop strings a request may give (OpenAI's limit).
MAX_STOP = 4


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    """A text content part: ``{"type": "text", "text": "..."}``."""

    type: Literal["text"]
    text: str


class StreamOptions(_Strict):
    """``stream_options``: only ``include_usage`` (a last chunk with the usage)."""

    include_usage: bool | None = None


class ChatCompletionBody(_Strict):
    """The supported fields of a chat-completions request (types only; the
    message list is checked by :func:`_messages`)."""

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    session_id: str | None = None
    prompt_cache_key: str | None = None
    top_k: int | None = Field(default=None, ge=-1)
    ignore_eos: bool | None = None


#: Fields accepted only with a value that asks for the default behaviour.
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "frequency_penalty": ((0, 0.0), "repetition penalties are not supported; send 0 or omit it"),
    "presence_penalty": ((0, 0.0), "repetition penalties are not supported; send 0 or omit it"),
    "logprobs": ((False,), "log probabilities are not supported; send false or omit it"),
    "top_logprobs": ((0,), "log probabilities are not supported; omit it"),
    "logit_bias": (({},), "logit_bias is not supported; omit it"),
    "tools": (([],), "tool calling is not supported by chatkv serve; send no tools"),
    "functions": (([],), "function calling is not supported by chatkv serve; send no functions"),
    "tool_choice": (("none",), "tool calling is not supported by chatkv serve; omit tool_choice or send 'none'"),
    "function_call": (("none",), "function calling is not supported by chatkv serve; omit it or send 'none'"),
    "parallel_tool_calls": ((True, False), "parallel_tool_calls must be a boolean (it has no effect without tools)"),
    "response_format": (({"type": "text"},), "only the text response format is supported (no JSON mode or schemas)"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "store": ((False,), "chatkv keeps every conversation as a session; OpenAI's stored completions are not supported"),
    "metadata": (({},), "metadata (for OpenAI's stored completions) is not supported; omit it"),
    "service_tier": (("auto", "default"), "service tiers are not supported; omit it or send 'auto'"),
    "safety_identifier": ((), "any string"),
}

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class ChatRequest:
    """A validated chat-completions request.

    Attributes:
        model: the model asked for (None: the served one).
        messages: ``[{"role", "content"}]`` with ``developer`` mapped to
            ``system`` and content parts joined.
        sampling: keyword arguments for :meth:`chatkv.Chat.stream_complete`.
        stream: answer as server-sent events.
        include_usage: with ``stream``, end with a chunk holding the usage.
        session_hint: ``(id, field)`` from ``session_id`` or ``prompt_cache_key``, or None.
    """

    model: str | None
    messages: list[dict[str, str]]
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    session_hint: tuple[str, str] | None = None


def parse_json(raw: bytes) -> Any:
    """The JSON document in ``raw``; a 400 with the parser's reason if it is not one."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not UTF-8: {exc.reason}", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}", code="invalid_json") from None


def _validation_error(exc: ValidationError, prefix: str = "") -> APIError:
    first = exc.errors()[0]
    loc = prefix + ".".join(str(p) for p in first["loc"])
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        return bad_request(f"unknown field {loc!r}", param=loc, code="unknown_field")
    if first["type"] == "missing":
        return bad_request(f"missing required field {loc!r}", param=loc, code="missing_field")
    return bad_request(f"invalid value for {loc!r}: {msg} (got {first.get('input')!r})", param=loc,
                       code="invalid_type")


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if isinstance(part, dict) and part.get("type") != "text":
                raise bad_request(f"{where}.content[{j}] is a {part.get('type')!r} part; only text parts are "
                                  "supported", param=f"{where}.content", code="unsupported_content")
            try:
                texts.append(TextPart.model_validate(part).text)
            except ValidationError as exc:
                raise _validation_error(exc, f"{where}.content.{j}.") from None
        return "".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts, got {value!r}",
                      param=f"{where}.content", code="invalid_type")


def _messages(raw: list[Any]) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content'", param=where,
                              code="invalid_type")
        role = m.get("role")
        if role in ("tool", "function"):
            raise bad_request(f"{where} has role {role!r}: tool calling is not supported by chatkv serve",
                              param=f"{where}.role", code="unsupported_role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of system, developer, user, assistant; got {role!r}",
                              param=f"{where}.role", code="invalid_value")
        for key in m:
            if key in ("tool_calls", "function_call"):
                raise bad_request(f"{where}.{key}: tool calling is not supported by chatkv serve",
                                  param=f"{where}.{key}", code="unsupported_field")
            if key not in ("role", "content"):
                raise bad_request(f"unknown field {where}.{key!r} (a message has only 'role' and 'content')",
                                  param=f"{where}.{key}", code="unknown_field")
        if "content" not in m:
            raise bad_request(f"missing required field '{where}.content'", param=f"{where}.content",
                              code="missing_field")
        out.append({"role": _ROLES[role], "content": _content(m["content"], where)})
    if out[-1]["role"] != "user":
        raise bad_request("the last message must be from the user (the reply answers it)",
                          param="messages", code="invalid_message")
    return out


def _check_neutral(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without the neutral-only fields (checked); unknown fields are a 400."""
    known = set(ChatCompletionBody.model_fields)
    rest = {}
    for key, value in body.items():
        if key in known:
            rest[key] = value
            continue
        if key not in _NEUTRAL:
            raise bad_request(f"unknown field {key!r}", param=key, code="unknown_field")
        allowed, why = _NEUTRAL[key]
        if value is None:
            continue
        if key == "safety_identifier":  # an end-user label, like `user`: it does not change the reply
            if not isinstance(value, str):
                raise bad_request(f"{key} must be a string", param=key, code="invalid_type")
            continue
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise bad_request(f"unsupported value for {key!r}: {why}", param=key, code="unsupported_value")
    if body.get("tools") in ([], None) and body.get("tool_choice") not in (None, "none"):
        raise bad_request("tool_choice needs tools, and tool calling is not supported", param="tool_choice",
                          code="unsupported_value")
    return rest


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a chat-completions body (already parsed JSON).

    Raises:
        APIError: 400 naming the field at fault.
    """
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_type")
    try:
        req = ChatCompletionBody.model_validate(_check_neutral(body))
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if req.n not in (None, 1):
        raise bad_request(f"n={req.n} is not supported: chatkv serve returns one choice per request",
                          param="n", code="unsupported_value")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options",
                          code="invalid_value")
    sampling: dict[str, Any] = {}
    if req.temperature is not None:
        sampling["temperature"] = float(req.temperature)
    if req.top_p is not None:
        sampling["top_p"] = float(req.top_p)
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one of them",
                          param="max_tokens", code="invalid_value")
    limit = req.max_completion_tokens or req.max_tokens
    if limit is not None:
        sampling["max_new_tokens"] = limit
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        if len(stops) > MAX_STOP:
            raise bad_request(f"at most {MAX_STOP} stop strings, got {len(stops)}", param="stop",
                              code="invalid_value")
        if any(not s for s in stops):
            raise bad_request("stop strings must be non-empty", param="stop", code="invalid_value")
        sampling["stop"] = tuple(stops)
    if req.seed is not None:
        sampling["seed"] = req.seed
    if req.top_k is not None:
        sampling["top_k"] = max(req.top_k, 0)  # vLLM's -1 means "no top-k", as 0 does here
    if req.ignore_eos is not None:
        sampling["ignore_eos"] = req.ignore_eos
    hint = None
    if req.session_id is not None and req.prompt_cache_key is not None and req.session_id != req.prompt_cache_key:
        raise bad_request("session_id and prompt_cache_key name different sessions; send one",
                          param="session_id", code="invalid_value")
    if req.session_id is not None:
        hint = (req.session_id, "session_id")
    elif req.prompt_cache_key is not None:
        hint = (req.prompt_cache_key, "prompt_cache_key")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ChatRequest(model=req.model, messages=_messages(req.messages), sampling=sampling,
                       stream=bool(req.stream), include_usage=include_usage, session_hint=hint)
