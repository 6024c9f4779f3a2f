"""The benchmark's smoke mode end to end on the tiny model (peers whose packages
are missing are reported, not run; llama.cpp is never run in smoke mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("safetensors")


def _conversation(turns: int = 8) -> list[dict[str, str]]:
    words = ["cache", "keys", "values", "pages", "blocks", "disk", "tiers", "resume", "prefill", "decode", "tokens"]
    out = []
    for i in range(turns):
        out.append({"role": "user", "content": f"question {i}: why " + " ".join(words[i % 5: i % 5 + 6]) + "?"})
        out.append({"role": "assistant", "content": f"answer {i}: because " + " ".join(words[i % 4: i % 4 + 7]) + "."})
    return out


def test_smoke_run_writes_report(tmp_path: Path) -> None:
    from benchmarks.run import main

    convs = tmp_path / "convs.json"
    convs.write_text(json.dumps([_conversation()]))
    out = tmp_path / "out"
    # The restart tier spawns a Python process (seconds of imports): left to the CLI's smoke run.
    argv = ["--smoke", "--conversations", str(convs), "--out", str(out), "--new-tokens", "4", "--restart-repeats", "0"]
    assert main(argv) == 0

    report = (out / "report.md").read_text()
    for section in ("## Goals", "## Time to first token", "## Decode speed", "## Bytes per cached token",
                    "## Restore bandwidth", "## Fidelity", "## Throughput"):
        assert section in report
    results = json.loads((out / "results.json").read_text())
    assert results["points"], "the conversation should give at least one point"
    systems = {s["system"] for s in results["samples"]}
    assert {"transformers re-prefill", "chatkv hot (device)", "chatkv disk (page cache warm)"} <= systems
    # Full-precision KV: every chatkv tier answers exactly as a re-prefill does (invariant 6).
    ref = {s["point"]: s["tokens"] for s in results["samples"] if s["system"] == "transformers re-prefill"}
    for s in results["samples"]:
        if s["system"].startswith("chatkv"):
            assert s["tokens"] == ref[s["point"]], s["system"]
            assert s["ttft_s"] > 0
    assert results["storage"]["bytes_on_disk"] > 0
    assert not (out / "work").exists(), "scratch state is removed after the run"


def test_long_context_smoke_compares_trim_and_sink_with_a_re_prefill(tmp_path: Path, capsys) -> None:
    from benchmarks.long_context import main

    out = tmp_path / "long.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| chatkv sink |" in table and "vs re-prefill" in table
    results = json.loads(out.read_text())
    systems = results["systems"]
    assert systems["re-prefill"]["summary"]["turns"] >= 3  # the conversation ran past the window
    # trim re-prefills exactly what a stock re-prefill of the kept messages sees: the same predictions.
    assert systems["chatkv trim"]["summary"]["top1_reprefill"] >= 0.99
    assert results["sink_dropped_tokens"] > 0
    # Past the window, sink prefills only each turn's new tokens (less than the re-prefill's whole window).
    assert systems["chatkv sink"]["summary"]["prefilled_per_turn"] < systems["re-prefill"]["summary"]["prefilled_per_turn"]


def test_serve_compare_smoke_restarts_chatkv_serve_and_reports_cached_turns(tmp_path: Path, capsys) -> None:
    """benchmarks/serve_compare.py end to end on chatkv alone (tiny model, 2 users, a few seconds):
    `chatkv serve` is started, loaded through benchmarks/loadgen.py, restarted after 2 s
    (SIGTERM, started again on the same home) and stopped once two later turns have succeeded
    after the restart; those turns still reuse KV."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from benchmarks.serve_compare import main

    out = tmp_path / "out"
    # The load ends on an event, not a clock: past its 4 s it goes on until two later turns
    # have succeeded after the restart (a restarted server's first turns can be slow while its
    # warm-up runs: with a fixed window, a full suite's run once saw none).
    argv = ["--systems", "chatkv", "--model", "tiny:llama", "--users", "2", "--duration", "4",
            "--restart-at", "2", "--min-later-turns", "2", "--max-turns", "6", "--max-tokens", "8",
            "--think-time", "0.3", "--source", "synthetic", "--stop-timeout", "30", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out

    assert "| later turns | turns | errors | TTFT p50 | TTFT p99 | ITL p50 | turns/s | cached |" in printed
    for row in ("| all later turns |", "| before restart |", "| after restart |"):
        assert row in printed
    assert "## Goals" in printed and "after the restart no worse than before" in printed
    assert (out / "report.md").read_text().strip() == printed.strip()

    summary = json.loads((out / "summary.json").read_text())
    assert summary["workload"]["restart_at"] == 2.0 and summary["workload"]["min_later_turns"] == 2
    assert "until 2 later turns had succeeded after it" in printed
    chatkv = summary["results"]["chatkv"]
    assert "unavailable" not in chatkv
    assert "--dtype float32" in chatkv["command"]
    [restart] = chatkv["restarts"]
    assert restart["signal"] == "SIGTERM" and restart["error"] is None
    loadgen = json.loads((out / "chatkv.json").read_text())
    assert loadgen["history"] == "recorded" and loadgen["users"] == 2
    for key in ("all", "later_turns", "before_restart", "after_restart"):
        assert {"turns", "ttft_ms", "itl_ms", "turns_per_s", "cached_fraction"} <= set(loadgen[key])
    assert loadgen["min_later_turns"] == 2
    after = loadgen["after_restart"]
    assert after["turns"] >= 2 and after["errors"] == 0
    assert after["cached_fraction"] and after["cached_fraction"] > 0, "later turns after the restart reused KV"
    tables = summary["tables"]["chatkv"]
    assert tables["after restart"]["cached"] == after["cached_fraction"]
    # Peers not asked for are "not measured", never a verdict.
    verdicts = {g["goal"]: g["verdict"] for g in summary["goals"]}
    assert verdicts["later-turn TTFT p50 at most 1/3 of transformers serve's"] is None
    state = json.loads((out / "chatkv.state.json").read_text())
    assert not Path(state["env"]["CHATKV_HOME"]).exists(), "the server's private home is removed"


def test_overlap_probe_times_reads_and_prefill_apart_and_together(tmp_path: Path, capsys) -> None:
    from benchmarks.overlap_probe import main

    out = tmp_path / "overlap.json"
    assert main(["--model", "tiny:llama", "--tokens", "300", "--repeats", "2", "--out", str(out)]) == 0
    assert "| read | prefill | sequential | overlapped |" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["context_tokens"] > 100 and r["new_tokens"] > 0 and r["disk_bytes"] > 0
    assert all(len(ts) == 2 and min(ts) > 0 for ts in r["times_s"].values())
    med = r["median_s"]
    assert r["best_over_sequential"] == max(med["read"], med["prefill"]) / med["sequential"]
    assert r["overlapped_over_sequential"] == med["overlapped"] / med["sequential"]


def test_decode_batch_times_compiled_and_padded_steps_against_uncompiled(tmp_path: Path, capsys) -> None:
    from chatkv.compile import unavailable

    if unavailable(__import__("torch").device("cpu")) is not None:
        pytest.skip("cannot compile here")
    from benchmarks.decode_batch import main

    out = tmp_path / "decode_batch.json"
    assert main(["--model", "tiny:llama", "--batches", "1,3,5", "--graphs", "1,4", "--context", "40",
                 "--steps", "4", "--skip", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| compiled (graph) | " in printed and "| transformers / compiled | " in printed
    r = json.loads(out.read_text())
    assert r["graph_used"] == {"1": 1, "3": 4, "5": None}  # 3 runs padded through 4; 5 as it is
    assert r["compiled_steps"] == {"1": 4, "3": 4, "5": 0}
    assert all(r["ms_per_step"][k][b] > 0 for k in ("uncompiled", "compiled", "transformers")
               for b in ("1", "3", "5"))


def test_restore_choice_reports_the_choice_its_reason_and_both_forced_times(tmp_path: Path, capsys) -> None:
    from benchmarks.restore_choice import main

    out = tmp_path / "restore_choice.json"
    assert main(["--model", "tiny:llama", "--tokens", "40,300", "--repeats", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| choice (auto) |" in printed and "The engine's prefill fit: " in printed
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["tokens"] for r in rows] == sorted(r["tokens"] for r in rows) and rows[0]["tokens"] >= 30
    # Both costs were sampled. Their slopes are timings (a tiny model's disk slope
    # can vanish in the noise), so only their shape is asserted.
    for name in ("prefill", "disk"):
        fixed, per_unit = result["fits"][name]
        assert fixed >= 0 and per_unit >= 0 and fixed + per_unit > 0
    for r in rows:
        assert r["decision"] in ("restore", "recompute") and "predicted" in r["reason"]
        assert 0 < r["restore_s"] < r["ttft_s"]["restore"]  # the restore is part of the turn it serves
        assert all(r["ttft_s"][m] > 0 for m in ("auto", "restore", "recompute"))
        assert r["right"] == (r["faster"] in ("either", r["decision"]))


def test_prefill_step_times_the_compiled_graph_against_the_model_and_the_peer(tmp_path: Path, capsys) -> None:
    from chatkv.compile import unavailable

    if unavailable(__import__("torch").device("cpu")) is not None:
        pytest.skip("cannot compile here")
    from benchmarks.prefill_step import main

    out = tmp_path / "prefill_step.json"
    assert main(["--model", "tiny:llama", "--context", "30", "--tokens", "3,17", "--repeats", "3",
                 "--out", str(out)]) == 0
    assert "| transformers / compiled | " in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["compiled_steps"] == {"3": 3, "17": 3}  # every compiled repeat ran through the graph
    assert all(r["ms"][k][t] > 0 for k in ("compiled", "uncompiled", "transformers") for t in ("3", "17"))
