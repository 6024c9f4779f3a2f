"""``chatkv models``: the models chatkv knows (converted or imported) and their fingerprints.

``models import`` converts a GGUF file once into the model cache
(``$CHATKV_MODEL_CACHE``, default ``$CHATKV_HOME/models``) or checks a
transformers directory, computes its fingerprint and records it in
``<model cache>/models.json`` so ``models ls`` can show it without loading
the model again.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from chatkv.storage.chunkfile import atomic_write

from .errors import CliError, ExitCode
from .output import human_bytes, note, print_json, print_table

REGISTRY_FILE = "models.json"


def _registry_path() -> Path:
    from chatkv.config import model_cache_dir

    return model_cache_dir() / REGISTRY_FILE


def read_registry() -> dict[str, dict[str, Any]]:
    """Imported models by resolved path; an unreadable registry reads as empty."""
    try:
        doc = json.loads(_registry_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    models = doc.get("models") if isinstance(doc, dict) else None
    return {m["path"]: m for m in models if isinstance(m, dict) and "path" in m} if isinstance(models, list) else {}


def _write_registry(entries: dict[str, dict[str, Any]]) -> None:
    doc = {"models": sorted(entries.values(), key=lambda m: m["name"])}
    atomic_write(_registry_path(), json.dumps(doc, indent=1).encode())


def file_stamp(path: Path) -> str:
    """Names, sizes and mtimes of a model's weight files: changes when the weights change."""
    files = [path] if path.is_file() else sorted(
        [*path.glob("*.safetensors"), *path.glob("*.bin"), path / "config.json"])
    return "|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f.exists())


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _default_model_row(registry: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from chatkv.errors import ModelNotFoundError
    from chatkv.models import DEFAULT_MODEL_INSTALL, DEFAULT_MODEL_NAME, default_gguf_path

    try:
        gguf = default_gguf_path()
    except ModelNotFoundError:
        return {"name": DEFAULT_MODEL_NAME, "spec": "default", "status": f"not installed ({DEFAULT_MODEL_INSTALL})",
                "path": None, "fingerprint": None, "bytes": None}
    entry = registry.get(str(gguf.resolve()))
    return {"name": DEFAULT_MODEL_NAME, "spec": "default",
            "status": "imported" if entry else "installed (converted on first use)",
            "path": entry["converted"] if entry else str(gguf),
            "fingerprint": entry["fingerprint"] if entry and entry.get("stamp") == file_stamp(gguf) else None,
            "bytes": gguf.stat().st_size}


def known_models() -> list[dict[str, Any]]:
    """The default model, every imported model and every converted directory in the cache."""
    from chatkv.config import model_cache_dir

    registry = read_registry()
    rows = [_default_model_row(registry)]
    seen = {rows[0]["path"]}
    for path, entry in sorted(registry.items()):
        if entry.get("spec") == "default" or path in seen:
            continue
        src = Path(path)
        fresh = src.exists() and entry.get("stamp") == file_stamp(src)
        rows.append({"name": entry["name"], "spec": path, "status": "imported" if fresh else "changed or missing",
                     "path": entry.get("converted") or path, "fingerprint": entry["fingerprint"] if fresh else None,
                     "bytes": entry.get("bytes")})
        seen.add(entry.get("converted") or path)
    cache = model_cache_dir()
    if cache.is_dir():
        for d in sorted(p for p in cache.iterdir() if (p / "config.json").is_file()):
            if str(d) not in seen:
                rows.append({"name": d.name, "spec": str(d), "status": "converted", "path": str(d),
                             "fingerprint": None, "bytes": _dir_bytes(d)})
    return rows


@click.group("models")
def models() -> None:
    """Models chatkv knows: list them, import (convert) new ones."""


@models.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def ls(as_json: bool) -> None:
    """List the default model, imported models and converted models in the model cache,
    with their fingerprints (recorded by ``models import``) and how many stored
    sessions hold KV made by each."""
    from .store import open_store

    rows = known_models()
    with open_store() as store:
        per_fp: dict[str, int] = {}
        for info in store.list_sessions():
            if info.fingerprint:
                per_fp[info.fingerprint] = per_fp.get(info.fingerprint, 0) + 1
    for row in rows:
        row["sessions"] = per_fp.get(row["fingerprint"], 0) if row["fingerprint"] else None
    if as_json:
        print_json(rows)
        return
    print_table(
        ["name", "status", "fingerprint", "sessions", "size", "spec"],
        [[r["name"], r["status"], (r["fingerprint"] or "-")[:16], "-" if r["sessions"] is None else r["sessions"],
          human_bytes(r["bytes"]), r["spec"]] for r in rows],
        title="models", right=("sessions", "size"),
    )
    if any(r["fingerprint"] is None and r["path"] for r in rows):
        note("fingerprint '-': not recorded yet; `chatkv models import SPEC` computes and records it")


@models.command("import")
@click.argument("spec")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def import_(spec: str, as_json: bool) -> None:
    """Convert a model once and record its fingerprint.

    SPEC is a .gguf file (converted to safetensors in the model cache, with a
    progress bar; later loads take seconds), a transformers model directory
    (checked and fingerprinted), or 'default' (the SmolLM2 wheel's GGUF).
    Exit code 3 if SPEC names nothing, 4 if it is not a loadable chat model.
    """
    from chatkv.errors import ModelNotFoundError
    from chatkv.models import DEFAULT_MODEL_NAME, default_gguf_path, load_model

    if spec == "default":
        source, name = default_gguf_path(), DEFAULT_MODEL_NAME
    else:
        source = Path(spec).expanduser()
        if not source.exists():
            raise CliError(f"no model at {spec!r}: expected a .gguf file, a model directory or 'default'",
                           ExitCode.NOT_FOUND)
        name = source.stem if source.is_file() else source.name
    source = source.resolve()
    registry = read_registry()
    entry = registry.get(str(source))
    if entry is None or entry.get("stamp") != file_stamp(source):
        note(f"loading {source} (a GGUF file is converted once; this can take a minute)")
        try:
            loaded = load_model(None if spec == "default" else source)
        except ModelNotFoundError as exc:
            raise CliError(str(exc), ExitCode.BAD_FILE) from exc
        except Exception as exc:  # transformers/gguf raise many kinds for a bad file
            raise CliError(f"{source} is not a loadable chat model: {type(exc).__name__}: {exc}",
                           ExitCode.BAD_FILE) from exc
        converted = Path(loaded.source)
        entry = {"name": name, "spec": "default" if spec == "default" else str(source), "path": str(source),
                 "converted": str(converted) if converted != source else None,
                 "fingerprint": loaded.fingerprint, "stamp": file_stamp(source),
                 "bytes": _dir_bytes(converted) if converted.is_dir() else source.stat().st_size,
                 "imported_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        registry[str(source)] = entry
        _write_registry(registry)
        status = "imported"
    else:
        status = "already imported"
    if as_json:
        print_json({**entry, "status": status})
        return
    click.echo(f"{status} {entry['name']}")
    click.echo(f"  fingerprint: {entry['fingerprint']}")
    if entry.get("converted"):
        click.echo(f"  converted:   {entry['converted']}")
    click.echo(f"  use it:      chatkv repl --model {entry['spec']}")
