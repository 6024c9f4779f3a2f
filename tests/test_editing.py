"""Editing a conversation: append, rewind, regenerate, edit.

Each must answer exactly as the stock transformers model re-prefilling the
resulting history, reuse the KV of the kept prefix (stats prove it), save the
new history, and survive a restart.
"""

from __future__ import annotations

import pytest

from chatkv import Chat, EngineConfig
from chatkv.engine import Engine
from chatkv.errors import EditError, InvalidMessageError, SessionBusyError
from chatkv.models import load_model
from chatkv.persistence import default_store
from chatkv.storage import SessionLockedError, Store

from conftest import stock_copy
from test_chat import stock_greedy

N = 8
SYSTEM = {"role": "system", "content": "You are terse."}
OLD = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six."},
    {"role": "user", "content": "And four plus four?"},
    {"role": "assistant", "content": "Eight."},
]


def make_engine() -> Engine:
    return Engine(load_model("tiny:llama"), EngineConfig(num_blocks=256, block_size=4))


@pytest.fixture
def setup():
    engine = make_engine()
    reference = stock_copy(engine.loaded.model)
    tok = engine.tokenizer

    def stock(messages):
        return stock_greedy(reference, tok, messages, N, tok.eos_token_id)

    return engine, stock


def open_chat(engine, sid="ed"):
    return Chat(sid, engine=engine, system=SYSTEM["content"], max_new_tokens=N, chunk_tokens=16)


def tokens(engine, messages, generate):
    return len(engine.encode_chat(messages, add_generation_prompt=generate))


