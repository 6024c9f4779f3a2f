"""``chatkv sessions`` and ``chatkv models`` through click's CliRunner, including error paths.

Sessions are seeded straight through ``chatkv.storage`` (no model needed) except
where a test needs real KV, which comes from a tiny model.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from chatkv.cli.errors import ExitCode
from chatkv.cli.main import main
from chatkv.storage import Store


def run(*args: str, input: str | None = None) -> Result:
    """Invoke ``chatkv ARGS`` in-process."""
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def seed(session_id: str, turns: int = 2, system: str | None = "be brief") -> None:
    """A stored session with ``turns`` user/assistant exchanges and no KV."""
    with Store() as store:
        store.open_session(session_id, fingerprint="f" * 64, system_prompt=system)
        if system:
            store.append_message(session_id, "system", system)
        for i in range(turns):
            store.append_message(session_id, "user", f"question {i}")
            store.append_message(session_id, "assistant", f"answer {i}")


@pytest.fixture(scope="module")
def tiny_session_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CHATKV_HOME holding session ``kv-1`` with real KV from the tiny model (built once)."""
    import os

    from chatkv import Chat

    home = tmp_path_factory.mktemp("home-kv")
    old = os.environ.get("CHATKV_HOME")
    os.environ["CHATKV_HOME"] = str(home)
    try:
        with Store(home) as store:
            chat = Chat("kv-1", system="be brief", model="tiny:llama", store=store, max_new_tokens=8)
            chat.send("hello there")
            chat.send("and again")
            chat.close()
    finally:
        if old is None:
            os.environ.pop("CHATKV_HOME", None)
        else:
            os.environ["CHATKV_HOME"] = old
    return home


# ---------------------------------------------------------------------------- help


def test_help_lists_every_command_and_exit_codes() -> None:
    out = run("--help").stdout
    for word in ("repl", "sessions", "models", "CHATKV_HOME", "Exit codes"):
        assert word in out
    for group, subs in (("sessions", ("ls", "show", "rm", "export", "import", "gc")), ("models", ("ls", "import"))):
        res = run(group, "--help")
        assert res.exit_code == 0
        for sub in subs:
            assert sub in res.stdout
            assert run(group, sub, "--help").exit_code == 0
    assert "--max-new-tokens" in run("repl", "--help").stdout


# ---------------------------------------------------------------------------- sessions ls / show


def test_ls_empty_then_table_and_json() -> None:
    assert run("sessions", "ls").stdout.strip() == "no sessions"
    seed("alpha", turns=2)
    seed("beta", turns=1)
    res = run("sessions", "ls")
    assert res.exit_code == 0
    lines = res.stdout.splitlines()
    assert lines[0].split()[:5] == ["id", "turns", "tokens", "tier", "bytes"]
    assert {line.split()[0] for line in lines[1:]} == {"alpha", "beta"}
    rows = json.loads(run("sessions", "ls", "--json").stdout)
    by_id = {r["id"]: r for r in rows}
    assert by_id["alpha"]["n_turns"] == 2 and by_id["beta"]["n_turns"] == 1
    assert "last_used_at" in by_id["alpha"]


