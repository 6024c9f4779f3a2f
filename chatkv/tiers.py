"""Memory tiers: idle sessions move down (device -> quantized -> host -> disk ->
expired) by policy and under budgets, and come back up when used.

Tiers of one session's KV, from fastest to slowest:

``device``
    Full precision in the block pool; the only tier a turn runs from.
``quantized``
    Its full blocks quantized (int8, fp8 or int4, see :mod:`chatkv.quant`) into
    compact tensors on the device; its pool blocks are free for others. The
    partial last block stays at full precision (KIVI's recent-token window).
``host``
    The same (quantized or not) in host RAM; pinned, and copied on a side
    stream, when CUDA is present.
``disk``
    Only the chunk files the store already holds (every turn writes through).
``expired``
    No KV anywhere (TTL or disk budget); the history stays, the next turn
    re-prefills.

Demotion order under pressure is least recently used first, and a session
with a turn in flight is never touched. KV that came back from a quantized
tier is approximate: the sequence is marked inexact, so its blocks are never
shared with other sessions and its chunks are stored under a lossy format.
A scheme is only used if its measured fidelity for the model passes the
configured floor (see :mod:`chatkv.fidelity`); otherwise the next finer
scheme is tried, down to full precision.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch

from chatkv.config import _from_dict
from chatkv.errors import ConfigError
from chatkv.quant import SCHEMES, QuantizedKV, bytes_per_token, check_scheme, dequantize, quantize

if TYPE_CHECKING:
    from chatkv.block_pool import BlockPool
    from chatkv.engine import Engine
    from chatkv.sequence import Sequence
    from chatkv.storage import Store

TIERS = ("device", "quantized", "host", "disk", "expired")
#: From coarsest to finest: the fallback order when a scheme fails its floor.
SCHEME_FALLBACK = ("int4", "fp8", "int8", "none")


@dataclass
class TierConfig:
    """Budgets and policies of the tier manager. Times are seconds of idleness.

    Attributes:
        device_budget_bytes: KV bytes allowed on the device (pool blocks in use
            plus quantized tensors); None means the pool's capacity.
        host_budget_bytes: KV bytes allowed in host RAM.
        quant_scheme: ``none``, ``int8``, ``fp8`` or ``int4``: how idle sessions
            are compressed in the quantized and host tiers.
        quantize_after_s / offload_after_s / spill_after_s: idle time after which
            a session moves to the quantized / host / disk tier (None: never by time).
        kv_ttl_s: idle time after which stored KV expires (history stays).
        disk_budget_bytes: chunk bytes allowed on disk (enforced by :func:`gc_store`).
        maintenance_interval_s: run policies in a background thread this often
            (None: only under pressure, or when :meth:`TierManager.maintain` is called).
        store_gc_interval_s: with the background thread, also run :func:`gc_store`
            (KV TTL, disk budget, orphan files) on the default store this often.
        fidelity_floors: minimum teacher-forced top-1 agreement per scheme.
    """

    device_budget_bytes: int | None = None
    host_budget_bytes: int = 1 << 30
    quant_scheme: str = "none"
    quantize_after_s: float | None = None
    offload_after_s: float | None = None
    spill_after_s: float | None = None
    kv_ttl_s: float | None = None
    disk_budget_bytes: int | None = None
    maintenance_interval_s: float | None = None
    store_gc_interval_s: float | None = None
    fidelity_floors: dict[str, float] = field(
        default_factory=lambda: {"int8": 0.99, "fp8": 0.98, "int4": 0.90}
    )

    def __post_init__(self) -> None:
        try:
            check_scheme(self.quant_scheme)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name in ("device_budget_bytes", "host_budget_bytes", "disk_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TierConfig":
        """Build from a mapping; unknown keys raise :class:`ConfigError` naming them."""
        return _from_dict(cls, values)


@dataclass
class OffloadedKV:
    """A session's KV outside the pool.

    ``k``/``v`` hold the full blocks of every layer as ``[layers * blocks,
    block_size, kv_heads, head_dim]`` (quantized unless the scheme is
    ``none``); ``tail`` is the partial last block at full precision,
    ``[layers, 2, t, kv_heads, head_dim]``.
    """

    token_ids: list[int]
    k: QuantizedKV | None
    v: QuantizedKV | None
    tail: torch.Tensor
    num_layers: int
    scheme: str
    exact: bool

    @property
    def nbytes(self) -> int:
        """Bytes held, codes and scales included."""
        cached = self.__dict__.get("_nbytes")
        if cached is None:
            full = (self.k.nbytes + self.v.nbytes) if self.k is not None and self.v is not None else 0
            cached = self.__dict__["_nbytes"] = full + self.tail.numel() * self.tail.element_size()
        return cached

    @property
    def lossless(self) -> bool:
        """True when reloading gives back exactly the KV that was offloaded."""
        return self.exact and (self.scheme == "none" or self.k is None)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held, in a fixed order (see :meth:`with_tensors`)."""
        out = []
        for q in (self.k, self.v):
            if q is not None:
                out += [t for t in (q.data, q.scale, q.zero) if t is not None]
        return out + [self.tail]

    def with_tensors(self, tensors: list[torch.Tensor]) -> "OffloadedKV":
        """A copy holding ``tensors`` (same order as :meth:`tensors`) instead."""
        it = iter(tensors)

        def take(q: QuantizedKV | None) -> QuantizedKV | None:
            if q is None:
                return None
            data = next(it)
            scale = next(it) if q.scale is not None else None
            zero = next(it) if q.zero is not None else None
            return dataclasses.replace(q, data=data, scale=scale, zero=zero)

        k, v = take(self.k), take(self.v)
        return dataclasses.replace(self, k=k, v=v, tail=next(it))

    def to(self, device: torch.device) -> "OffloadedKV":
        """A copy on ``device``. Off a CUDA device it lands in pinned host memory,
        copied on a side stream (see :mod:`chatkv.transfer`); onto CUDA the
        current stream waits for the side-stream copy."""
        from chatkv import transfer

        tensors = self.tensors()
        if device.type == "cpu":
            moved = transfer.to_host(tensors)
        else:
            moved = transfer.to_device(tensors, device)
        return self.with_tensors(moved)


