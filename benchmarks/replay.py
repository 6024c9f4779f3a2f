"""chatkv in the benchmark: teacher-forced replay of conversations into persistent
sessions, and one system per tier a returning session can come back from.

Replay. Each conversation is one persistent session (``conv<i>``). Its turns are
appended as they were recorded: the user turn *and the recorded assistant reply*
extend the history and the KV (a prefill of the new tokens, no generation), then
the session is saved incrementally, as a real turn saves. ``Chat`` has no public
call for "append a message without generating", so :func:`append_messages` drives
its internals (``_align``, ``Engine.prefill``, ``_persist``); the report proposes
``Chat.append(role, content)`` to replace it.

At each point the session is snapshotted at the store level (``c<i>-<bin>``: a new
session row pointing at the same content-addressed chunks, no file written), and
every timed run works on a throw-away clone of that snapshot, so the timed turn
never changes what the next repeat or tier starts from.

Tiers (each a small class; a new tier, e.g. quantized or host, is a subclass
overriding :meth:`ChatkvTier.open`):

* ``chatkv hot (device)``: the session's KV resident in the pool; the turn
  prefills only the delta.
* ``chatkv disk (page cache warm|cold)``: a fresh engine (an empty pool) opens
  the session from its chunk files, first read into the page cache or evicted
  from it.
* ``chatkv after process restart``: a new Python process loads the model and
  opens the session (``benchmarks.restart_probe``); TTFT counts from ``Chat()``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chatkv.storage import Store

from benchmarks import measure
from benchmarks.measure import Sample, evict_page_cache, idle_before_turn, raw_read, sample_for
from benchmarks.workload import Point
from chatkv.chat import Chat
from chatkv.stats import TurnStats
from chatkv.config import EngineConfig
from chatkv.engine import Engine
from chatkv.models import LoadedModel


def append_messages(chat: Chat, messages: list[dict[str, str]]) -> TurnStats:
    """Teacher-force ``messages`` onto ``chat`` (:meth:`Chat.append`): extend its
    history and KV without generating, then save the session incrementally.

    Returns:
        The turn's stats (``prefilled_tokens``, ``reused_tokens``, ``bytes_written``).
    """
    return chat.append(messages)


def timed_turn(open_chat: Callable[[], Chat], user: str, new_tokens: int
               ) -> tuple[float, float, list[int], Chat, dict[str, float]]:
    """Open a session and send ``user``, timing from the call of ``open_chat``.

    Returns:
        ``(seconds to the first token, decode seconds, generated ids, the chat,
        breakdown)``; the breakdown has ``open_s`` (the ``open_chat`` call) and
        ``first_token_s`` (the turn's own time to first token, from the
        ``stream`` call: waiting for the restore, templating, alignment, the
        delta's prefill and the first sample).
    """
    t0 = time.perf_counter()
    chat = open_chat()
    opened = time.perf_counter() - t0
    for _ in chat.stream(user, max_new_tokens=new_tokens, ignore_eos=True):
        pass
    gen = chat.last_stats
    assert gen is not None and gen.ttft_s is not None and gen.started_at is not None
    ttft = gen.started_at + gen.ttft_s - t0
    return ttft, gen.decode_s, list(gen.token_ids), chat, {"open_s": opened, "first_token_s": gen.ttft_s}


class ChatkvReplay:
    """The replayed sessions of one benchmark run, in a store of their own.

    Attributes:
        store: the benchmark's store (its own home, never the user's).
        engine: the engine the replay and the hot tier run on.
        bytes_written: chunk bytes the replay's incremental saves wrote.
        full_rewrite_bytes: what saving each turn's whole KV would have written.
        replay_prefill_s: seconds the replay spent prefilling.
    """

    def __init__(self, loaded: LoadedModel, home: Path, model_spec: str, threads: int) -> None:
        """Open a store at ``home`` and an engine for ``loaded``.

        ``model_spec`` and ``threads`` are what the restart probe loads and uses.
        """
        self.loaded, self.home, self.model_spec, self.threads = loaded, home, model_spec, threads
        self.store = Store(home)
        self.engine = Engine(loaded, EngineConfig(compile=False))  # builds histories: nothing compiles beside it
        self.chats: dict[int, Chat] = {}
        self.snapshots: list[str] = []
        self.bytes_written = 0
        self.full_rewrite_bytes = 0
        self.replay_prefill_s = 0.0
        self.replayed_tokens = 0

    def session_id(self, conv: int) -> str:
        """The id of conversation ``conv``'s replay session."""
        return f"conv{conv}"

    def advance(self, point: Point) -> None:
        """Replay conversation ``point.conv`` up to ``point.history`` and snapshot it as ``point.key``."""
        chat = self.chats.get(point.conv)
        if chat is None:
            sid = self.session_id(point.conv)
            if self.store.has_session(sid):
                self.store.delete_session(sid)
            chat = self.chats[point.conv] = Chat(sid, engine=self.engine, store=self.store)
        have = len(chat.messages)
        for i in range(have, len(point.history), 2):
            t0 = time.perf_counter()
            stats = append_messages(chat, list(point.history[i : i + 2]))
            self.replay_prefill_s += time.perf_counter() - t0
            self.replayed_tokens += stats.prefilled_tokens
            self.bytes_written += stats.bytes_written
            self.full_rewrite_bytes += self.store.session_bytes(chat.session_id).total
        cached = self.engine.call(lambda: tuple(chat._session.kv.seq.computed_ids[: point.n_cached]))
        assert cached == point.cached_ids
        self.clone(chat.session_id, point.key)
        self.snapshots.append(point.key)

    def finish_conversation(self, conv: int) -> None:
        """Close conversation ``conv``'s session (saved; its blocks return to the pool)."""
        chat = self.chats.pop(conv, None)
        if chat is not None:
            chat.close()

    def clone(self, src: str, dst: str) -> str:
        """A new session ``dst`` with ``src``'s history and KV chunks (shared, not copied)."""
        store = self.store
        if store.has_session(dst):
            store.delete_session(dst)
        fp = self.loaded.fingerprint
        store.open_session(dst, fingerprint=fp)
        for m in store.messages(src):
            store.append_message(dst, m.role, m.content, partial=m.partial)
        store.save_kv(dst, token_ids=store.cached_token_ids(src), fingerprint=fp, chunks=store.kv_chunks(src))
        return dst

    def chunk_paths(self, session_id: str) -> list[Path]:
        """The chunk files of a session, in order."""
        return [self.store.path_of(c) for c in self.store.kv_chunks(session_id)]

    def fresh_engine(self, point: Point, new_tokens: int) -> Engine:
        """An engine with an empty pool just large enough for ``point``'s next turn."""
        bs = EngineConfig().block_size
        blocks = math.ceil((len(point.prompt_ids) + new_tokens) / bs) + 4
        engine = Engine(self.loaded, EngineConfig(num_blocks=blocks))
        engine.wait_warm()  # the warm-up belongs to loading, not to the timed turn
        return engine

    def close(self) -> None:
        """Close every open session, the engine and the store."""
        for conv in list(self.chats):
            self.finish_conversation(conv)
        self.engine.close()
        self.store.close()


