"""Where a turn's output goes: a thread-safe channel of text pieces, drained by a
blocked thread or, without blocking, by an event loop.

The scheduler's step loop puts pieces, then an end marker or a failure, into a
request's :class:`Channel`. A consumer thread blocks on it; an asyncio consumer
instead runs the turn's generator in non-blocking mode
(:func:`next_nonblocking`), where the generator yields a :class:`Pending`
rather than block, and is woken through :meth:`Pending.on_ready`.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: True while :func:`next_nonblocking` runs a generator.
NONBLOCKING: contextvars.ContextVar[bool] = contextvars.ContextVar("chatkv_nonblocking", default=False)


class _End:
    """The generation finished normally."""


#: The last item of a channel whose generation ended normally.
END = _End()
#: What :meth:`Channel.get` and :meth:`Channel.peek` return when nothing is ready.
EMPTY = object()


@dataclass
class Failure:
    """The generation failed; the consumer re-raises ``exc``."""

    exc: BaseException


class Channel:
    """A thread-safe queue of a request's outputs: text pieces, then :data:`END` or a :class:`Failure`.

    Consumers block on it (:meth:`get`) or register a callback (:meth:`on_ready`)
    that runs, from the producing thread, once an item is available.
    """

    def __init__(self) -> None:
        """An empty channel."""
        self._items: deque[Any] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._wakers: list[Callable[[], None]] = []

    def put(self, item: Any) -> None:
        """Append ``item`` and wake whoever waits for it."""
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            try:
                wake()
            except RuntimeError as exc:  # e.g. the consumer's event loop is closed: nobody is listening
                log.debug("a channel waker failed (its event loop is gone): %s", exc)

    def get(self, timeout: float) -> Any:
        """The next item, waiting up to ``timeout`` seconds; :data:`EMPTY` if none came."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            return self._take() if self._items else EMPTY

    def wait_drained(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the consumer has taken every item
        put so far; returns whether it has. For a producer that lets its
        consumer run before it goes on (:meth:`chatkv.scheduler.Scheduler._hand_over_first_pieces`)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items, timeout)

    def peek(self) -> Any:
        """The next item without taking it, or :data:`EMPTY`."""
        with self._cond:
            return self._items[0] if self._items else EMPTY

    def pop(self) -> Any:
        """Take the next item (one must be there)."""
        with self._cond:
            return self._take()

    def _take(self) -> Any:
        """The next item, taken (the lock held): the last one wakes a producer
        waiting for the channel to be drained (:meth:`wait_drained`)."""
        item = self._items.popleft()
        if not self._items:
            self._cond.notify_all()
        return item

    def on_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once an item is available: at once if one is, else from
        the thread that puts it."""
        with self._cond:
            if not self._items:
                self._wakers.append(callback)
                return
        callback()


class Pending:
    """Yielded by :meth:`Engine.generate` instead of blocking, in non-blocking mode
    (see :func:`next_nonblocking`): no piece is ready yet.

    Attributes:
        final: the generation has ended; the next ``next()`` finishes it (and runs
            whatever cleanup the caller's generator does, which may block).
    """

    __slots__ = ("_channel", "final")

    def __init__(self, channel: Channel, final: bool) -> None:
        """A marker for ``channel``'s next item; ``final`` when that item ends the generation."""
        self.final = final
        self._channel = channel

    def on_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread, possibly at once) when the next item is ready."""
        self._channel.on_ready(callback)


def next_nonblocking(gen: Iterator[Any]) -> Any:
    """``next(gen)`` where an :meth:`Engine.generate` inside ``gen`` yields a
    :class:`Pending` instead of blocking for its next piece."""
    token = NONBLOCKING.set(True)
    try:
        return next(gen)
    finally:
        NONBLOCKING.reset(token)