def test_append_teacher_forces_history_then_answers_as_stock(setup):
    engine, stock = setup
    chat = open_chat(engine)
    stats = chat.append(OLD)
    assert chat.messages == [SYSTEM, *OLD]
    assert stats.finish_reason == "prefilled" and stats.generated_tokens == 0
    assert stats.prompt_tokens == tokens(engine, [SYSTEM, *OLD], False)
    assert stats.prefilled_tokens == stats.prompt_tokens and stats.reused_tokens == 0
    assert [(m.role, m.content) for m in default_store().messages("ed")] == \
        [(m["role"], m["content"]) for m in [SYSTEM, *OLD]]
    question = {"role": "user", "content": "And five plus five?"}
    want = stock([SYSTEM, *OLD, question])
    chat.send(question["content"])
    assert chat.last_stats.token_ids == want
    assert chat.last_stats.reused_tokens == stats.prompt_tokens  # every appended token's KV was reused
    # An appended batch on top of an existing history reuses that history too.
    more = chat.append([{"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "Welcome."}])
    assert more.reused_tokens >= stats.prompt_tokens
    chat.close()


def test_append_rejects_bad_messages_and_changes_nothing(setup):
    engine, _ = setup
    chat = open_chat(engine)
    chat.append(OLD[:2])
    for bad in ([{"role": "wizard", "content": "x"}], [{"role": "user"}], ["hello"],
                [{"role": "system", "content": "late system prompt"}]):
        with pytest.raises(InvalidMessageError):
            chat.append(bad)
    assert chat.messages == [SYSTEM, *OLD[:2]]
    chat.close()


def test_rewind_drops_turns_and_reuses_the_kept_prefix(setup):
    engine, stock = setup
    chat = open_chat(engine)
    chat.append(OLD)
    cached = chat.num_cached_tokens
    removed = chat.rewind(2)
    assert removed == OLD[2:]
    kept = [SYSTEM, *OLD[:2]]
    assert chat.num_cached_tokens <= tokens(engine, kept, False) < cached  # no KV past the kept history
    assert chat.messages == kept
    assert [m.content for m in default_store().messages("ed")] == [m["content"] for m in kept]
    question = {"role": "user", "content": "What about seven?"}
    want = stock([*kept, question])
    chat.send(question["content"])
    assert chat.last_stats.token_ids == want
    assert chat.last_stats.reused_tokens >= tokens(engine, kept, False)
    assert chat.last_stats.discarded_tokens == 0  # the rewound turns' KV was let go at the rewind
    with pytest.raises(EditError):
        chat.rewind(5)
    with pytest.raises(EditError):
        chat.rewind(0)
    assert len(chat.messages) == 5
    chat.close()


def test_regenerate_replaces_the_last_reply(setup):
    engine, stock = setup
    chat = open_chat(engine)
    chat.append(OLD)
    base = [SYSTEM, *OLD[:-1]]
    want = stock(base)
    reply = chat.regenerate()
    assert chat.last_stats.token_ids == want
    assert chat.messages[:-1] == base and chat.messages[-1]["content"] == reply
    prompt = tokens(engine, base, True)
    assert chat.last_stats.prompt_tokens == prompt
    assert chat.last_stats.reused_tokens == prompt - 1  # all but the token that starts generation
    assert len(default_store().messages("ed")) == len(base) + 1
    # Streaming, with other sampling, replaces it again.
    again = "".join(chat.stream_regenerate(temperature=0.8, seed=3))
    assert chat.messages[-1]["content"] == again and len(chat.messages) == len(base) + 1
    chat.close()


def test_edit_replaces_a_user_message_and_drops_what_followed(setup):
    engine, stock = setup
    chat = open_chat(engine)
    chat.append(OLD)
    index = 3  # "And three plus three?"
    assert chat.messages[index] == OLD[2]
    edited = {"role": "user", "content": "And nine plus nine?"}
    base = [SYSTEM, *OLD[:2], edited]
    want = stock(base)
    reply = chat.edit(index, edited["content"])
    assert chat.last_stats.token_ids == want
    assert chat.messages == [*base, {"role": "assistant", "content": reply}]
    assert chat.last_stats.reused_tokens >= tokens(engine, base[:-1], False)
    assert chat.last_stats.not_reused and "diverged" in chat.last_stats.not_reused
    assert [m.content for m in default_store().messages("ed")] == [m["content"] for m in chat.messages]
    for bad in (0, 2, 99, -1):  # the system prompt, an assistant reply, out of range
        with pytest.raises(EditError):
            chat.edit(bad, "nope")
    assert chat.messages == [*base, {"role": "assistant", "content": reply}]
    chat.close()


def test_edits_survive_a_restart(setup):
    engine, stock = setup
    chat = open_chat(engine)
    chat.append(OLD)
    chat.rewind(1)
    chat.edit(3, "And ten plus ten?")
    chat.regenerate(temperature=0.9, seed=5)  # a sampled reply replaces the greedy one
    history = chat.messages
    cached = chat.num_cached_tokens
    chat.close()

    again = open_chat(make_engine())  # a new engine: nothing in memory
    info = again.wait_restored()
    assert info.source == "disk" and info.cached_tokens == cached
    assert again.messages == history
    question = {"role": "user", "content": "Sure?"}
    want = stock([*history, question])
    again.send(question["content"])
    assert again.last_stats.token_ids == want
    assert again.last_stats.kv_source == "device"  # restored at open, before the turn
    assert again.last_stats.reused_tokens >= tokens(engine, history[:-1], False)
    # Regenerating after the restart replaces the reply just given, reusing the restored history.
    again.regenerate()
    assert again.last_stats.token_ids == want
    assert again.messages[:-1] == [*history, question]
    assert again.last_stats.reused_tokens == tokens(engine, [*history, question], True) - 1
    again.close()
    third = open_chat(make_engine())
    third.wait_restored()
    assert third.messages == again.messages
    third.close()


def test_two_handles_share_one_session_and_the_lease():
    engine = make_engine()
    a = open_chat(engine, "shared")
    b = Chat("shared", engine=engine, max_new_tokens=N, chunk_tokens=16)
    a.send("hello")
    assert b.messages == a.messages  # one state, not two
    store = default_store()
    a.close()
    with Store() as other:  # another process: b still holds the lease
        assert other.lease_holder("shared") == store.owner
        with pytest.raises(SessionLockedError):
            other.acquire_lease("shared")
        b.send("still here")
        assert len(store.messages("shared")) == 5
        with pytest.raises(SessionBusyError):
            a.send("closed handle")
        b.close()
        assert other.lease_holder("shared") is None  # the last handle let it go
    # Another engine in this process may not open it while it is open here.
    c = open_chat(engine, "pinned-here")
    with pytest.raises(SessionBusyError, match="another engine"):
        Chat("pinned-here", engine=make_engine())
    c.close()


def test_complete_replies_to_a_whole_conversation_reusing_what_matches(setup):
    engine, stock = setup
    chat = open_chat(engine)
    chat.append(OLD[:4])
    # The client sends the whole conversation, its last answer changed: the shared
    # prefix's KV is reused, the rest re-prefilled, the stored history rewritten.
    sent = [SYSTEM, *OLD[:2], OLD[2], {"role": "assistant", "content": "Six, surely."},
            {"role": "user", "content": "Why?"}]
    want = stock(sent)
    reply = chat.complete(sent)
    assert chat.last_stats.token_ids == want
    assert chat.messages == [*sent, {"role": "assistant", "content": reply}]
    assert chat.last_stats.reused_tokens >= tokens(engine, sent[:4], False) - 1
    assert [m.content for m in default_store().messages("ed")] == [m["content"] for m in chat.messages]
    # A reply that was only an end-of-sequence token is stored as "": such a history is valid.
    assert chat.complete([SYSTEM, OLD[0], {"role": "assistant", "content": ""}, OLD[2]]) is not None
    chat.complete(sent)
    for bad in ([], [OLD[1]], [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
                [{"role": "user", "content": ""}]):
        with pytest.raises(InvalidMessageError):
            chat.complete(bad)
    assert len(chat.messages) == len(sent) + 1
    chat.close()
