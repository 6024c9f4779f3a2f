"""``chatkv sessions``: list, show, remove, export, import, pin/unpin and garbage-collect stored sessions.

Every command works on the index through :mod:`chatkv.storage` alone: none
imports torch, except ``export`` and ``import`` of a session that has KV
(its tensors are read or written then).
"""

from __future__ import annotations

import dataclasses
import os
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .errors import CliError, ExitCode, exit_code_for
from .output import ago, human_bytes, print_fields, print_json, print_table, printable
from .store import open_reader, open_store

if TYPE_CHECKING:
    from collections.abc import Callable

    from chatkv.storage import DiskGcReport, SessionInfo, Store

#: Names a session archive may contain (what :func:`chatkv.storage.export_session` writes).
BUNDLE_MEMBERS = ("history.json", "kv.safetensors")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def session_dict(info: "SessionInfo") -> dict[str, Any]:
    """A JSON-ready dict of a :class:`~chatkv.storage.SessionInfo`."""
    return dataclasses.asdict(info)


@click.group("sessions")
def sessions() -> None:
    """Stored sessions: list, inspect, remove, export, import, pin, set TTLs, collect garbage."""


@sessions.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def ls(as_json: bool) -> None:
    """List sessions, most recently used first: id, turns, cached tokens, tier, KV bytes, last use,
    pinned, own KV TTL."""
    with open_reader() as store:
        infos = store.list_sessions()
    if as_json:
        print_json([session_dict(i) for i in infos])
        return
    if not infos:
        click.echo("no sessions")
        return
    print_table(
        ["id", "turns", "tokens", "tier", "bytes", "last used", "pin", "ttl"],
        [[i.id, i.n_turns, i.n_cached, i.tier, human_bytes(i.kv_bytes), ago(i.last_used_at),
          "yes" if i.pinned else "-", human_duration(i.kv_ttl_s)] for i in infos],
        title="sessions", right=("turns", "tokens", "bytes"),
    )


def human_duration(seconds: float | None) -> str:
    """``7d``, ``12h``, ``90m``, ``45s`` for a TTL in seconds; ``-`` for none."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


@sessions.command("show")
@click.argument("session_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (facts and messages).")
def show(session_id: str, as_json: bool) -> None:
    """Show one session's cache facts and its history. Exit code 3 if it does not exist."""
    with open_reader() as store:
        info = store.get_session(session_id)
        size = store.session_bytes(session_id)
        messages = store.messages(session_id)
    if as_json:
        print_json({
            "session": session_dict(info),
            "disk_bytes": dataclasses.asdict(size),
            "messages": [{"index": m.index, "role": m.role, "content": m.content,
                          "partial": m.partial, "created_at": m.created_at}
                         for m in messages],
        })
        return
    print_fields([
        ("session", info.id),
        ("turns", f"{info.n_turns} ({info.n_messages} messages)"),
        ("cached tokens", info.n_cached),
        ("tier", info.tier),
        ("disk", f"{human_bytes(size.total)} in {info.n_chunks} chunks "
                 f"({human_bytes(size.unique)} own, {human_bytes(size.shared)} shared)"),
        ("fingerprint", info.fingerprint or "-"),
        ("retention", f"{'pinned' if info.pinned else 'not pinned'}, KV TTL "
                      f"{human_duration(info.kv_ttl_s) if info.kv_ttl_s is not None else 'the store default'}"),
        *([("kv verified", "yes" if info.kv_verified else
            "no (imported: checked against the model before it is used)")] if info.n_cached else []),
        ("created", info.created_at.isoformat(timespec="seconds")),
        ("last used", f"{info.last_used_at.isoformat(timespec='seconds')} ({ago(info.last_used_at)})"),
    ])
    if messages:
        click.echo()
    for m in messages:
        mark = " [interrupted]" if m.partial else ""
        click.echo(f"{m.role}: {printable(m.content)}{mark}")


@sessions.command("rm")
@click.argument("session_ids", nargs=-1, required=True)
def rm(session_ids: tuple[str, ...]) -> None:
    """Remove sessions: history, KV links, and chunk files no other session uses.

    Every id is tried; the exit code is that of the first failure (3 for an
    unknown id, 5 for a session in use).
    """
    def remove(store: "Store", sid: str) -> str:
        res = store.delete_session(sid)
        return f"removed {sid} ({res.files_removed} files, {human_bytes(res.bytes_removed)})"

    _each(session_ids, remove)


def _each(session_ids: tuple[str, ...], fn: "Callable[[Store, str], str]") -> None:
    """Run ``fn(store, id)`` for every id and print what it returns; a chatkv error
    is printed and the next id tried. Exits with the first failure's code, if any."""
    first_failure: ExitCode | None = None
    with open_store() as store:
        for sid in session_ids:
            try:
                line = fn(store, sid)
            except Exception as exc:
                code = exit_code_for(exc)
                if code is None:
                    raise
                click.echo(f"Error: {exc}", err=True)
                first_failure = first_failure or code
                continue
            click.echo(line)
    if first_failure is not None:
        raise click.exceptions.Exit(int(first_failure))


