"""Several chatkv servers on one PostgreSQL index and one shared chunk directory (issue 15, must-shows).

Each "server" is a real process with its own ``CHATKV_HOME`` (model cache
aside), all sharing ``CHATKV_DB_URL`` (a fresh database on the session's
private PostgreSQL cluster) and ``CHATKV_KV_DIR``. The test drives them in
lockstep through their stdin/stdout, one turn at a time, never by the clock.

- A and B alternate turns on one session (A, B, A, B): every turn after the
  first restores the KV the other server wrote (``kv_source == "disk"``, and
  it reuses at least the whole previous prompt), and the replies equal one
  process running the same turns alone.
- ``chatkv sessions gc --ttl 0 --disk-budget 0 --grace 0`` in a third
  process, run while both servers are held inside a turn, removes the seeded
  garbage (an idle session's KV, an orphan chunk file, a stale temp file) and
  nothing in use: the next turns still reuse everything and nothing is
  quarantined.
- PostgreSQL restarted between turns and during a turn (``pg_ctl restart``):
  no turn is lost or duplicated in the stored history, and chatting goes on.
- The holder SIGKILLed at 20 random points of a turn, its lease lapsing only
  by expiry (as on another machine): the other server takes the session over,
  every completed turn is stored, and its reply is stock transformers' (no
  torn KV used). ``CHATKV_MULTISERVER_KILLS`` sets the number of kills.

The paused holder (SIGSTOP past its expiry, then SIGCONT) on PostgreSQL is
``tests/test_reliability.py::test_a_paused_chat_learns_it_lost_its_session_and_writes_nothing``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

_SERVER = textwrap.dedent("""
    import json, sys, warnings
    from chatkv import Chat
    from chatkv.storage import Store

    store = Store()  # CHATKV_HOME, CHATKV_DB_URL and CHATKV_KV_DIR from the environment
    caught = []
    warnings.simplefilter("always")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        with warnings.catch_warnings(record=True) as got:
          warnings.simplefilter("always")
          try:
            chat = Chat(cmd["session"], system="You are terse.", model="tiny:llama", store=store,
                        lease_timeout_s=60, max_new_tokens=cmd.get("max_new_tokens", 8), ignore_eos=True)
            restored = chat.wait_restored()
            try:
                reply = chat.send(cmd["text"])
            finally:
                chat.close()
            st = chat.last_stats
          except Exception as e:  # a turn that failed clearly (the database restarting): the client may retry
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
            continue
        print(json.dumps({"reply": reply, "prompt": st.prompt_tokens, "reused": st.reused_tokens,
                          "prefilled": st.prefilled_tokens, "source": str(st.kv_source),
                          "restored": restored.source, "restored_tokens": restored.cached_tokens,
                          "bytes_read": restored.bytes_read,
                          "persist_error": st.persist_error, "warnings": [str(w.message) for w in got]}), flush=True)
    store.close()
""")

TURNS = ["Hello there, who are you?", "Tell me about KV caches.", "And why would I page them?",
         "Thanks. One more: what is prefill?", "Last one: and decode?", "Bye!"]


class Server:
    """One chatkv process with its own home, answering turns sent as JSON lines."""

    #: The script the process runs.
    SCRIPT = _SERVER

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self._spawn(home, env)
        assert self._read().get("ready")

    def _spawn(self, home: Path, env: dict[str, str]) -> None:
        """Start :attr:`SCRIPT` with ``home`` as its CHATKV_HOME (it reports ready on its first line)."""
        self.proc = subprocess.Popen([sys.executable, "-c", self.SCRIPT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_ROOT,
                                     env={**env, "CHATKV_HOME": str(home)})

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            out, err = self.proc.communicate(timeout=60)
            raise AssertionError(f"server exited ({self.proc.returncode}): {out}{err[-4000:]}")
        return json.loads(line)

    def start_turn(self, session: str, text: str) -> None:
        """Send a turn; :meth:`result` waits for its reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"session": session, "text": text}) + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        """The reply and stats of the turn started last."""
        return self._read()

    def turn(self, session: str, text: str) -> dict:
        """One whole turn."""
        self.start_turn(session, text)
        return self.result()

    def stop(self) -> None:
        """End the process (its store closes: leases released) and check that it exited 0."""
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, out + err[-4000:]


