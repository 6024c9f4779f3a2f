"""The index side of storage, and the ``chatkv sessions`` commands built on it, never load torch.

Each check runs in a fresh child process (this one has torch loaded already)
against a small store seeded here, with real KV chunks, and asserts from the
child's ``sys.modules`` or its ``-X importtime`` log that neither torch,
``safetensors.torch`` nor transformers was imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from chatkv.storage import ChunkMeta, NewChunk, Store

HEAVY = ("torch", "safetensors.torch", "transformers")
FP = "fp-torch-free"
META = ChunkMeta(fingerprint=FP, kv_format="paged-v1", dtype="float32", block_size=4)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A store with sessions ``with-kv`` (two chunks), ``also-kv`` and ``text-only``."""
    home = tmp_path / "home"
    with Store(home) as st:
        for sid, base in (("with-kv", 0), ("also-kv", 100)):
            st.open_session(sid, fingerprint=FP, system_prompt="be brief")
            st.append_message(sid, "user", "hello")
            st.append_message(sid, "assistant", "hi")
            ids = list(range(base, base + 12))
            chunks = [NewChunk(8, {"kv": torch.ones(2, 8, 2)}, META), NewChunk(4, {"kv": torch.zeros(2, 4, 2)}, META)]
            st.save_kv(sid, token_ids=ids, fingerprint=FP, chunks=chunks)
        st.open_session("text-only")
        st.append_message("text-only", "user", "no KV here")
    return home


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CHATKV_DB_URL"}
    env["CHATKV_HOME"] = str(home)
    return env


def _imported(importtime_log: str) -> set[str]:
    """Module names from a ``python -X importtime`` log."""
    names = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def _heavy(modules: set[str] | list[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def _child_modules(home: Path, script: str) -> list[str]:
    """Run ``script`` in a fresh interpreter; return the modules it had loaded at the end."""
    script += "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    res = subprocess.run([sys.executable, "-c", script], env=_env(home), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


def test_import_and_list_sessions_do_not_import_torch(home: Path) -> None:
    script = f"import chatkv.storage as st\nassert len(st.Store({str(home)!r}).list_sessions()) == 3"
    assert _heavy(_child_modules(home, script)) == []


def test_storage_index_api_does_not_import_torch(home: Path) -> None:
    script = textwrap.dedent(f"""
        import chatkv.storage as st
        store = st.Store({str(home)!r})
        assert [i.id for i in store.list_sessions()]
        store.get_session("with-kv"); store.messages("with-kv"); store.session_bytes("with-kv")
        store.kv_chunks("with-kv"); store.cached_token_ids("with-kv"); store.disk_usage(); store.chunk_usage()
        lease = store.acquire_lease("also-kv", auto_renew=False)
        assert store.lease_holder("also-kv") is None and not lease.released
        store.release_lease("also-kv")
        st.collect_garbage(store, dry_run=True, grace_s=0)
        st.enforce_disk_policy(store, st.DiskPolicy(kv_ttl_s=0, disk_budget_bytes=0), dry_run=True, grace_s=0)
        st.export_session(store, "text-only", {str(home / "bundle")!r})
        store.invalidate_kv("also-kv")
        store.delete_session("with-kv")
        st.enforce_disk_policy(store, st.DiskPolicy(kv_ttl_s=0), grace_s=0)
        store.close()
    """)
    assert _heavy(_child_modules(home, script)) == []


#: Commands that only read the index: they read it through ``chatkv.storage.quickread``
#: (the standard library's sqlite3), so they import no SQLAlchemy either.
READ_ONLY_COMMANDS = [
    ["sessions", "ls"],
    ["sessions", "ls", "--json"],
    ["sessions", "show", "with-kv"],
    ["sessions", "show", "with-kv", "--json"],
    ["sessions", "gc", "--dry-run"],
    ["sessions", "gc", "--dry-run", "--ttl", "0s", "--disk-budget", "0"],
]


@pytest.mark.parametrize("args", [
    *READ_ONLY_COMMANDS,
    ["sessions", "export", "text-only", "-o", "text-only.tar"],
    ["sessions", "rm", "with-kv"],
    ["sessions", "gc", "--ttl", "0s", "--grace", "0"],
], ids=lambda a: " ".join(a[1:]))
def test_sessions_commands_do_not_import_torch(home: Path, tmp_path: Path, args: list[str]) -> None:
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "chatkv.cli.main", *args], cwd=tmp_path,
                         env=_env(home), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    modules = _imported(res.stderr)
    if args in READ_ONLY_COMMANDS:  # the log is real and the command reached the index
        assert "chatkv.storage.quickread" in modules
        assert sorted(m for m in modules if m == "sqlalchemy" or m.startswith("sqlalchemy.")) == []
    else:
        assert "chatkv.storage.store" in modules
    assert _heavy(modules) == []