@sessions.command("export")
@click.argument("session_id")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=True, path_type=Path), default=None,
              help="Archive to write (.tar, .tar.gz or .tgz), or any other path for a bundle "
                   "directory. Default: ./<ID>.tar")
def export(session_id: str, output: Path | None) -> None:
    """Export a session (history and verified KV) to a portable archive or bundle directory."""
    from chatkv.storage import export_session

    output = output or Path(f"{session_id}.tar")
    with open_store() as store:
        store.get_session(session_id)  # unknown id -> exit 3 before touching the file system
        if not output.name.endswith(ARCHIVE_SUFFIXES):
            export_session(store, session_id, output)
            click.echo(f"exported {session_id} to {output}/")
            return
        with tempfile.TemporaryDirectory(prefix="chatkv-export-") as tmp:
            bundle = export_session(store, session_id, Path(tmp) / "bundle")
            _write_archive(bundle, output)
    click.echo(f"exported {session_id} to {output} ({human_bytes(output.stat().st_size)})")


def _write_archive(bundle: Path, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        gz = output.name.endswith((".gz", ".tgz"))
        with tarfile.open(tmp, "w:gz") if gz else tarfile.open(tmp, "w") as tar:
            for name in BUNDLE_MEMBERS:
                if (bundle / name).is_file():
                    tar.add(bundle / name, arcname=name)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)


@sessions.command("import")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--as", "session_id", default=None, help="Import under this id instead of the bundle's.")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing session with the same id (only once the new one is fully checked; "
                   "a refused import leaves the old one as it was).")
@click.option("--history-only", is_flag=True,
              help="Import the messages alone, not the bundle's KV; the next turn re-prefills.")
@click.option("--max-size", "max_size", envvar="CHATKV_IMPORT_MAX_SIZE", default=None,
              help="Refuse bundles whose KV, or archives whose contents, exceed this size (e.g. 2G). "
                   "Default 64G. [env CHATKV_IMPORT_MAX_SIZE]")
def import_(source: Path, session_id: str | None, overwrite: bool, history_only: bool, max_size: str | None) -> None:
    """Import a session from an archive or bundle directory made by ``sessions export``.

    A bundle is untrusted input: only its regular files are read, sizes are
    capped before reading (an archive is unpacked as a stream, so a
    decompression bomb is refused early), messages and KV tensors are checked
    (roles, dtypes, shapes, finite values, checksums, chained hashes) before
    anything is written. Imported KV is marked unverified: chatkv checks it
    against the model before using it. Exit code 4 for a corrupt, unsafe or
    oversize file, 5 if the id exists (without --overwrite).
    """
    from chatkv.storage import BundleLimits, extract_archive, import_session

    cap = _parse_bytes(max_size)
    limits = BundleLimits(max_kv_bytes=cap, max_archive_bytes=cap) if cap is not None else BundleLimits()
    with open_store() as store, tempfile.TemporaryDirectory(prefix="chatkv-import-") as tmp:
        if source.is_dir() or source.suffix == ".json":
            bundle = source
        else:
            bundle = extract_archive(source, Path(tmp), limits=limits)
        info = import_session(store, bundle, session_id=session_id, overwrite=overwrite,
                              with_kv=not history_only, limits=limits)
    note = " (history only)" if history_only else \
        (" (KV unverified: checked against the model before it is used)" if not info.kv_verified else "")
    click.echo(f"imported {info.id}: {info.n_turns} turns, {info.n_cached} cached tokens{note}")


