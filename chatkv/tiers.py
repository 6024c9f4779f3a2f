"""Memory tiers: the policy of what moves when. Idle sessions move down
(device -> quantized -> host -> disk -> expired) by idle time and under
budgets, and come back up when used.

Tiers of one session's KV, from fastest to slowest (:class:`Tier`):

``device``
    Full precision in the block pool; the only tier a turn runs from.
``quantized``
    Its full blocks quantized (int8, fp8 or int4, see :mod:`chatkv.quant`) into
    compact tensors on the device; its pool blocks are free for others.
``host``
    The same (quantized or not) in host RAM.
``disk``
    Only the chunk files the store already holds (every turn writes through).
``expired``
    No KV anywhere (TTL or disk budget); the history stays, the next turn
    re-prefills.

The mechanism (copying KV out and back, quantizing) is :mod:`chatkv.offload`;
the disk gc policy is :func:`chatkv.storage.enforce_disk_policy`. A
:class:`TierManager` belongs to one engine and runs only on the engine's loop
thread (:mod:`chatkv.scheduler`), which owns the pool and every session's
:class:`TieredKV`: it needs no lock. Demotion order is least recently used
first, and a pinned session (one with a turn in flight, a restore or a save)
is never touched. KV that came back from a quantized tier is approximate: the
sequence is marked inexact, so its blocks are never shared with other
sessions and its chunks are stored under a lossy format. A scheme is used
only if its measured fidelity for the model passes the configured floor (see
:mod:`chatkv.fidelity`); otherwise the next finer scheme is tried, down to
full precision.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from chatkv.config import TierConfig
from chatkv.offload import OffloadedKV, offload, reload
from chatkv.quant import CAST_DTYPES, SCHEMES, bytes_per_token
from chatkv.sequence import Sequence

if TYPE_CHECKING:
    from chatkv.engine import Engine

__all__ = ["SCHEME_FALLBACK", "Tier", "TierConfig", "TierManager", "TierStats", "TieredKV"]

log = logging.getLogger(__name__)


class Tier(str, enum.Enum):
    """Where a session's KV lives, fastest first. Compares equal to its name."""

    DEVICE = "device"
    QUANTIZED = "quantized"
    HOST = "host"
    DISK = "disk"
    EXPIRED = "expired"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def rank(self) -> int:
        """0 for the device, 4 for expired."""
        return _ORDER.index(self)


_ORDER = list(Tier)
#: From coarsest to finest: the fallback order when a scheme fails its floor.
SCHEME_FALLBACK = ("int4", "fp8", "int8", "none")
#: The same for chunks on disk (``TierConfig.disk_format``), where casts to 16 bits come before exact.
DISK_FALLBACK = ("int4", "fp8", "int8", "bf16", "fp16", "none")


@dataclass(eq=False)
class TieredKV:
    """One session's KV as the tier policy sees it. Owned by the engine's loop.

    Attributes:
        session_id: the session's id.
        persistent: the session has a store, so ``disk`` holds a copy.
        seq: its sequence in the pool (empty below the device tier).
        tier: where its KV lives now.
        offloaded: its KV in the quantized or host tier.
        last_used: ``time.monotonic()`` of its last turn.
        pins: > 0 while a turn, restore or save uses it: never demoted then.
        keep_resident: the app asked to keep it on the device (``Chat(pin=True)``):
            idle policies skip it and pressure demotes it only after every other
            idle session.
        kv_ttl_s: idle seconds after which its KV expires, overriding
            ``TierConfig.kv_ttl_s`` (``Chat(ttl=...)``, stored with the session); None: the engine's.
        lost: why its KV was last lost (expired, no room), for turn stats.
        disk_bytes: bytes of its chunk files (kept by the session layer, for stats).
    """

    session_id: str
    persistent: bool
    seq: Sequence = field(default_factory=Sequence)
    tier: Tier = Tier.DEVICE
    offloaded: OffloadedKV | None = None
    last_used: float = field(default_factory=time.monotonic)
    pins: int = 0
    keep_resident: bool = False
    kv_ttl_s: float | None = None
    lost: str | None = None
    disk_bytes: int = 0


@dataclass
class TierStats:
    """Where KV lives now, and how accesses were served.

    Attributes:
        sessions: sessions per tier.
        bytes: KV bytes per tier (``disk`` counts chunk files of open sessions
            only; see the store for the whole home).
        hits: turns served from each tier (``device`` is a hit, the rest are
            promotions); ``misses`` count turns that had to re-prefill everything.
        demotions: sessions moved into each tier.
        bytes_per_token: bytes one cached token costs per scheme for this model.
        device_budget_bytes / host_budget_bytes: the budgets in force.
    """

    sessions: dict[str, int]
    bytes: dict[str, int]
    hits: dict[str, int]
    misses: int
    demotions: dict[str, int]
    bytes_per_token: dict[str, float]
    device_budget_bytes: int
    host_budget_bytes: int


