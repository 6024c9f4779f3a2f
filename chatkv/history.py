"""The rules of editing a conversation's history, as pure functions.

Each takes the current messages and returns the history a turn or an edit
runs on (or raises :class:`~chatkv.errors.EditError` / ``InvalidMessageError``
without changing anything). The session layer applies the result, reusing
the KV of whatever prefix stays the same.
"""

from __future__ import annotations

from chatkv.errors import ContextWindowExceededError, EditError, InvalidMessageError
from chatkv.session import Message


def check_text(text: object, max_chars: int, what: str = "a message", allow_empty: bool = False) -> str:
    """``text`` if it is a valid message text, before any tokenizing or side effect.

    ``allow_empty`` accepts an empty text (an assistant reply that was only an
    end-of-sequence token is stored as "").

    Raises:
        InvalidMessageError: not a string, empty, or not encodable as UTF-8
            (a lone surrogate).
        ContextWindowExceededError: longer than ``max_chars`` characters, more
            than the context window can hold whatever it tokenizes to (checked
            by counting, so rejecting a huge text costs nothing).
    """
    if not isinstance(text, str) or not (allow_empty or text.strip()):
        raise InvalidMessageError(f"{what} must be a {'' if allow_empty else 'non-empty '}string")
    if len(text) > max_chars:
        raise ContextWindowExceededError(
            f"{what} of {len(text)} characters cannot fit the model's context window")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(f"{what} is not valid Unicode text ({exc.reason} at {exc.start})") from None
    return text


def for_regenerate(msgs: list[Message]) -> list[Message]:
    """The history a regenerated last reply answers: everything but that reply."""
    if len(msgs) < 2 or msgs[-1].role != "assistant" or msgs[-2].role != "user":
        raise EditError("there is no reply to regenerate")
    return msgs[:-1]


def for_edit(msgs: list[Message], index: int, user: Message) -> list[Message]:
    """The history after replacing the user message at ``index`` with ``user``
    and dropping what followed it."""
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(msgs) \
            or msgs[index].role != "user":
        raise EditError(f"message {index!r} is not a user message of this conversation")
    return msgs[:index] + [user]


def rewound(msgs: list[Message], turns: int) -> tuple[list[Message], list[Message]]:
    """``(kept, removed)``: the history without its last ``turns`` user turns."""
    starts = [i for i, m in enumerate(msgs) if m.role == "user"]
    if not isinstance(turns, int) or isinstance(turns, bool) or not 1 <= turns <= len(starts):
        raise EditError(f"cannot rewind {turns!r} turns: the conversation has {len(starts)}")
    cut = starts[-turns]
    return msgs[:cut], msgs[cut:]


def appended(msgs: list[Message], new: list[Message]) -> list[Message]:
    """The history with ``new`` appended; a system message may only come first."""
    out = msgs + new
    if any(m.role == "system" for m in out[1:]):
        raise InvalidMessageError("a system message may only be the first of the history")
    return out


def with_system(msgs: list[Message], system: str) -> list[Message] | None:
    """The history with ``system`` as its system prompt, or None if it already is."""
    if not isinstance(system, str):
        raise InvalidMessageError("the system prompt must be a string")
    out = list(msgs)
    if out and out[0].role == "system":
        if out[0].content == system:
            return None
        out[0] = Message("system", system)
    else:
        out.insert(0, Message("system", system))
    return out


def for_complete(msgs: list[Message]) -> list[Message]:
    """``msgs`` as the history a reply answers: it must end with a user message,
    and a system message may only come first."""
    if not msgs or msgs[-1].role != "user":
        raise InvalidMessageError("the messages to reply to must end with a user message")
    return appended([], msgs)