def _parse_bytes(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
             "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40}
    text = value.strip().lower()
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = text[len(num):].strip()
    if unit not in units or not num:
        raise CliError(f"not a size: {value!r} (e.g. 500M, 20G)", ExitCode.USAGE)
    return int(float(num) * units[unit])


def _parse_duration(value: str | None) -> float | None:
    if value is None or value == "":
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    text = value.strip().lower()
    try:
        if text[-1:] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise CliError(f"not a duration: {value!r} (e.g. 3600, 90m, 7d)", ExitCode.USAGE) from None


_TTL_HELP = ("Also give the sessions their own KV TTL (e.g. 7d, 12h; 'none' returns to the store-wide "
             "TTL gc is given); it overrides gc's --ttl for them.")


def _parse_ttl(value: str | None) -> float | None | object:
    """A ``--ttl`` of a retention command: ``...`` when not given, None for ``none``."""
    if value is None:
        return ...
    if value.strip().lower() in ("none", "default", "off"):
        return None
    seconds = _parse_duration(value)
    if seconds is None or seconds < 0:
        raise CliError(f"--ttl must be a duration >= 0 or 'none', not {value!r}", ExitCode.USAGE)
    return seconds


def _set_retention(session_ids: tuple[str, ...], pinned: bool | None, ttl: str | None) -> None:
    """Set retention on each id; the exit code is that of the first failure (3: unknown id)."""
    kv_ttl_s = _parse_ttl(ttl)

    def apply(store: "Store", sid: str) -> str:
        info = store.set_retention(sid, pinned=pinned, kv_ttl_s=kv_ttl_s)
        ttl_text = human_duration(info.kv_ttl_s) if info.kv_ttl_s is not None else "store default"
        return f"{sid}: {'pinned' if info.pinned else 'not pinned'}, KV TTL {ttl_text}"

    _each(session_ids, apply)


@sessions.command("pin")
@click.argument("session_ids", nargs=-1, required=True)
@click.option("--ttl", "ttl", default=None, help=_TTL_HELP)
def pin(session_ids: tuple[str, ...], ttl: str | None) -> None:
    """Pin sessions: their KV stays resident however long they idle (the tier
    policy skips them; gc never expires them by TTL and drops them for the disk
    budget only after every unpinned session). Takes effect when a session is
    next opened, and at once for gc."""
    _set_retention(session_ids, True, ttl)


@sessions.command("unpin")
@click.argument("session_ids", nargs=-1, required=True)
@click.option("--ttl", "ttl", default=None, help=_TTL_HELP)
def unpin(session_ids: tuple[str, ...], ttl: str | None) -> None:
    """Unpin sessions: their KV follows the tier policy and TTLs again."""
    _set_retention(session_ids, False, ttl)


@sessions.command("ttl")
@click.argument("session_id")
@click.argument("duration")
def ttl_cmd(session_id: str, duration: str) -> None:
    """Give a session its own KV TTL (e.g. 7d, 12h, 3600), overriding gc's --ttl;
    'none' returns it to the store-wide TTL. The history is never expired."""
    _set_retention((session_id,), None, duration)


@sessions.command("gc")
@click.option("--dry-run", is_flag=True, help="Report what would be reclaimed; remove nothing.")
@click.option("--ttl", "ttl", envvar="CHATKV_KV_TTL", default=None,
              help="Expire the KV of sessions idle this long (e.g. 7d, 12h); histories stay. [env CHATKV_KV_TTL]")
@click.option("--disk-budget", "disk_budget", envvar="CHATKV_DISK_BUDGET", default=None,
              help="Drop least recently used sessions' KV until chunk files fit (e.g. 20G). "
                   "[env CHATKV_DISK_BUDGET]")
@click.option("--grace", "grace_s", default=600.0, show_default=True, type=float,
              help="Spare orphan and temporary files younger than this many seconds (saves in flight).")
@click.option("--force", is_flag=True,
              help="Delete orphan chunk files even when the index looks lost (deleted, recreated or emptied "
                   "while chunk files remain); without it gc keeps them and exits 1.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def gc(dry_run: bool, ttl: str | None, disk_budget: str | None, grace_s: float, force: bool, as_json: bool) -> None:
    """Enforce the disk tier and reclaim space: expire KV past its TTL, fit the disk
    budget (least recently used first), remove orphan and temporary files, dangling
    and unreferenced chunks. Histories are never deleted, and sessions another
    process is using are left alone, so it is safe while apps run.

    If the index looks lost (index.db deleted, truncated or emptied while chunk
    files remain), every chunk file looks like an orphan: gc keeps them, says
    why, and exits 1; restore the index from a backup, or pass --force to
    delete them."""
    from chatkv.storage import DiskPolicy, enforce_disk_policy

    try:
        policy = DiskPolicy(kv_ttl_s=_parse_duration(ttl), disk_budget_bytes=_parse_bytes(disk_budget))
    except ValueError as exc:
        raise CliError(str(exc), ExitCode.USAGE) from None
    if grace_s < 0:
        raise CliError(f"--grace must be >= 0, not {grace_s:g}", ExitCode.USAGE)
    with open_reader() if dry_run else open_store() as store:
        report = enforce_disk_policy(store, policy, dry_run=dry_run, grace_s=grace_s, force=force)
    if as_json:
        print_json(dataclasses.asdict(report))
    else:
        _print_gc(report)
    if report.index_lost and not force:
        if report.orphans_kept and not dry_run:
            click.echo(f"Error: kept {report.orphan_files} orphan chunk files: {report.index_lost}", err=True)
            raise click.exceptions.Exit(int(ExitCode.ERROR))
        click.echo(f"Warning: {report.index_lost}", err=True)


def _print_gc(report: "DiskGcReport") -> None:
    dry_run = report.dry_run
    verb = "would reclaim" if dry_run else "reclaimed"
    print_fields([
        ("expired sessions (TTL)", f"{len(report.expired_sessions)} ({human_bytes(report.expired_bytes)})"),
        ("sessions over disk budget", f"{len(report.over_budget_sessions)} ({human_bytes(report.over_budget_bytes)})"),
        ("orphan files", f"{report.orphan_files}{' (kept: the index looks lost)' if report.orphans_kept else ''}"),
        ("temp files", report.temp_files),
        ("dangling chunks", report.dangling_chunks),
        ("unreferenced chunks", report.unreferenced_chunks),
        ("files removed", report.files_removed),
        (verb, human_bytes(report.bytes_reclaimed)),
        ("disk before / after", f"{human_bytes(report.disk_bytes_before)} / {human_bytes(report.disk_bytes_after)}"),
        ("took", f"{report.seconds * 1000:.0f} ms"),
    ])
    if dry_run:
        click.echo("(dry run: nothing was removed)")
