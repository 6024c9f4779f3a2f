"""Which chatkv session a request continues, and the sessions the server holds open.

A request names its session explicitly (the ``X-Session-ID`` header, or the
body's ``session_id`` or ``prompt_cache_key``), or not at all, as OpenAI
clients do: they send the whole conversation each turn. Then the server asks
the :class:`~chatkv.server.prefix_index.PrefixIndex` for stored sessions of
the same tenant sharing a prefix of the request's messages, longest first:

* ``prefix``: the session with the longest whole history that is a prefix
  of the request (the request continues it). The usual case, and how an
  unmodified client resumes after a restart.
* ``branch``: no stored history is a prefix of the request, but one shares
  at least its first two messages (the client regenerated or edited a reply,
  or retried after a dropped stream). The session sharing the longest prefix
  is forked (its KV blocks shared, copy on write) into a new one that takes
  the request, so the original is never rewritten behind its owner's back.
* ``new``: nothing shares at least two messages; a new session ``conv-<hex>``.

A candidate busy with another request is skipped. Every candidate's messages
are checked against the store before use (the index is only a cache).
Whichever way it was found, the request's messages become the session's
history (:meth:`chatkv.Chat.stream_complete`): the KV of the prefix they share
with the stored history is reused, the rest re-prefilled, and the stored
history rewritten where it differs (possible only with an explicit id).

Two requests on one session at once: the second gets 409 ``session_busy``
at once (it does not wait).

The server keeps at most ``max_open`` sessions open (their KV moves down the
engine's tiers as they idle); the least recently used idle one is closed
(saved) to make room, and reopens from disk when its conversation comes back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from chatkv.server.auth import Tenant
from chatkv.server.errors import APIError
from chatkv.server.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from chatkv.chat import Chat
    from chatkv.engine import Engine
    from chatkv.storage import SessionInfo, Store

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A branch needs at least this many shared messages (a shared system prompt
#: alone is not a conversation; its KV is shared by the pool's prefix cache anyway).
MIN_BRANCH_MESSAGES = 2


def new_client_id() -> str:
    """A fresh session id for a conversation the server could not match: ``conv-<24 hex>``."""
    return f"conv-{secrets.token_hex(12)}"


@dataclass
class Claim:
    """A session held for one request.

    Attributes:
        chat: the open chat the request runs on.
        internal_id: its stored id.
        client_id: the id the client sees (``X-Session-ID``).
        tenant: whose it is.
        match: ``explicit``, ``prefix``, ``branch`` or ``new``.
        opened: this request opened the session (so its restore, if any, counts for it).
        origin: the chat whose KV the request reuses (the parent, for a branch).
    """

    chat: "Chat"
    internal_id: str
    client_id: str
    tenant: Tenant
    match: str
    opened: bool
    origin: "Chat"

    def restored_from_disk(self) -> bool:
        """This request's KV was loaded from disk when its session was opened."""
        return self.opened and self.origin.restore.source == "disk"


def _same_prefix(history: list[dict[str, str]], messages: list[dict[str, str]], n: int) -> bool:
    if len(history) < n or len(messages) < n:
        return False
    return all(h["role"] == m["role"] and h["content"] == m["content"] for h, m in zip(history[:n], messages[:n]))


