"""The ASGI app of ``chatkv serve``: OpenAI's chat-completions API over chatkv sessions.

Endpoints (all but ``/health`` need ``Authorization: Bearer <key>`` when keys are set):

* ``POST /v1/chat/completions``: a reply, whole or streamed as server-sent
  events ending in ``data: [DONE]`` (``stream_options.include_usage`` adds a
  last chunk with the usage);
* ``GET /v1/models``, ``GET /v1/models/{id}``;
* ``GET /v1/sessions``, ``GET /v1/sessions/{id}``, ``DELETE /v1/sessions/{id}``:
  the tenant's stored conversations;
* ``GET /health`` (no key), ``GET /version``, ``GET /metrics`` (Prometheus text).

Each completion runs as a turn of a chatkv session (see
:mod:`chatkv.server.sessions` for which one) through the engine's scheduler,
so concurrent requests batch together. Responses carry ``X-Session-ID`` (the
session the request continued or started: send it back to pin the next
turn), ``X-ChatKV-Session-Match`` (``explicit``, ``prefix``, ``branch`` or
``new``) and, for whole replies, ``X-ChatKV-KV-Source`` (where the reused KV
came from: ``device``, ``quantized``, ``host``, ``disk``, or ``recomputed``
when none was reused) and ``X-ChatKV-Cached-Tokens``. The same facts are in the
body's ``chatkv`` object (the last content chunk's, when streaming).
``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens whose
KV was reused, from any tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatkv.server.auth import KeyRing, Tenant
from chatkv.server.driver import TurnDriver
from chatkv.server.errors import APIError, bad_request, from_exception
from chatkv.server.metrics import Metrics
from chatkv.server.prefix_index import PrefixIndex
from chatkv.server.schemas import ChatRequest, parse_chat_request, parse_json
from chatkv.server.sessions import Claim, SessionRegistry

if TYPE_CHECKING:
    from chatkv.engine import Engine
    from chatkv.stats import TurnStats
    from chatkv.storage import Store

log = logging.getLogger("chatkv.server")

#: chatkv's finish reasons -> OpenAI's (``abort``, as vLLM says, for a turn cut short by a
#: disconnect or a shutdown past its drain timeout).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
                  "interrupted": "abort"}

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerConfig:
    """How ``chatkv serve`` answers.

    Attributes:
        model_name: the model's name in requests and ``/v1/models`` (default:
            the loaded model's name).
        aliases: other names requests may use for it.
        max_body_bytes: larger request bodies get 413.
        max_open_sessions: sessions held open at once (idle ones beyond are saved and closed).
        default_max_tokens: the reply limit when a request sets none (None:
            until end of sequence or the context window, as OpenAI's API).
        default_temperature: when a request sets none (OpenAI's default is 1).
        context_policy: a history longer than the window: ``error`` (400
            ``context_length_exceeded``, as OpenAI), ``trim`` (the oldest turns
            leave the window) or ``sink`` (the first and the most recent tokens
            stay cached, kept keys shifted in place); see :class:`chatkv.Chat`'s
            ``context_policy``.
        threads: worker threads for the blocking parts of requests (opening and
            saving sessions, the index); generation itself needs none.
    """

    model_name: str | None = None
    aliases: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20
    max_open_sessions: int = 256
    default_max_tokens: int | None = None
    default_temperature: float = 1.0
    context_policy: str = "error"
    threads: int = 32


@dataclass
class _State:
    engine: "Engine"
    store: "Store"
    config: ServerConfig
    keys: KeyRing
    metrics: Metrics
    registry: SessionRegistry
    index: PrefixIndex
    executor: ThreadPoolExecutor
    model_name: str
    names: frozenset[str]
    created: int = field(default_factory=lambda: int(time.time()))
    running: int = 0
    cleanups: set[asyncio.Task[None]] = field(default_factory=set)
    sync: asyncio.Future[int] | None = None


# ------------------------------------------------------------------------------ middleware


async def _send_error(send: Callable[[MutableMapping[str, Any]], Awaitable[None]], err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Authentication and the body-size limit, before any route runs.

    Every HTTP request but ``GET /health`` must carry a valid key (when keys are
    configured): 401 otherwise. A body over ``max_body_bytes`` (by its
    Content-Length, or counted as it arrives) gets 413 without being read further.
    """

    def __init__(self, app: Any, state: _State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if scope["path"] not in ("/health", "/health/"):
            try:
                scope["chatkv.tenant"] = state.keys.authenticate(headers.get("authorization"))
            except APIError as err:
                state.metrics.errors.labels(state.model_name, str(err.status)).inc()
                await _send_error(send, err)
                return
        else:
            scope["chatkv.tenant"] = Tenant()
        limit = state.config.max_body_bytes
        too_big = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = headers.get("content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _send_error(send, bad_request("malformed Content-Length header"))
                return
            if declared > limit:
                state.metrics.errors.labels(state.model_name, "413").inc()
                await _send_error(send, too_big)
                return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # Read the body here, counting, so a chunked upload cannot exceed the limit either.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                state.metrics.errors.labels(state.model_name, "413").inc()
                await _send_error(send, too_big)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# ------------------------------------------------------------------------------ a turn


class Turn:
    """One completion request running as a turn of its session."""

    def __init__(self, state: _State, claim: Claim, req: ChatRequest, sampling: dict[str, Any],
                 started: float) -> None:
        self.state = state
        self.claim = claim
        self.req = req
        self.sampling = sampling
        self.started = started
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.driver: TurnDriver | None = None
        self.stats: "TurnStats | None" = None
        self.pieces: list[str] = []
        self.first_at: float | None = None
        self.last_at: float | None = None
        self._prev_stats = claim.chat.last_stats
        self._finish: asyncio.Task[None] | None = None
        self._counted = False

    async def start(self) -> str | None:
        """Begin the turn; the first piece of the reply (None if it ended without any).

        Raises:
            APIError: the request cannot run (bad messages, context window, busy, queue full...).
        """
        self.state.running += 1
        self._counted = True
        try:
            gen = self.claim.chat.stream_complete(self.req.messages, **self.sampling)
            self.driver = TurnDriver(gen, self.state.executor)
            return await self.next()
        except BaseException as exc:
            await self.finished()
            err = from_exception(exc)
            if err is not None:
                raise err from None
            raise

    async def next(self) -> str | None:
        """The next piece, or None at the end of the reply."""
        assert self.driver is not None
        piece = await self.driver.next()
        if piece is None:
            return None
        now = time.perf_counter()
        metrics, name = self.state.metrics, self.state.model_name
        if self.first_at is None:
            self.first_at = now
            metrics.ttft.labels(name).observe(now - self.started)
        elif self.last_at is not None:
            metrics.itl.labels(name).observe(now - self.last_at)
        self.last_at = now
        self.pieces.append(piece)
        return piece

    def finished(self) -> Awaitable[None]:
        """End the turn (cancelling it if it still runs), record it and let its
        session go; idempotent. Await it (the work goes on if the waiter is cancelled)."""
        if self._finish is None:
            self._finish = asyncio.ensure_future(self._wrap_up())
            self.state.cleanups.add(self._finish)
            self._finish.add_done_callback(self.state.cleanups.discard)
        return asyncio.shield(self._finish)

    async def _wrap_up(self) -> None:
        state = self.state
        try:
            if self.driver is not None:
                await self.driver.aclose()
        except Exception:
            log.exception("closing the turn of session %s failed", self.claim.internal_id)
        finally:
            if self._counted:
                state.running -= 1
                self._counted = False
        chat = self.claim.chat
        if chat.last_stats is not self._prev_stats:
            self.stats = chat.last_stats
            self._observe(self.stats)
        await state.registry.release(self.claim)

    def _observe(self, stats: "TurnStats | None") -> None:
        if stats is None:
            return
        m, name = self.state.metrics, self.state.model_name
        m.prompt_tokens.labels(name).inc(stats.prompt_tokens)
        m.generation_tokens.labels(name).inc(len(stats.token_ids))
        m.prefix_queries.labels(name).inc(stats.prompt_tokens)
        m.prefix_hits.labels(name).inc(stats.reused_tokens)
        m.prefilled.labels(name).inc(stats.prefilled_tokens)
        m.success.labels(name, self.finish_reason).inc()
        m.kv_source.labels(name, self.kv_source).inc()
        m.session_match.labels(name, self.claim.match).inc()
        m.e2e.labels(name).observe(time.perf_counter() - self.started)
        if self.claim.restored_from_disk():
            info = self.claim.origin.restore
            m.restores.labels(name).inc()
            m.restore_bytes.labels(name).inc(info.bytes_read)
            m.restore_seconds.labels(name).observe(info.seconds)

    # -- what the client gets --------------------------------------------------------------

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish reason of the ended turn."""
        reason = self.stats.finish_reason if self.stats is not None else None
        return FINISH_REASONS.get(reason or "", "stop")

    @property
    def kv_source(self) -> str:
        """Where the reused KV came from: a tier, or ``recomputed`` when none was reused."""
        stats = self.stats
        if stats is None or stats.reused_tokens == 0:
            return "recomputed"
        if self.claim.restored_from_disk():
            return "disk"
        source = stats.kv_source.value
        return "recomputed" if source == "expired" else source

    def usage(self) -> dict[str, Any]:
        """The ``usage`` object."""
        stats = self.stats
        prompt = stats.prompt_tokens if stats else 0
        completion = len(stats.token_ids) if stats else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": stats.reused_tokens if stats else 0}}

    def extra(self) -> dict[str, Any]:
        """The ``chatkv`` object: the session and where the KV came from."""
        stats = self.stats
        out: dict[str, Any] = {"session_id": self.claim.client_id, "session_match": self.claim.match,
                               "kv_source": self.kv_source}
        if stats is not None:
            out.update(reused_tokens=stats.reused_tokens, prefilled_tokens=stats.prefilled_tokens,
                       discarded_tokens=stats.discarded_tokens, not_reused=stats.not_reused,
                       finish_reason=stats.finish_reason)
        if self.first_at is not None:
            out["ttft_s"] = round(self.first_at - self.started, 6)
        if self.claim.restored_from_disk():
            info = self.claim.origin.restore
            out["restore"] = {"source": info.source, "cached_tokens": info.cached_tokens,
                              "seconds": round(info.seconds, 6), "bytes_read": info.bytes_read}
        return out

    def headers(self, whole: bool) -> dict[str, str]:
        """Response headers; with ``whole`` (a finished turn) the KV facts too."""
        out = {"X-Session-ID": self.claim.client_id, "X-ChatKV-Session-Match": self.claim.match}
        if whole:
            out["X-ChatKV-KV-Source"] = self.kv_source
            out["X-ChatKV-Cached-Tokens"] = str(self.stats.reused_tokens if self.stats else 0)
        return out

    def completion(self) -> dict[str, Any]:
        """The ``chat.completion`` body of the finished turn."""
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.state.model_name,
            "system_fingerprint": _fingerprint(self.state),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(self.pieces)},
                         "logprobs": None, "finish_reason": self.finish_reason}],
            "usage": self.usage(), "chatkv": self.extra(),
        }

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **more: Any) -> str:
        body: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.state.model_name, "system_fingerprint": _fingerprint(self.state),
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.req.include_usage:
            body["usage"] = None
        body.update(more)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self, first: str | None) -> AsyncIterator[str]:
        """The server-sent events of a streamed reply, from its first piece on."""
        try:
            yield self._chunk({"role": "assistant", "content": ""})
            piece = first
            while piece is not None:
                if piece:
                    yield self._chunk({"content": piece})
                piece = await self.next()
            await self.finished()  # the session is free before the client hears the end
            yield self._chunk({}, self.finish_reason, chatkv=self.extra())
            if self.req.include_usage:
                yield "data: " + json.dumps({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.state.model_name, "system_fingerprint": _fingerprint(self.state),
                    "choices": [], "usage": self.usage()}) + "\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # the turn failed mid-reply: say so in the stream, then end it
            err = from_exception(exc) or APIError(500, f"internal error: {type(exc).__name__}: {exc}")
            if err.status >= 500:
                log.exception("a streamed turn failed")
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await self.finished()


class EventStream(StreamingResponse):
    """A streamed reply whose event generator is closed however the response ends.

    Starlette stops iterating when sending fails or the client disconnects,
    but leaves the generator suspended (closed only when collected); closing it
    at once ends the turn at once (the partial reply kept)."""

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _fingerprint(state: _State) -> str:
    return "fp_" + state.engine.loaded.fingerprint[:12]


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ------------------------------------------------------------------------------ the app


def create_app(engine: "Engine", store: "Store", config: ServerConfig | None = None,
               keys: KeyRing | None = None, index_path: str | Path | None = None) -> FastAPI:
    """The ASGI app serving ``engine``, its sessions persisted in ``store``.

    Args:
        engine: the engine (one model) every request runs on.
        store: where sessions persist (``chatkv.persistence.default_store()`` in ``chatkv serve``).
        config: answers and limits (:class:`ServerConfig`).
        keys: API keys and tenants (none: no authentication).
        index_path: the prefix index's SQLite file (default ``<store home>/server/prefixes.db``).
    """
    from chatkv.errors import ConfigError

    config = config or ServerConfig()
    keys = keys or KeyRing()
    if config.context_policy not in ("error", "trim", "sink"):
        raise ConfigError(f"context_policy must be 'error', 'trim' or 'sink', got {config.context_policy!r}")
    if config.context_policy == "sink":
        from chatkv.session import rope_shift

        rope_shift(engine)  # refuse a model whose positions cannot be shifted, at start
    chat_options: dict[str, Any] = {"context_policy": config.context_policy}
    model_name = config.model_name or engine.loaded.name
    names = frozenset({model_name, engine.loaded.name, *config.aliases})
    metrics = Metrics(model_name)
    index = PrefixIndex(index_path or Path(store.home) / "server" / "prefixes.db")
    executor = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="chatkv-serve")
    registry = SessionRegistry(engine, store, index, executor, max_open=config.max_open_sessions,
                               chat_options=chat_options)
    state = _State(engine, store, config, keys, metrics, registry, index, executor, model_name, names)
    metrics.attach(engine, Path(store.home) / "quarantine", lambda: registry.num_open, lambda: state.running)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        state.sync = loop.run_in_executor(executor, registry.sync, keys.tenants)
        state.sync.add_done_callback(_log_sync)
        try:
            yield
        finally:
            await _shutdown(state)

    app = FastAPI(title="chatkv", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.chatkv = state
    app.add_middleware(GuardMiddleware, state=state)

    def error_response(err: APIError) -> JSONResponse:
        state.metrics.errors.labels(model_name, str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
                       exc.status_code, str(exc.detail))
        return error_response(APIError(exc.status_code, message, code="not_found" if exc.status_code == 404
                                       else None))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(bad_request(f"invalid {loc}: {first.get('msg')}", param=loc or None))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)
        if err is None:
            log.exception("unexpected error on %s %s", request.method, request.url.path)
            err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
        return error_response(err)

    # -- routes -------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": state.created, "owned_by": "chatkv",
                "root": engine.loaded.source, "max_model_len": engine.max_context}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in names:
            raise _no_model(model_id, model_name)
        return model_card()

    @app.get("/metrics")
    async def metrics_text() -> Response:
        loop = asyncio.get_running_loop()
        body, content_type = await loop.run_in_executor(executor, metrics.render)
        return Response(body, media_type=content_type)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        started = time.perf_counter()
        req = parse_chat_request(parse_json(await request.body()))
        if req.model is not None and req.model not in names:
            raise _no_model(req.model, model_name)
        tenant: Tenant = request.scope["chatkv.tenant"]
        session_id = _session_id(request, req)
        sampling = {"temperature": config.default_temperature,
                    "max_new_tokens": config.default_max_tokens or engine.max_context}
        sampling.update(req.sampling)
        claim = await registry.claim(tenant, session_id, req.messages)
        turn = Turn(state, claim, req, sampling, started)
        first = await turn.start()
        if req.stream:
            return EventStream(turn.events(first), media_type="text/event-stream",
                               headers={**SSE_HEADERS, **turn.headers(whole=False)})
        collect = asyncio.ensure_future(_collect(turn, first))
        watch = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not collect.done():  # the client went away (or we are cancelled): stop the turn
                collect.cancel()
            watch.cancel()
        try:
            await collect
        except asyncio.CancelledError:
            await turn.finished()
            return Response(status_code=499)  # nobody is listening
        return JSONResponse(turn.completion(), headers=turn.headers(whole=True))

    @app.get("/v1/sessions")
    async def list_sessions(request: Request) -> dict[str, Any]:
        tenant: Tenant = request.scope["chatkv.tenant"]
        rows = await registry.list(tenant)
        return {"object": "list", "data": [_session_card(state, client, info) for client, info in rows]}

    @app.get("/v1/sessions/{session_id}")
    async def get_session(request: Request, session_id: str) -> dict[str, Any]:
        tenant: Tenant = request.scope["chatkv.tenant"]
        info, messages = await registry.info(tenant, session_id)
        card = _session_card(state, session_id, info)
        card["messages"] = [{"role": m.role, "content": m.content, "partial": m.partial} for m in messages]
        return card

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(request: Request, session_id: str) -> dict[str, Any]:
        tenant: Tenant = request.scope["chatkv.tenant"]
        result = await registry.delete(tenant, session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True,
                "files_removed": result.files_removed, "bytes_removed": result.bytes_removed}

    return app


async def _collect(turn: Turn, first: str | None) -> None:
    try:
        piece = first
        while piece is not None:
            piece = await turn.next()
    finally:
        await turn.finished()


def _session_id(request: Request, req: ChatRequest) -> str | None:
    header = request.headers.get("x-session-id")
    hint = req.session_hint
    if header is not None and hint is not None and header != hint[0]:
        raise bad_request(f"the X-Session-ID header and the body's {hint[1]} name different sessions",
                          param=hint[1], code="invalid_value")
    if header is not None:
        return header
    return hint[0] if hint is not None else None


def _session_card(state: _State, client_id: str, info: Any) -> dict[str, Any]:
    return {
        "id": client_id, "object": "session", "created_at": int(info.created_at.timestamp()),
        "last_used_at": int(info.last_used_at.timestamp()), "messages": info.n_messages, "turns": info.n_turns,
        "cached_tokens": info.n_cached, "kv_bytes": info.kv_bytes, "tier": info.tier,
        "open": state.registry.is_open(info.id),
    }


def _no_model(asked: str, served: str) -> APIError:
    return APIError(404, f"the model {asked!r} does not exist; this server serves {served!r}",
                    code="model_not_found", param="model")


def _version() -> str:
    import chatkv

    return chatkv.__version__


def _log_sync(future: "asyncio.Future[int]") -> None:
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        log.error("could not sync the prefix index with the store", exc_info=exc)
    elif future.result():
        log.info("prefix index: %d sessions re-indexed from the store", future.result())


async def _shutdown(state: _State) -> None:
    """Wait for the turns still ending, then save and close every session."""
    if state.sync is not None:
        with contextlib.suppress(Exception):
            await state.sync
    while state.cleanups:
        await asyncio.gather(*list(state.cleanups), return_exceptions=True)
    await state.registry.close_all()
    state.index.close()
    state.executor.shutdown(wait=True)
    log.info("chatkv serve: every session saved")
