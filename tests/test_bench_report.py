"""The resume benchmark's verdicts (benchmarks/report.py): ratios paired by
repeat, judged by the interval around their median, so that a noisy machine
gives "undecided" rather than a verdict its samples cannot carry."""

from __future__ import annotations

import pytest

from benchmarks.report import HF_HOT, HF_RESUME, RESTART, Results, goals_section, median_interval, restart_goals


def test_the_median_interval_takes_the_sign_tests_order_statistics() -> None:
    assert median_interval([]) is None
    assert median_interval([3.0, 1.0, 5.0, 2.0, 4.0]) == (1.0, 3.0, 5.0, pytest.approx(1 - 2 / 32))
    low, mid, high, cover = median_interval(range(1, 11))
    assert (low, mid, high) == (2, 5.5, 9) and cover == pytest.approx(1 - 2 * 11 / 1024)
    low, _, high, cover = median_interval(range(1, 21))
    assert (low, high) == (6, 15) and cover >= 0.9
    low, _, high, cover = median_interval([1.0, 2.0, 3.0, 4.0])  # too few for 90%: the whole range
    assert (low, high) == (1.0, 4.0) and cover == pytest.approx(0.875)


def _results(restart: list[tuple[float, float]], resume: list[float], hot: list[float]) -> Results:
    """One 1k history; per repeat the restart's (first, next) turns and each peer's turn, in seconds."""
    def sample(system: str, repeat: int, ttft: float, **extra: float) -> dict:
        return {"system": system, "point": "c0-1k", "bin": "1k", "history_tokens": 1000, "delta_tokens": 20,
                "repeat": repeat, "ttft_s": ttft, "decode_tok_s": None, "tokens": [], "extra": extra}

    samples = [sample(RESTART, i, first, next_ttft_s=nxt) for i, (first, nxt) in enumerate(restart)]
    samples += [sample(HF_RESUME, i, t) for i, t in enumerate(resume)]
    samples += [sample(HF_HOT, i, t) for i, t in enumerate(hot)]
    return Results({"meta": {"bins": ["1k"]}, "systems": [RESTART, HF_RESUME, HF_HOT], "samples": samples})


def test_restart_goals_pair_turns_by_repeat_and_say_undecided_where_the_interval_holds_the_limit() -> None:
    # The machine slows down for two repeats; every system with it.
    resume = [0.100, 0.100, 0.100, 0.400, 0.400]
    restart = [(0.070, 0.068), (0.070, 0.069), (0.070, 0.070), (0.310, 0.300), (0.310, 0.305)]
    hot = [0.080, 0.080, 0.080, 0.200, 0.200]
    r = _results(restart, resume, hot)
    by_goal = {goal.split(" (median")[0]: (met, measured) for goal, met, measured in restart_goals(r)}
    # Paired: 0.70, 0.70, 0.70, 0.775, 0.775: met (all below 0.8), although
    # two repeats' restart turns are slower than three of the peer's.
    met, measured = by_goal["after a process restart: TTFT <= 0.8x transformers' hand-made resume, every length"]
    assert met is True and measured == "0.70x (0.70–0.77) at 1k"
    # Paired: 0.875 three times, 1.55 twice: the interval holds 1.0.
    met, measured = by_goal["after a process restart: TTFT <= transformers' DynamicCache kept in RAM, every length"]
    assert met == "undecided" and measured == "0.88x (0.88–1.55) at 1k"
    met, _ = by_goal["first turn of a fresh process <= 1.1x the next turn of the same shape"]
    assert met is True
    table = "\n".join(goals_section(r, restart_goals(r)))
    assert "undecided: the interval holds the limit" in table and "interval covering 94%" in table


def test_a_goal_is_not_met_where_the_whole_interval_is_above_it() -> None:
    r = _results([(0.100, 0.050)] * 5, [0.100] * 5, [0.050] * 5)
    verdicts = [met for _, met, _ in restart_goals(r)]
    assert verdicts == [False, False, False]


def test_unpaired_samples_are_left_out() -> None:
    # The peer failed in repeats 3 and 4: only repeats 0 to 2 pair.
    r = _results([(0.07, 0.07)] * 5, [0.1, 0.1, 0.1], [0.1] * 5)
    _, _, measured = restart_goals(r)[0]
    assert measured == "0.70x (0.70–0.70) at 1k"


def test_the_decode_goal_is_judged_on_ratios_paired_by_repeat() -> None:
    """benchmarks.decode: chatkv's rate over eager's in the same repeat; a repeat
    one of them lacks is left out; the verdict per context from the interval."""
    from benchmarks.decode import decode_goal

    def runs(rates: list[tuple[float, float]]) -> list[dict]:
        return [{"repeat": i, "rates": {"1000": a, "2000": b}} for i, (a, b) in enumerate(rates)]

    eager = runs([(30.0, 20.0)] * 5)
    # 1k: 1.6x-1.8x in every repeat (met); 2k: 1.2x-1.9x around 1.5x (undecided).
    chatkv = runs([(48.0, 24.0), (51.0, 38.0), (54.0, 30.0), (50.0, 36.0), (49.0, 26.0)])
    lines = decode_goal(chatkv, eager, [1000, 2000])
    assert "undecided." in lines[0]
    assert "1000 tok: 1.67x (1.60-1.80, 94%) met" in lines[-1]
    assert "2000 tok: 1.50x (1.20-1.90, 94%) undecided" in lines[-1]
    slow = runs([(40.0, 20.0)] * 5)
    assert "not met" in decode_goal(slow, eager, [1000, 2000])[0]
    assert "1.33x (1.33-1.33" in decode_goal(slow, eager, [1000])[-1]
    del chatkv[2]  # a failed chatkv process: its repeat's eager run has no partner and is left out
    eager[2]["rates"]["1000"] = 1.0
    assert "1000 tok: 1.65x (1.60-1.70, 88%) met" in decode_goal(chatkv, eager, [1000])[-1]


