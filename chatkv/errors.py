"""Exceptions raised by chatkv. Every one derives from :class:`ChatKVError`."""

from __future__ import annotations


class ChatKVError(Exception):
    """Base class of every error chatkv raises on purpose."""


class InvalidMessageError(ChatKVError, ValueError):
    """A message is empty, not a string, or otherwise unusable. Nothing was changed."""


class InvalidSessionIdError(ChatKVError, ValueError):
    """A session id is too long, empty, starts with ``.``, or has characters
    outside ``[A-Za-z0-9._-]``."""


class ContextWindowExceededError(ChatKVError, ValueError):
    """The conversation plus the new message does not fit the model's context window.

    The session is left as it was before the call.
    """


class OutOfBlocksError(ChatKVError, MemoryError):
    """The block pool cannot hold the tokens a request needs, even after evicting
    every unreferenced cached block. The request was not started; nothing leaked."""


class ModelNotFoundError(ChatKVError, FileNotFoundError):
    """A model spec names nothing loadable (a missing path, or the default model's
    wheel is not installed)."""


class ConfigError(ChatKVError, ValueError):
    """A configuration value or key is not valid."""


class SessionBusyError(ChatKVError, RuntimeError):
    """The session already has a turn in flight (or is closed)."""


class ChatKVWarning(UserWarning):
    """Something was recovered from without losing the conversation: a cache made
    by another model, a corrupt chunk, a save that failed (full disk)."""


class QueueFullError(ChatKVError, RuntimeError):
    """The engine already has ``EngineConfig.max_waiting`` turns waiting to start;
    this one was refused before it began (the session is unchanged). Retry later."""


class EditError(ChatKVError, ValueError):
    """A history edit that does not apply: no turn to rewind or regenerate, an
    index that is not a user message."""


class EngineClosedError(ChatKVError, RuntimeError):
    """The engine was closed (:meth:`chatkv.engine.Engine.close`): it runs no
    more turns or jobs. Open the session on another engine."""