@pytest.fixture
def cluster_env(pg_cluster, pg_url: str, tmp_path: Path) -> dict[str, str]:
    """The environment every server shares: the index URL and the chunk directory."""
    # the conftest's pins travel (float32; always restore, so every turn's kv_source is checkable)
    kept = ("CHATKV_MODEL_CACHE", "CHATKV_CHECK_OWNER", "CHATKV_DTYPE", "CHATKV_RESTORE_POLICY", "CHATKV_COMPILE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATKV_") or k in kept}
    env.update(CHATKV_DB_URL=pg_url, CHATKV_KV_DIR=str(tmp_path / "shared-kv"))
    return env


def _reference(tmp_path: Path, env: dict[str, str], turns: list[str]) -> list[str]:
    """The replies of one process running ``turns`` alone, on its own SQLite index."""
    alone = {k: v for k, v in env.items() if k not in ("CHATKV_DB_URL", "CHATKV_KV_DIR")}
    ref = Server(tmp_path / "alone", alone)
    try:
        return [ref.turn("conv", t)["reply"] for t in turns]
    finally:
        ref.stop()


def _stored_history(url: str, session: str) -> list[tuple[str, str]]:
    from chatkv.storage import Store

    with Store(Path(os.environ["CHATKV_HOME"]) / "reader", db_url=url, read_only=False) as st:
        return [(m.role, m.content) for m in st.messages(session)]


def _check_reuse(results: list[dict]) -> None:
    """Every turn after the first restored the KV the previous turn's server wrote, all of it."""
    assert results[0]["reused"] == 0
    for before, r in zip(results, results[1:]):
        assert r["restored"] == "disk" and r["bytes_read"] > 0, r  # from the chunk files the other wrote
        # the previous turn's whole prompt (and its reply, but the last sampled token) was cached
        assert r["reused"] >= before["prompt"], (before, r)
        assert r["persist_error"] is None and not r["warnings"], r


def test_two_servers_alternate_turns_reusing_each_others_kv(tmp_path: Path, cluster_env: dict[str, str]) -> None:
    turns = TURNS[:4]
    a = Server(tmp_path / "home-a", cluster_env)
    b = Server(tmp_path / "home-b", cluster_env)
    try:
        results = [(a if i % 2 == 0 else b).turn("conv", t) for i, t in enumerate(turns)]
    finally:
        a.stop()
        b.stop()
    _check_reuse(results)
    assert [r["reply"] for r in results] == _reference(tmp_path, cluster_env, turns)
    history = _stored_history(cluster_env["CHATKV_DB_URL"], "conv")
    assert [c for role, c in history if role == "user"] == turns
    assert [c for role, c in history if role == "assistant"] == [r["reply"] for r in results]
    assert not (tmp_path / "home-a" / "kv").exists() and not (tmp_path / "home-b" / "kv").exists()


_PAUSING = textwrap.dedent("""
    import json, sys, warnings
    from chatkv import Chat
    from chatkv.storage import Store

    # As _SERVER (the same Chat settings, so its replies are comparable), but a
    # turn sent with "pause" stops after its first reply piece, inside the turn
    # (lease held, KV in memory, nothing saved yet), until the client sends "go".
    store = Store()
    print(json.dumps({"ready": True}), flush=True)
    while line := sys.stdin.readline():
        cmd = json.loads(line)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            chat = Chat(cmd["session"], system="You are terse.", model="tiny:llama", store=store,
                        lease_timeout_s=60, max_new_tokens=8, ignore_eos=True)
            restored = chat.wait_restored()
            pieces = []
            try:
                for piece in chat.stream(cmd["text"]):
                    pieces.append(piece)
                    if cmd.get("pause") and len(pieces) == 1:
                        print(json.dumps({"paused": True}), flush=True)
                        go = sys.stdin.readline()  # EOF (the client stopping) lets it finish too
                        assert not go or json.loads(go) == {"go": True}, go
            finally:
                chat.close()
            st = chat.last_stats
        print(json.dumps({"reply": "".join(pieces), "prompt": st.prompt_tokens, "reused": st.reused_tokens,
                          "prefilled": st.prefilled_tokens, "source": str(st.kv_source),
                          "restored": restored.source, "restored_tokens": restored.cached_tokens,
                          "bytes_read": restored.bytes_read, "pieces": len(pieces),
                          "persist_error": st.persist_error, "warnings": [str(w.message) for w in got]}), flush=True)
    store.close()
""")


