"""``chatkv serve``: a real uvicorn server on 127.0.0.1 (a free port), driven by the
official ``openai`` client (sync, async and streaming) and by raw HTTP.

Servers run in a thread of the test process (each on an engine of its own, so
scheduler counters belong to one test) and, for the restart, as a real
``python -m chatkv serve`` process. Readiness is a /health poll, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from chatkv import Chat, EngineConfig  # noqa: E402
from chatkv.engine import Engine  # noqa: E402
from chatkv.models import load_model  # noqa: E402
from chatkv.persistence import default_store  # noqa: E402
from chatkv.server import KeyRing, ServerConfig, create_app  # noqa: E402

MODEL = "tiny:llama"
REPO = Path(__file__).resolve().parent.parent


def make_engine(**cfg: Any) -> Engine:
    cfg.setdefault("num_blocks", 1024)
    return Engine(load_model(MODEL), EngineConfig(**cfg))


@pytest.fixture(scope="module")
def engine() -> Engine:
    """One engine for the tests that do not count scheduler steps."""
    return make_engine()


def wait_healthy(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not become healthy in {timeout}s")
        time.sleep(0.02)


class LiveServer:
    """An app served by uvicorn in a thread, on 127.0.0.1 and a free port."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=10)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        wait_healthy(self.url)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not stop"
        self.sock.close()

    def __exit__(self, *exc: object) -> None:
        if self.thread.is_alive():
            self.stop()

    @property
    def state(self) -> Any:
        return self.app.state.chatkv

    def client(self, key: str = "none", **kw: Any) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=60, **kw)


@contextmanager
def serving(engine: Engine, keys: KeyRing | None = None, **config: Any) -> Iterator[LiveServer]:
    config.setdefault("default_temperature", 0.0)
    app = create_app(engine, default_store(), ServerConfig(**config), keys)
    with LiveServer(app) as live:
        yield live


def complete(client: "openai.OpenAI", messages: list[dict[str, str]], stream: bool = False,
             **kw: Any) -> tuple[str, Any, Any]:
    """(reply, usage, response headers) of one request, streamed or not."""
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    if not stream:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, **kw)
        resp = raw.parse()
        return resp.choices[0].message.content, resp.usage, raw.headers
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **kw) as raw:
        text, usage, finish = "", None, None
        for chunk in raw.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        assert finish in ("stop", "length")
        return text, usage, raw.headers


def reference(engine: Engine, conversation: list[str], max_tokens: int = 6, system: str | None = None
              ) -> list[str]:
    """Chat's greedy replies to the same user turns, each answering the whole history."""
    chat = Chat(f"ref-{abs(hash((tuple(conversation), system)))}", engine=engine, persist=False)
    msgs: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    out = []
    for text in conversation:
        msgs.append({"role": "user", "content": text})
        reply = chat.complete(msgs, max_new_tokens=max_tokens, temperature=0)
        out.append(reply)
        msgs.append({"role": "assistant", "content": reply})
    chat.close()
    return out


