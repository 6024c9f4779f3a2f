"""Continuous batching: concurrent sessions share forward passes and still answer
exactly as they would alone; cancellation, preemption and backpressure."""

from __future__ import annotations

import _thread
import asyncio
import signal
import threading
from contextlib import aclosing

import pytest

from chatkv import Chat, EngineConfig
from chatkv.aio import asend, astream
from chatkv.engine import Engine
from chatkv.errors import OutOfBlocksError, QueueFullError
from chatkv.models import load_model
from chatkv.channel import Pending, next_nonblocking
from chatkv.sequence import Sequence

TURNS = ("Hello there", "Tell me a story", "Ünïcödé 🙂 ok?")


def make_engine(**cfg: object) -> Engine:
    cfg.setdefault("num_blocks", 512)
    cfg.setdefault("block_size", 4)
    return Engine(load_model("tiny:llama"), EngineConfig(**cfg))  # type: ignore[arg-type]


def conversation(engine: Engine, i: int, **sampling: object) -> tuple[list[str], list[list[int]]]:
    """Run session ``i``'s 3-turn conversation (one of 4 distinct ones: sessions
    with the same one share prefix blocks); returns its replies and token ids."""
    chat = Chat(f"user-{i}", system=f"You are bot {i % 4}.", engine=engine, persist=False, **sampling)
    replies, tokens = [], []
    for text in TURNS:
        replies.append(chat.send(f"{text} #{i % 4}"))
        tokens.append(list(chat.last_stats.token_ids))
    chat.close()
    return replies, tokens


def run_threads(n: int, target) -> list:
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = target(i)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


def test_16_threads_match_their_conversations_run_alone():
    alone = make_engine()
    want = [conversation(alone, i, max_new_tokens=8) for i in range(4)]
    assert alone.scheduler.stats.max_batch_seqs == 1
    assert len({tuple(map(tuple, w[1])) for w in want}) == 4  # four different conversations

    engine = make_engine()
    got = run_threads(16, lambda i: conversation(engine, i, max_new_tokens=8))
    for i, g in enumerate(got):
        assert g == want[i % 4], f"session {i}"
    stats = engine.scheduler.stats
    assert stats.max_batch_seqs > 1, stats  # turns really shared forward passes
    assert stats.steps < 4 * alone.scheduler.stats.steps
    assert stats.finished == 48 and stats.failed == stats.cancelled == 0
    assert engine.pool_stats().used_blocks == 0


def test_32_concurrent_astreams_some_cancelled():
    prompts = [f"question {i % 4}" for i in range(32)]
    alone = make_engine()
    want = {}
    for p in sorted(set(prompts)):
        chat = Chat(f"ref-{p[-1]}", engine=alone, persist=False, max_new_tokens=12, ignore_eos=True)
        want[p] = chat.send(p)

    engine = make_engine()
    chats = [Chat(f"a-{i}", engine=engine, persist=False, max_new_tokens=12, ignore_eos=True) for i in range(32)]
    cancel = {i for i in range(32) if i % 4 == 1}

    async def consume(i: int, started: asyncio.Event) -> str:
        pieces = []
        async with aclosing(astream(chats[i], prompts[i])) as stream:
            async for piece in stream:
                pieces.append(piece)
                started.set()
        return "".join(pieces)

    async def main() -> list:
        events = [asyncio.Event() for _ in chats]
        tasks = [asyncio.create_task(consume(i, events[i])) for i in range(32)]
        for i in cancel:
            await events[i].wait()
            tasks[i].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    for i, r in enumerate(results):
        if i in cancel:
            assert isinstance(r, asyncio.CancelledError) or r == want[prompts[i]], i
            if isinstance(r, asyncio.CancelledError):
                assert chats[i].last_stats.finish_reason == "interrupted"
                assert chats[i].history[-1].partial
        else:
            assert r == want[prompts[i]], i
            assert chats[i].last_stats.finish_reason == "length"
    assert engine.scheduler.stats.max_batch_seqs > 1
    assert engine.scheduler.stats.cancelled >= 1
    # A cancelled session is still usable.
    i = min(cancel)
    assert asyncio.run(asend(chats[i], "again"))
    for chat in chats:
        chat.close()
    assert engine.pool_stats().used_blocks == 0


def test_preemption_under_a_small_pool_keeps_greedy_tokens():
    # Each turn ends at 18 + 23 computed tokens (11 blocks): one fits the pool alone, four
    # do not fit together, so the latest arrivals are preempted and recomputed.
    def turn(engine: Engine, i: int) -> list[int]:
        chat = Chat(f"p-{i}", engine=engine, persist=False, max_new_tokens=24, ignore_eos=True)
        chat.send(f"hi {i}")
        tokens = list(chat.last_stats.token_ids)
        chat.close()
        return tokens

    alone = make_engine()
    want = [turn(alone, i) for i in range(4)]
    engine = make_engine(num_blocks=24, block_wait_s=30.0)
    got = run_threads(4, lambda i: turn(engine, i))
    assert got == want
    assert engine.scheduler.stats.preemptions > 0
    assert engine.scheduler.stats.failed == 0
    assert engine.pool_stats().used_blocks == 0


