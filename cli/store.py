"""The CLI's one way to open durable state: :func:`open_store`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatkv.storage import Store


@contextmanager
def open_store() -> Iterator["Store"]:
    """Open the store at ``$CHATKV_HOME`` (index at ``$CHATKV_DB_URL``), closing it on exit.

    Errors (a newer schema, an unreachable database) propagate as storage
    errors; the CLI's group turns them into exit codes.
    """
    from chatkv.storage import Store

    store = Store()
    try:
        yield store
    finally:
        store.close()
