"""Fixtures for the storage tests; makes ``chatkv.storage`` importable before ``pip install -e``."""

from __future__ import annotations

import importlib.util
import sys
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


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CHATKV_DB_URL", raising=False)
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path / "env-home"))


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def store(home: Path):
    s = Store(home)
    yield s
    s.close()