class StartedServer(Server):
    """A server started at construction and waited for by :meth:`ready`, so that several start at once."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:  # noqa: D107 - as Server, without the wait
        self._spawn(home, env)

    def ready(self):  # noqa: ANN201 - returns self, of the subclass's type
        """Wait for the process to have opened its store; returns the server."""
        assert self._read().get("ready")
        return self


class Pausing(StartedServer):
    """A server whose turn can be held inside itself, after its first reply piece, until :meth:`go`."""

    SCRIPT = _PAUSING

    def _send(self, obj: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def start_paused_turn(self, session: str, text: str) -> None:
        """Send a turn and wait until it is paused mid-turn (it has yielded a piece and saved nothing)."""
        self._send({"session": session, "text": text, "pause": True})
        assert self._read() == {"paused": True}

    def go(self) -> dict:
        """Let the paused turn finish; its reply and stats."""
        self._send({"go": True})
        return self._read()


def test_gc_in_a_third_process_while_both_chat_removes_nothing_in_use(tmp_path: Path,
                                                                      cluster_env: dict[str, str]) -> None:
    """Both servers are held inside a turn (A on the shared session, B on one
    of its own, then the other way round) while ``chatkv sessions gc --ttl 0
    --disk-budget 0 --grace 0`` runs in a third process: the most aggressive
    settings, so that everything not in use is collected. Each gc removes real
    garbage (a finished session's KV, an orphan chunk file, a stale temp
    file, then each previous side session's KV), and none of what the two
    turns use: their chunk files and histories are untouched, the turns save,
    and every next turn restores the shared session's KV from disk and answers
    as one process alone."""
    from chatkv.storage import Store

    url, kv_dir = cluster_env["CHATKV_DB_URL"], Path(cluster_env["CHATKV_KV_DIR"])
    turns = TURNS[:4]  # A, B, A, B: each server holds the shared session during a gc, and a side one during another
    a = Pausing(tmp_path / "home-a", cluster_env)
    b = Pausing(tmp_path / "home-b", cluster_env)  # both start while the reference does
    # the reference: one process alone on its own SQLite index, running the same turns meanwhile
    ref = Server(tmp_path / "alone",
                 {k: v for k, v in cluster_env.items() if k not in ("CHATKV_DB_URL", "CHATKV_KV_DIR")})
    for text in turns:
        ref.start_turn("conv", text)
    a.ready(), b.ready()
    gc_env = {**cluster_env, "CHATKV_HOME": str(tmp_path / "home-gc")}
    index = Store(tmp_path / "reader", db_url=url, kv_dir=kv_dir)  # the test's own view of the index and files

    def kv_files(session: str) -> dict[Path, tuple[int, int]]:
        chunks = [index.path_of(c) for c in index.kv_chunks(session)]
        return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in chunks}

    def state(session: str) -> tuple[list[tuple[str, str, bool]], dict[Path, tuple[int, int]], int]:
        msgs = [(m.role, m.content, m.partial) for m in index.messages(session)]
        return msgs, kv_files(session), index.get_session(session).n_cached

    results, sides = [], []
    side_files: dict[str, dict[Path, tuple[int, int]]] = {}
    try:
        # garbage for the first gc: a finished session's KV (idle: --ttl 0 expires it), an orphan
        # chunk file (no index row) and a temp file a dead writer left (no owner token: only gc removes it)
        done = b.turn("finished", "An old conversation nobody continues.")  # B: A's first turn starts cold
        assert done["persist_error"] is None and not done["warnings"], done
        finished = kv_files("finished")
        assert finished and all(p.exists() for p in finished)
        some = next(iter(finished))
        orphan = kv_dir / "ee" / ("ee" * 32 + ".safetensors")
        orphan.parent.mkdir(exist_ok=True)
        orphan.write_bytes(some.read_bytes())
        temp = some.parent / f".tmp-{some.name}.99999.deadbeef"
        temp.write_bytes(b"half a chunk")
        garbage_bytes = sum(size for size, _ in finished.values()) + orphan.stat().st_size + temp.stat().st_size

        for i, text in enumerate(turns):
            server, other = (a, b) if i % 2 == 0 else (b, a)
            side = f"side-{i}"
            server.start_paused_turn("conv", text)
            other.start_paused_turn(side, f"Side question number {i}?")
            # both servers are now inside a turn, and stay there until go()
            before = {s: state(s) for s in ("conv", side)}
            g = subprocess.run([sys.executable, "-m", "chatkv.cli.main", "sessions", "gc", "--ttl", "0",
                                "--disk-budget", "0", "--grace", "0", "--json"],
                               env=gc_env, capture_output=True, text=True, timeout=120, cwd=_ROOT)
            assert g.returncode == 0, g.stdout + g.stderr
            report = json.loads(g.stdout)
            # nothing in use went: neither session's KV was dropped, no chunk file of theirs touched
            assert {s: state(s) for s in ("conv", side)} == before, report
            assert all(p.exists() for s in ("conv", side) for p in before[s][1])
            assert "conv" not in report["expired_sessions"] + report["over_budget_sessions"], report
            assert side not in report["expired_sessions"] + report["over_budget_sessions"], report
            # and what was not in use did go
            if i == 0:
                assert report["expired_sessions"] == ["finished"], report
                assert report["orphan_files"] == 1 and report["temp_files"] == 1, report
                assert report["files_removed"] == 2, report  # those two; the expired KV is counted in bytes
                assert not orphan.exists() and not temp.exists()
                assert not any(p.exists() for p in finished)
                assert report["bytes_reclaimed"] >= garbage_bytes, (report, garbage_bytes)
                assert index.get_session("finished").n_cached == 0
            else:
                prev = f"side-{i - 1}"
                assert report["expired_sessions"] == [prev], report
                assert report["expired_bytes"] > 0, report
                assert index.get_session(prev).n_cached == 0 and index.kv_chunks(prev) == []
                assert side_files[prev] and not any(p.exists() for p in side_files[prev])
            assert report["over_budget_sessions"] == [] and report["dangling_chunks"] == 0, report
            assert report["disk_bytes_after"] < report["disk_bytes_before"], report
            results.append(server.go())
            sides.append(other.go())
            side_files[side] = kv_files(side)
        for r in results + sides:
            assert r["pieces"] > 1 and r["persist_error"] is None and not r["warnings"], r  # paused mid-reply
        alone = [ref.result()["reply"] for _ in turns]
    finally:
        a.stop()
        b.stop()
        ref.stop()
        index.close()
    _check_reuse(results)  # every turn after the first restored, from disk, the KV saved after the previous gc
    assert [r["reply"] for r in results] == alone
    # histories are never collected: the shared one is whole, the expired sessions' stay
    index = Store(tmp_path / "reader", db_url=url, kv_dir=kv_dir)
    history = [(m.role, m.content) for m in index.messages("conv")]
    assert [c for role, c in history if role == "user"] == turns
    assert [c for role, c in history if role == "assistant"] == [r["reply"] for r in results]
    for i, r in enumerate(sides):
        assert [(m.role, m.content) for m in index.messages(f"side-{i}")][-2:] == [
            ("user", f"Side question number {i}?"), ("assistant", r["reply"])]
    assert [m.content for m in index.messages("finished")][-2:] == ["An old conversation nobody continues.",
                                                                    done["reply"]]
    quarantine = [p for home in ("home-a", "home-b", "home-gc") for p in (tmp_path / home / "quarantine").glob("*")]
    assert quarantine == []
    index.close()


def test_postgres_restarts_between_and_during_turns_lose_and_duplicate_nothing(
        tmp_path: Path, cluster_env: dict[str, str], pg_cluster) -> None:
    a = Server(tmp_path / "home-a", cluster_env)
    b = Server(tmp_path / "home-b", cluster_env)
    results, failed = [], []
    try:
        for i, text in enumerate(TURNS):
            server = a if i % 2 == 0 else b
            if i % 2:
                pg_cluster.restart()  # between two turns: every pooled connection is dead
                r = server.turn("conv", text)
            else:
                server.start_turn("conv", text)
                pg_cluster.restart()  # while the turn runs (wherever it is: opening, decoding, saving)
                r = server.result()
            while "error" in r:  # it failed clearly, so the client sends it again (as after an HTTP 503)
                assert "index" in r["error"] and len(failed) < 20, r
                failed.append(r["error"])
                r = server.turn("conv", text)
            results.append(r)
    finally:
        a.stop()
        b.stop()
    print(f"{len(failed)} turns failed during a restart and were sent again: {failed}")
    history = _stored_history(cluster_env["CHATKV_DB_URL"], "conv")
    replies = [r["reply"] for r in results]
    # every turn is stored exactly once, in order; none lost, none duplicated
    assert [c for role, c in history if role == "user"] == TURNS
    assert [c for role, c in history if role == "assistant"] == replies
    assert replies == _reference(tmp_path, cluster_env, TURNS)


def test_cli_sessions_ls_and_show_read_the_postgresql_index(tmp_path: Path, cluster_env: dict[str, str]) -> None:
    from chatkv.storage import Store

    with Store(tmp_path / "writer", db_url=cluster_env["CHATKV_DB_URL"]) as st:
        st.open_session("on-pg", system_prompt="sys")
        st.append_messages("on-pg", [("system", "sys", None, False), ("user", "hello from pg", None, False)])
    env = {**cluster_env, "CHATKV_HOME": str(tmp_path / "cli-home")}  # a home with no index of its own
    cli = [sys.executable, "-m", "chatkv.cli.main", "sessions"]
    ls = subprocess.run([*cli, "ls", "--json"], env=env, capture_output=True, text=True, timeout=120, cwd=_ROOT)
    assert ls.returncode == 0, ls.stdout + ls.stderr
    listed = json.loads(ls.stdout)
    rows = listed if isinstance(listed, list) else listed["sessions"]
    assert [r["id"] for r in rows] == ["on-pg"]
    show = subprocess.run([*cli, "show", "on-pg"], env=env, capture_output=True, text=True, timeout=120, cwd=_ROOT)
    assert show.returncode == 0 and "hello from pg" in show.stdout, show.stdout + show.stderr
    assert not (tmp_path / "cli-home" / "index.db").exists()


# ---------------------------------------------------------------------------- a holder killed mid-turn

_KILLABLE = textwrap.dedent("""
    import json, sys
    from chatkv.storage import leases
    # As if on another machine: this holder's owner id names no kernel or PID
    # namespace, so nobody can prove it dead and its lease lapses only by expiry.
    leases._namespace_id = lambda: None
    from chatkv import Chat
    from chatkv.storage import Store

    store = Store(lease_ttl_s=1.5)  # renewed every 0.5 s; CHATKV_DB_URL and CHATKV_KV_DIR from the environment
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        chat = Chat(cmd["session"], system="You are terse.", model="tiny:llama", store=store,
                    lease_timeout_s=60, max_new_tokens=12)
        restored = chat.wait_restored()
        print(json.dumps({"progress": "opened"}), flush=True)
        pieces = []
        for piece in chat.stream(cmd["text"]):
            pieces.append(piece)
            print(json.dumps({"progress": "piece"}), flush=True)
        print(json.dumps({"progress": "sent"}), flush=True)
        chat.close()
        st = chat.last_stats
        print(json.dumps({"reply": "".join(pieces), "token_ids": st.token_ids,
                          "restored": restored.source, "bytes_read": restored.bytes_read,
                          "persist_error": st.persist_error}), flush=True)
    store.close()
""")

KILLS = int(os.environ.get("CHATKV_MULTISERVER_KILLS", "20"))


class Killable(StartedServer):
    """A server process whose lease can only lapse by expiry, reporting each step of a turn."""

    SCRIPT = _KILLABLE

    def result(self) -> dict:
        """The final line of the turn started last, skipping its progress lines."""
        while "progress" in (line := self._read()):
            pass
        return line

    def kill(self) -> None:
        """SIGKILL, and reap."""
        self.proc.kill()
        self.proc.communicate(timeout=60)


def _stock_reply(loaded, history: list[tuple[str, str]], text: str) -> list[int]:
    """The greedy token ids stock transformers gives after ``history`` plus the user's ``text``."""
    import torch

    from chatkv.models import encode_chat

    msgs = [{"role": r, "content": c} for r, c in history] + [{"role": "user", "content": text}]
    ids = encode_chat(loaded.tokenizer, msgs)
    tok = loaded.tokenizer
    with torch.no_grad():
        out = loaded.reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return out[0, len(ids):].tolist()


def test_a_holder_killed_mid_turn_is_taken_over_after_its_lease_expires(tmp_path: Path,
                                                                        cluster_env: dict[str, str]) -> None:
    """Two servers take turns on one session; at 20 random points of a turn
    (opening, restoring, decoding, saving, releasing) the one holding it is
    SIGKILLed. Its lease cannot be proven dead (as for another machine), so
    the other server's next turn waits for the expiry and takes the session
    over from what was committed: the history holds every completed turn,
    whole and in order, and the successor's reply is exactly stock
    transformers' greedy continuation of the stored history, so no torn or
    foreign KV was ever used."""
    import random

    from chatkv.models import load_model

    from conftest import stock_copy

    loaded = load_model("tiny:llama")
    loaded.reference = stock_copy(loaded.model)
    rng = random.Random(15)
    url = cluster_env["CHATKV_DB_URL"]
    homes = iter(range(10_000))
    servers = [Killable(tmp_path / f"home-{next(homes)}", cluster_env).ready() for _ in range(2)]
    completed: list[str] = []  # the user texts whose turn the client saw complete
    sources: dict[str, int] = {}
    try:
        for k in range(KILLS):
            victim, successor = servers[k % 2], servers[1 - k % 2]
            text = f"Turn {k}: what is block {rng.randrange(1000)}?"
            victim.start_turn("conv", text)
            steps = rng.randrange(0, 16)  # opened, up to 12 pieces, sent: the kill lands before, inside or after
            for _ in range(steps):
                line = victim._read()
                if "progress" not in line:  # the whole turn ended first
                    completed.append(text)
                    break
            time.sleep(rng.random() * 0.03)  # the kill point: somewhere within the step after that
            victim.kill()
            servers[k % 2] = Killable(tmp_path / f"home-{next(homes)}", cluster_env)  # starts meanwhile

            before = _stored_history(url, "conv")
            users = [c for role, c in before if role == "user"]
            assert users in (completed, completed + [text]), (users, completed)  # every completed turn, once
            if users == completed + [text]:
                completed.append(text)  # it committed; the kill cut the reply line
            roles = [r for r, _ in before]
            assert roles[roles[:1] == ["system"]:] == ["user", "assistant"] * len(users), before  # whole turns

            follow = f"After kill {k}: go on."
            r = successor.turn("conv", follow)  # waits out the victim's lease, then takes the session over
            assert r["persist_error"] is None, r
            sources[r["restored"]] = sources.get(r["restored"], 0) + 1
            assert r["token_ids"] == _stock_reply(loaded, before, follow), (k, r, before)
            completed.append(follow)
            servers[k % 2].ready()
    finally:
        for s in servers:
            s.kill()
    history = _stored_history(url, "conv")
    assert [c for role, c in history if role == "user"] == completed
    print(f"{KILLS} kills; the successor restored from: {sources}")
    assert sources.get("disk", 0) > 0  # KV the killed servers committed was used, not only re-prefilled
