"""The ``chatkv`` command line: ``chatkv repl``, ``chatkv sessions …``, ``chatkv models …``.

Each command parses its options, calls the library and prints. Library errors
become exit codes in one place (:class:`ChatKVGroup`); see :mod:`chatkv.cli.errors`.
"""

from __future__ import annotations

import click

from .errors import ExitCode, translate
from .models import models
from .repl import repl
from .serve import serve
from .sessions import sessions

EPILOG = """\b
Environment:
  CHATKV_HOME          data directory (sessions, KV chunks, REPL history);
                       default: the platform's user data dir
  CHATKV_DB_URL        SQLAlchemy URL of the index; default sqlite:///$CHATKV_HOME/index.db
  CHATKV_MODEL_CACHE   converted models; default $CHATKV_HOME/models
  CHATKV_API_KEY       `chatkv serve --api-key`: the key every request needs
  CHATKV_API_KEY_FILE  `chatkv serve --api-key-file`: tenants, one 'NAME KEY' a line

\b
Exit codes: 0 ok, 1 error, 2 usage (bad option or session id), 3 unknown
session or model, 4 corrupt or unreadable file, 5 session in use or already
exists, 130 interrupted."""


class ChatKVGroup(click.Group):
    """A click group that turns chatkv's exceptions into messages and exit codes."""

    def invoke(self, ctx: click.Context) -> object:
        """Run the subcommand; expected library errors become :class:`~chatkv.cli.errors.CliError`."""
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            raise click.exceptions.Exit(int(ExitCode.INTERRUPTED)) from None
        except Exception as exc:
            err = translate(exc)
            if err is None:
                raise
            raise err from exc


@click.group(cls=ChatKVGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="chatkv")
def main() -> None:
    """chatkv: multi-turn chat whose KV cache persists across turns, processes and restarts."""


main.add_command(repl)
main.add_command(serve)
main.add_command(sessions)
main.add_command(models)


if __name__ == "__main__":
    main()