def metric_value(url: str, name: str, key: str = "none", **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


TURNS = ["Hello there", "Tell me a story", "And then what?"]


# ------------------------------------------------------------------------------ conversations


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_three_turns_equal_chat_and_report_cached_history(engine: Engine, stream: bool) -> None:
    system = f"You are terse ({'streamed' if stream else 'whole'})."
    want = reference(engine, TURNS, system=system)
    with serving(engine) as live:
        client = live.client()
        msgs = [{"role": "system", "content": system}]
        ids, prev_prompt = set(), 0
        for i, text in enumerate(TURNS):
            msgs.append({"role": "user", "content": text})
            reply, usage, headers = complete(client, msgs, stream=stream)
            assert reply == want[i], f"turn {i + 1}"
            ids.add(headers["x-session-id"])
            cached = usage.prompt_tokens_details.cached_tokens
            if i == 0:
                assert headers["x-chatkv-session-match"] == "new"
            else:  # the OpenAI norm (no id): found by its messages' prefix, the history's KV reused
                assert headers["x-chatkv-session-match"] == "prefix"
                assert prev_prompt <= cached < usage.prompt_tokens
            if not stream:
                # (turn 1 may reuse the reference's blocks from the pool's prefix cache)
                assert headers["x-chatkv-kv-source"] == ("device" if cached else "recomputed")
                assert int(headers["x-chatkv-cached-tokens"]) == cached
            assert usage.completion_tokens == 6 and usage.total_tokens == usage.prompt_tokens + 6
            prev_prompt = usage.prompt_tokens
            msgs.append({"role": "assistant", "content": reply})
        assert len(ids) == 1, "every turn continued one session"
        (sid,) = ids
        stored = httpx.get(f"{live.base_url}/sessions/{sid}").json()
        assert [(m["role"], m["content"]) for m in stored["messages"]] == [(m["role"], m["content"]) for m in msgs]


def test_explicit_session_rewrites_a_diverging_history(engine: Engine) -> None:
    with serving(engine) as live:
        client = live.client()
        msgs = [{"role": "user", "content": "first question"}]
        reply, _, h = complete(client, msgs, extra_headers={"X-Session-ID": "pinned-1"})
        assert h["x-session-id"] == "pinned-1" and h["x-chatkv-session-match"] == "explicit"
        # The body fields name sessions too; the client's messages are the truth.
        edited = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "my own answer"},
                  {"role": "user", "content": "second"}]
        _, usage, h = complete(client, edited, extra_body={"session_id": "pinned-1"})
        assert h["x-session-id"] == "pinned-1"
        assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens  # the shared prefix only
        stored = httpx.get(f"{live.base_url}/sessions/pinned-1").json()["messages"]
        assert [m["content"] for m in stored[:3]] == ["first question", "my own answer", "second"]
        _, _, h = complete(client, edited, extra_body={"prompt_cache_key": "pinned-2"})
        assert h["x-session-id"] == "pinned-2"
        # OpenAI's newer forms: a developer message is the system prompt; text parts are joined.
        parts = [{"role": "developer", "content": "be brief"},
                 {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}]
        complete(client, parts, extra_headers={"X-Session-ID": "parts"})
        stored = httpx.get(f"{live.base_url}/sessions/parts").json()["messages"]
        assert [(m["role"], m["content"]) for m in stored[:2]] == [("system", "be brief"), ("user", "two parts")]


def test_regenerate_branches_and_keeps_the_original(engine: Engine) -> None:
    with serving(engine) as live:
        client = live.client()
        msgs = [{"role": "system", "content": "branching"}, {"role": "user", "content": "pick a color"}]
        reply, _, h = complete(client, msgs)
        first = h["x-session-id"]
        # A UI's "regenerate": the same messages again, at a higher temperature.
        _, usage, h = complete(client, msgs, temperature=1.0, seed=7)
        assert h["x-chatkv-session-match"] == "branch" and h["x-session-id"] != first
        assert usage.prompt_tokens_details.cached_tokens > 0
        original = httpx.get(f"{live.base_url}/sessions/{first}").json()["messages"]
        assert original[-1]["content"] == reply


# ------------------------------------------------------------------------------ restarts and shutdown


def _start_cli(home: Path, *args: str) -> tuple[subprocess.Popen, str, list[str]]:
    env = dict(os.environ, CHATKV_HOME=str(home), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "chatkv", "serve", "--model", MODEL, "--port", "0",
                             "--default-temperature", "0", *args],
                            cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+) ", line)
            if m and not url:
                url.append(m.group(1))
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(120), "chatkv serve printed no address"
    assert url, "".join(lines)
    wait_healthy(url[0], proc=proc)
    return proc, url[0], lines