def offload(pool: "BlockPool", seq: "Sequence", scheme: str, lock: threading.RLock) -> OffloadedKV:
    """Copy ``seq``'s computed KV out of the pool (quantizing its full blocks with
    ``scheme``); the sequence and its blocks are left untouched.

    The caller must keep ``seq`` idle (hold its session's ``busy`` lock). The
    engine lock is taken for one block's copy at a time, so turns of other
    sessions are never held up for longer than that.
    """
    bs = pool.block_size
    with lock:
        ids = list(seq.computed_ids)
        exact = seq.exact
    n = len(ids)
    full = (n // bs) * bs
    L = pool.kv.shape[0]
    pieces = []
    for start in range(0, n, bs):
        with lock:
            pieces.append(pool.read_tokens(seq, start, min(bs, n - start)))
    dense = torch.cat(pieces[: full // bs], dim=2) if full else None
    tail = pieces[-1] if n > full else pool.kv.new_empty((L, 2, 0, *pool.kv.shape[4:]))
    k = v = None
    if dense is not None:
        h, d = dense.shape[-2:]
        # [L, 2, full, H, D] -> per K/V: [L * blocks, bs, H, D]
        k = quantize(dense[:, 0].reshape(L * (full // bs), bs, h, d), "k", scheme)
        v = quantize(dense[:, 1].reshape(L * (full // bs), bs, h, d), "v", scheme)
        if scheme == "none":  # quantize() keeps a reference for "none": make it own its memory
            k = dataclasses.replace(k, data=k.data.clone())
            v = dataclasses.replace(v, data=v.data.clone())
    return OffloadedKV(ids, k, v, tail, L, scheme, exact)


def reload(pool: "BlockPool", seq: "Sequence", off: OffloadedKV, lock: threading.RLock) -> None:
    """Write offloaded KV back into the pool for empty ``seq`` (dequantizing on the
    pool's device). Lossy KV marks the sequence inexact."""
    L = off.num_layers
    dtype, device = pool.kv.dtype, pool.kv.device
    if off.tail.device != device:
        off = off.to(device)
    parts = []
    if off.k is not None and off.v is not None:
        k = dequantize(off.k, dtype)
        v = dequantize(off.v, dtype)
        h, d = k.shape[-2:]
        parts.append(torch.stack([k.reshape(L, -1, h, d), v.reshape(L, -1, h, d)], dim=1))
    parts.append(off.tail.to(dtype=dtype))
    kv = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    with lock:
        assert seq.num_computed == 0 and not seq.block_table, "reload needs an empty sequence"
        pool.write_tokens(seq, off.token_ids, kv, exact=off.lossless)


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
    """Moves the sessions of one engine between tiers.

    The sessions are the engine's in-process sessions (``engine.sessions``),
    each with ``busy`` (held while a turn runs), ``seq``, ``tier``,
    ``last_used``, ``offloaded`` and, when persistent, ``store``/``persister``.
    """

    def __init__(self, engine: "Engine", config: TierConfig | None = None) -> None:
        """Manage ``engine``'s sessions under ``config`` (defaults: no quantization,
        device budget = the pool, 1 GiB of host RAM)."""
        self.engine = engine
        self.config = config or TierConfig()
        self.hits = {t: 0 for t in TIERS}
        self.misses = 0
        self.demotions = {t: 0 for t in TIERS}
        self._scheme_ok: dict[str, bool] = {}
        self._lock = threading.Lock()  # serialises demotion passes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_store_gc = time.monotonic()
        if self.config.maintenance_interval_s:
            self.start()

    # -- accounting -------------------------------------------------------------

    @property
    def pool(self) -> "BlockPool":
        """The engine's block pool."""
        return self.engine.pool

    @property
    def device_budget(self) -> int:
        """Bytes of KV the device may hold."""
        cap = self.pool.num_blocks * self.pool.bytes_per_block
        b = self.config.device_budget_bytes
        return cap if b is None else min(b, cap)

    def _states(self) -> list[Any]:
        with self.engine.lock:
            return list(self.engine.sessions.values())

    def device_bytes(self) -> int:
        """KV bytes on the device now: pool blocks in use plus quantized tensors."""
        used = self.pool.num_used * self.pool.bytes_per_block
        return used + sum(s.offloaded.nbytes for s in self._states() if s.tier == "quantized" and s.offloaded)

    def host_bytes(self) -> int:
        """KV bytes held in host RAM now."""
        return sum(s.offloaded.nbytes for s in self._states() if s.tier == "host" and s.offloaded)

    def stats(self) -> TierStats:
        """A snapshot of tiers, bytes and counters."""
        states = self._states()
        sessions = {t: 0 for t in TIERS}
        nbytes = {t: 0 for t in TIERS}
        bpb = self.pool.bytes_per_block
        bs = self.pool.block_size
        for s in states:
            sessions[s.tier] += 1
            if s.tier == "device":
                nbytes["device"] += -(-s.seq.num_computed // bs) * bpb
            elif s.tier in ("quantized", "host") and s.offloaded is not None:
                nbytes[s.tier] += s.offloaded.nbytes
            elif s.tier == "disk" and s.store is not None:
                try:
                    nbytes["disk"] += s.store.get_session(s.session_id).kv_bytes
                except Exception:  # a session deleted meanwhile counts nothing
                    pass
        L, _, _, _, h, d = self.pool.kv.shape
        per_token = {
            scheme: bytes_per_token(scheme, h, d, L, bs, self.pool.kv.dtype) for scheme in SCHEMES
        }
        return TierStats(sessions, nbytes, dict(self.hits), self.misses, dict(self.demotions), per_token,
                         self.device_budget, self.config.host_budget_bytes)

    # -- the scheme in force ----------------------------------------------------------

    def effective_scheme(self) -> str:
        """The configured scheme if its measured fidelity passes its floor for
        this model, else the next finer one that does (``none`` always does)."""
        wanted = self.config.quant_scheme
        order = SCHEME_FALLBACK[SCHEME_FALLBACK.index(wanted):]
        for scheme in order:
            if scheme == "none":
                return scheme
            if scheme not in self._scheme_ok:
                from chatkv.fidelity import passes_floor

                floor = self.config.fidelity_floors.get(scheme, 1.0)
                self._scheme_ok[scheme] = passes_floor(self.engine, scheme, floor)
            if self._scheme_ok[scheme]:
                return scheme
        return "none"

    # -- moving one session ----------------------------------------------------------

    def make_resident(self, state: Any) -> str:
        """Bring ``state``'s KV into the pool at full precision (the caller holds
        ``state.busy``). Returns the tier it came from."""
        tier = state.tier
        state.last_used = time.monotonic()
        if tier == "device":
            self.hits["device"] += 1
            return tier
        tokens = 0
        if tier in ("quantized", "host") and state.offloaded is not None:
            tokens = len(state.offloaded.token_ids)
        elif tier == "disk" and state.store is not None:
            tokens = state.store.get_session(state.session_id).n_cached
        need = -(-tokens // self.pool.block_size)
        self.reserve(state, need)
        if tier in ("quantized", "host") and self.pool.num_available < need:
            # No room even after demoting others: fall back to the disk copy.
            state.offloaded, tier = None, "disk"
        if tier in ("quantized", "host") and state.offloaded is not None:
            reload(self.pool, state.seq, state.offloaded, self.engine.lock)
            state.offloaded = None
            self.hits[tier] += 1
        elif tier == "disk" and state.persister is not None:
            from chatkv.persistence import RestoreInfo

            info = RestoreInfo("disk")
            state.saved = state.persister.restore(state.session_id, state.seq, info)
            if state.seq.num_computed:
                self.hits["disk"] += 1
            else:
                self.misses += 1
        else:
            self.misses += 1
        state.tier = "device"
        return tier

    def demote(self, state: Any, target: str) -> bool:
        """Move an idle session down to ``target``. Returns False (and does
        nothing) if a turn is running on it or it is not above ``target``."""
        if TIERS.index(target) <= TIERS.index(state.tier):
            return False
        if not state.busy.acquire(blocking=False):
            return False
        try:
            return self._demote_locked(state, target)
        finally:
            state.busy.release()

    def _demote_locked(self, state: Any, target: str) -> bool:
        current = state.tier
        if TIERS.index(target) <= TIERS.index(current):
            return False
        engine = self.engine
        if target in ("quantized", "host"):
            off = state.offloaded
            if current == "device":
                if state.seq.num_computed == 0:
                    target = "disk" if state.persister is not None else "expired"
                else:
                    scheme = self.effective_scheme()  # host copies are compressed the same way
                    if target == "quantized" and scheme == "none":
                        target = "host"  # quantizing is off (or failed its floor): skip that tier
                    off = offload(self.pool, state.seq, scheme, engine.lock)
            if target == "host" and off is not None:
                off = off.to(torch.device("cpu"))
            if target in ("quantized", "host"):
                with engine.lock:
                    self.pool.release(state.seq)
                state.offloaded = off
        if target in ("disk", "expired"):
            if current == "device":
                with engine.lock:
                    self.pool.release(state.seq)
            state.offloaded = None
            if target == "disk" and state.persister is None:
                target = "expired"
            if target == "expired" and state.store is not None:
                try:
                    state.store.invalidate_kv(state.session_id)
                    state.saved = type(state.saved)()
                except Exception:
                    pass  # the store may refuse (another owner); its gc will expire it
        state.tier = target
        self.demotions[target] += 1
        return True

    # -- policies ---------------------------------------------------------------------

    def _idle_lru(self, exclude: Any = None) -> list[Any]:
        states = [s for s in self._states() if s is not exclude and not s.busy.locked()]
        return sorted(states, key=lambda s: s.last_used)

    def reserve(self, state: Any, blocks: int) -> None:
        """Make ``blocks`` pool blocks available for ``state``'s turn, demoting the
        least recently used idle sessions (never ``state``) until they are."""
        if self.pool.num_available >= blocks:
            return
        with self._lock:
            for victim in self._idle_lru(exclude=state):
                if self.pool.num_available >= blocks:
                    break
                if victim.tier == "device" and victim.seq.block_table:
                    self.demote(victim, self._first_tier_below_device())
        self.enforce_budgets(exclude=state)

    def _first_tier_below_device(self) -> str:
        if self.config.quant_scheme != "none" and self.effective_scheme() != "none":
            return "quantized"
        return "host" if self.config.host_budget_bytes > 0 else "disk"

    def enforce_budgets(self, exclude: Any = None) -> None:
        """Demote LRU idle sessions until device and host usage fit their budgets."""
        with self._lock:
            device, host = self.device_bytes(), self.host_bytes()
            if device <= self.device_budget and host <= self.config.host_budget_bytes:
                return
            for victim in self._idle_lru(exclude):
                if device <= self.device_budget:
                    break
                if victim.tier not in ("device", "quantized"):
                    continue
                target = self._first_tier_below_device() if victim.tier == "device" else (
                    "host" if self.config.host_budget_bytes > 0 else "disk")
                if self.demote(victim, target):
                    # Measured, not estimated: shared blocks stay in use until their last owner goes.
                    device, host = self.device_bytes(), self.host_bytes()
            for victim in self._idle_lru(exclude):
                if host <= self.config.host_budget_bytes:
                    break
                if victim.tier == "host":
                    nbytes = victim.offloaded.nbytes if victim.offloaded is not None else 0
                    if self.demote(victim, "disk"):
                        host -= nbytes  # host copies are never shared

    def apply_idle_policies(self, now: float | None = None) -> None:
        """Demote sessions idle longer than the configured thresholds."""
        now = time.monotonic() if now is None else now
        c = self.config
        steps = [("quantized", c.quantize_after_s), ("host", c.offload_after_s),
                 ("disk", c.spill_after_s), ("expired", c.kv_ttl_s)]
        with self._lock:
            for victim in self._idle_lru():
                idle = now - victim.last_used
                target = None
                for tier, after in steps:
                    if after is not None and idle >= after:
                        target = tier
                if target == "quantized" and (c.quant_scheme == "none" or self.effective_scheme() == "none"):
                    target = None
                if target is not None:
                    self.demote(victim, target)

    def maintain(self, now: float | None = None) -> None:
        """One maintenance pass: idle policies, then budgets; and, when
        ``store_gc_interval_s`` has passed, :func:`gc_store` on the default store
        (sessions open in this engine are skipped: their policies run here)."""
        self.apply_idle_policies(now)
        self.enforce_budgets()
        interval = self.config.store_gc_interval_s
        if interval is not None and time.monotonic() - self._last_store_gc >= interval:
            from chatkv.persistence import default_store

            self._last_store_gc = time.monotonic()
            gc_store(default_store(), self.config, skip=[s.session_id for s in self._states()])

    def start(self) -> None:
        """Run :meth:`maintain` every ``maintenance_interval_s`` in a daemon thread."""
        if self._thread is not None:
            return
        interval = self.config.maintenance_interval_s or 5.0

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.maintain()
                except Exception:  # never let housekeeping kill the process
                    pass

        self._thread = threading.Thread(target=loop, name="chatkv-tiers", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the maintenance thread, if running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def tier_manager(engine: "Engine", config: TierConfig | None = None) -> TierManager:
    """The engine's tier manager, created on first use. Passing ``config``
    replaces the configuration in force."""
    manager = getattr(engine, "_tier_manager", None)
    if manager is None:
        manager = TierManager(engine, config)
        engine._tier_manager = manager  # type: ignore[attr-defined]
        # When a running turn needs blocks, demote idle sessions before the
        # scheduler preempts turns in flight.
        engine.reclaimer = lambda wanted: manager.reserve(None, wanted)
    elif config is not None:
        manager.stop()
        manager.config = config
        manager._scheme_ok.clear()
        if config.maintenance_interval_s:
            manager._stop = threading.Event()
            manager.start()
    return manager


@dataclass
class StoreGcReport:
    """What :func:`gc_store` did (or would do, with ``dry_run``)."""

    dry_run: bool
    expired_sessions: list[str]
    expired_bytes: int
    over_budget_sessions: list[str]
    over_budget_bytes: int
    orphan_files: int
    temp_files: int
    dangling_chunks: int
    unreferenced_chunks: int
    files_removed: int
    bytes_reclaimed: int
    disk_bytes_before: int
    disk_bytes_after: int
    seconds: float


def gc_store(store: "Store", config: TierConfig | None = None, *, dry_run: bool = False,
             grace_s: float = 600.0, now: Any = None, skip: Iterable[str] = ()) -> StoreGcReport:
    """Enforce the disk tier: expire KV idle longer than ``kv_ttl_s``, drop the
    least recently used sessions' KV until chunk bytes fit ``disk_budget_bytes``,
    then remove orphan files, temp files, dangling rows and unreferenced chunks
    (older than ``grace_s``). Histories are never deleted. Sessions in ``skip``
    and sessions another live process holds a lease on are left alone, so it
    is safe while apps use the store (a running ``Chat`` holds its session's lease).
    """
    from datetime import datetime, timezone

    from chatkv.storage import SessionLockedError

    config = config or TierConfig()
    started = time.perf_counter()
    now = now or datetime.now(timezone.utc)
    skip = set(skip)
    before = store.disk_usage().file_bytes
    expired: list[str] = []
    expired_bytes = 0
    over: list[str] = []
    over_bytes = 0

    def drop(info: Any) -> int:
        if store.lease_holder(info.id) is not None:
            return -1  # another live process is using it
        if dry_run:
            return store.session_bytes(info.id).unique
        try:
            return store.invalidate_kv(info.id).bytes_removed
        except SessionLockedError:
            return -1

    sessions = [s for s in store.list_sessions() if s.id not in skip and s.n_cached]
    if config.kv_ttl_s is not None:
        for info in sessions:
            last = info.last_used_at if info.last_used_at.tzinfo else info.last_used_at.replace(tzinfo=timezone.utc)
            if (now - last).total_seconds() >= config.kv_ttl_s:
                got = drop(info)
                if got >= 0:
                    expired.append(info.id)
                    expired_bytes += got
        sessions = [s for s in sessions if s.id not in expired]
    if config.disk_budget_bytes is not None:
        usage = store.disk_usage().indexed_bytes - (expired_bytes if dry_run else 0)
        for info in sorted(sessions, key=lambda s: s.last_used_at):  # least recently used first
            if usage <= config.disk_budget_bytes:
                break
            got = drop(info)
            if got >= 0:
                over.append(info.id)
                over_bytes += got
                usage -= got
    report = store.gc(dry_run=dry_run, grace_s=grace_s)
    after = store.disk_usage().file_bytes
    return StoreGcReport(
        dry_run=dry_run, expired_sessions=expired, expired_bytes=expired_bytes,
        over_budget_sessions=over, over_budget_bytes=over_bytes,
        orphan_files=len(report.orphan_files), temp_files=len(report.temp_files),
        dangling_chunks=len(report.dangling_chunks), unreferenced_chunks=len(report.unreferenced_chunks),
        files_removed=report.files_removed,
        bytes_reclaimed=(report.reclaimable_bytes if dry_run else report.bytes_reclaimed)
        + expired_bytes + over_bytes,
        disk_bytes_before=before, disk_bytes_after=after, seconds=time.perf_counter() - started,
    )
