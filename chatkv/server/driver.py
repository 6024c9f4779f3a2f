"""Driving a chatkv turn from the server's event loop without a thread per request.

A turn is the generator :meth:`chatkv.Chat.stream_complete` returns. Its first
step (waiting for the session's restore, templating, aligning the cache,
queueing the turn) and its last (saving the session) block, so they run in a
thread pool; every step in between runs on the event loop in chatkv's
non-blocking mode (:func:`chatkv.channel.next_nonblocking`): when no piece is
ready the generator yields a :class:`~chatkv.channel.Pending`, and the
engine's scheduler thread wakes the event loop when one is. Many turns in
flight thus cost no threads, and all of them batch in the engine's scheduler.

Closing a turn early (the client went away, the server is shutting down)
cancels it at the engine's next step; the partial reply is kept, marked
``partial``, as with Ctrl-C in the REPL.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Executor
from typing import Any

from chatkv.aio import DONE, advance, close, wait_ready
from chatkv.channel import Pending

class TurnDriver:
    """Steps one turn's generator from asyncio.

    :meth:`next` returns the next text piece, or None once the turn has ended
    (re-raising the exception it failed with). :meth:`aclose` cancels a turn
    still running and waits until it has let go of the session.
    """

    def __init__(self, gen: Iterator[str], executor: Executor) -> None:
        """Drive ``gen``, running its blocking steps in ``executor``."""
        self._gen = gen
        self._executor = executor
        self._lock = threading.Lock()
        self._started = False
        self.done = False

    async def _blocking(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, self._gen, self._lock)

    async def next(self) -> str | None:
        """The next piece of the reply, or None when the turn has ended."""
        if self.done:
            return None
        loop = asyncio.get_running_loop()
        try:
            if not self._started:
                self._started = True
                item = await self._blocking(advance)
            else:
                item = advance(self._gen, self._lock)
            while True:
                if item is DONE:
                    self.done = True
                    return None
                if isinstance(item, Pending):
                    if item.final:  # ending the turn saves the session: blocking work
                        item = await self._blocking(advance)
                        continue
                    await wait_ready(loop, item)
                    item = advance(self._gen, self._lock)
                    continue
                return item
        except asyncio.CancelledError:
            raise  # the generator is still alive: the caller closes it
        except BaseException:
            self.done = True  # the turn raised: its generator is finished
            raise

    async def aclose(self) -> None:
        """Cancel the turn if it is still running and wait until it has ended
        (the partial reply kept and saved). Idempotent."""
        if self.done:
            return
        self.done = True
        await self._blocking(close)
