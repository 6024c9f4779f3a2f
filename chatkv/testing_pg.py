"""A private, throw-away PostgreSQL cluster for tests, benchmarks and multi-process checks.

:class:`PgCluster` runs the server binaries that ``pg_config --bindir`` names
(Debian's ``postgresql`` package): ``initdb`` into a fresh temporary
directory, then ``pg_ctl start`` listening on 127.0.0.1 at a free port (and
on a Unix socket in that directory), trust authentication for one superuser,
and durability switched off (``fsync``, ``synchronous_commit``): the cluster
lives for one test session and is removed by :meth:`PgCluster.stop`.

``initdb`` refuses to run as root, so under root the binaries run as the
``postgres`` user (else ``nobody``) through ``runuser``, in a directory that
user owns. Nothing here
imports torch or SQLAlchemy; the driver (``psycopg``, the ``postgres``
extra) is needed only by :meth:`PgCluster.create_database` and friends.

Command line (for a benchmark or a manual check)::

    python -m chatkv.testing_pg         # start one, print its URL, stop it on Ctrl-C
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

#: The cluster's superuser (trust authentication: no password).
SUPERUSER = "chatkv"
#: Set to "1" (or run under ``CI``) to make a missing PostgreSQL an error instead of a skip.
REQUIRE_ENV = "CHATKV_REQUIRE_PG"


class PgUnavailable(RuntimeError):
    """The PostgreSQL server binaries (or the ``psycopg`` driver) are not installed here."""


def required(variable: str) -> bool:
    """True when a piece the tests can skip without (a server, a native
    library) must be there instead, a missing one failing them: the
    environment variable ``variable`` set (not ``0``), or ``CI`` set."""
    if os.environ.get(variable, "") not in ("", "0"):
        return True
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def pg_required() -> bool:
    """True when a missing PostgreSQL must fail the tests: ``CHATKV_REQUIRE_PG=1`` or ``CI`` set."""
    return required(REQUIRE_ENV)


def find_bindir() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl``.

    ``$CHATKV_PG_BINDIR`` if set, else what ``pg_config --bindir`` prints,
    else the newest ``/usr/lib/postgresql/<version>/bin``.

    Raises:
        PgUnavailable: none of them holds ``initdb`` and ``pg_ctl``.
    """
    candidates: list[Path] = []
    env = os.environ.get("CHATKV_PG_BINDIR")
    if env:
        candidates.append(Path(env))
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=30)
            candidates.append(Path(out.stdout.strip()))
        except (OSError, subprocess.SubprocessError):
            pass

    def _version(p: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in p.parent.name.split(".") if x.isdigit())

    candidates.extend(sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version, reverse=True))
    for d in candidates:
        if (d / "initdb").is_file() and (d / "pg_ctl").is_file():
            return d
    raise PgUnavailable("the PostgreSQL server binaries (initdb, pg_ctl) are not installed "
                        "(Debian: apt-get install postgresql; or set CHATKV_PG_BINDIR)")


