"""A tiny multi-user chat service: one ``Chat`` per user id, over HTTP (standard library only).

    python examples/http_app.py [--model tiny:llama] [--port 8800] [--max-users 64]

    curl -s localhost:8800/chat/alice -d '{"message": "Hi, I am Alice."}'
    curl -s localhost:8800/chat/alice -d '{"message": "What is my name?"}'
    curl -s localhost:8800/history/alice
    curl -s localhost:8800/health

It listens on 127.0.0.1 only. Each user id is a chatkv session: its history
and KV persist under $CHATKV_HOME, so a restarted server picks up where each
user left off. At most ``--max-users`` chats stay open; the least recently
used one is closed (saved) to make room, and reopens from disk when its user
returns. Requests for different users run concurrently (one thread each);
chatkv serialises turns of the same session.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from chatkv import Chat

MAX_BODY = 64 * 1024


class Chats:
    """At most ``limit`` open chats, by user id; the least recently used is closed first."""

    def __init__(self, model: str | None, limit: int, max_new_tokens: int) -> None:
        self.model = model
        self.limit = limit
        self.max_new_tokens = max_new_tokens
        self._open: OrderedDict[str, Chat] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, user: str) -> Chat:
        """The user's chat, opened (or resumed from disk) on first use."""
        with self._lock:
            chat = self._open.get(user)
            if chat is not None:
                self._open.move_to_end(user)
                return chat
            chat = Chat(user, system="You are a helpful assistant.", model=self.model,
                        max_new_tokens=self.max_new_tokens)
            self._open[user] = chat
            while len(self._open) > self.limit:
                _, oldest = self._open.popitem(last=False)
                oldest.close()
            return chat

    def __len__(self) -> int:
        return len(self._open)

    def close_all(self) -> None:
        """Close (and so save) every open chat."""
        with self._lock:
            while self._open:
                self._open.popitem()[1].close()


def make_handler(chats: Chats) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to ``chats``."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body, ensure_ascii=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _user(self, prefix: str) -> str | None:
            return self.path[len(prefix):] if self.path.startswith(prefix) else None

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                self._send(200, {"ok": True, "open_chats": len(chats)})
                return
            user = self._user("/history/")
            if not user:
                self._send(404, {"error": "GET /health or /history/<user>"})
                return
            try:
                chat = chats.get(user)
            except ValueError as exc:  # an invalid user id
                self._send(400, {"error": str(exc)})
                return
            self._send(200, {"user": user, "messages": chat.messages})

        def do_POST(self) -> None:  # noqa: N802
            user = self._user("/chat/")
            if not user:
                self._send(404, {"error": "POST /chat/<user> with {\"message\": ...}"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                self._send(413 if length else 400, {"error": f"body must be 1..{MAX_BODY} bytes of JSON"})
                return
            try:
                message = json.loads(self.rfile.read(length))["message"]
                chat = chats.get(user)
                reply = chat.send(message)
            except (ValueError, KeyError, TypeError) as exc:  # bad JSON, bad user id, bad message
                self._send(400, {"error": str(exc)})
                return
            except Exception as exc:  # e.g. the session is busy or in use elsewhere
                self._send(409, {"error": str(exc)})
                return
            s = chat.last_stats
            self._send(200, {"user": user, "reply": reply,
                             "stats": {"reused_tokens": s.reused_tokens, "prefilled_tokens": s.prefilled_tokens}})

        def log_message(self, format: str, *args: Any) -> None:
            pass  # keep the console for the startup line

    return Handler


def main() -> None:
    """Serve until Ctrl-C (or SIGTERM), then close every chat so its session is saved."""
    import signal

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model spec (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--port", type=int, default=8800, help="port on 127.0.0.1 (0 picks a free one)")
    parser.add_argument("--max-users", type=int, default=64, help="chats kept open at once")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    chats = Chats(args.model, args.max_users, args.max_new_tokens)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(chats))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"listening on http://127.0.0.1:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        chats.close_all()
        print("stopped; sessions saved", flush=True)


if __name__ == "__main__":
    main()