def hog_blocks(engine: Engine, tokens: int) -> Sequence:
    """Blocks held outside any session (nothing can demote or preempt them)."""
    hog = Sequence(token_ids=list(range(tokens)))

    def take() -> None:
        engine.pool.prepare_write(hog, tokens)
        engine.pool.commit(hog, tokens)

    engine.call(take)
    return hog


def test_a_turn_that_cannot_fit_alone_waits_then_fails():
    engine = make_engine(num_blocks=16, block_wait_s=0.2)
    hog = hog_blocks(engine, 40)  # 10 of the 16 blocks
    chat = Chat("late", engine=engine, persist=False, max_new_tokens=20, ignore_eos=True)
    text = "Tell me a story about the quick brown fox"  # 38 tokens: 10 blocks
    with pytest.raises(OutOfBlocksError, match="came free"):
        chat.send(text)
    assert chat.messages == []
    # Blocks that come free while the turn waits are used.
    engine.config.block_wait_s = 30.0
    blocked = engine.scheduler.stats.blocked_turns

    def free_hog() -> None:
        assert engine.scheduler.wait_until(lambda: engine.scheduler.stats.blocked_turns > blocked, timeout=60)
        engine.call(lambda: engine.pool.release(hog))

    freer = threading.Thread(target=free_hog)
    freer.start()
    assert chat.send(text)
    freer.join()
    assert engine.scheduler.stats.blocked_turns == blocked + 1  # it did wait for the hog's blocks
    assert chat.last_stats.finish_reason == "length"
    chat.close()
    assert engine.pool_stats().used_blocks == 0


def test_a_full_queue_refuses_new_turns():
    # One turn runs at a time; a long one keeps the next two waiting to start.
    engine = make_engine(max_waiting=2, max_num_seqs=1)
    long = Chat("q-long", engine=engine, persist=False, max_new_tokens=400, ignore_eos=True)
    chats = [Chat(f"q-{i}", engine=engine, persist=False, max_new_tokens=4) for i in range(3)]
    running = long.stream("go on")
    assert next(running)
    streams = [chats[i].stream("hi") for i in range(2)]
    for s in streams:
        assert isinstance(next_nonblocking(s), Pending)
    assert engine.scheduler.num_waiting == 2
    with pytest.raises(QueueFullError, match="max_waiting"):
        next(chats[2].stream("hi"))
    running.close()  # the long turn is cancelled: the waiting ones start
    replies = ["".join(s) for s in streams]
    assert all(len(chats[i].messages) == 2 for i in range(2)) and all(replies)
    assert chats[2].messages == []
    assert chats[2].send("hi")  # the queue drained: accepted now
    long.close()
    assert engine.scheduler.stats.rejected == 1
    for chat in chats:
        chat.close()
    assert engine.pool_stats().used_blocks == 0