def _unprivileged_user() -> str:
    """Who runs the server binaries under root (``initdb`` refuses root): ``postgres``, else ``nobody``."""
    import pwd

    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise PgUnavailable("running as root, and there is neither a postgres nor a nobody user to run initdb as")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgCluster:
    """One private PostgreSQL cluster: :meth:`start`, :meth:`url`, :meth:`restart`, :meth:`stop`.

    Args:
        base_dir: where its data directory, socket and log go; default a new
            temporary directory (removed by :meth:`stop`).
        port: TCP port on 127.0.0.1; default a free one.
        max_connections: the server's connection limit (each Store keeps a pool).

    Usable as a context manager (started on entry, stopped and removed on exit).
    """

    def __init__(self, base_dir: str | os.PathLike[str] | None = None, *, port: int | None = None,
                 max_connections: int = 300) -> None:
        self.bindir = find_bindir()
        self._own_dir = base_dir is None
        self.base = Path(base_dir) if base_dir is not None else Path(tempfile.mkdtemp(prefix="chatkv-pg-"))
        self.data = self.base / "data"
        self.socket_dir = self.base / "sock"
        self.log = self.base / "server.log"
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.max_connections = max_connections
        self._user = _unprivileged_user() if os.geteuid() == 0 else None
        self.running = False

    # ------------------------------------------------------------------ running the binaries

    def _cmd(self, *args: str) -> list[str]:
        if self._user is None:
            return list(args)
        runuser = shutil.which("runuser")
        if runuser:
            return [runuser, "-u", self._user, "--", *args]
        return ["su", self._user, "-s", "/bin/sh", "-c", " ".join(_quote(a) for a in args)]

    def _run(self, *args: str, timeout: float = 120.0) -> str:
        proc = subprocess.run(self._cmd(*args), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}{tail}")
        return proc.stdout

    def start(self) -> "PgCluster":
        """``initdb`` (first time only) and start the server; returns self.

        Raises:
            PgUnavailable: no server binaries. RuntimeError: initdb or the start failed.
        """
        if self.running:
            return self
        self.base.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        if self._user is not None:
            import pwd

            pw = pwd.getpwnam(self._user)
            for p in (self.base, self.socket_dir):
                os.chown(p, pw.pw_uid, pw.pw_gid)
            os.chmod(self.base, 0o755)
        if not (self.data / "PG_VERSION").exists():
            self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", SUPERUSER, "--auth=trust",
                      "-E", "UTF8", "--locale=C", "--no-sync")
            with open(self._conf_path(), "a") as f:
                f.write(
                    "\n# chatkv.testing_pg: a throw-away cluster\n"
                    f"listen_addresses = '{self.host}'\n"
                    f"port = {self.port}\n"
                    f"unix_socket_directories = '{self.socket_dir}'\n"
                    f"max_connections = {self.max_connections}\n"
                    "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
                    "shared_buffers = 32MB\n"
                )
        self._pg_ctl("start")
        self.running = True
        return self

    def _conf_path(self) -> Path:
        return self.data / "postgresql.conf"

    def _pg_ctl(self, action: str) -> None:
        args = [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60"]
        if action in ("stop", "restart"):
            args += ["-m", "fast"]
        if action in ("start", "restart"):
            args += ["-l", str(self.log)]
        self._run(*args, action)

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every open connection is cut; the data stays."""
        self._pg_ctl("restart")
        self.running = True

    def stop(self, *, remove: bool = True) -> None:
        """Stop the server (fast shutdown) and, with ``remove``, delete its directory. Idempotent."""
        if self.running:
            try:
                self._pg_ctl("stop")
            finally:
                self.running = False
        if remove and self._own_dir:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "PgCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ databases

    def url(self, database: str = "postgres", *, driver: str = "psycopg", schema: str | None = None) -> str:
        """An SQLAlchemy URL for ``database`` (``postgresql+psycopg://chatkv@127.0.0.1:port/db``).

        With ``schema``, every connection's ``search_path`` is that schema, so
        tables are created there (a private index inside a shared database).
        """
        u = f"postgresql+{driver}://{SUPERUSER}@{self.host}:{self.port}/{database}"
        if schema is not None:
            u += f"?options=-csearch_path%3D{schema}"
        return u

    def conninfo(self, database: str = "postgres") -> str:
        """A libpq connection string for ``database`` (what ``psycopg.connect`` takes)."""
        return f"host={self.host} port={self.port} user={SUPERUSER} dbname={database}"

    def execute(self, *statements: str, database: str = "postgres") -> None:
        """Run ``statements`` in autocommit mode (CREATE DATABASE cannot run in a transaction).

        Raises:
            PgUnavailable: the ``psycopg`` driver is not installed.
        """
        try:
            import psycopg
        except ImportError as e:
            raise PgUnavailable("the psycopg driver is not installed: pip install 'chatkv[postgres]'") from e
        with psycopg.connect(self.conninfo(database), autocommit=True) as conn:
            for sql in statements:
                conn.execute(sql)

    def create_database(self, name: str) -> str:
        """Create (or re-create, empty) database ``name``; return its SQLAlchemy URL."""
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}" TEMPLATE template0')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name``, cutting its connections. Idempotent."""
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def create_schema(self, name: str, database: str = "postgres") -> str:
        """Create (or re-create, empty) schema ``name`` in ``database``; return a URL whose tables live there."""
        self.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE', f'CREATE SCHEMA "{name}"', database=database)
        return self.url(database, schema=name)

    def drop_schema(self, name: str, database: str = "postgres") -> None:
        """Drop schema ``name`` and everything in it. Idempotent."""
        self.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE', database=database)


_names = itertools.count(1)


def unique_db_name(label: str) -> str:
    """A database name unique in this process (and readable: it carries ``label``, e.g. a test's name)."""
    slug = re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")
    return f"t{os.getpid()}_{next(_names)}_{slug}"[:63]


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def main() -> None:
    """Start a cluster, print its URL, and keep it until Ctrl-C (then stop and remove it)."""
    with PgCluster() as pg:
        print(pg.url(), flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