def test_conversations_resume_from_disk_after_a_restart_and_sigterm_drains(chatkv_home: Path) -> None:
    """Turns 1-2 on one server, stop it, turn 3 on a new `chatkv serve` process: the
    history comes back from disk, for the explicit id and for the prefix match."""
    explicit = ["Hi, I am Alice.", "What is a KV cache?", "What is my name?"]
    implicit = ["Hola!", "Tell me a story", "Go on."]
    first = make_engine()
    want_e, want_i = reference(first, explicit), reference(first, implicit, system="You are kind.")
    convs = {"e": [], "i": [{"role": "system", "content": "You are kind."}]}
    prompts: dict[str, int] = {}
    with serving(first) as live:
        client = live.client()
        for turn in range(2):
            for key, texts, want in (("e", explicit, want_e), ("i", implicit, want_i)):
                convs[key].append({"role": "user", "content": texts[turn]})
                extra = {"extra_headers": {"X-Session-ID": "alice"}} if key == "e" else {}
                reply, usage, h = complete(client, convs[key], **extra)
                assert reply == want[turn]
                convs[key].append({"role": "assistant", "content": reply})
                prompts[key] = usage.prompt_tokens
                if key == "i":
                    implicit_id = h["x-session-id"]
    # Stopped: every session saved and let go. A new process must find them on disk.
    proc, url, lines = _start_cli(chatkv_home)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        for key, texts, want in (("e", explicit, want_e), ("i", implicit, want_i)):
            convs[key].append({"role": "user", "content": texts[2]})
            extra = {"extra_headers": {"X-Session-ID": "alice"}} if key == "e" else {}
            reply, usage, h = complete(client, convs[key], **extra)
            assert reply == want[2], key
            assert h["x-chatkv-kv-source"] == "disk", key
            assert usage.prompt_tokens_details.cached_tokens >= prompts[key], key
            if key == "i":
                assert h["x-chatkv-session-match"] == "prefix" and h["x-session-id"] == implicit_id
        assert metric_value(url, "chatkv:session_restores_total") == 2
        # SIGTERM while a reply streams: the reply completes, every session is saved, exit 0.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a long one"}], "max_tokens": 24,
                "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "drain"},
                          timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]]
        assert finish[-1] == "length"
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert any("every session saved" in line for line in lines)
    store = default_store()
    drained = store.messages("drain")
    assert drained[-1].role == "assistant" and not drained[-1].partial
    assert store.lease_holder("drain") is None and store.lease_holder("alice") is None


# ------------------------------------------------------------------------------ concurrency


def test_16_concurrent_clients_batch_and_match_their_sequential_replies() -> None:
    n = 16
    systems = [f"You are bot {i}." for i in range(n)]
    texts = ["Hello", "More please"]
    alone = make_engine()
    want = [reference(alone, texts, max_tokens=4, system=s) for s in systems]
    engine = make_engine()

    async def user(live: LiveServer, i: int) -> list[str]:
        client = openai.AsyncOpenAI(base_url=live.base_url, api_key="none", max_retries=0, timeout=60)
        msgs = [{"role": "system", "content": systems[i]}]
        replies = []
        for text in texts:
            msgs.append({"role": "user", "content": text})
            if i % 2:
                stream = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                                              temperature=0, stream=True)
                reply = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            else:
                resp = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
                reply = resp.choices[0].message.content
            replies.append(reply)
            msgs.append({"role": "assistant", "content": reply})
        await client.close()
        return replies

    async def main(live: LiveServer) -> list[list[str]]:
        return await asyncio.gather(*(user(live, i) for i in range(n)))

    with serving(engine) as live:
        got = asyncio.run(main(live))
        assert got == want
        stats = engine.scheduler.stats
        assert stats.max_batch_seqs > 1, stats  # the requests shared forward passes
        assert stats.failed == 0
        assert len(httpx.get(live.base_url + "/sessions").json()["data"]) == n


def test_busy_session_gets_409_and_a_full_queue_429() -> None:
    engine = make_engine(max_num_seqs=1, max_waiting=1)
    with serving(engine) as live:
        long = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 6000,
                "ignore_eos": True, "stream": True}  # cut short when the test hangs up
        with httpx.Client(timeout=60) as http, \
                http.stream("POST", live.base_url + "/chat/completions", json=long,
                            headers={"X-Session-ID": "busy"}) as first:
            lines = first.iter_lines()  # (kept: a discarded iterator would close the response)
            next(lines)  # generating now
            # The same session again, while its turn is in flight: 409 at once.
            again = http.post(live.base_url + "/chat/completions", headers={"X-Session-ID": "busy"},
                              json={**long, "stream": False})
            assert again.status_code == 409
            assert again.json()["error"]["code"] == "session_busy"
            # One turn may wait to start; the next is refused with 429 and Retry-After.
            waiting = threading.Thread(target=lambda: httpx.post(
                live.base_url + "/chat/completions", json={**long, "stream": False, "max_tokens": 1},
                headers={"X-Session-ID": "waiting"}, timeout=60))
            waiting.start()
            deadline = time.monotonic() + 30
            while metric_value(live.url, "chatkv:num_requests_waiting") < 1:
                assert time.monotonic() < deadline, "the second turn never queued"
                time.sleep(0.02)
            full = http.post(live.base_url + "/chat/completions", json={**long, "stream": False},
                             headers={"X-Session-ID": "third"})
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                live.client().chat.completions.create(model=MODEL, messages=long["messages"], max_tokens=1)
        waiting.join(60)
        # The refused requests left nothing behind, and the server keeps serving.
        ids = {s["id"] for s in httpx.get(live.base_url + "/sessions").json()["data"]}
        assert "third" not in ids and {"busy", "waiting"} <= ids
        assert complete(live.client(), [{"role": "user", "content": "still there?"}])[0]