class TierManager:
    """Moves the registered sessions of one engine between tiers (on its loop thread)."""

    def __init__(self, engine: "Engine", config: TierConfig | None = None) -> None:
        """Manage ``engine``'s sessions under ``config`` (defaults: no quantization,
        device budget = the pool, 1 GiB of host RAM)."""
        self.engine = engine
        self.config = config or TierConfig()
        self.hits = {t.value: 0 for t in Tier}
        self.misses = 0
        self.demotions = {t.value: 0 for t in Tier}
        self._scheme_ok: dict[str, bool] = {}
        self._exact_casts: set[str] = set()  # formats said to be written exact (effective_disk_scheme)
        self._sessions: dict[str, TieredKV] = {}

    def counters(self) -> tuple[dict[str, int], int, dict[str, int]]:
        """A copy of the counters a turn moves (hits per tier, misses, demotions
        per tier), for :meth:`restore_counters`. On the loop."""
        return dict(self.hits), self.misses, dict(self.demotions)

    def restore_counters(self, saved: tuple[dict[str, int], int, dict[str, int]]) -> None:
        """Put back counters :meth:`counters` copied (after work that is not to
        count, such as the warm-up's rehearsal). On the loop."""
        hits, self.misses, demotions = saved
        self.hits, self.demotions = dict(hits), dict(demotions)

    def configure(self, config: TierConfig) -> None:
        """Put ``config`` in force (the fidelity gate is checked again)."""
        self.config = config
        self._scheme_ok.clear()

    # -- registry --------------------------------------------------------------------

    def register(self, kv: TieredKV) -> None:
        """Start managing ``kv`` (its id must not be registered)."""
        assert kv.session_id not in self._sessions, kv.session_id
        self._sessions[kv.session_id] = kv

    def unregister(self, kv: TieredKV) -> None:
        """Stop managing ``kv`` and free whatever memory it holds."""
        self.engine.pool.release(kv.seq)
        kv.offloaded = None
        self._sessions.pop(kv.session_id, None)

    def get(self, session_id: str) -> TieredKV | None:
        """The registered KV of ``session_id``, if any."""
        return self._sessions.get(session_id)

    # -- accounting -------------------------------------------------------------

    @property
    def device_budget(self) -> int:
        """Bytes of KV the device may hold."""
        pool = self.engine.pool
        cap = pool.num_blocks * pool.bytes_per_block
        b = self.config.device_budget_bytes
        return cap if b is None else min(b, cap)

    def device_bytes(self) -> int:
        """KV bytes on the device now: pool blocks in use plus quantized tensors."""
        pool = self.engine.pool
        quantized = sum(s.offloaded.nbytes for s in self._sessions.values()
                        if s.tier is Tier.QUANTIZED and s.offloaded is not None)
        return pool.num_used * pool.bytes_per_block + quantized

    def host_bytes(self) -> int:
        """KV bytes held in host RAM now."""
        return sum(s.offloaded.nbytes for s in self._sessions.values()
                   if s.tier is Tier.HOST and s.offloaded is not None)

    def stats(self) -> TierStats:
        """A snapshot of tiers, bytes and counters."""
        pool = self.engine.pool
        sessions = {t.value: 0 for t in Tier}
        nbytes = {t.value: 0 for t in Tier}
        bpb, bs = pool.bytes_per_block, pool.block_size
        for s in self._sessions.values():
            sessions[s.tier.value] += 1
            if s.tier is Tier.DEVICE:
                nbytes["device"] += -(-s.seq.num_computed // bs) * bpb
            elif s.tier in (Tier.QUANTIZED, Tier.HOST) and s.offloaded is not None:
                nbytes[s.tier.value] += s.offloaded.nbytes
            elif s.tier is Tier.DISK:
                nbytes["disk"] += s.disk_bytes
        L, _, _, _, h, d = pool.kv.shape
        per_token = {scheme: bytes_per_token(scheme, h, d, L, bs, pool.kv.dtype) for scheme in SCHEMES}
        return TierStats(sessions, nbytes, dict(self.hits), self.misses, dict(self.demotions), per_token,
                         self.device_budget, self.config.host_budget_bytes)

    # -- the scheme in force ----------------------------------------------------------

    def effective_scheme(self) -> str:
        """The configured scheme if its measured fidelity passes its floor for
        this model, else the next finer one that does (``none`` always does)."""
        return self._passing(self.config.quant_scheme, SCHEME_FALLBACK)

    def effective_disk_scheme(self) -> str:
        """The quantization scheme of chunks written to disk: ``none`` for
        ``disk_format="exact"`` and for a cast that saves no bytes (``bf16`` or
        ``fp16`` of a pool whose KV is already two bytes a value: the KV as
        computed is as small, loses nothing and restores without a
        conversion), else the configured format if it passes its fidelity
        floor for this model, else the next finer one that does."""
        wanted = "none" if self.config.disk_format == "exact" else self.config.disk_format
        cast, pool = CAST_DTYPES.get(wanted), self.engine.pool.kv.dtype
        if cast is not None and cast.itemsize >= pool.itemsize:
            if cast != pool and wanted not in self._exact_casts:
                self._exact_casts.add(wanted)
                log.info("disk_format %s saves no bytes over this pool's %s KV: its chunks are written exact",
                         wanted, str(pool).removeprefix("torch."))
            return "none"
        return self._passing(wanted, DISK_FALLBACK)

    def _passing(self, wanted: str, fallback: tuple[str, ...]) -> str:
        chain = fallback[fallback.index(wanted):] if wanted in fallback else (wanted, "none")
        for scheme in chain:
            if scheme == "none":
                return scheme
            if scheme not in self._scheme_ok:
                from chatkv.fidelity import passes_floor

                floor = self.config.fidelity_floors.get(scheme, 1.0)
                self._scheme_ok[scheme] = ok = passes_floor(self.engine, scheme, floor)
                log.info("KV scheme %s %s its fidelity floor %.3f for this model", scheme,
                         "passes" if ok else "fails", floor)
            if self._scheme_ok[scheme]:
                return scheme
        return "none"

    # -- moving one session ----------------------------------------------------------

    def promote(self, kv: TieredKV) -> Tier:
        """Bring ``kv`` back to the device from a memory tier, making room by
        demoting others. Returns the tier it came from. KV on disk is left
        there (tier ``disk``): the session layer restores it through its one
        restore path. A memory copy that cannot get room falls back to disk
        (or is lost) rather than fail the turn."""
        tier = kv.tier
        kv.last_used = time.monotonic()
        if tier is Tier.DEVICE:
            self.hits["device"] += 1
        elif tier in (Tier.QUANTIZED, Tier.HOST):
            off = kv.offloaded
            assert off is not None
            need = -(-len(off.token_ids) // self.engine.pool.block_size)
            self.reclaim(need, exclude=kv)
            kv.offloaded = None
            if self.engine.pool.num_available >= need:
                reload(self.engine.pool, kv.seq, off)
                kv.tier = Tier.DEVICE
                self.hits[tier.value] += 1
            else:
                self._lose(kv, f"no room to reload its {tier} copy", to_disk=True)
                log.info("session %s: no room to reload its %s copy; falling back to %s",
                         kv.session_id, tier, kv.tier)
                if kv.tier is Tier.EXPIRED:
                    self.misses += 1
                    kv.tier = Tier.DEVICE
        elif tier is Tier.EXPIRED:
            self.misses += 1
            kv.tier = Tier.DEVICE
        return tier

    def restored(self, kv: TieredKV) -> None:
        """Record that the session layer restored ``kv`` from disk (whole or part)."""
        if kv.seq.num_computed:
            self.hits["disk"] += 1
        else:
            self.misses += 1
        kv.tier = Tier.DEVICE
        kv.last_used = time.monotonic()

    def _lose(self, kv: TieredKV, why: str, to_disk: bool) -> None:
        self.engine.pool.release(kv.seq)
        kv.offloaded = None
        if to_disk and kv.persistent:
            kv.tier = Tier.DISK
        else:
            kv.tier = Tier.EXPIRED
            kv.lost = f"{why} at {time.strftime('%H:%M:%S')}"

    def demote(self, kv: TieredKV, target: Tier | str) -> bool:
        """Move an unpinned session down to ``target``. Returns False (and does
        nothing) if it is pinned or not above ``target``. A session without a
        store that goes to ``disk`` expires instead; quantization that is off
        (or failed its floor) skips the quantized tier."""
        target = Tier(target)
        current = kv.tier
        if kv.pins or target.rank <= current.rank:
            return False
        pool = self.engine.pool
        if target in (Tier.QUANTIZED, Tier.HOST):
            off = kv.offloaded
            if current is Tier.DEVICE:
                if kv.seq.num_computed == 0:
                    target = Tier.DISK if kv.persistent else Tier.EXPIRED
                    off = None
                else:
                    scheme = self.effective_scheme()  # host copies are compressed the same way
                    if target is Tier.QUANTIZED and scheme == "none":
                        target = Tier.HOST
                    off = offload(pool, kv.seq, scheme)
            if target is Tier.HOST and off is not None:
                off = off.to(torch.device("cpu"))
            if target in (Tier.QUANTIZED, Tier.HOST):
                pool.release(kv.seq)
                kv.offloaded = off
        if target in (Tier.DISK, Tier.EXPIRED):
            why = "expired by the idle policy" if target is Tier.EXPIRED else "spilled"
            self._lose(kv, why, to_disk=target is Tier.DISK)
            target = kv.tier
        kv.tier = target
        self.demotions[target.value] += 1
        log.debug("session %s: %s -> %s", kv.session_id, current, target)
        return True

    # -- policies ---------------------------------------------------------------------

    def _idle_lru(self, exclude: TieredKV | None = None) -> list[TieredKV]:
        idle = [s for s in self._sessions.values() if s is not exclude and not s.pins]
        return sorted(idle, key=lambda s: (s.keep_resident, s.last_used))

    def _first_tier_below_device(self) -> Tier:
        if self.config.quant_scheme != "none" and self.effective_scheme() != "none":
            return Tier.QUANTIZED
        return Tier.HOST if self.config.host_budget_bytes > 0 else Tier.DISK

    def reclaim(self, blocks: int, exclude: TieredKV | None = None) -> bool:
        """Demote least recently used idle sessions (never ``exclude``) until
        ``blocks`` pool blocks are available, then fit the budgets again.
        Returns whether they are available."""
        pool = self.engine.pool
        if pool.num_available < blocks:
            for victim in self._idle_lru(exclude):
                if pool.num_available >= blocks:
                    break
                if victim.tier is Tier.DEVICE and victim.seq.block_table:
                    self.demote(victim, self._first_tier_below_device())
            self.enforce_budgets(exclude)
        return pool.num_available >= blocks

    def enforce_budgets(self, exclude: TieredKV | None = None) -> None:
        """Demote LRU idle sessions until device and host usage fit their budgets."""
        device, host = self.device_bytes(), self.host_bytes()
        if device <= self.device_budget and host <= self.config.host_budget_bytes:
            return
        for victim in self._idle_lru(exclude):
            if device <= self.device_budget:
                break
            if victim.tier not in (Tier.DEVICE, Tier.QUANTIZED):
                continue
            target = self._first_tier_below_device() if victim.tier is Tier.DEVICE else (
                Tier.HOST if self.config.host_budget_bytes > 0 else Tier.DISK)
            if self.demote(victim, target):
                # Measured, not estimated: shared blocks stay in use until their last owner goes.
                device, host = self.device_bytes(), self.host_bytes()
        for victim in self._idle_lru(exclude):
            if host <= self.config.host_budget_bytes:
                break
            if victim.tier is Tier.HOST:
                nbytes = victim.offloaded.nbytes if victim.offloaded is not None else 0
                if self.demote(victim, Tier.DISK):
                    host -= nbytes  # host copies are never shared

    def apply_idle_policies(self, now: float | None = None) -> list[TieredKV]:
        """Demote sessions idle longer than the configured thresholds (a
        session's own ``kv_ttl_s`` replaces the engine's TTL; pinned sessions
        are skipped). Returns the sessions whose KV expired (the caller drops
        their stored copy)."""
        now = time.monotonic() if now is None else now
        c = self.config
        expired = []
        for victim in self._idle_lru():
            if victim.keep_resident:
                continue
            ttl = victim.kv_ttl_s if victim.kv_ttl_s is not None else c.kv_ttl_s
            steps = [(Tier.QUANTIZED, c.quantize_after_s), (Tier.HOST, c.offload_after_s),
                     (Tier.DISK, c.spill_after_s), (Tier.EXPIRED, ttl)]
            idle = now - victim.last_used
            target = None
            for tier, after in steps:
                if after is not None and idle >= after:
                    target = tier
            if target is Tier.QUANTIZED and (c.quant_scheme == "none" or self.effective_scheme() == "none"):
                target = None
            if target is not None and self.demote(victim, target) and victim.tier is Tier.EXPIRED:
                expired.append(victim)
        return expired

    def maintain(self, now: float | None = None) -> list[TieredKV]:
        """One pass: idle policies, then budgets. Returns the sessions whose KV expired."""
        expired = self.apply_idle_policies(now)
        self.enforce_budgets()
        return expired
