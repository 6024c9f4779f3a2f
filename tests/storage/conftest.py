"""Fixtures for the storage tests; makes ``chatkv.storage`` importable before ``pip install -e``.

Every test here runs twice, on SQLite and on PostgreSQL (``[sqlite]`` and
``[postgres]`` in its id): the autouse :func:`db_backend` fixture points
``CHATKV_DB_URL`` at a fresh PostgreSQL database of the session's private
cluster (``pg_cluster`` in ``tests/conftest.py``) or leaves the default, an
SQLite file in the Store's home. Subprocesses inherit the variable. A test
that needs a second, separate index (another "machine") asks
:func:`other_db` for one. ``@pytest.mark.sqlite_only`` marks the few tests
about SQLite files themselves.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import types
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]


def _ensure_chatkv_storage() -> None:
    try:
        if importlib.util.find_spec("chatkv.storage") is not None:
            return
    except ImportError:
        pass
    if "chatkv" not in sys.modules:
        try:
            import chatkv  # noqa: F401
        except ImportError:
            pkg = types.ModuleType("chatkv")
            pkg.__path__ = [str(_ROOT / "chatkv")]
            sys.modules["chatkv"] = pkg
    spec = importlib.util.spec_from_file_location(
        "chatkv.storage", _ROOT / "storage" / "__init__.py",
        submodule_search_locations=[str(_ROOT / "storage")],
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["chatkv.storage"] = mod
    spec.loader.exec_module(mod)


if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
_ensure_chatkv_storage()

from chatkv.storage import ChunkMeta, NewChunk, Store  # noqa: E402

BLOCK = 16
CHUNK = 64  # tokens per chunk: 4 blocks
FP = "fp-test-model"
META = ChunkMeta(fingerprint=FP, kv_format="paged-v1", dtype="float32", block_size=BLOCK, quant="none")


def kv_for(token_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """Deterministic K/V for these tokens: [2 layers, 2 (k/v), n_blocks, 16, 2 heads, 8]."""
    g = torch.Generator().manual_seed(hash(tuple(token_ids)) & 0x7FFFFFFF)
    n_blocks = -(-len(token_ids) // BLOCK)
    return {"kv": torch.randn(2, 2, n_blocks, BLOCK, 2, 8, generator=g)}


def new_chunks(token_ids: Sequence[int], start: int = 0, meta: ChunkMeta = META) -> list[NewChunk]:
    """Chunks of CHUNK tokens (the last one partial) covering token_ids[start:]."""
    out = []
    for a in range(start, len(token_ids), CHUNK):
        piece = token_ids[a: a + CHUNK]
        out.append(NewChunk(len(piece), kv_for(piece), meta))
    return out


def kv_files(home: Path) -> list[Path]:
    """Chunk files under home/kv."""
    return sorted((home / "kv").glob("*/*.safetensors"))


BACKENDS = ("sqlite", "postgres")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run every storage test on each backend."""
    if "db_backend" in metafunc.fixturenames:
        metafunc.parametrize("db_backend", BACKENDS, indirect=True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sqlite_only: about SQLite files themselves; skipped on PostgreSQL")


@pytest.fixture
def db_backend(request: pytest.FixtureRequest):
    """``sqlite`` or ``postgres``; for ``postgres``, ``CHATKV_DB_URL`` names a fresh database.

    Set through its own MonkeyPatch, so a test's ``monkeypatch.undo()`` keeps it.
    """
    backend = request.param
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CHATKV_DB_URL", raising=False)
        if backend == "postgres":
            if request.node.get_closest_marker("sqlite_only"):
                pytest.skip("about SQLite index files")
            mp.setenv("CHATKV_DB_URL", request.getfixturevalue("pg_url"))
        yield backend


@pytest.fixture
def index_url(db_backend: str, home: Path) -> str:
    """The URL of the index a plain ``Store(home)`` opens in this test."""
    return os.environ.get("CHATKV_DB_URL") or f"sqlite:///{home / 'index.db'}"


@pytest.fixture
def index_engine(index_url: str):
    """A plain SQLAlchemy engine on :func:`index_url` (to set up or inspect raw rows); disposed after."""
    from sqlalchemy import create_engine

    engine = create_engine(index_url)
    yield engine
    engine.dispose()


@pytest.fixture
def other_db(db_backend: str, request: pytest.FixtureRequest):
    """``other_db(home)``: the URL of a second, separate index for ``home`` (another
    "machine"): an SQLite file in it, or another fresh PostgreSQL database (the
    same one for the same ``home``, dropped after the test)."""
    made: dict[Path, str] = {}

    def make(home: Path) -> str:
        home = Path(home)
        if db_backend == "sqlite":
            return f"sqlite:///{home / 'index.db'}"
        if home not in made:
            from chatkv.testing_pg import unique_db_name

            made[home] = unique_db_name(f"other_{request.node.name}")
            request.getfixturevalue("pg_cluster").create_database(made[home])
        return request.getfixturevalue("pg_cluster").url(made[home])

    yield make
    if made:
        cluster = request.getfixturevalue("pg_cluster")
        for name in made.values():
            cluster.drop_database(name)


@pytest.fixture
def other_store(other_db):
    """``other_store(home)``: a new Store on ``home`` with its own index (see :func:`other_db`)."""
    return lambda home, **kw: Store(home, db_url=other_db(home), **kw)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, db_backend: str) -> None:
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path / "env-home"))


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def store(home: Path):
    s = Store(home)
    yield s
    s.close()


class ChunkReads:
    """Which way a test's chunk reads go (:func:`chunk_reads`), and how many
    native calls they made: ``native_calls`` through ``read_hashed`` (refused
    ones among them), ``templated_calls`` straight through ``read_fields``
    (a templated read's)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.native_calls = 0
        self.templated_calls = 0


@pytest.fixture(params=["python", "native"])
def chunk_reads(request, monkeypatch) -> ChunkReads:
    """Chunk reads (``ChunkReader.read_into``'s checked reads) through Python's
    slice loop, then through the native call (``chatkv.storage.nativeread``),
    whose calls are counted; skipped where the native reads cannot be built."""
    from chatkv.storage import nativeread

    mode = ChunkReads(request.param)
    if request.param == "python":
        monkeypatch.setattr(nativeread, "reader", lambda: None)
        return mode
    reads = request.getfixturevalue("native_reads")  # (skips, or fails where they are required)
    real, real_fields = reads.read_hashed, reads.read_fields
    inside = threading.local()  # (read_hashed's own call of read_fields is not a templated one)

    def counted(*args, **kwargs):
        mode.native_calls += 1
        inside.hashed = True
        try:
            return real(*args, **kwargs)
        finally:
            inside.hashed = False

    def counted_fields(*args, **kwargs):
        if not getattr(inside, "hashed", False):
            mode.templated_calls += 1
        return real_fields(*args, **kwargs)

    monkeypatch.setattr(reads, "read_hashed", counted)
    monkeypatch.setattr(reads, "read_fields", counted_fields)
    monkeypatch.setattr(nativeread, "reader", lambda: reads)
    return mode