def test_a_dropped_stream_keeps_the_partial_reply_and_the_session_resumes(engine: Engine) -> None:
    with serving(engine) as live:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "talk to me"}], "max_tokens": 2000,
                "ignore_eos": True, "stream": True}
        seen = ""
        with httpx.stream("POST", live.base_url + "/chat/completions", json=body,
                          headers={"X-Session-ID": "dropped"}, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    seen += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    if len(seen) >= 8:
                        break  # hang up mid-reply
        deadline = time.monotonic() + 30
        while True:  # the server notices, cancels the turn and saves what was generated
            stored = httpx.get(live.base_url + "/sessions/dropped").json()["messages"]
            if stored[-1]["role"] == "assistant" and stored[-1]["partial"]:
                break
            assert time.monotonic() < deadline, stored
            time.sleep(0.02)
        partial = stored[-1]["content"]
        assert partial.startswith(seen) and len(partial) < 2000
        assert live.state.engine.scheduler.stats.cancelled >= 1
        msgs = body["messages"] + [{"role": "assistant", "content": partial}, {"role": "user", "content": "go on"}]
        _, usage, h = complete(live.client(), msgs, extra_headers={"X-Session-ID": "dropped"})
        assert usage.prompt_tokens_details.cached_tokens > 0


# ------------------------------------------------------------------------------ security


def test_api_key_and_tenants(engine: Engine, tmp_path: Path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("# tenants\nalice key-alice-1\nbob key-bob-2\n")
    with serving(engine, keys=KeyRing(key_file=keyfile)) as live:
        assert httpx.get(live.url + "/health").status_code == 200  # no key needed
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic key-alice-1"}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/sessions"),
                                 ("POST", "/v1/chat/completions")):
                r = httpx.request(method, live.url + path, headers=headers, json={})
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            live.client("nope").models.list()
        alice, bob = live.client("key-alice-1"), live.client("key-bob-2")
        msgs = [{"role": "system", "content": "tenant test"}, {"role": "user", "content": "secret plans"}]
        reply, _, h = complete(alice, msgs)
        alice_implicit = h["x-session-id"]
        complete(alice, msgs[1:], extra_headers={"X-Session-ID": "notes"})
        assert {s.id for s in default_store().list_sessions()} == {f"alice.{alice_implicit}", "alice.notes"}
        # Bob sees none of Alice's sessions, by listing, by id or by prefix.
        assert httpx.get(live.base_url + "/sessions", headers={"Authorization": "Bearer key-bob-2"}).json()["data"] == []
        for sid in ("notes", alice_implicit):
            for method in ("GET", "DELETE"):
                r = httpx.request(method, f"{live.base_url}/sessions/{sid}",
                                  headers={"Authorization": "Bearer key-bob-2"})
                assert r.status_code == 404, (method, sid)
        follow = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and?"}]
        _, usage, h = complete(bob, follow)
        assert h["x-chatkv-session-match"] == "new" and h["x-session-id"] != alice_implicit
        _, _, h = complete(bob, [{"role": "user", "content": "bob's own"}], extra_headers={"X-Session-ID": "notes"})
        alice_notes = httpx.get(live.base_url + "/sessions/notes",
                                headers={"Authorization": "Bearer key-alice-1"}).json()["messages"]
        assert alice_notes[0]["content"] == "secret plans"  # Bob's "notes" is his own session
        assert {s["id"] for s in httpx.get(live.base_url + "/sessions",
                                           headers={"Authorization": "Bearer key-alice-1"}).json()["data"]} \
            == {alice_implicit, "notes"}
        # Alice continues her conversation by prefix; Bob's identical messages did not touch it.
        _, _, h = complete(alice, follow)
        assert h["x-chatkv-session-match"] == "prefix" and h["x-session-id"] == alice_implicit


