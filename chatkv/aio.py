"""asyncio API: ``await chat.asend(text)`` and ``async for piece in chat.astream(text)``.

Both run over :meth:`Chat.stream`, driven from the event loop. The blocking
parts of a turn (waiting for the session to load, templating and aligning its
cache, saving it at the end) run in the loop's default executor; the pieces in
between come from the engine's scheduler without any thread waiting on them:
the turn's generator runs in non-blocking mode (see
:func:`chatkv.channel.next_nonblocking`), where it yields a
:class:`~chatkv.channel.Pending` instead of blocking, and the scheduler's
thread wakes the event loop when the next piece is ready.

Cancelling the task that iterates (or closing the async generator) cancels the
turn at the engine's next step; the partial reply is kept, as with
:meth:`Chat.stream`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from chatkv.channel import Pending, next_nonblocking

if TYPE_CHECKING:
    from chatkv.chat import Chat

#: What :func:`advance` returns once the generator is exhausted.
DONE = object()


def advance(gen: Iterator[Any], lock: threading.Lock) -> Any:
    """One non-blocking step of a turn's generator (under ``lock``); :data:`DONE` when it is exhausted."""
    with lock:
        try:
            return next_nonblocking(gen)
        except StopIteration:
            return DONE


def close(gen: Iterator[Any], lock: threading.Lock) -> None:
    """Close a turn's generator (cancelling the turn), after any step still running."""
    with lock:  # waits for a step still running in another thread
        gen.close()  # type: ignore[attr-defined]


async def wait_ready(loop: asyncio.AbstractEventLoop, pending: Pending) -> None:
    """Return once ``pending``'s channel has an item (woken from the scheduler's thread)."""
    ready = loop.create_future()

    def set_ready() -> None:
        if not ready.done():
            ready.set_result(None)

    def wake() -> None:  # runs in the scheduler's thread
        loop.call_soon_threadsafe(set_ready)

    pending.on_ready(wake)
    await ready


async def astream(chat: Chat, text: str, **sampling: Any) -> AsyncGenerator[str, None]:
    """Send a user message and yield the reply's text pieces as they are generated.

    The async counterpart of :meth:`Chat.stream` (same history, stats, errors
    and partial-reply rules). Cancelling the consuming task, or closing this
    generator early, cancels the turn at the engine's next step and keeps the
    partial reply. Iterate it with ``contextlib.aclosing`` (or to the end) so an
    early exit cleans up at once rather than when the generator is collected.

    Raises:
        InvalidMessageError: ``text`` is empty or not a string (at the call).
        SessionBusyError, ContextWindowExceededError, OutOfBlocksError,
        QueueFullError: as :meth:`Chat.stream`, when iteration starts.
    """
    loop = asyncio.get_running_loop()
    gen = chat.stream(text, **sampling)
    lock = threading.Lock()
    finished = False
    try:
        # Waiting for the session, templating and aligning its cache may block.
        item = await loop.run_in_executor(None, advance, gen, lock)
        while item is not DONE:
            if isinstance(item, Pending):
                if item.final:
                    # Ending the turn saves the session: blocking work.
                    item = await loop.run_in_executor(None, advance, gen, lock)
                    continue
                await wait_ready(loop, item)
            else:
                yield item
            item = advance(gen, lock)
        finished = True
    except BaseException:
        finished = gen.gi_frame is None  # type: ignore[attr-defined]  # the turn raised: nothing to close
        raise
    finally:
        if not finished:
            closing = loop.run_in_executor(None, close, gen, lock)
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError:
                pass  # cancelled again while closing: the close still completes in its thread


async def asend(chat: Chat, text: str, **sampling: Any) -> str:
    """Send a user message and return the assistant's whole reply (see :func:`astream`)."""
    async with aclosing(astream(chat, text, **sampling)) as pieces:
        return "".join([piece async for piece in pieces])
