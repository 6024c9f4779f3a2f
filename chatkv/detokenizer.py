"""Incremental detokenization and stop strings for streaming.

A byte-level tokenizer may split one character (an emoji, a CJK glyph) across
several tokens; decoding them one at a time yields U+FFFD. The streamer keeps a
small window of tokens and emits text only once it decodes cleanly, so pieces
always concatenate to the full reply.
"""

from __future__ import annotations

from typing import Any, Sequence


class TextStreamer:
    """Turns generated token ids into text pieces, honouring stop strings.

    Feed tokens with :meth:`push`; each call returns the new text that is safe
    to show (possibly empty). Text that could be the start of a stop string is
    held back until it is clear. :attr:`stopped` turns True once a stop string
    appears; the reply then ends right before it.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        """Stream for ``tokenizer``; ``stop`` strings end the reply (excluded)."""
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""          # all decoded text so far (before stop handling)
        self._emitted = 0       # characters of self.text already returned
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """End of generation: return whatever is still held back (minus any stop string)."""
        if not self.stopped and self._read_offset < len(self.ids):
            tail = self._decode(self.ids[self._prefix_offset :])
            prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
            self.text += tail[len(prefix) :]
            self._read_offset = len(self.ids)
        return self._release(final=True)

    @property
    def reply(self) -> str:
        """The reply so far as the user sees it (cut before a stop string)."""
        return self.text[: self._emitted] if self.stopped else self.text

    def _release(self, final: bool) -> str:
        text = self.text
        if self.stop:
            hits = [i for i in (text.find(s, max(0, self._emitted - len(s))) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                self.stopped = True
                piece = text[self._emitted : cut] if cut > self._emitted else ""
                self._emitted = max(self._emitted, cut)
                self.text = text[: self._emitted]
                return piece
            if not final:
                hold = 0
                for s in self.stop:
                    for k in range(min(len(s) - 1, len(text)), 0, -1):
                        if text.endswith(s[:k]):
                            hold = max(hold, k)
                            break
                safe = len(text) - hold
                piece = text[self._emitted : safe] if safe > self._emitted else ""
                self._emitted = max(self._emitted, safe)
                return piece
        piece = text[self._emitted :]
        self._emitted = len(text)
        return piece
