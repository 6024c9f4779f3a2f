"""``chatkv serve``: an OpenAI-compatible HTTP server whose conversations persist.

Loads the model, opens the store at ``$CHATKV_HOME`` and serves
:func:`chatkv.server.create_app` with uvicorn on a socket it binds itself (so
``--port 0`` picks a free port, printed once the server listens). SIGTERM or
Ctrl-C stops accepting connections, lets the replies in flight finish (up to
``--drain-timeout`` seconds; later ones are cut, their partial replies kept),
saves every session and exits 0; a second Ctrl-C exits at once.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .errors import CliError, ExitCode
from .options import compile_option, disk_format_option, dtype_option, kv_quant_option, model_option

if TYPE_CHECKING:
    import uvicorn

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


class Size(click.ParamType):
    """A byte count: ``4M``, ``512k``, ``2G`` or plain bytes."""

    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().lower()
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
        unit = text[len(num):].strip()
        try:
            n = int(float(num) * _SIZE_UNITS[unit])
        except (KeyError, ValueError):
            self.fail(f"not a size: {value!r} (e.g. 4M, 512k, 2G)", param, ctx)
        if n <= 0:
            self.fail(f"must be positive: {value!r}", param, ctx)
        return n


class BatchSizes(click.ParamType):
    """Decode batch sizes to compile: ``1,2,4,8`` (positive integers)."""

    name = "SIZES"

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            sizes = tuple(sorted({int(part) for part in str(value).split(",") if part.strip()}))
        except ValueError:
            self.fail(f"not a comma-separated list of batch sizes: {value!r} (e.g. 1,2,4,8)", param, ctx)
        if not sizes or sizes[0] < 1:
            self.fail(f"batch sizes must be positive integers: {value!r}", param, ctx)
        return sizes


def is_loopback(host: str) -> bool:
    """True if ``host`` only accepts connections from this machine."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: any free port).

    Raises:
        CliError: the address cannot be bound (in use, not ours).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CliError(f"cannot resolve --host {host!r}: {exc}", ExitCode.USAGE) from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror}", ExitCode.ERROR) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(app: Any, *, drain_timeout: float, log_level: str) -> "uvicorn.Server":
    """A uvicorn server for ``app`` whose SIGINT/SIGTERM drain and return (exit 0)
    instead of re-raising the signal; a second SIGINT forces the exit."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, lifespan="on", log_level=log_level, timeout_graceful_shutdown=drain_timeout,
                            access_log=log_level == "debug", server_header=False)
    return Server(config)


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 for every interface: set an API key).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port; 0 picks a free one (printed at start).")
@model_option
@click.option("--served-model-name", default=None,
              help="The model's name in requests and /v1/models (default: the loaded model's name).")
@click.option("--api-key", envvar="CHATKV_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every endpoint but /health. [env CHATKV_API_KEY]")
@click.option("--api-key-file", envvar="CHATKV_API_KEY_FILE", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Tenants, one 'NAME KEY' per line: each key's sessions are its own (ids stored as NAME.<id>). "
                   "[env CHATKV_API_KEY_FILE]")
@dtype_option
@compile_option
@click.option("--compile-batch-sizes", default="1,2,4,8", show_default=True, type=BatchSizes(),
              help="Decode batch sizes to compile a graph for (a CUDA graph on a GPU); a step of fewer "
                   "sequences runs padded through the next larger one (each size is one more compile in "
                   "the background).")
@kv_quant_option
@disk_format_option
@click.option("--kv-budget", default=None, type=Size(),
              help="Bytes of KV the device block pool holds (e.g. 2G); default: a quarter of free RAM, "
                   "at most 2G (60% of free GPU memory on CUDA).")
@click.option("--max-num-seqs", default=256, show_default=True, type=click.IntRange(min=1),
              help="Most sequences one batched step runs.")
@click.option("--max-waiting", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Most turns queued to start; more get 429 with Retry-After.")
@click.option("--max-open-sessions", default=256, show_default=True, type=click.IntRange(min=1),
              help="Sessions held open at once; the least recently used idle one is saved and closed "
                   "beyond this (it reopens from disk).")
@click.option("--max-body-size", default="4M", show_default=True, type=Size(),
              help="Larger request bodies get 413.")
@click.option("--default-max-tokens", default=None, type=click.IntRange(min=1),
              help="Reply limit when a request sets none (default: until end of sequence or the context window).")
@click.option("--default-temperature", default=1.0, show_default=True, type=click.FloatRange(0, 2),
              help="Temperature when a request sets none (1 as in OpenAI's API; 0 is greedy).")
@click.option("--context-policy", type=click.Choice(["error", "trim", "sink"]), default="error", show_default=True,
              help="A conversation longer than the window: error answers 400 context_length_exceeded (as "
                   "OpenAI's API); trim leaves its oldest turns out of the window; sink keeps its first and "
                   "most recent tokens cached, shifting kept keys in place (nothing is re-prefilled).")
@click.option("--drain-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds a shutdown waits for replies in flight before cutting them (partial replies kept).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="info", show_default=True, help="Server log level (debug adds an access log).")
def serve(host: str, port: int, model: str | None, served_model_name: str | None, api_key: str | None,
          api_key_file: Path | None, dtype: str | None, compile_mode: str | None, compile_batch_sizes: tuple[int, ...],
          kv_quant: str | None, disk_format: str,
          kv_budget: int | None, max_num_seqs: int, max_waiting: int, max_open_sessions: int, max_body_size: int, default_max_tokens: int | None,
          default_temperature: float, context_policy: str, drain_timeout: float, log_level: str) -> None:
    """Serve the model over OpenAI's chat-completions API; conversations persist.

    Any OpenAI client works unchanged (base URL http://HOST:PORT/v1). A client
    that sends the whole conversation each turn continues its stored session
    (found by its messages' prefix), reusing the session's KV from memory or
    disk, after a restart too; or pin a session with the X-Session-ID header.

    \b
    Endpoints:
      POST /v1/chat/completions       replies, streamed as server-sent events with "stream": true
      GET  /v1/models                 the served model
      GET  /v1/sessions[/ID]          stored sessions (DELETE /v1/sessions/ID removes one)
      GET  /metrics                   Prometheus metrics (chatkv:*)
      GET  /health                    liveness (no key needed)

    \b
    Example:
      chatkv serve --model default --port 8000
      curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}]}'

    SIGTERM or Ctrl-C drains the replies in flight, saves every session and
    exits 0. Exit codes: 1 error, 2 usage, 3 unknown model.
    """
    from chatkv.server.auth import KeyRing

    try:
        keys = KeyRing(api_key, api_key_file)
    except Exception as exc:  # ConfigError: a malformed key file
        raise CliError(str(exc), ExitCode.USAGE) from None
    if kv_quant is not None:
        from chatkv.quant import check_scheme

        try:
            check_scheme(kv_quant)
        except ValueError as exc:
            raise CliError(str(exc), ExitCode.USAGE) from None
    if not is_loopback(host) and not keys.enabled:
        click.echo(f"warning: listening on {host} without an API key: anyone who can reach this address can "
                   "use the model and read every session; set --api-key or CHATKV_API_KEY", err=True)
    logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    sock = bind(host, port)
    try:
        from chatkv.config import EngineConfig, TierConfig
        from chatkv.engine import get_engine
        from chatkv.persistence import default_store
        from chatkv.server import ServerConfig, create_app

        store = default_store()  # first: it warms up its statements while the model loads
        click.echo(f"chatkv serve: loading model {model or 'default'}…", err=True)
        tiers = TierConfig(quant_scheme=kv_quant or "none", disk_format=disk_format) \
            if kv_quant or disk_format != "exact" else None
        engine = get_engine(model, EngineConfig(kv_budget_bytes=kv_budget, max_num_seqs=max_num_seqs,
                                                max_waiting=max_waiting, tiers=tiers, dtype=dtype,
                                                compile=compile_mode, compile_batch_sizes=compile_batch_sizes))
        config = ServerConfig(model_name=served_model_name, aliases=tuple(a for a in (model,) if a),
                              max_body_bytes=max_body_size, max_open_sessions=max_open_sessions,
                              default_max_tokens=default_max_tokens, default_temperature=default_temperature,
                              context_policy=context_policy)
        app = create_app(engine, store, config, keys)
        server = make_server(app, drain_timeout=drain_timeout, log_level=log_level)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        name = config.model_name or engine.loaded.name
        click.echo(f"chatkv serve: model {name} on http://{shown}:{bound_port} (OpenAI base URL "
                   f"http://{shown}:{bound_port}/v1); sessions in {store.home}"
                   f"{'' if keys.enabled else '; no API key'}", err=True)
        sys.stderr.flush()
        server.run(sockets=[sock])
    finally:
        sock.close()
    click.echo("chatkv serve: stopped; every session saved", err=True)
