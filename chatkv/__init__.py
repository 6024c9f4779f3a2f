"""chatkv: multi-turn chat whose paged KV cache persists across turns, processes and restarts.

>>> from chatkv import Chat
>>> chat = Chat("user-42", system="You are a terse assistant.")
>>> chat.send("What is a KV cache?")

Heavy modules (torch, transformers) load on first use of a name, so importing
``chatkv`` itself is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "Chat": "chatkv.chat",
    "TurnStats": "chatkv.stats",
    "Message": "chatkv.chat",
    "validate_session_id": "chatkv.chat",
    "Engine": "chatkv.engine",
    "get_engine": "chatkv.engine",
    "EngineConfig": "chatkv.config",
    "SamplingParams": "chatkv.config",
    "LoadedModel": "chatkv.models",
    "TierConfig": "chatkv.config",
    "Tier": "chatkv.tiers",
    "RestoreInfo": "chatkv.stats",
    "load_model": "chatkv.models",
}

__all__ = sorted(_LAZY) + ["__version__"]

if TYPE_CHECKING:
    from chatkv.chat import Chat, Message, validate_session_id
    from chatkv.stats import TurnStats
    from chatkv.config import EngineConfig, SamplingParams
    from chatkv.engine import Engine, get_engine
    from chatkv.models import LoadedModel, load_model
    from chatkv.config import TierConfig
    from chatkv.stats import RestoreInfo
    from chatkv.tiers import Tier


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'chatkv' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