@pytest.fixture
def python_ctrl_c():
    """Python's own Ctrl-C handler for the test, the previous one put back
    after: ``_thread.interrupt_main`` does nothing where SIGINT is ignored,
    as in a suite started as a background job of a non-interactive shell,
    which inherits it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_in_the_consumer_thread_interrupts_the_turn(python_ctrl_c):
    engine = make_engine()
    chat = Chat("ctrlc", engine=engine, persist=False, max_new_tokens=400, ignore_eos=True)
    other = Chat("other", engine=engine, persist=False, max_new_tokens=4)
    got = []
    with pytest.raises(KeyboardInterrupt):
        for piece in chat.stream("go on and on"):
            got.append(piece)
            if len(got) == 3:
                _thread.interrupt_main()  # as Ctrl-C would, while the engine runs ahead
    assert chat.last_stats.finish_reason == "interrupted"
    assert chat.history[-1].partial
    assert chat.messages[-1]["content"].startswith("".join(got))
    assert other.send("still serving")
    chat.send("next")
    assert not chat.history[-1].partial
    chat.close()
    other.close()
    assert engine.pool_stats().used_blocks == 0


def test_one_turn_per_session_at_a_time():
    engine = make_engine()
    chat = Chat("busy", engine=engine, persist=False, max_new_tokens=4)
    first = chat.stream("one")
    next_nonblocking(first)
    from chatkv.errors import SessionBusyError

    with pytest.raises(SessionBusyError):
        chat.send("two")
    "".join(p for p in first if isinstance(p, str))
    assert len(chat.messages) == 2
    chat.close()


def test_closing_an_engine_saves_its_sessions_and_ends_its_loop_thread(chatkv_home):
    from chatkv.errors import EngineClosedError

    engine = make_engine()
    stored = Chat("kept", system="sys", engine=engine, max_new_tokens=6)
    stored.send("hello there")
    local = Chat("local", engine=engine, persist=False, max_new_tokens=6)
    local.send("hi")
    thread = engine.scheduler._thread
    assert thread is not None and thread.is_alive()
    engine.close()
    assert not thread.is_alive() and engine.scheduler.closed  # now, not after the idle timeout
    with pytest.raises(EngineClosedError):
        stored.send("and again")
    with pytest.raises(EngineClosedError):
        engine.pool_stats()
    stored.close()  # a handle closed after its engine: nothing left to do
    engine.close()  # idempotent
    again = Chat("kept", engine=make_engine(), max_new_tokens=6)  # saved and its lease released
    assert again.wait_restored().source == "disk"
    assert [m["role"] for m in again.messages] == ["system", "user", "assistant"]
    again.close()


def test_a_channel_is_drained_once_its_consumer_took_every_item():
    from chatkv.channel import EMPTY, Channel

    channel = Channel()
    assert channel.wait_drained(0.0)  # nothing put: drained
    channel.put("a")
    channel.put("b")
    assert not channel.wait_drained(0.0)
    taken = threading.Event()
    drained: list[bool] = []
    waiter = threading.Thread(target=lambda: (taken.set(), drained.append(channel.wait_drained(60.0))))
    waiter.start()
    taken.wait()
    assert channel.get(0.0) == "a" and channel.pop() == "b"  # the last take wakes the waiting producer
    waiter.join(60.0)
    assert drained == [True] and channel.get(0.0) is EMPTY


def test_the_loop_lets_a_turns_consumer_take_its_first_text_before_the_next_step(monkeypatch):
    """After the step that gives a turn its first text, the loop waits (at most
    FIRST_PIECE_WAIT_S) for the turn's consumer to take it, once per turn, and
    a consumer that does not read at once only costs that wait: the turn still ends."""
    from chatkv import channel as channel_module
    from chatkv import scheduler

    waits: list[float] = []
    real = channel_module.Channel.wait_drained

    def recording(self, timeout: float) -> bool:
        waits.append(timeout)
        return real(self, timeout)

    monkeypatch.setattr(channel_module.Channel, "wait_drained", recording)
    engine = make_engine()
    chat = Chat("handoff", engine=engine, persist=False, max_new_tokens=8, ignore_eos=True)
    chat.send("Hello there")
    chat.send("Tell me a story")
    assert len(waits) == 2 and all(0 <= w <= scheduler.FIRST_PIECE_WAIT_S for w in waits)
    finished = engine.scheduler.stats.finished
    stream = chat.stream("And then?")
    first = next(stream)  # the first piece, then nothing read until the turn is over
    assert engine.scheduler.wait_until(lambda: engine.scheduler.stats.finished == finished + 1, 60)
    rest = "".join(stream)
    assert first and len(chat.last_stats.token_ids) == 8 and chat.last_stats.text == first + rest
    chat.close()
    engine.close()


def test_an_idle_loop_keeps_its_thread_alone_and_gives_way_beside_another(monkeypatch: pytest.MonkeyPatch) -> None:
    # A turn on a new loop thread pays for a new OpenMP pool; two idle loops' pools crowd the cores.
    from chatkv import scheduler

    monkeypatch.setattr(scheduler, "IDLE_EXIT_S", 0.02)
    monkeypatch.setattr(scheduler, "_LOOPS", set())  # other tests' idle loops are not this test's
    a, b = make_engine(warmup=False), make_engine(warmup=False)
    try:
        a.call(lambda: None)
        loop = a.scheduler._thread
        assert loop is not None
        loop.join(timeout=0.5)  # 25 idle waits
        assert loop.is_alive() and a.call(threading.current_thread) is loop  # the same thread runs the next job
        b.call(lambda: None)  # another engine's loop runs: the idle one ends
        loop.join(timeout=60)
        assert not loop.is_alive()
        assert a.call(lambda: 7) == 7  # and a new one starts for the next job
    finally:
        a.close()
        b.close()


def test_a_lone_idle_loop_that_cannot_let_its_openmp_pool_go_ends_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    from chatkv import scheduler

    monkeypatch.setattr(scheduler, "IDLE_EXIT_S", 0.02)
    monkeypatch.setattr(scheduler, "_LOOPS", set())
    monkeypatch.setattr(scheduler, "release_openmp_pool", lambda: False)  # no OpenMP runtime call for it
    engine = make_engine(warmup=False)
    try:
        engine.call(lambda: None)
        loop = engine.scheduler._thread
        assert loop is not None
        loop.join(timeout=60)
        assert not loop.is_alive()
    finally:
        engine.close()


def test_counters_put_back_leave_the_thread_gauge_to_the_governor() -> None:
    engine = make_engine(warmup=False)
    try:
        saved = engine.call(engine.scheduler.counters)
        with Chat("counted", engine=engine, persist=False, max_new_tokens=3) as chat:
            chat.send("hello")
        stats = engine.scheduler.stats
        assert stats.finished == 1 and stats.steps > 0
        stats.threads, stats.thread_changes = 1, 1  # as the governor sets them for another process's load
        engine.call(lambda: engine.scheduler.restore_counters(saved))
        assert (stats.finished, stats.submitted, stats.steps) == (0, 0, 0)
        assert (stats.threads, stats.thread_changes) == (1, 1)  # they follow the machine, not the work
    finally:
        engine.close()
