"""A sequence: the token ids a session's KV covers and the blocks holding them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatkv.block_pool import BlockHash


@dataclass(frozen=True)
class Shift:
    """A sequence whose window dropped tokens (``context_policy="sink"``).

    Its KV covers the conversation's token stream minus ``dropped`` tokens
    right after the first ``sink`` ones (a whole number of blocks), with the
    kept keys' rotary positions shifted down to be contiguous: ``token_ids`` is
    ``stream[:sink] + stream[sink + dropped:]``. Past the sink, that KV is not
    what a fresh prefill of ``token_ids`` computes (it attended to the dropped
    tokens), so those blocks are hashed under ``key``, a digest of everything
    dropped so far, never under the plain namespace.
    """

    sink: int
    dropped: int
    key: bytes

    @property
    def tag(self) -> str:
        """A short printable identity (``s<sink>.d<dropped>.<key hex>``) for chunk formats."""
        return f"s{self.sink}.d{self.dropped}.{self.key.hex()}"


@dataclass
class Sequence:
    """Token ids plus the block table that holds their keys and values.

    Invariant: blocks ``block_table[i]`` hold the KV of tokens
    ``token_ids[i * block_size : (i + 1) * block_size]`` for the first
    ``num_computed`` tokens. ``token_ids`` may run one past ``num_computed``
    (a sampled token not yet fed back). ``block_hashes[i]`` is the chained
    content hash of full block ``i`` (only full, computed blocks have one).
    ``shift`` is set once the sink policy dropped tokens from its window; a
    token's position is its index in ``token_ids`` either way.
    """

    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: "list[BlockHash]" = field(default_factory=list)
    num_computed: int = 0
    exact: bool = True
    shift: Shift | None = None

    @property
    def computed_ids(self) -> list[int]:
        """The token ids whose KV is in the blocks."""
        return self.token_ids[: self.num_computed]

    def __len__(self) -> int:
        return len(self.token_ids)