class SessionRegistry:
    """The open chats of one server, who is using which, and the prefix index.

    Its state is changed only on the server's event loop; blocking work
    (opening and closing sessions, the index and the store) runs in ``executor``.
    """

    def __init__(self, engine: "Engine", store: "Store", index: PrefixIndex, executor: Executor, *,
                 max_open: int = 256, chat_options: dict[str, Any] | None = None) -> None:
        """Sessions on ``engine`` persisted in ``store``, at most ``max_open`` held open."""
        self.engine = engine
        self.store = store
        self.index = index
        self.executor = executor
        self.max_open = max_open
        self.chat_options = dict(chat_options or {})
        self._open: OrderedDict[str, "Chat"] = OrderedDict()
        self._busy: set[str] = set()
        self._closing: dict[str, asyncio.Future[None]] = {}

    # -- helpers -----------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    @property
    def num_open(self) -> int:
        """Sessions held open now."""
        return len(self._open)

    def is_open(self, internal_id: str) -> bool:
        """True if the server holds ``internal_id`` open."""
        return internal_id in self._open

    def _new_chat(self, internal_id: str) -> "Chat":
        from chatkv.chat import Chat

        return Chat(internal_id, engine=self.engine, store=self.store, persist=True, **self.chat_options)

    async def _wait_closing(self, internal_id: str) -> None:
        closing = self._closing.get(internal_id)
        if closing is not None:
            await asyncio.shield(closing)

    async def _open_chat(self, internal_id: str) -> tuple["Chat", bool]:
        """The open chat for ``internal_id`` (the caller has marked it busy) and
        whether this call opened it."""
        await self._wait_closing(internal_id)
        chat = self._open.get(internal_id)
        if chat is not None:
            self._open.move_to_end(internal_id)
            return chat, False
        chat = await self._run(self._new_chat, internal_id)
        self._open[internal_id] = chat
        return chat, True

    def _claim_id(self, internal_id: str) -> None:
        if internal_id in self._busy:
            raise APIError(409, "this session already has a request in flight; wait for it to finish "
                                "(one request per session at a time)", code="session_busy")
        self._busy.add(internal_id)

    # -- claiming ----------------------------------------------------------------------

    async def claim(self, tenant: Tenant, client_id: str | None, messages: list[dict[str, str]]) -> Claim:
        """Hold a session for a request: the one named ``client_id``, else the
        one the prefix index finds for ``messages``, else a new one.

        Raises:
            APIError: 400 for a bad id, 409 if the named session is busy here
                or locked by another process.
        """
        if client_id is not None:
            internal = tenant.internal_id(client_id)
            self._claim_id(internal)
            return await self._open_claimed(tenant, client_id, internal, "explicit")
        found = await self._match(tenant, messages)
        if found is not None:
            return found
        client_id, internal = self._reserve_new_id(tenant)
        return await self._open_claimed(tenant, client_id, internal, "new")

    async def _open_claimed(self, tenant: Tenant, client_id: str, internal: str, how: str) -> Claim:
        """Open the session ``internal`` (already marked busy) as a claim; unmark it if opening fails."""
        try:
            chat, opened = await self._open_chat(internal)
        except BaseException:
            self._busy.discard(internal)
            raise
        return Claim(chat, internal, client_id, tenant, how, opened, chat)

    async def _match(self, tenant: Tenant, messages: list[dict[str, str]]) -> Claim | None:
        from chatkv.errors import ChatKVError
        from chatkv.storage import SessionNotFoundError, StorageError

        candidates = await self._run(self.index.candidates, tenant.name, messages)
        for cand in candidates:
            sid = cand.session_id
            client = tenant.client_id(sid)
            if client is None or sid in self._busy:
                continue
            if cand.n < len(messages) and not cand.full and cand.n < MIN_BRANCH_MESSAGES:
                continue
            self._busy.add(sid)
            try:
                try:
                    chat, opened = await self._open_chat(sid)
                except SessionNotFoundError:
                    await self._run(self.index.forget, sid)
                    continue
                except (StorageError, ChatKVError) as exc:  # locked by another process, busy elsewhere
                    log.info("prefix match %s skipped: %s", sid, exc)
                    continue
                history = chat.messages
                if _same_prefix(history, messages, len(history)) and len(history) <= len(messages):
                    if len(history) == 0:
                        continue
                    claim = Claim(chat, sid, client, tenant, "prefix", opened, chat)
                    sid = ""  # handed over: stays busy
                    return claim
                shared = cand.n if _same_prefix(history, messages, cand.n) else 0
                if shared < cand.n:  # the index was stale: record what the store holds
                    await self._run(self.index.record, sid, tenant.name, history)
                    continue
                if shared < MIN_BRANCH_MESSAGES:
                    continue
                return await self._branch(tenant, chat, opened)
            finally:
                if sid:
                    self._busy.discard(sid)
        return None

    def _reserve_new_id(self, tenant: Tenant) -> tuple[str, str]:
        """A fresh ``(client id, internal id)`` for ``tenant``, marked busy."""
        while True:
            client_id = new_client_id()
            internal = tenant.internal_id(client_id)
            if internal not in self._busy and internal not in self._open:
                self._busy.add(internal)
                return client_id, internal

    async def _branch(self, tenant: Tenant, parent: "Chat", opened: bool) -> Claim:
        """Fork ``parent`` (held busy by the caller) into a new session for the request."""
        client_id, internal = self._reserve_new_id(tenant)
        try:
            child = await self._run(parent.fork, internal)
        except BaseException:
            self._busy.discard(internal)
            raise
        self._open[internal] = child
        return Claim(child, internal, client_id, tenant, "branch", opened, parent)

    async def release(self, claim: Claim) -> None:
        """The request is over: index the session's new history, let it go, and
        close idle sessions beyond ``max_open``. A session this request created
        and left empty (it failed before any reply) is deleted again."""
        chat, sid = claim.chat, claim.internal_id
        try:
            history = chat.messages
            created = claim.match in ("new", "branch") or (claim.opened and chat.restore.source == "new")
            if not history and created:
                self._open.pop(sid, None)
                await self._run(self._discard, chat, sid)
            elif history:
                await self._run(self.index.record, sid, claim.tenant.name, history)
        except Exception:
            log.exception("could not index session %s", sid)
        finally:
            self._busy.discard(sid)
        await self._evict()

    def _discard(self, chat: "Chat", internal_id: str) -> None:
        from chatkv.storage import SessionNotFoundError

        chat.close()
        try:
            self.store.delete_session(internal_id)
        except SessionNotFoundError:
            pass
        self.index.forget(internal_id)

    async def _evict(self) -> None:
        while len(self._open) > self.max_open:
            victim = next((sid for sid in self._open if sid not in self._busy), None)
            if victim is None:
                return
            await self._close(victim)

    async def _close(self, internal_id: str) -> None:
        chat = self._open.pop(internal_id)
        done: asyncio.Future[None] = asyncio.ensure_future(self._run(chat.close))
        self._closing[internal_id] = done
        try:
            await asyncio.shield(done)
        finally:
            if self._closing.get(internal_id) is done:
                del self._closing[internal_id]

    # -- administration ------------------------------------------------------------------

    async def list(self, tenant: Tenant) -> list[tuple[str, "SessionInfo"]]:
        """``(client id, info)`` of every stored session of ``tenant``, most recently used first."""
        infos = await self._run(self.store.list_sessions)
        out = []
        for info in infos:
            client = tenant.client_id(info.id)
            if client:
                out.append((client, info))
        return out

    async def info(self, tenant: Tenant, client_id: str) -> tuple["SessionInfo", list[Any]]:
        """The stored facts and messages of one of ``tenant``'s sessions.

        Raises:
            APIError: 400 for a bad id; 404 if there is no such session.
        """
        internal = tenant.internal_id(client_id)

        def read() -> tuple["SessionInfo", list[Any]]:
            return self.store.get_session(internal), self.store.messages(internal)

        return await self._run(read)

    async def delete(self, tenant: Tenant, client_id: str) -> Any:
        """Delete one of ``tenant``'s sessions (history, KV, index entries).

        Raises:
            APIError: 400 for a bad id; 404 if there is no such session; 409 if
                a request is using it, or another process holds it.
        """
        internal = tenant.internal_id(client_id)
        self._claim_id(internal)
        try:
            if internal in self._open:
                await self._close(internal)
            await self._wait_closing(internal)
            result = await self._run(self.store.delete_session, internal)
            await self._run(self.index.forget, internal)
            return result
        finally:
            self._busy.discard(internal)

    async def close_all(self) -> None:
        """Save and close every open session (at shutdown)."""
        for sid in list(self._open):
            try:
                await self._close(sid)
            except Exception:
                log.exception("could not close session %s", sid)
        for closing in list(self._closing.values()):
            await asyncio.shield(closing)

    # -- start-up ----------------------------------------------------------------------

    def sync(self, tenants: list[Tenant]) -> int:
        """Bring the index up to date with the store (sessions changed, e.g. by
        ``chatkv repl``, or deleted while the server was not running); blocking.
        Returns how many sessions were re-indexed."""
        infos = self.store.list_sessions()
        recorded = self.index.recorded()
        live = {info.id for info in infos}
        self.index.forget_many(sid for sid in recorded if sid not in live)
        n = 0
        for info in infos:
            when = recorded.get(info.id)
            if when is not None and info.updated_at.timestamp() <= when:
                continue
            owner = next((t for t in tenants if t.client_id(info.id)), None)
            if owner is None or info.id in self._busy:
                continue
            messages = [{"role": m.role, "content": m.content} for m in self.store.messages(info.id)]
            if messages:
                self.index.record(info.id, owner.name, messages)
                n += 1
        return n