class ChatkvTier:
    """A chatkv session answering the next turn after coming back from one tier.

    Subclasses set ``name`` and override :meth:`open` (untimed setup goes in
    :meth:`before`). Each measurement works on a clone of the point's snapshot,
    deleted afterwards.
    """

    name = "chatkv"

    def __init__(self, bench: ChatkvReplay, new_tokens: int) -> None:
        """Measure on ``bench``'s sessions, generating ``new_tokens`` per turn."""
        self.bench, self.new_tokens = bench, new_tokens
        self.engine: Engine | None = None  # the measurement's own engine, closed after it

    def prepare(self, point: Point) -> None:
        """Nothing: the replay made the snapshot."""

    def before(self, point: Point, session_id: str) -> dict[str, float]:
        """Untimed setup of the clone ``session_id``; returns facts for the sample."""
        return {}

    def open(self, point: Point, session_id: str) -> Callable[[], Chat]:
        """How the session comes back: a callable that opens it (timed), on an
        engine of its own (:attr:`engine`, closed after the measurement)."""
        engine = self.engine = self.bench.fresh_engine(point, self.new_tokens)
        return lambda: Chat(session_id, engine=engine, store=self.bench.store)

    def after(self, point: Point, session_id: str, chat: Chat) -> dict[str, float]:
        """Untimed measurements after the turn (before the clone is deleted)."""
        return {}

    def measure(self, point: Point, repeat: int) -> Sample | None:
        """Clone the snapshot, bring it back through this tier, time the next turn."""
        sid = self.bench.clone(point.key, f"t{repeat}-{point.key}")
        try:
            extra = self.before(point, sid)
            opener = self.open(point, sid)
            idle_before_turn()
            ttft, decode, tokens, chat, parts = timed_turn(opener, point.user, self.new_tokens)
            info = chat.restore
            extra.update(parts)
            extra.update(restore_s=info.seconds, bytes_read=info.bytes_read, cached_tokens=info.cached_tokens)
            extra.update(self.after(point, sid, chat))
            chat.close()
        finally:
            if self.engine is not None:  # its loop thread (and OpenMP pool) ends now
                self.engine.close()
                self.engine = None
            self.bench.store.delete_session(sid)
        return sample_for(self.name, point, repeat, ttft, decode, tokens, **extra)

    def release(self, point: Point) -> None:
        """Nothing to free."""


