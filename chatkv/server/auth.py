"""API keys and tenants.

Three modes:

* no key: every request is served (bind to loopback only; ``chatkv serve``
  warns otherwise);
* one key (``--api-key`` or ``CHATKV_API_KEY``): every endpoint but ``/health``
  needs ``Authorization: Bearer <key>``; session ids are used as given, so
  ``chatkv sessions ls`` and ``Chat("id")`` see the same sessions;
* a key file (``--api-key-file``): one tenant per line, ``NAME KEY``. Each
  tenant's session ids are stored as ``NAME.<id>``, and a tenant only ever
  sees, continues, lists, deletes or prefix-matches its own.

Keys are compared in constant time, each against every configured key.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from chatkv.errors import ConfigError
from chatkv.server.errors import APIError
from chatkv.storage import MAX_SESSION_ID_LEN, validate_session_id

_TENANT_NAME = re.compile(r"^[A-Za-z0-9-]{1,32}$")
#: Separates a tenant's name from its own session id in a stored id (never in a tenant name).
SEP = "."


@dataclass(frozen=True)
class Tenant:
    """Who a request is from, and how its session ids are stored.

    Attributes:
        name: the tenant's name ("" without a key file).
        namespaced: store ids as ``name.<id>`` (key-file mode).
    """

    name: str = ""
    namespaced: bool = False

    def internal_id(self, client_id: object) -> str:
        """The stored id of the client's session id ``client_id``.

        Raises:
            APIError: 400 if it is not a valid session id (1-128 characters of
                ``[A-Za-z0-9._-]`` not starting with ``.``, less the tenant prefix).
        """
        from chatkv.storage import InvalidSessionIdError

        try:
            sid = validate_session_id(client_id)
            if not self.namespaced:
                return sid
            if len(sid) + len(self.name) + 1 > MAX_SESSION_ID_LEN:
                raise InvalidSessionIdError(
                    f"session id {sid!r} is too long: at most {MAX_SESSION_ID_LEN - len(self.name) - 1} characters")
            return validate_session_id(f"{self.name}{SEP}{sid}")
        except InvalidSessionIdError as exc:
            raise APIError(400, str(exc), code="invalid_session_id", param="session_id") from None

    def client_id(self, internal_id: str) -> str | None:
        """The client's view of a stored id, or None if it is not this tenant's."""
        if not self.namespaced:
            return internal_id
        prefix = self.name + SEP
        return internal_id[len(prefix):] if internal_id.startswith(prefix) else None


class KeyRing:
    """The configured API keys and the tenant each one stands for."""

    def __init__(self, api_key: str | None = None, key_file: str | Path | None = None) -> None:
        """Keys from ``api_key`` and/or ``key_file`` (``NAME KEY`` per line, ``#``
        comments); with a key file, ``api_key`` (if given) is the tenant ``default``.

        Raises:
            ConfigError: a malformed key file, a bad tenant name, or a name or key given twice.
        """
        self._keys: list[tuple[bytes, Tenant]] = []
        if key_file is None:
            if api_key:
                self._keys.append((api_key.encode(), Tenant()))
            return
        entries: list[tuple[str, str]] = []
        path = Path(key_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file {str(path)!r}: {exc.strerror}") from None
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigError(f"{path}:{n}: expected 'TENANT KEY', got {len(parts)} fields")
            entries.append((parts[0], parts[1]))
        if api_key:
            entries.append(("default", api_key))
        if not entries:
            raise ConfigError(f"the API key file {str(path)!r} has no keys")
        names: set[str] = set()
        keys: set[str] = set()
        for name, key in entries:
            if not _TENANT_NAME.match(name):
                raise ConfigError(f"tenant name {name!r}: use 1-32 characters of [A-Za-z0-9-]")
            if name in names or key in keys:
                raise ConfigError(f"tenant {name!r}: every tenant needs its own name and key")
            names.add(name)
            keys.add(key)
            self._keys.append((key.encode(), Tenant(name, namespaced=True)))

    @property
    def enabled(self) -> bool:
        """True if requests need a key."""
        return bool(self._keys)

    @property
    def tenants(self) -> list[Tenant]:
        """Every configured tenant (one unnamed one without keys)."""
        return [t for _, t in self._keys] or [Tenant()]

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant whose key ``authorization`` (``Bearer <key>``) carries.

        Raises:
            APIError: 401 for a missing, malformed or unknown key.
        """
        if not self._keys:
            return Tenant()
        headers = {"WWW-Authenticate": "Bearer"}
        if not authorization:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                           headers=headers)
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "malformed Authorization header: use 'Bearer <key>'", code="invalid_api_key",
                           headers=headers)
        given = token.strip().encode()
        found: Tenant | None = None
        for key, tenant in self._keys:  # compare with every key: the time does not say which matched
            if hmac.compare_digest(given, key):
                found = tenant
        if found is None:
            raise APIError(401, "incorrect API key", code="invalid_api_key", headers=headers)
        return found
