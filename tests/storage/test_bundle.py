from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chatkv.storage import BundleError, SessionExistsError, Store, export_session, import_session

from .conftest import FP, kv_files, new_chunks


def _session(store: Store, sid: str = "s") -> list[int]:
    store.open_session(sid, fingerprint=FP, system_prompt="Be terse.")
    ids = list(range(150))
    store.append_message(sid, "system", "Be terse.", (0, 20))
    store.append_message(sid, "user", "héllo ✓", (20, 100))
    store.append_message(sid, "assistant", "hi", (100, 150))
    store.save_kv(sid, token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    return ids


def test_export_import_round_trip(store: Store, tmp_path: Path, other_store) -> None:
    ids = _session(store)
    out = export_session(store, "s", tmp_path / "bundle")
    doc = json.loads((out / "history.json").read_text())
    assert doc["format"] == "chatkv.session_bundle" and len(doc["chunks"]) == 3
    assert [m["content"] for m in doc["messages"]] == ["Be terse.", "héllo ✓", "hi"]
    with other_store(tmp_path / "other-home") as other:
        info = import_session(other, out)
        assert (info.id, info.n_cached, info.n_messages, info.fingerprint, info.system_prompt) == ("s", 150, 3, FP, "Be terse.")
        a, b = store.load_kv("s", fingerprint=FP), other.load_kv("s", fingerprint=FP)
        assert a.token_ids == b.token_ids == ids
        for x, y in zip(a.chunks, b.chunks):
            assert x.info.hash == y.info.hash and torch.equal(x.tensors["kv"], y.tensors["kv"])
        assert [(m.role, m.content, m.token_span) for m in other.messages("s")] == \
               [(m.role, m.content, m.token_span) for m in store.messages("s")]
    # into the same home under a new id: chunks are shared, no new files
    n = len(kv_files(store.home))
    import_session(store, out, session_id="s-copy")
    assert len(kv_files(store.home)) == n and store.load_kv("s-copy").token_ids == ids
    with pytest.raises(SessionExistsError):
        import_session(store, out)
    store.append_message("s", "user", "extra")
    import_session(store, out, overwrite=True)
    assert store.get_session("s").n_messages == 3


def test_export_without_kv(store: Store, tmp_path: Path, other_store) -> None:
    store.open_session("h")
    store.append_message("h", "user", "only text")
    out = export_session(store, "h", tmp_path / "b")
    assert not (out / "kv.safetensors").exists()
    with other_store(tmp_path / "h2") as other:
        assert import_session(other, out).n_messages == 1


def _rewrite(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda d: (d / "history.json").write_text("{nope"), "not readable JSON"),
        (lambda d: (d / "history.json").unlink(), "no history.json"),
        (lambda d: _rewrite(d / "history.json", lambda j: j.update(version=99)), "version 99"),
        (lambda d: _rewrite(d / "history.json", lambda j: j.update(format="x")), "not a chatkv session bundle"),
        (lambda d: _rewrite(d / "history.json", lambda j: j["messages"][0].pop("role")), "role"),
        (lambda d: _rewrite(d / "history.json", lambda j: j["cached_token_ids"].__setitem__(3, 7)), "differ"),
        (lambda d: (d / "kv.safetensors").write_bytes((d / "kv.safetensors").read_bytes()[:-9]), "sha256"),
        (lambda d: (d / "kv.safetensors").unlink(), "kv.safetensors is missing from the bundle"),
    ],
)
def test_corrupt_bundles_are_refused_and_write_nothing(store: Store, tmp_path: Path, other_store, damage, words: str) -> None:
    _session(store)
    out = export_session(store, "s", tmp_path / "bundle")
    damage(out)
    with other_store(tmp_path / "fresh") as other:
        with pytest.raises(BundleError, match=words):
            import_session(other, out)
        assert other.list_sessions() == [] and kv_files(other.home) == []


def test_tensor_tampering_is_caught_by_the_chunk_checksum(store: Store, tmp_path: Path, other_store) -> None:
    import hashlib

    from safetensors.torch import load_file, save_file

    _session(store)
    out = export_session(store, "s", tmp_path / "bundle")
    t = load_file(out / "kv.safetensors")
    t["000001/kv"][0, 0, 0, 0, 0, 0] += 1
    save_file(t, out / "kv.safetensors")
    _rewrite(out / "history.json", lambda j: j.update(kv_sha256=hashlib.sha256((out / "kv.safetensors").read_bytes()).hexdigest()))
    with pytest.raises(BundleError, match="chunk 1 fails its checksum"):
        import_session(other_store(tmp_path / "fresh"), out)


def test_overwrite_replaces_in_one_step_and_removes_the_old_unshared_chunks(store: Store, tmp_path: Path) -> None:
    ids = _session(store)
    out = export_session(store, "s", tmp_path / "bundle")
    other_ids = list(range(1000, 1100))
    store.save_kv("s", token_ids=other_ids, fingerprint=FP, chunks=new_chunks(other_ids))
    old_files = set(kv_files(store.home))
    lease = store.acquire_lease("s", auto_renew=False)
    info = import_session(store, out, overwrite=True)
    assert (info.n_cached, info.n_messages) == (len(ids), 3) and store.load_kv("s").token_ids == ids
    assert not old_files & set(kv_files(store.home))  # the replaced KV's files are gone
    assert not lease.released and store.lease_holder("s") is None  # our own lease survives the replace
    with Store(store.home) as b:
        assert b.lease_holder("s") == store.owner


def test_a_bad_token_span_is_a_bundle_error(store: Store, tmp_path: Path, other_store) -> None:
    _session(store)
    out = export_session(store, "s", tmp_path / "bundle")
    _rewrite(out / "history.json", lambda j: j["messages"][1].update(token_span=[9, 3]))
    with other_store(tmp_path / "fresh") as other:
        with pytest.raises(BundleError, match="token_span"):
            import_session(other, out)
        assert other.list_sessions() == []
