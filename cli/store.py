"""The CLI's ways to open durable state: :func:`open_store` and, for commands that only read, :func:`open_reader`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatkv.storage import Store
    from chatkv.storage.quickread import QuickReader


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


@contextmanager
def open_reader() -> Iterator["Store | QuickReader"]:
    """Open the same index for reading only, as cheaply as it allows; closed on exit.

    A plain SQLite index at the current schema is read through the standard
    library (:mod:`chatkv.storage.quickread`: no SQLAlchemy import, nothing
    written), which keeps ``sessions ls``, ``show`` and ``gc --dry-run`` well
    under half a second; anything else opens a :class:`~chatkv.storage.Store`
    as :func:`open_store` does (which may migrate or create the index).
    """
    from chatkv.storage.quickread import open_quick_reader

    reader = open_quick_reader()
    if reader is None:
        with open_store() as store:
            yield store
        return
    try:
        yield reader
    finally:
        reader.close()
