"""Keep CPython's oldest-generation collections off a loaded engine's heap.

A process with an engine loaded holds about a million objects that live as
long as it does: the model's modules and parameters, transformers', torch's,
Inductor's and SQLAlchemy's own. CPython's cyclic collector walks all of them
in an oldest-generation collection, which runs whenever enough new objects
have survived, so at any moment of the process's life: 0.4 to 1 s on this
project's VM with SmolLM2 loaded, during which no thread runs Python (a
benchmark caught one stalling a restore's reader threads for 160 ms; twelve
ran during one load, warm-up and compile).

Once an engine's warm-up and compile are done, :func:`freeze` moves every
object then tracked to the collector's permanent generation (``gc.freeze()``,
as vLLM does at the end of its startup); later collections walk only the
objects made since (a full collection: 0.4 ms against 405 ms). The young
generations are collected first; what the oldest holds that is already
garbage (about 19,000 objects after a SmolLM2 warm-up) stays until the last
engine that froze is closed, when :func:`release` unfreezes; the next freeze
then collects every generation first (a 0.3 to 1 s pause in that engine's
warm-up), or a process that makes and closes engines one after another would
keep each closed one's pool, frozen with the rest. ``CHATKV_GC_FREEZE=0``
leaves the collector alone (the test suite, which makes hundreds of engines,
sets it and tests the freeze on its own).
"""

from __future__ import annotations

import gc
import logging
import threading
import time

from chatkv.config import switched_off

log = logging.getLogger(__name__)

#: Environment variable: ``0`` (or off/false/no) leaves the garbage collector alone.
FREEZE_ENV = "CHATKV_GC_FREEZE"

_lock = threading.Lock()
_holders = 0
#: Objects have been unfrozen since the last freeze: what closed engines left
#: in cycles is among them, and a freeze must not keep it.
_unfrozen = False


def enabled() -> bool:
    """Whether ``$CHATKV_GC_FREEZE`` allows freezing (it does unless set to 0/off/false/no)."""
    return not switched_off(FREEZE_ENV)


def freeze() -> bool:
    """Collect the young generations (every generation, where an earlier
    :func:`release` unfroze objects: a closed engine's pool may be garbage
    among them), then move every object the collector tracks to its
    permanent generation, and count one more holder (an engine, which calls
    :func:`release` when it closes). Returns False, doing nothing, where
    ``$CHATKV_GC_FREEZE`` turns it off."""
    global _holders, _unfrozen
    if not enabled():
        return False
    with _lock:
        started = time.perf_counter()
        gc.collect(2 if _unfrozen else 1)
        gc.freeze()
        _holders += 1
        _unfrozen = False
        log.debug("froze %d objects out of the garbage collector's walks in %.1f ms",
                  gc.get_freeze_count(), (time.perf_counter() - started) * 1e3)
    return True


def release() -> None:
    """Count one holder less; the last one's release unfreezes every frozen
    object (the collector walks them again and frees what is garbage)."""
    global _holders, _unfrozen
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            gc.unfreeze()
            _unfrozen = True