def _disk_format_result(warm: list[float], cold: list[float], **more: object) -> dict:
    """One format's entry in ``benchmarks.disk_formats``'s results, as its run
    leaves it before :func:`~benchmarks.disk_formats.add_vs_exact`: restore
    times ``warm`` (from the page cache) and ``cold`` (from the device), the
    rest fixed, ``more`` added."""
    pairs = (1.0, 0.4, 0.5, 0.9)
    return {"tokens": 1000, "disk_bytes": 10_000, "bytes_per_token": 10.0, "restore_s": warm,
            "restore_cold_s": cold, "restore_median_s": 1.0, "restore_cold_median_s": 3.0,
            "restore_bytes_per_s": 1e9, "raw_read_bytes_per_s": 2e9, "raw_read_into_bytes_per_s": 2e9,
            "raw_read_cold_bytes_per_s": 1e9, "top1_agreement": 1.0, "mean_kl": 0.0, "cold": "evicted",
            "paired_read_ratio": pairs, "paired_read_into_ratio": pairs, **more}


def test_disk_formats_judges_each_compact_restore_against_exacts_in_the_same_round() -> None:
    """benchmarks.disk_formats pairs each format's restore with exact's of the
    same round (the VM's drift between rounds cancels), from the device and,
    in results without restores of exact's beside each format's (older
    runs), from the page cache: met where every pair
    is faster, not met where every one is slower, undecided where they
    straddle exact; and the table says so per format, warm and cold. The
    control (exact's own session restored again) gets its ratio, no verdict,
    and no row among the formats' numbers (its files are exact's)."""
    import argparse

    from benchmarks.disk_formats import CONTROL, add_vs_exact, render

    drift = [1.0, 1.6, 0.8, 1.3, 0.9, 1.5, 1.1, 0.7, 1.2, 1.4]  # exact's time, round by round

    def result(factors: list[float]) -> dict:
        times = [d * f for d, f in zip(drift, factors)]
        return _disk_format_result(times, [3 * t for t in times])

    results = {"exact": result([1.0] * 10), "int8": result([0.9] * 10), "fp8": result([1.2] * 10),
               "int4": result([0.9, 1.1] * 5), CONTROL: result([0.95, 1.05] * 5)}
    for name in ("paired_read_ratio", "paired_read_into_ratio", "raw_read_bytes_per_s"):
        del results[CONTROL][name]  # (not measured for the control: exact's files)
    add_vs_exact(results)
    assert results["int8"]["vs_exact_ratio"][1] == pytest.approx(0.9)  # not 0.9 times a median of the drift
    assert results["fp8"]["vs_exact_cold_ratio"][1] == pytest.approx(1.2)
    table = render(results, argparse.Namespace(dtype="bfloat16", repeats=10))
    rows = {line.split("|")[1].strip(): line for line in table.split("Restore time over exact's")[1].splitlines()
            if line.startswith("| ") and not line.startswith("| format")}
    control = f"{CONTROL} (exact's own files: this run's spread)"
    assert set(rows) == {"int8", "fp8", "int4", control}
    assert rows["int8"].count(" met") == 2 and "not met" not in rows["int8"]
    assert rows["fp8"].count("not met") == 2
    assert rows["int4"].count("undecided") == 2
    assert "| 1.00x (0.95-1.05" in rows[control] and not any(
        word in rows[control] for word in ("met", "undecided"))
    assert f"| {CONTROL} |" not in table.split("Restore time over exact's")[0]


def test_disk_formats_judges_the_page_caches_restores_against_exacts_beside_them() -> None:
    """Where a round also restored exact's session right before or after a
    format's (``adjacent_exact_s``), the page cache's ratio pairs the two
    restores made side by side, not the format's with exact's a whole round
    away: exact's own restores there drift (here 1.0 to 1.6) where those
    beside each format keep in step with it. From the device, pairs stay by
    round."""
    import argparse

    from benchmarks.disk_formats import add_vs_exact, render

    drift = [1.0, 1.6, 0.8, 1.3, 0.9, 1.5]
    beside = [1.3, 1.0, 1.4, 0.9, 1.2, 1.1]  # the machine's speed when int8's pair ran

    cold = [3 * t for t in drift]
    results = {"exact": _disk_format_result(drift, cold, adjacent_exact_s=[]),
               "int8": _disk_format_result([0.9 * b for b in beside], cold, adjacent_exact_s=beside)}
    add_vs_exact(results)
    assert results["int8"]["vs_exact_ratio"][::2] == pytest.approx((0.9, 0.9))  # every adjacent pair
    low, _, high, _ = results["int8"]["vs_exact_round_ratio"]
    assert low < 1.0 < high  # by round, the drift alone would leave it undecided
    assert results["int8"]["vs_exact_cold_ratio"][1] == pytest.approx(1.0)  # (the same cold times as exact's)
    table = render(results, argparse.Namespace(dtype="bfloat16", repeats=6))
    row = next(line for line in table.split("Restore time over exact's")[1].splitlines()
               if line.startswith("| int8 |"))
    assert row.split("|")[2].strip().startswith("0.90x (0.90-0.90") and row.split("|")[2].strip().endswith(" met")
