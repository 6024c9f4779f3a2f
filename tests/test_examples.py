"""Every program in ``examples/`` runs, as a user would run it, on the tiny model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT_S = 180

# Each example is a fresh Python process (torch + transformers imports): ~10 s of CPU each.
pytestmark = pytest.mark.slow


def run_example(name: str, home: Path, *args: str) -> str:
    """Run ``examples/<name>.py --model tiny:llama ARGS`` with its own CHATKV_HOME; return stdout."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--model", "tiny:llama", *args],
        env=dict(os.environ, CHATKV_HOME=str(home)), capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_quickstart(chatkv_home: Path) -> None:
    out = run_example("quickstart", chatkv_home)
    assert "reply 1:" in out and "reply 2:" in out
    reused = int(re.search(r"turn 2 reused (\d+) cached tokens", out).group(1))
    assert reused > 0


def test_streaming(chatkv_home: Path) -> None:
    out = run_example("streaming", chatkv_home, "--prompt", "Hello!")
    m = re.search(r"(\d+) pieces, (\d+) tokens; first token after", out)
    assert m and int(m.group(1)) > 1 and int(m.group(2)) == 64


def test_resume_across_restart(chatkv_home: Path) -> None:
    first = run_example("resume", chatkv_home)
    assert "restore: source=new turns=0" in first
    second = run_example("resume", chatkv_home)
    m = re.search(r"restore: source=disk turns=1 cached_tokens=(\d+)", second)
    assert m and int(m.group(1)) > 0
    reused = int(re.search(r"turn 2: reused (\d+) tokens", second).group(1))
    assert reused > int(m.group(1)) // 2  # the restored KV was used, not re-prefilled


def test_fork(chatkv_home: Path) -> None:
    out = run_example("fork", chatkv_home)
    reused = int(re.search(r"the branch began with (\d+) reused tokens", out).group(1))
    assert reused > 0
    trunk, branch = out.split("--- ")[1:]
    assert "Now name a fruit" in trunk and "Now name an animal" not in trunk
    assert "Now name an animal" in branch and "Now name a fruit" not in branch
    assert trunk.count("user: Name a colour.") == branch.count("user: Name a colour.") == 1


def _request(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_app_serves_users_and_saves_them(chatkv_home: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "http_app.py"), "--model", "tiny:llama", "--port", "0",
         "--max-users", "1", "--max-new-tokens", "8"],
        env=dict(os.environ, CHATKV_HOME=str(chatkv_home)), stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        base = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line).group(1)
        assert _request(f"{base}/health")[0] == 200
        for user in ("alice", "bob", "alice"):  # max-users 1: alice is closed, then resumed
            status, body = _request(f"{base}/chat/{user}", {"message": f"hi, I am {user}"})
            assert status == 200, body
            assert isinstance(body["reply"], str)
        assert body["stats"]["reused_tokens"] > 0  # alice's second turn reused her restored KV
        status, body = _request(f"{base}/history/alice")
        assert status == 200 and [m["role"] for m in body["messages"]].count("user") == 2
        assert _request(f"{base}/chat/bad%2Fid", {"message": "x"})[0] == 400
        assert _request(f"{base}/chat/bob", {"nomessage": 1})[0] == 400
        assert _request(f"{base}/nowhere")[0] == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "sessions saved" in out
    from chatkv.storage import Store

    with Store(chatkv_home) as store:
        turns = {i.id: i.n_turns for i in store.list_sessions()}
    assert turns == {"alice": 2, "bob": 1}
