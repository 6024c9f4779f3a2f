"""Exit codes of the ``chatkv`` command, and the translation of library errors into them.

=====  =========================================================================
code   meaning
=====  =========================================================================
0      success
1      any other error (storage failure, model failure, ...)
2      usage error: a bad option, argument or session id (click's own code)
3      not found: an unknown session id or model
4      bad file: a corrupt or unreadable bundle, archive or model file
5      conflict: the session is in use by another process, or already exists
130    interrupted (Ctrl-C outside the REPL's generation)
=====  =========================================================================
"""

from __future__ import annotations

from enum import IntEnum

import click


class ExitCode(IntEnum):
    """Process exit codes; see the module docstring."""

    OK = 0
    ERROR = 1
    USAGE = 2
    NOT_FOUND = 3
    BAD_FILE = 4
    CONFLICT = 5
    INTERRUPTED = 130


class CliError(click.ClickException):
    """A user-facing error with a specific exit code; click prints ``Error: <message>``."""

    def __init__(self, message: str, code: ExitCode = ExitCode.ERROR) -> None:
        super().__init__(message)
        self.exit_code = int(code)  # type: ignore[misc]  # click declares a class-level default


def exit_code_for(exc: BaseException) -> ExitCode | None:
    """The exit code for a library exception, or None if it is not one chatkv expects.

    Imports the exception classes lazily, so ``chatkv --help`` stays cheap.
    """
    from chatkv import errors as core
    from chatkv.storage import errors as st

    table: list[tuple[tuple[type[BaseException], ...], ExitCode]] = [
        ((st.InvalidSessionIdError, core.InvalidSessionIdError, core.ConfigError), ExitCode.USAGE),
        ((st.SessionNotFoundError, core.ModelNotFoundError), ExitCode.NOT_FOUND),
        ((st.BundleError, st.CorruptChunkError), ExitCode.BAD_FILE),
        ((st.SessionLockedError, st.SessionExistsError, core.SessionBusyError), ExitCode.CONFLICT),
        ((st.StorageError, core.ChatKVError), ExitCode.ERROR),
    ]
    for classes, code in table:
        if isinstance(exc, classes):
            return code
    return None


def translate(exc: BaseException) -> CliError | None:
    """A :class:`CliError` carrying ``exc``'s message and exit code, or None for unexpected errors."""
    code = exit_code_for(exc)
    if code is None:
        return None
    return CliError(str(exc), code)
