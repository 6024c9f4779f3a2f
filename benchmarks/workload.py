"""The benchmark's workload: points in real ShareGPT conversations where the user
comes back, binned by how long the history is.

A *point* is a conversation cut just before one of its user turns: the history
(every earlier user turn and the *recorded* assistant reply to it, teacher-forced)
and the user's next message. Every system caches the same tokens for the history
(the chat template of it) and prefills the same delta (the new user turn plus
the assistant header), so their times compare the same work.

Each conversation gives at most one point per bin: the first user turn whose
history falls in the bin (bins are geometric windows around 512, 1024, 2048,
4096 and 8192 tokens).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: Bin label -> target history length in tokens (SmolLM2's window, 8,192 tokens,
#: holds the 8k bin's histories from 5.8k tokens up to what leaves room for the turn).
DEFAULT_BINS: dict[str, int] = {"0.5k": 512, "1k": 1024, "2k": 2048, "4k": 4096, "8k": 8192}
#: Tiny bins for the smoke run on the byte-level tiny model.
SMOKE_BINS: dict[str, int] = {"0.25k": 256}


@dataclass(frozen=True)
class Point:
    """A history plus the user's next message; see the module docstring.

    Attributes:
        conv: the conversation's index in the sample.
        bin: the history-length bin label.
        history: the messages before the timed turn, ending with an assistant reply.
        user: the next user message (the timed turn).
        cached_ids: the tokens every system holds the KV of before the turn
            (the template of ``history``, cut to its common prefix with ``prompt_ids``).
        prompt_ids: the template of ``history + [user]`` with the assistant header.
    """

    conv: int
    bin: str
    history: tuple[dict[str, str], ...]
    user: str
    cached_ids: tuple[int, ...]
    prompt_ids: tuple[int, ...]

    @property
    def key(self) -> str:
        """A short id, usable as a session id: ``c<conv>-<bin>``."""
        return f"c{self.conv}-{self.bin}"

    @property
    def n_cached(self) -> int:
        """Tokens of history."""
        return len(self.cached_ids)

    @property
    def n_delta(self) -> int:
        """Tokens the next turn prefills."""
        return len(self.prompt_ids) - len(self.cached_ids)

    @property
    def delta_ids(self) -> list[int]:
        """The tokens the next turn prefills."""
        return list(self.prompt_ids[len(self.cached_ids):])


def template_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, exactly as a
    session makes them (:func:`chatkv.models.encode_chat`, what ``Engine.encode_chat`` calls)."""
    from chatkv.models import encode_chat

    return encode_chat(tokenizer, messages, generation_prompt)


def bin_of(n_tokens: int, bins: dict[str, int]) -> str | None:
    """The bin whose window ``[target / sqrt 2, target * sqrt 2)`` holds ``n_tokens``, if any."""
    for label, target in bins.items():
        if target / math.sqrt(2) <= n_tokens < target * math.sqrt(2):
            return label
    return None


def find_points(conv: int, messages: list[dict[str, str]], tokenizer: Any, bins: dict[str, int],
                max_prompt: int) -> list[Point]:
    """The points of one conversation, at most one per bin, in conversation order.

    Args:
        conv: the conversation's index (names the points).
        messages: alternating user/assistant messages, user first.
        tokenizer: the model's tokenizer (with a chat template).
        bins: label -> target history tokens.
        max_prompt: the longest prompt (history + next user turn) allowed; it
            leaves room in the context window for the generated tokens.
    """
    from benchmarks.measure import lcp

    points: list[Point] = []
    seen: set[str] = set()
    for k in range(2, len(messages), 2):
        history, user = messages[:k], messages[k]
        hist = template_ids(tokenizer, history, generation_prompt=False)
        if len(hist) >= max_prompt:
            break
        label = bin_of(len(hist), bins)
        if label is None or label in seen:
            continue
        prompt = template_ids(tokenizer, history + [user], generation_prompt=True)
        if len(prompt) > max_prompt:
            break
        n = lcp(hist, prompt)
        seen.add(label)
        points.append(Point(conv, label, tuple(dict(m) for m in history), user["content"],
                            tuple(prompt[:n]), tuple(prompt)))
    return points


def stitched_conversations(seed: int, max_chars: int) -> list[list[dict[str, str]]]:
    """Long conversations rebuilt from the segments of one ShareGPT conversation.

    The V3 file is the *split* version: conversations are cut into records of
    about 2k tokens (ids ``<base>_<k>``), and cleaning dropped some of them, so
    no record reaches a 4k-token history. Joining a conversation's surviving
    segments in order gives real text from one conversation (minus the dropped
    turns); each is cut to ``max_chars`` characters of whole turns.
    """
    from benchmarks.sharegpt import _normalize, dataset_path, iter_records

    groups: dict[str, list[tuple[int, Any]]] = {}
    for record in iter_records(dataset_path().read_text(encoding="utf-8")):
        base, _, k = str(record.get("id", "")).rpartition("_")
        turns = _normalize(record.get("conversations"))
        if base and k.isdigit() and turns:
            groups.setdefault(base, []).append((int(k), turns))
    out: list[list[dict[str, str]]] = []
    for base in sorted(groups):
        segments = sorted(groups[base], key=lambda kv: kv[0])
        if len(segments) < 2:
            continue
        messages: list[dict[str, str]] = []
        total = 0
        for _, turns in segments:
            turns = turns[: len(turns) // 2 * 2]  # end each segment on a reply, so roles keep alternating
            for role, content in turns:
                total += len(content)
                if total > max_chars:
                    break
                messages.append({"role": role, "content": content})
        if len(messages) >= 4:
            out.append(messages)
    random.Random(seed).shuffle(out)
    return out


def select_points(n_conversations: int, per_bin: int, seed: int, tokenizer: Any, bins: dict[str, int],
                  max_prompt: int, chars_per_token: float = 4.0, source: list[list[dict[str, str]]] | None = None,
                  ) -> tuple[list[list[dict[str, str]]], list[Point]]:
    """Pick up to ``n_conversations`` ShareGPT conversations giving up to ``per_bin``
    points in each bin.

    Conversations come in the order :func:`benchmarks.sharegpt.load_conversations`
    shuffles them with ``seed``, then (for bins no record is long enough for)
    :func:`stitched_conversations`. A conversation is taken when it has a point in a
    bin that still needs one (a cheap character count first skips those too short
    for any such bin); only its points in bins still short of ``per_bin`` are kept.

    Args:
        source: conversations to pick from instead of ShareGPT (in this order).

    Returns:
        ``(conversations, points)``; points are ordered by conversation.
    """
    from benchmarks.sharegpt import load_conversations

    max_chars = int(max_prompt * chars_per_token * 1.5)
    pool: Iterable[list[dict[str, str]]] = source if source is not None else itertools.chain(
        load_conversations(None, seed=seed, min_turns=4, max_chars=max_chars),
        stitched_conversations(seed, max_chars))
    counts = {b: 0 for b in bins}
    convs: list[list[dict[str, str]]] = []
    points: list[Point] = []
    for messages in pool:
        open_bins = [b for b in bins if counts[b] < per_bin]
        if len(convs) >= n_conversations or not open_bins:
            break
        need_chars = min(bins[b] for b in open_bins) / math.sqrt(2) * chars_per_token * 0.8
        if sum(len(m["content"]) for m in messages[:-1]) < need_chars:
            continue
        found = [p for p in find_points(len(convs), messages, tokenizer, bins, max_prompt) if p.bin in open_bins]
        if not found:
            continue
        for p in found:
            counts[p.bin] += 1
        convs.append(messages)
        points.extend(found)
    return convs, points
