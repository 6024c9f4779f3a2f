"""Printing for the CLI: rich tables on a terminal, plain text in pipes, JSON for scripts."""

from __future__ import annotations

import json
import sys
import unicodedata
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

import click


def stdout_is_tty() -> bool:
    """True when stdout is an interactive terminal (rich output), false in pipes and tests."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def human_bytes(n: int | float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def ago(when: datetime | None, now: datetime | None = None) -> str:
    """A short relative time: ``"12s ago"``, ``"3h ago"``, ``"5d ago"``; None -> ``"-"``."""
    if when is None:
        return "-"
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    now = now or datetime.now(timezone.utc)
    s = max(0, int((now - when).total_seconds()))
    for span, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if s >= span:
            return f"{s // span}{unit} ago"
    return f"{s}s ago"


def printable(text: str) -> str:
    """``text`` with control characters (escape sequences included) made visible-safe.

    A model's output goes to the user's terminal; it must not be able to move the
    cursor or change colours. Newlines and tabs are kept.
    """
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in "\n\t" or ch.isprintable() or unicodedata.category(ch) in ("Zs",):
            out.append(ch)
        else:
            out.append("\ufffd")
    return "".join(out)


def print_json(obj: Any) -> None:
    """Write ``obj`` as indented JSON on stdout (datetimes as ISO 8601 strings)."""
    click.echo(json.dumps(obj, indent=2, ensure_ascii=False, default=_json_default))


def _json_default(o: Any) -> Any:
    if isinstance(o, datetime):
        return o.isoformat()
    if hasattr(o, "__fspath__"):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def print_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None,
                right: Sequence[str] = ()) -> None:
    """Print a table: a rich table on a terminal, aligned plain columns otherwise.

    Args:
        columns: header names.
        rows: cell values (converted with ``str``).
        title: shown above the table on a terminal.
        right: names of columns to right-align (numbers).
    """
    cells = [[str(c) for c in row] for row in rows]
    if stdout_is_tty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, show_edge=False, header_style="bold")
        for name in columns:
            table.add_column(name, justify="right" if name in right else "left", overflow="fold")
        for row in cells:
            table.add_row(*row)
        Console().print(table)
        return
    widths = [max([len(name)] + [len(r[i]) for r in cells]) for i, name in enumerate(columns)]

    def fmt(row: Sequence[str]) -> str:
        parts = [v.rjust(w) if name in right else v.ljust(w) for v, w, name in zip(row, widths, columns)]
        return "  ".join(parts).rstrip()

    click.echo(fmt(list(columns)))
    for row in cells:
        click.echo(fmt(row))


def print_fields(pairs: Sequence[tuple[str, Any]]) -> None:
    """Print ``name: value`` lines with the names aligned."""
    width = max((len(k) for k, _ in pairs), default=0)
    for key, value in pairs:
        click.echo(f"{key + ':':<{width + 1}} {value}")


def note(message: str) -> None:
    """A status line on stderr (dim on a terminal), so stdout stays clean for data."""
    styled = click.style(message, dim=True) if sys.stderr.isatty() else message
    click.echo(styled, err=True)