def test_show_prints_facts_and_history() -> None:
    seed("alpha", turns=2)
    res = run("sessions", "show", "alpha")
    assert res.exit_code == 0
    assert "turns:" in res.stdout and "2 (5 messages)" in res.stdout
    assert "user: question 1" in res.stdout and "assistant: answer 1" in res.stdout
    doc = json.loads(run("sessions", "show", "alpha", "--json").stdout)
    assert [m["role"] for m in doc["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert doc["disk_bytes"]["total"] == 0


def test_show_unknown_id_exits_3() -> None:
    res = run("sessions", "show", "nope")
    assert res.exit_code == ExitCode.NOT_FOUND == 3
    assert "no session 'nope'" in res.stderr


def test_invalid_session_id_is_a_usage_error() -> None:
    res = run("sessions", "show", "../etc")
    assert res.exit_code == ExitCode.USAGE == 2
    assert "session id" in res.stderr


# ---------------------------------------------------------------------------- rm


def test_rm_removes_and_reports_unknown_ids() -> None:
    seed("alpha")
    seed("beta")
    res = run("sessions", "rm", "alpha", "ghost", "beta")
    assert res.exit_code == ExitCode.NOT_FOUND
    assert "removed alpha" in res.stdout and "removed beta" in res.stdout
    assert "ghost" in res.stderr
    assert run("sessions", "ls").stdout.strip() == "no sessions"
    assert run("sessions", "rm").exit_code == ExitCode.USAGE  # at least one id


def test_rm_locked_session_exits_5() -> None:
    seed("held")
    with Store() as other:  # another process, as far as the index can tell
        other.acquire_lease("held")
        res = run("sessions", "rm", "held")
    assert res.exit_code == ExitCode.CONFLICT == 5
    assert "in use" in res.stderr
    assert run("sessions", "show", "held").exit_code == 0


# ---------------------------------------------------------------------------- export / import


def test_export_import_roundtrip_archive_and_directory(tmp_path: Path) -> None:
    seed("alpha", turns=2)
    archive = tmp_path / "alpha.tar"
    res = run("sessions", "export", "alpha", "-o", str(archive))
    assert res.exit_code == 0, res.output
    assert tarfile.is_tarfile(archive)
    bundle_dir = tmp_path / "alpha-bundle"
    assert run("sessions", "export", "alpha", "-o", str(bundle_dir)).exit_code == 0
    assert (bundle_dir / "history.json").is_file()

    res = run("sessions", "import", str(archive))
    assert res.exit_code == ExitCode.CONFLICT  # alpha exists
    assert "exists" in res.stderr
    res = run("sessions", "import", str(archive), "--as", "alpha-copy")
    assert res.exit_code == 0, res.output
    assert "imported alpha-copy: 2 turns" in res.stdout
    assert run("sessions", "import", str(bundle_dir), "--as", "alpha-dir").exit_code == 0
    assert run("sessions", "import", str(archive), "--overwrite").exit_code == 0
    ids = {r["id"] for r in json.loads(run("sessions", "ls", "--json").stdout)}
    assert ids == {"alpha", "alpha-copy", "alpha-dir"}
    copy = json.loads(run("sessions", "show", "alpha-copy", "--json").stdout)
    assert [m["content"] for m in copy["messages"]][-1] == "answer 1"


def test_export_unknown_id_exits_3_and_writes_nothing(tmp_path: Path) -> None:
    res = run("sessions", "export", "ghost", "-o", str(tmp_path / "g.tar"))
    assert res.exit_code == ExitCode.NOT_FOUND
    assert not (tmp_path / "g.tar").exists()


@pytest.mark.parametrize("content", [b"\x00garbage, not a tar file" * 10, b""])
def test_import_corrupt_file_exits_4(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.tar"
    bad.write_bytes(content)
    res = run("sessions", "import", str(bad))
    assert res.exit_code == ExitCode.BAD_FILE == 4
    assert "not a" in res.stderr
    assert run("sessions", "ls").stdout.strip() == "no sessions"


def test_import_tampered_bundle_exits_4(tmp_path: Path) -> None:
    seed("alpha")
    bundle = tmp_path / "b"
    run("sessions", "export", "alpha", "-o", str(bundle))
    doc = json.loads((bundle / "history.json").read_text())
    doc["version"] = 999
    (bundle / "history.json").write_text(json.dumps(doc))
    res = run("sessions", "import", str(bundle), "--as", "tampered")
    assert res.exit_code == ExitCode.BAD_FILE
    assert "version" in res.stderr
    # a tar holding something else entirely
    other = tmp_path / "other.tar"
    (tmp_path / "readme.txt").write_text("hi")
    with tarfile.open(other, "w") as tar:
        tar.add(tmp_path / "readme.txt", arcname="readme.txt")
    res = run("sessions", "import", str(other))
    assert res.exit_code == ExitCode.BAD_FILE and "history.json" in res.stderr


def test_import_missing_path_is_a_usage_error(tmp_path: Path) -> None:
    assert run("sessions", "import", str(tmp_path / "missing.tar")).exit_code == ExitCode.USAGE


def test_export_import_with_kv_verifies_and_keeps_tokens(tiny_session_home: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATKV_HOME", str(tiny_session_home))
    facts = json.loads(run("sessions", "show", "kv-1", "--json").stdout)
    assert facts["session"]["n_cached"] > 0 and facts["disk_bytes"]["total"] > 0
    archive = tmp_path / "kv.tar.gz"
    assert run("sessions", "export", "kv-1", "-o", str(archive)).exit_code == 0
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path / "elsewhere"))
    res = run("sessions", "import", str(archive))
    assert res.exit_code == 0, res.output
    copy = json.loads(run("sessions", "show", "kv-1", "--json").stdout)
    assert copy["session"]["n_cached"] == facts["session"]["n_cached"]
    assert copy["session"]["fingerprint"] == facts["session"]["fingerprint"]
    # flip one byte of the KV inside a copy of the bundle: import refuses it
    bundle = tmp_path / "flip"
    bundle.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(bundle, filter="data")
    kv = bundle / "kv.safetensors"
    raw = bytearray(kv.read_bytes())
    raw[-5] ^= 0xFF
    kv.write_bytes(bytes(raw))
    res = run("sessions", "import", str(bundle), "--as", "flipped")
    assert res.exit_code == ExitCode.BAD_FILE


# ---------------------------------------------------------------------------- gc


def test_gc_dry_run_then_collect(tmp_path: Path, chatkv_home: Path) -> None:
    seed("alpha")
    orphan = chatkv_home / "kv" / "ab" / ("ab" + "0" * 62 + ".safetensors")
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"x" * 100)
    res = run("sessions", "gc", "--dry-run", "--grace", "0")
    assert res.exit_code == 0
    assert "orphan files:" in res.stdout and "dry run" in res.stdout
    assert orphan.exists()
    report = json.loads(run("sessions", "gc", "--grace", "0", "--json").stdout)
    assert report["dry_run"] is False and report["files_removed"] >= 1 and report["bytes_reclaimed"] >= 100
    assert not orphan.exists()
    assert run("sessions", "show", "alpha").exit_code == 0


# ---------------------------------------------------------------------------- models


def _save_tiny_dir(path: Path) -> Path:
    from chatkv.testing import tiny_model

    model, tok = tiny_model("llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_models_ls_shows_default_model() -> None:
    res = run("models", "ls")
    assert res.exit_code == 0
    assert "SmolLM2-135M-Instruct" in res.stdout
    rows = json.loads(run("models", "ls", "--json").stdout)
    assert rows[0]["spec"] == "default"


def test_models_import_directory_records_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATKV_MODEL_CACHE", str(tmp_path / "cache"))
    model_dir = _save_tiny_dir(tmp_path / "tiny-llama")
    res = run("models", "import", str(model_dir), "--json")
    assert res.exit_code == 0, res.output
    entry = json.loads(res.stdout)
    assert entry["status"] == "imported" and len(entry["fingerprint"]) == 64
    again = json.loads(run("models", "import", str(model_dir), "--json").stdout)
    assert again["status"] == "already imported" and again["fingerprint"] == entry["fingerprint"]
    rows = json.loads(run("models", "ls", "--json").stdout)
    mine = [r for r in rows if r["name"] == "tiny-llama"]
    assert mine and mine[0]["fingerprint"] == entry["fingerprint"] and mine[0]["sessions"] == 0
    from chatkv.models import load_model

    assert load_model(str(model_dir)).fingerprint == entry["fingerprint"]


def test_models_import_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATKV_MODEL_CACHE", str(tmp_path / "cache"))
    res = run("models", "import", str(tmp_path / "missing.gguf"))
    assert res.exit_code == ExitCode.NOT_FOUND
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    res = run("models", "import", str(bad))
    assert res.exit_code == ExitCode.BAD_FILE
    assert "not a loadable chat model" in res.stderr
    not_model = tmp_path / "empty-dir"
    not_model.mkdir()
    res = run("models", "import", str(not_model))
    assert res.exit_code == ExitCode.BAD_FILE


# ---------------------------------------------------------------------------- repl (piped stdin)


def test_repl_piped_input_commands_and_multiline() -> None:
    script = "\n".join([
        "/help",
        "first line \\",
        "second line",
        '"""',
        "block one",
        "block two",
        '"""',
        "/history",
        "/system be terse",
        "/system",
        "/set temperature 0.5",
        "/set top_p 7",
        "/set nonsense 1",
        "/set",
        "/bogus",
        "//not a command",
        "/sessions",
        "/stats",
        "/reset",
        "/history",
        "/session pipe-2",
        "/session",
        "/exit",
        "never read",
    ]) + "\n"
    res = run("repl", "--model", "tiny:llama", "--session", "pipe-1", "--max-new-tokens", "4", input=script)
    assert res.exit_code == 0, res.output
    out, err = res.stdout, res.stderr
    assert out.startswith("new session pipe-1")
    assert "/session NAME" in out  # the help text
    assert "user: first line \nsecond line" in out
    assert "user: block one\nblock two" in out
    assert "system: be terse" in out
    assert "temperature = 0.5" in out and "bad value for top_p" in err and "cannot set 'nonsense'" in err
    assert "temperature=0.5" in out and "max_new_tokens=4" in out
    assert "unknown command /bogus" in err
    assert "last turn:" in out and "session pipe-1: 3 turns" in out
    assert "conversation cleared" in out
    assert "new session pipe-2" in out and "session pipe-2" in out
    assert err.count("[reused") == 3
    assert "saved session pipe-2" in err
    with Store() as store:
        history = [(m.role, m.content) for m in store.messages("pipe-1")]
        assert store.get_session("pipe-2").n_turns == 0
    assert history == [("system", "be terse")]  # /reset kept only the system prompt


def test_repl_resumes_piped_session_from_disk() -> None:
    assert run("repl", "--model", "tiny:llama", "--session", "pipe-r", "--max-new-tokens", "4",
               input="hi\nthere\n").exit_code == 0
    # The session left this process's memory when the REPL closed it.
    res = run("repl", "--model", "tiny:llama", "--session", "pipe-r", input="/history\n")
    assert res.exit_code == 0, res.output
    assert re.search(r"resumed pipe-r: 2 turns, \d+ cached tokens; KV loaded from disk", res.stdout)
    assert "user: hi\n" in res.stdout and "user: there\n" in res.stdout


def test_repl_undo_retry_and_edit() -> None:
    script = "\n".join([
        "/undo",  # nothing yet
        "/retry",
        "first question",
        "second question",
        "/retry",
        "/edit 0 an edited first question",
        "/history",
        "/undo",
        "/history",
        "/edit 5 nope",
        "/exit",
    ]) + "\n"
    res = run("repl", "--model", "tiny:llama", "--session", "pipe-e", "--max-new-tokens", "4", input=script)
    assert res.exit_code == 0, res.output
    out, err = res.stdout, res.stderr
    assert "cannot rewind 1 turns: the conversation has 0" in err
    assert "there is no reply to regenerate" in err
    assert err.count("[reused") == 4  # two messages, a retry and an edit replied
    assert "[0] user: an edited first question" in out
    assert "second question" not in out.split("[0] user: an edited first question")[1]
    assert "removed 2 messages" in out
    assert "message 5 is not a user message" in err
    with Store() as store:
        assert [m.role for m in store.messages("pipe-e")] == []  # the edit, then its undo


def test_repl_session_in_use_exits_5() -> None:
    seed("held-repl", turns=1)
    with Store() as other:
        other.acquire_lease("held-repl")
        res = run("repl", "--model", "tiny:llama", "--session", "held-repl", input="hello\n")
    assert res.exit_code == ExitCode.CONFLICT
    assert "in use" in res.stderr


def test_repl_option_errors(tmp_path: Path) -> None:
    system_file = tmp_path / "system.txt"
    system_file.write_text("You are a pirate.\n")
    res = run("repl", "--model", "tiny:llama", "--session", "sysfile", "--system-file", str(system_file),
              input="/system\n")
    assert res.exit_code == 0 and "system: You are a pirate." in res.stdout
    res = run("repl", "--system", "a", "--system-file", str(system_file), input="")
    assert res.exit_code == ExitCode.USAGE
    res = run("repl", "--model", str(tmp_path / "no-such-model"), input="")
    assert res.exit_code == ExitCode.NOT_FOUND and "no model at" in res.stderr
    res = run("repl", "--model", "tiny:llama", "--session", "bad/id", input="")
    assert res.exit_code == ExitCode.USAGE
    res = run("repl", "--model", "tiny:llama", "--kv-quant", "int3", input="")
    assert res.exit_code == ExitCode.USAGE and "int8" in res.stderr


def test_gc_expires_kv_by_ttl_and_keeps_history(chatkv_home: Path) -> None:
    from chatkv import Chat

    c = Chat("old", model="tiny:llama", chunk_tokens=16, max_new_tokens=4)
    c.send("hello there")
    c.close()
    before = json.loads(run("sessions", "show", "old", "--json").stdout)
    dry = json.loads(run("sessions", "gc", "--ttl", "0s", "--dry-run", "--json").stdout)
    assert dry["expired_sessions"] == ["old"] and dry["bytes_reclaimed"] > 0
    report = json.loads(run("sessions", "gc", "--ttl", "0s", "--json").stdout)
    assert report["expired_sessions"] == ["old"]
    assert report["disk_bytes_after"] < report["disk_bytes_before"]
    after = json.loads(run("sessions", "show", "old", "--json").stdout)
    assert len(after["messages"]) == len(before["messages"]) == 2
    assert run("sessions", "gc", "--ttl", "soon").exit_code == 2


def test_serve_refuses_bad_compile_batch_sizes_before_loading_anything() -> None:
    from chatkv.cli.serve import BatchSizes

    assert BatchSizes().convert("4,1,2,2", None, None) == (1, 2, 4)
    for bad, why in (("0,2", "must be positive"), ("1,x", "not a comma-separated list"), (",", "must be positive")):
        result = run("serve", "--compile-batch-sizes", bad)
        assert result.exit_code == 2 and why in result.output, result.output