def test_single_api_key_keeps_ids_unchanged(engine: Engine) -> None:
    with serving(engine, keys=KeyRing(api_key="s3cret")) as live:
        with pytest.raises(openai.AuthenticationError):
            live.client("wrong").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        complete(live.client("s3cret"), [{"role": "user", "content": "hi"}], extra_headers={"X-Session-ID": "plain"})
        assert [s.id for s in default_store().list_sessions()] == ["plain"]


def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(engine: Engine) -> None:
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases: list[tuple[Any, int, str | None]] = [
        (b"{not json", 400, "invalid_json"),
        (b"", 400, "invalid_json"),
        ([1, 2], 400, "invalid_type"),
        ({**ok, "temperature": "hot"}, 400, "invalid_type"),
        ({**ok, "max_tokens": "10"}, 400, "invalid_type"),
        ({**ok, "stream": "yes"}, 400, "invalid_type"),
        ({**ok, "messages": "hi"}, 400, "invalid_type"),
        ({**ok, "messages": []}, 400, None),
        ({**ok, "messages": [{"role": "user"}]}, 400, "missing_field"),
        ({**ok, "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value"),
        ({**ok, "messages": [{"role": "tool", "content": "x"}]}, 400, "unsupported_role"),
        ({**ok, "messages": [{"role": "user", "content": "x", "name": "al"}]}, 400, "unknown_field"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
         "unsupported_content"),
        ({**ok, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, 400,
         "invalid_message"),
        ({**ok, "messages": [{"role": "user", "content": "   "}]}, 400, "invalid_message"),
        ({**ok, "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"},
                             {"role": "user", "content": "b"}]}, 400, "invalid_message"),
        ({**ok, "frobnicate": True}, 400, "unknown_field"),
        ({**ok, "n": 2}, 400, "unsupported_value"),
        ({**ok, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "unsupported_value"),
        ({**ok, "logprobs": True}, 400, "unsupported_value"),
        ({**ok, "response_format": {"type": "json_object"}}, 400, "unsupported_value"),
        ({**ok, "stream_options": {"include_usage": True}}, 400, "invalid_value"),
        ({**ok, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
        ({**ok, "top_p": 0}, 400, "invalid_type"),
        ({**ok, "max_tokens": 3, "max_completion_tokens": 4}, 400, "invalid_value"),
        ({**ok, "session_id": "../../etc"}, 400, "invalid_session_id"),
        ({**ok, "session_id": ""}, 400, "invalid_session_id"),
        ({**ok, "model": "gpt-9"}, 404, "model_not_found"),
        ({**ok, "messages": [{"role": "user", "content": "x" * 600_000}]}, 400, "context_length_exceeded"),
    ]
    with serving(engine, max_body_bytes=1 << 20) as live, httpx.Client(timeout=30) as http:
        url = live.base_url + "/chat/completions"
        for body, status, code in cases:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(url, content=data, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body if len(data) < 200 else data[:80], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            if code is not None:
                assert err["code"] == code, (body if len(data) < 200 else data[:80], err)
        # The header names a session too, and is checked the same way.
        r = http.post(url, json=ok, headers={"X-Session-ID": "../../etc"})
        assert r.status_code == 400 and "outside" in r.json()["error"]["message"]
        r = http.post(url, json={**ok, "session_id": "a"}, headers={"X-Session-ID": "b"})
        assert r.status_code == 400
        # An oversized body: 413, whether its length is declared or not.
        huge = json.dumps({**ok, "messages": [{"role": "user", "content": "y" * (2 << 20)}]}).encode()
        r = http.post(url, content=huge, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = http.post(url, content=iter([huge[i:i + 65536] for i in range(0, len(huge), 65536)]))
        assert r.status_code == 413
        r = http.get(live.url + "/v1/nowhere")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert http.get(url).status_code == 405
        assert http.get(live.base_url + "/models/gpt-9").status_code == 404
        # The official client maps them to its exceptions.
        client = live.client()
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ok["messages"], n=3)
        assert info.value.code == "unsupported_value" and info.value.param == "n"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-9", messages=ok["messages"])
        # Nothing was stored by a refused request, and the server still answers.
        assert httpx.get(live.base_url + "/sessions").json()["data"] == []
        assert http.post(url, json=ok).status_code == 200


# ------------------------------------------------------------------------------ models, sessions, metrics


def test_models_sessions_and_metrics(engine: Engine) -> None:
    with serving(engine) as live:
        client = live.client()
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert client.models.retrieve(MODEL).id == MODEL
        hits = "chatkv:prefix_cache_hits_total"
        before = metric_value(live.url, hits)
        msgs = [{"role": "system", "content": "metrics"}, {"role": "user", "content": "one"}]
        reply, u1, h = complete(client, msgs)
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "two"}]
        _, u2, _ = complete(client, msgs, stream=True)
        reported = u1.prompt_tokens_details.cached_tokens + u2.prompt_tokens_details.cached_tokens
        assert reported > 0
        assert metric_value(live.url, hits) - before == reported
        text = httpx.get(live.url + "/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("chatkv:prompt_tokens", "chatkv:generation_tokens", "chatkv:prefix_cache_queries",
                     "chatkv:prefix_cache_hits", "chatkv:time_to_first_token_seconds",
                     "chatkv:inter_token_latency_seconds", "chatkv:e2e_request_latency_seconds",
                     "chatkv:num_requests_running", "chatkv:num_requests_waiting", "chatkv:kv_cache_bytes",
                     "chatkv:kv_cache_sessions", "chatkv:kv_cache_usage_perc", "chatkv:session_restores",
                     "chatkv:session_restore_bytes", "chatkv:session_restore_seconds", "chatkv:quarantined_chunks",
                     "chatkv:request_kv_source", "chatkv:session_match", "chatkv:request_success"):
            assert name in families, name
        assert metric_value(live.url, "chatkv:time_to_first_token_seconds_count") == 2
        assert metric_value(live.url, "chatkv:kv_cache_sessions", tier="device") >= 1
        assert metric_value(live.url, "chatkv:session_match_total", match="prefix") == 1
        # Session administration.
        sid = h["x-session-id"]
        listed = httpx.get(live.base_url + "/sessions").json()
        assert listed["object"] == "list" and [s["id"] for s in listed["data"]] == [sid]
        card = httpx.get(f"{live.base_url}/sessions/{sid}").json()
        assert card["turns"] == 2 and card["open"] and len(card["messages"]) == 5
        deleted = httpx.delete(f"{live.base_url}/sessions/{sid}").json()
        assert (deleted["id"], deleted["object"], deleted["deleted"]) == (sid, "session.deleted", True)
        assert deleted["files_removed"] >= 1 and deleted["bytes_removed"] > 0
        assert httpx.get(f"{live.base_url}/sessions/{sid}").status_code == 404
        assert httpx.delete(f"{live.base_url}/sessions/{sid}").status_code == 404
        # A deleted conversation is not matched any more: it starts over.
        _, _, h = complete(client, msgs)
        assert h["x-chatkv-session-match"] == "new"


def test_loadgen_smoke_drives_chatkv_serve(engine: Engine, tmp_path: Path) -> None:
    from benchmarks.loadgen import main

    with serving(engine) as live:
        out = tmp_path / "report.json"
        # Past its 2 s the load goes on until a later turn has succeeded: an event, not a clock.
        argv = ["--base-url", live.base_url, "--users", "3", "--duration", "2", "--min-later-turns", "1",
                "--max-tokens", "4", "--max-turns", "3", "--think-time", "0.05", "--source", "synthetic",
                "--json-out", str(out)]
        assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["model"] == MODEL and report["all"]["errors"] == 0
    assert report["all"]["turns"] >= 3 and report["all"]["ttft_ms"]["p50"] > 0
    later = report["later_turns"]
    assert later["turns"] >= 1 and later["cached_fraction"] > 0.3  # turns after the first reuse the history


def test_cli_serve_help_and_refusals(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from chatkv.cli.main import main

    runner = CliRunner()
    result = runner.invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--api-key", "--api-key-file", "--port", "--model", "CHATKV_API_KEY", "/v1/chat/completions"):
        assert option in result.output
    assert "CHATKV_API_KEY" in runner.invoke(main, ["--help"]).output
    bad = tmp_path / "keys"
    bad.write_text("only-one-field\n")
    result = runner.invoke(main, ["serve", "--api-key-file", str(bad)])
    assert result.exit_code == 2 and "TENANT KEY" in result.output
    # Any interface without a key: a warning (then, here, the port is taken: exit 1 before loading anything).
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen(1)
    try:
        result = runner.invoke(main, ["serve", "--host", "0.0.0.0", "--port", str(taken.getsockname()[1])])
    finally:
        taken.close()
    assert result.exit_code == 1
    assert "without an API key" in result.output and "cannot listen" in result.output