class HotTier(ChatkvTier):
    """The session still resident in the engine's pool (device tier)."""

    name = "chatkv hot (device)"

    def __init__(self, bench: ChatkvReplay, new_tokens: int) -> None:
        """See :class:`ChatkvTier`."""
        super().__init__(bench, new_tokens)
        self.chat: Chat | None = None

    def prepare(self, point: Point) -> None:
        """Make an in-process session holding the history (its blocks shared with the replay's)."""
        chat = Chat(f"hot-{point.key}", engine=self.bench.engine, persist=False)
        append_messages(chat, list(point.history))
        self.chat = chat

    def measure(self, point: Point, repeat: int) -> Sample:
        """Send the next turn, then roll the session back to the history."""
        chat = self.chat
        assert chat is not None
        ttft, decode, tokens, _, parts = timed_turn(lambda: chat, point.user, self.new_tokens)
        chat.rewind(1)  # back to the history; the next turn realigns its KV to it
        assert chat.messages == list(point.history)
        return sample_for(self.name, point, repeat, ttft, decode, tokens, **parts)

    def release(self, point: Point) -> None:
        """Release the session's blocks and forget it."""
        if self.chat is not None:
            self.chat.close()
        self.chat = None


class DiskTier(ChatkvTier):
    """The session loaded from its chunk files into an empty pool.

    ``cold`` evicts the files from the page cache first (``evict`` names how:
    see :func:`benchmarks.measure.evict_page_cache`); warm reads them once first.
    After the turn, a raw read of the same files (same cache state) gives the
    physical limit the restore is compared with.
    """

    def __init__(self, bench: ChatkvReplay, new_tokens: int, cold: bool, evict: str = "fadvise") -> None:
        """See the class docstring."""
        super().__init__(bench, new_tokens)
        self.cold, self.evict = cold, evict
        self.name = f"chatkv disk (page cache {'cold' if cold else 'warm'})"
        self.evicted_with = "none"

    def _prime(self, paths: list[Path]) -> None:
        if self.cold:
            self.evicted_with = evict_page_cache(paths, self.evict)
        else:
            raw_read(paths)

    def before(self, point: Point, session_id: str) -> dict[str, float]:
        """Warm or evict the clone's chunk files."""
        self._prime(self.bench.chunk_paths(session_id))
        return {}

    def after(self, point: Point, session_id: str, chat: Chat) -> dict[str, float]:
        """Raw-read the files the restore read, in the same page-cache state."""
        paths = self.bench.chunk_paths(point.key)  # the clone has grown by the turn; the snapshot has not
        self._prime(paths)
        n, secs = raw_read(paths)
        return {"raw_bytes": n, "raw_s": secs}


class RestartTier(ChatkvTier):
    """The session opened by a new Python process (``benchmarks.restart_probe``)."""

    name = "chatkv after process restart"

    def __init__(self, bench: ChatkvReplay, new_tokens: int, repeats: int = 1) -> None:
        """Measure only the first ``repeats`` repeats (each costs a process start)."""
        super().__init__(bench, new_tokens)
        self.repeats = repeats

    def measure(self, point: Point, repeat: int) -> Sample | None:
        """Run the probe on a clone of the snapshot (and, for its next turn, a
        second clone) and read its JSON answer."""
        if repeat >= self.repeats:
            return None
        sid = self.bench.clone(point.key, f"t{repeat}-{point.key}")
        sid2 = self.bench.clone(point.key, f"u{repeat}-{point.key}")
        try:
            req = {"home": str(self.bench.home), "session": sid, "next_session": sid2, "user": point.user,
                   "model": self.bench.model_spec, "dtype": str(self.bench.loaded.dtype).removeprefix("torch."),
                   "threads": self.bench.threads, "new_tokens": self.new_tokens, "idle_s": measure.TURN_GAP_S,
                   "spawned_at": time.time()}
            proc = subprocess.run([sys.executable, "-m", "benchmarks.restart_probe"], input=json.dumps(req),
                                  capture_output=True, text=True, timeout=600, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"restart probe failed ({proc.returncode}): {proc.stderr[-2000:]}")
            out = json.loads(proc.stdout.strip().splitlines()[-1])
        finally:
            self.bench.store.delete_session(sid)
            self.bench.store.delete_session(sid2)
        return sample_for(self.name, point, repeat, out["ttft_s"], out["decode_s"], out["tokens"],
                          restore_s=out["restore_s"], open_s=out["open_s"], first_token_s=out["first_token_s"],
                          bytes_read=out["bytes_read"], process_to_first_token_s=out["process_to_first_token_s"],
                          model_load_s=out["model_load_s"], next_ttft_s=out.get("next_ttft_s"),
                          next_restore_s=out.get("next_restore_s"), next_open_s=out.get("next_open_s"),
                          next_first_token_s=out.get("next_first_token_s"))


def chatkv_systems(bench: ChatkvReplay, new_tokens: int, evict: str, restart_repeats: int) -> list[ChatkvTier]:
    """One system per tier that exists today (quantized and host tiers add a line each)."""
    systems: list[ChatkvTier] = [
        HotTier(bench, new_tokens),
        DiskTier(bench, new_tokens, cold=False),
        DiskTier(bench, new_tokens, cold=True, evict=evict),
    ]
    if restart_repeats > 0:
        systems.append(RestartTier(bench, new_tokens, restart_repeats))
    return systems
