"""A sequence: the token ids a session's KV covers and the blocks holding them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatkv.block_pool import BlockHash


@dataclass
class Sequence:
    """Token ids plus the block table that holds their keys and values.

    Invariant: blocks ``block_table[i]`` hold the KV of tokens
    ``token_ids[i * block_size : (i + 1) * block_size]`` for the first
    ``num_computed`` tokens. ``token_ids`` may run one past ``num_computed``
    (a sampled token not yet fed back). ``block_hashes[i]`` is the chained
    content hash of full block ``i`` (only full, computed blocks have one).
    """

    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: "list[BlockHash]" = field(default_factory=list)
    num_computed: int = 0
    exact: bool = True

    @property
    def computed_ids(self) -> list[int]:
        """The token ids whose KV is in the blocks."""
        return self.token_ids[: self.num_computed]

    def __len__(self) -> int:
        return len(self.token_ids)
