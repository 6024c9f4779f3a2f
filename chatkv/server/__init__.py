"""``chatkv serve``: an OpenAI-compatible HTTP server whose conversations persist.

>>> from chatkv.engine import get_engine
>>> from chatkv.persistence import default_store
>>> from chatkv.server import create_app, ServerConfig
>>> app = create_app(get_engine("default"), default_store(), ServerConfig())   # any ASGI server runs it

Parts: :mod:`.app` (routes, streaming, the ASGI guard for keys and body size),
:mod:`.schemas` (strict request validation), :mod:`.sessions` (which session a
request continues; the open sessions), :mod:`.prefix_index` (message-prefix
hashes in a SQLite side file), :mod:`.driver` (turns stepped from asyncio),
:mod:`.metrics` (Prometheus), :mod:`.auth` (keys and tenants),
:mod:`.errors` (OpenAI's error shape). Needs the ``serve`` extra
(``pip install 'chatkv[serve]'``: FastAPI, uvicorn, prometheus_client).
"""

from __future__ import annotations

from chatkv.server.app import ServerConfig, create_app
from chatkv.server.auth import KeyRing, Tenant

__all__ = ["KeyRing", "ServerConfig", "Tenant", "create_app"]
