"""``chatkv repl``: chat in the terminal, streaming replies, with slash commands.

Input: one line is one message. A line ending in ``\\`` continues on the next
line; a line holding only ``\"\"\"`` opens a block that the next such line
closes (the lines between are one message). A message that really starts with
``/`` is typed as ``//...``.

Ctrl-C while a reply streams stops it (the partial reply is kept, marked
interrupted); a second Ctrl-C aborts the step in progress. Ctrl-C at the
prompt clears the line. Ctrl-D (or ``/exit``) saves the session and exits.

On a terminal, input goes through prompt_toolkit (line editing, history in
``$CHATKV_HOME/repl_history``); otherwise (pipes, ``--plain``) lines are read
from stdin as they come, with no prompt when stdin is not a terminal.
"""

from __future__ import annotations

import math
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .errors import CliError, ExitCode, exit_code_for
from .options import compile_option, disk_format_option, dtype_option, kv_quant_option, model_option
from .output import ago, human_bytes, note, print_table, printable
from .store import open_store

if TYPE_CHECKING:
    from chatkv import Chat
    from chatkv.storage import Store

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK_FENCE = '"""'
HISTORY_FILE = "repl_history"

#: Reads one line, given a prompt. Raises EOFError (Ctrl-D) or KeyboardInterrupt (Ctrl-C).
LineReader = Callable[[str], str]


def fresh_session_id() -> str:
    """A new readable session id: ``chat-YYYYMMDD-HHMMSS-xxxx``."""
    return f"chat-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


# ---------------------------------------------------------------------------- input


def plain_reader(show_prompt: bool) -> LineReader:
    """Read lines from stdin with no line editing (pipes, pexpect, ``--plain``)."""

    def read(prompt: str) -> str:
        if show_prompt:
            sys.stdout.write(prompt)
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    return read


def prompt_toolkit_reader(history_path: Path) -> LineReader:
    """Read lines through prompt_toolkit: editing, persistent history, Ctrl-R search."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory

    history_path.parent.mkdir(parents=True, exist_ok=True)
    session: PromptSession[str] = PromptSession(history=FileHistory(str(history_path)))

    def read(prompt: str) -> str:
        return session.prompt(prompt)

    return read


def make_reader(home: Path, plain: bool) -> LineReader:
    """prompt_toolkit on an interactive terminal, plain line reading otherwise."""
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if interactive and not plain:
        return prompt_toolkit_reader(home / HISTORY_FILE)
    # Bytes that are not UTF-8 (a binary file piped in) become U+FFFD instead of a crash.
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="replace")
    return plain_reader(show_prompt=sys.stdin.isatty())


def read_message(read: LineReader) -> str:
    """Read one (possibly multi-line) message: ``\\`` continuations or a ``\"\"\"`` block.

    Raises:
        EOFError: end of input before a message began (an unterminated block
            ends at end of input instead).
        KeyboardInterrupt: Ctrl-C; the partial message is dropped.
    """
    line = read(PROMPT)
    if line.strip() == BLOCK_FENCE:
        lines: list[str] = []
        while True:
            try:
                nxt = read(CONTINUATION)
            except EOFError:
                break
            if nxt.strip() == BLOCK_FENCE:
                break
            lines.append(nxt)
        return "\n".join(lines)
    parts: list[str] = []
    while line.endswith("\\"):
        parts.append(line[:-1])
        try:
            line = read(CONTINUATION)
        except EOFError:
            line = ""
            break
    parts.append(line)
    return "\n".join(parts)


# ---------------------------------------------------------------------------- Ctrl-C


class StopFlag:
    """Set by the first Ctrl-C during a reply; a second Ctrl-C raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    def handler(self, signum: int, frame: Any) -> None:
        """The SIGINT handler installed while a reply streams."""
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()


@contextmanager
def graceful_sigint() -> Iterator[StopFlag]:
    """Install :class:`StopFlag`'s handler for the block (main thread only), restoring the old one."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, flag.handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------------------- summaries


def kv_origin(chat: "Chat") -> str:
    """Where the session's KV came from when it was opened, and how long that took."""
    chat.wait_restored()
    r = chat.restore
    return {
        "new": "new session",
        "memory": "KV already in memory",
        "disk": f"KV loaded from disk in {r.seconds * 1000:.0f} ms",
        "history": "KV not reusable: re-prefilled from the history on the next turn",
    }.get(r.source, f"KV from {r.source}")


def restore_summary(chat: "Chat") -> str:
    """One line on how the session came back: turns, tokens, where its KV came from, how long."""
    chat.wait_restored()
    r = chat.restore
    if r.source == "new":
        line = f"new session {chat.session_id}"
    else:
        line = f"resumed {chat.session_id}: {r.turns} turns, {r.cached_tokens} cached tokens; {kv_origin(chat)}"
    if r.warning:
        line += f" (warning: {r.warning})"
    return line


def turn_summary(chat: "Chat") -> str | None:
    """The short line printed after each reply: reused/prefilled tokens, first-token time, speed."""
    s = chat.last_stats
    if s is None:
        return None
    parts = [f"reused {s.reused_tokens}, prefilled {s.prefilled_tokens} tokens"]
    if s.ttft_s is not None:
        parts.append(f"first token {s.ttft_s * 1000:.0f} ms")
    if s.decode_tokens_per_s:
        parts.append(f"{s.decode_tokens_per_s:.1f} tok/s")
    line = "[" + " · ".join(parts) + "]"
    if s.not_reused:
        line += f"\n(KV not reused: {s.not_reused})"
    if s.trimmed_messages:
        line += f"\n({s.trimmed_messages} earlier messages left the context window; the history keeps them)"
    if s.persist_error:
        line += f"\nwarning: this turn was not saved ({s.persist_error}); the conversation goes on in memory"
    return line


def stats_lines(chat: "Chat", store: "Store") -> list[str]:
    """The ``/stats`` report: the last turn, then the session's tokens and bytes per tier."""
    lines: list[str] = []
    s = chat.last_stats
    if s is None:
        lines.append("last turn: none yet")
    else:
        lines.append(
            f"last turn: {s.prompt_tokens} prompt tokens = {s.reused_tokens} reused + "
            f"{s.prefilled_tokens} prefilled ({s.discarded_tokens} discarded, "
            f"{s.prefix_cache_tokens} from the shared prefix cache)"
        )
        ttft = f"{s.ttft_s * 1000:.1f} ms" if s.ttft_s is not None else "-"
        rate = f"{s.decode_tokens_per_s:.1f} tok/s" if s.decode_tokens_per_s else "-"
        lines.append(f"           {s.generated_tokens} generated, first token {ttft}, decode {rate}, "
                     f"total {s.total_s:.2f} s, finished: {s.finish_reason}; "
                     f"saved {human_bytes(s.bytes_written)}" + (f" (not saved: {s.persist_error})"
                                                                if s.persist_error else ""))
        if s.not_reused:
            lines.append(f"           KV not reused: {s.not_reused}")
    turns = sum(1 for m in chat.history if m.role == "user")
    lines.append(f"session {chat.session_id}: {turns} turns, {chat.num_cached_tokens} cached tokens "
                 f"(when opened: {kv_origin(chat)})")
    pool = chat.engine.pool_stats()
    blocks = math.ceil(chat.num_cached_tokens / pool.block_size) if pool.block_size else 0
    lines.append(f"  device: {blocks} blocks ≈ {human_bytes(blocks * pool.bytes_per_block)} "
                 f"(pool: {pool.used_blocks} used, {pool.cached_blocks} cached, "
                 f"{pool.free_blocks} free of {pool.num_blocks}; "
                 f"{human_bytes(pool.bytes_per_block)} per block)")
    try:
        disk = store.session_bytes(chat.session_id)
        lines.append(f"  disk:   {human_bytes(disk.total)} ({human_bytes(disk.unique)} own, "
                     f"{human_bytes(disk.shared)} shared with other sessions)")
    except Exception as exc:  # a session not saved yet, or a storage hiccup: stats stay usable
        lines.append(f"  disk:   - ({exc})")
    if s is not None:
        lines.append(f"  this turn's KV came from: {s.kv_source}")
    tiers = chat.engine.tier_stats()
    scheme = chat.engine.tiers.config.quant_scheme
    lines.append("  engine tiers: " + ", ".join(
        f"{tier} {tiers.sessions[tier]} ({human_bytes(tiers.bytes[tier])})"
        for tier in ("device", "quantized", "host", "disk") if tiers.sessions[tier]) +
        f"; quantization {scheme}, {tiers.bytes_per_token[scheme]:.0f} B/token")
    return lines


# ---------------------------------------------------------------------------- the loop


HELP = """\
Type a message and press Enter. End a line with \\ to continue it; a line with
only \"\"\" opens a block closed by the next such line. //text sends "/text".

  /help            this help
  /stats           last turn (reused vs prefilled tokens, first token, tok/s) and session bytes
  /history         the conversation so far, numbered
  /undo            drop the last exchange (your message and its reply)
  /retry           replace the last reply with a new one
  /edit [N] TEXT   replace your message number N (default: the last one) with TEXT,
                   drop what followed, and reply again
  /reset           forget the conversation (keeps the system prompt)
  /session NAME    switch to (or create) another session; no NAME prints the current one
  /sessions        stored sessions
  /system TEXT     set the system prompt; no TEXT prints it
  /set NAME VALUE  change a sampling option for the next turns (temperature, top_p, top_k,
                   seed, max_new_tokens, ignore_eos); no NAME prints them
  /exit            save and quit (also Ctrl-D)

Ctrl-C stops a reply (the partial reply is kept); Ctrl-C twice aborts at once."""


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "on", "yes"):
        return True
    if low in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"expected on/off, got {text!r}")


def _parse_seed(text: str) -> int | None:
    return None if text.lower() in ("", "none") else int(text)


#: ``/set`` names and how their values are parsed.
SETTABLE: dict[str, Callable[[str], Any]] = {
    "temperature": float, "top_p": float, "top_k": int, "seed": _parse_seed,
    "max_new_tokens": int, "ignore_eos": _parse_bool,
}


def _sampling_view(params: Any) -> dict[str, Any]:
    return {name: getattr(params, name) for name in SETTABLE}


class Repl:
    """The interactive loop around one :class:`~chatkv.Chat` at a time.

    Args:
        chat: the open chat.
        store: the store the chat persists to (also used by ``/sessions``, ``/stats``).
        read: how to read a line (see :data:`LineReader`).
        chat_options: keyword arguments for :class:`~chatkv.Chat` when ``/session``
            opens another session (sampling defaults, etc.).
    """

    def __init__(self, chat: "Chat", store: "Store", read: LineReader, chat_options: dict[str, Any]) -> None:
        self.chat = chat
        self.store = store
        self.read = read
        self.chat_options = chat_options
        self.commands: dict[str, Callable[[str], bool]] = {
            "help": self.cmd_help, "stats": self.cmd_stats, "history": self.cmd_history,
            "undo": self.cmd_undo, "retry": self.cmd_retry, "edit": self.cmd_edit,
            "reset": self.cmd_reset, "session": self.cmd_session, "sessions": self.cmd_sessions,
            "system": self.cmd_system, "set": self.cmd_set, "exit": self.cmd_exit, "quit": self.cmd_exit,
        }
        #: Sampling overrides from ``/set``, passed to every turn.
        self.overrides: dict[str, Any] = {}

    def run(self) -> None:
        """Read and handle messages until Ctrl-D or ``/exit``; the caller closes the chat."""
        while True:
            try:
                text = read_message(self.read)
            except EOFError:
                sys.stdout.write("\n")
                return
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                continue
            if not self.handle(text):
                return

    def handle(self, text: str) -> bool:
        """Handle one input: a slash command or a message. Returns False to quit."""
        stripped = text.strip()
        if not stripped:
            return True
        if stripped.startswith("/") and not stripped.startswith("//"):
            name, _, arg = stripped[1:].partition(" ")
            command = self.commands.get(name.lower())
            if command is None:
                click.echo(f"unknown command /{name}; /help lists the commands", err=True)
                return True
            return command(arg.strip())
        self.reply(text[text.index("/") + 1:] if stripped.startswith("//") else text)
        return True

    def reply(self, text: str) -> None:
        """Stream the reply to ``text``; Ctrl-C stops it, keeping the partial reply."""
        self.stream(lambda: self.chat.stream(text, **self.overrides))

    def stream(self, start: Callable[[], Iterator[str]]) -> None:
        """Run a turn (``start()`` returns its pieces), streaming it to the terminal;
        Ctrl-C stops it, keeping the partial reply."""
        from chatkv.errors import ChatKVError
        from chatkv.storage import StorageError

        interrupted = False
        try:
            pieces = start()
            with graceful_sigint() as stop:
                try:
                    for piece in pieces:
                        sys.stdout.write(printable(piece))
                        sys.stdout.flush()
                        if stop:
                            interrupted = True
                            break
                except KeyboardInterrupt:  # the second Ctrl-C
                    interrupted = True
                finally:
                    if isinstance(pieces, Generator):
                        pieces.close()  # ends the turn now: the partial reply joins the history
        except (ChatKVError, StorageError) as exc:
            sys.stdout.write("\n")
            click.echo(f"error: {exc}", err=True)
            return
        sys.stdout.write(" [interrupted]\n" if interrupted else "\n")
        sys.stdout.flush()
        summary = turn_summary(self.chat)
        if summary:
            note(summary)

    # -- slash commands (each returns False to quit) -----------------------------

    def cmd_help(self, arg: str) -> bool:
        """``/help``: print the commands and input conventions."""
        click.echo(HELP)
        return True

    def cmd_stats(self, arg: str) -> bool:
        """``/stats``: the last turn's token accounting and timing, and the session's bytes per tier."""
        for line in stats_lines(self.chat, self.store):
            click.echo(line)
        return True

    def cmd_history(self, arg: str) -> bool:
        """``/history``: print the conversation, marking interrupted replies."""
        history = self.chat.history
        if not history:
            click.echo("(no messages yet)")
        for i, m in enumerate(history):
            mark = " [interrupted]" if m.partial else ""
            click.echo(f"[{i}] {m.role}: {printable(m.content)}{mark}")
        return True

    def cmd_undo(self, arg: str) -> bool:
        """``/undo``: drop the last exchange (the user message and what followed it)."""
        from chatkv.errors import ChatKVError

        try:
            removed = self.chat.rewind(1)
        except ChatKVError as exc:
            click.echo(f"error: {exc}", err=True)
            return True
        click.echo(f"removed {len(removed)} messages: {printable(removed[0]['content'])[:60]!r}…"
                   if removed else "nothing to undo")
        return True

    def cmd_retry(self, arg: str) -> bool:
        """``/retry``: generate the last reply again (with the current sampling settings)."""
        self.stream(lambda: self.chat.stream_regenerate(**self.overrides))
        return True

    def cmd_edit(self, arg: str) -> bool:
        """``/edit [N] TEXT``: replace user message N (default: the last) and reply again."""
        head, _, rest = arg.partition(" ")
        if head.isdigit() and rest.strip():
            index, text = int(head), rest.strip()
        else:
            users = [i for i, m in enumerate(self.chat.history) if m.role == "user"]
            if not users:
                click.echo("error: there is no message to edit", err=True)
                return True
            index, text = users[-1], arg
        if not text:
            click.echo("usage: /edit [N] TEXT (N from /history)", err=True)
            return True
        self.stream(lambda: self.chat.stream_edit(index, text, **self.overrides))
        return True

    def cmd_reset(self, arg: str) -> bool:
        """``/reset``: forget the conversation, keeping the system prompt."""
        self.chat.reset()
        click.echo("conversation cleared (system prompt kept)")
        return True

    def cmd_session(self, arg: str) -> bool:
        """``/session NAME``: close this session (saving it) and open or resume NAME.

        If NAME cannot be opened (in use elsewhere, a bad id) the current session stays.
        """
        from chatkv import Chat

        if not arg:
            click.echo(f"session {self.chat.session_id}")
            return True
        if arg == self.chat.session_id:
            click.echo(f"already in session {arg}")
            return True
        try:
            new = Chat(arg, engine=self.chat.engine, store=self.store, **self.chat_options)
        except Exception as exc:
            if exit_code_for(exc) is None:
                raise
            click.echo(f"error: {exc}", err=True)
            return True
        self.chat.close()
        self.chat = new
        click.echo(restore_summary(new))
        return True

    def cmd_sessions(self, arg: str) -> bool:
        """``/sessions``: list stored sessions, marking the current one."""
        infos = self.store.list_sessions()
        print_table(
            ["", "id", "turns", "tokens", "bytes", "last used"],
            [["*" if i.id == self.chat.session_id else "", i.id, i.n_turns, i.n_cached,
              human_bytes(i.kv_bytes), ago(i.last_used_at)] for i in infos],
            right=("turns", "tokens", "bytes"),
        )
        return True

    def cmd_system(self, arg: str) -> bool:
        """``/system TEXT``: set the system prompt; without TEXT, print it."""
        if not arg:
            click.echo(f"system: {self.chat.system}" if self.chat.system else "(no system prompt)")
            return True
        self.chat.set_system(arg)
        click.echo("system prompt set")
        return True

    def cmd_set(self, arg: str) -> bool:
        """``/set NAME VALUE``: override a sampling option for the following turns; no NAME lists them."""
        from chatkv.errors import ConfigError

        name, _, value = arg.partition(" ")
        name = name.replace("-", "_")
        if not name:
            current = {**_sampling_view(self.chat.sampling), **self.overrides}
            click.echo("  ".join(f"{k}={v}" for k, v in current.items()))
            return True
        if name not in SETTABLE:
            click.echo(f"cannot set {name!r}; choose from {', '.join(SETTABLE)}", err=True)
            return True
        try:
            parsed = SETTABLE[name](value.strip())
            self.chat.sampling.replace(**self.overrides, **{name: parsed})  # validates
        except (ValueError, ConfigError) as exc:
            click.echo(f"bad value for {name}: {exc}", err=True)
            return True
        self.overrides[name] = parsed
        click.echo(f"{name} = {parsed}")
        return True

    def cmd_exit(self, arg: str) -> bool:
        """``/exit``: leave the loop (the caller saves and closes the session)."""
        return False


# ---------------------------------------------------------------------------- the command


@click.command("repl")
@click.option("--session", "session_id", default=None,
              help="Session id to resume or create (default: a fresh id, printed at start).")
@click.option("--system", default=None, help="System prompt (replaces a resumed session's).")
@click.option("--system-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Read the system prompt from a file.")
@model_option
@dtype_option
@compile_option
@kv_quant_option
@disk_format_option
@click.option("--max-new-tokens", default=512, show_default=True, type=click.IntRange(min=1),
              help="Longest reply, in tokens.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Sampling temperature; 0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              help="Nucleus sampling: keep the smallest token set with this much probability.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0),
              help="Keep only the k most likely tokens (0: off).")
@click.option("--seed", default=None, type=int, help="Seed for reproducible sampling.")
@click.option("--stop", multiple=True, help="Stop a reply at this string (repeatable).")
@click.option("--ignore-eos", is_flag=True,
              help="Keep generating past the end-of-sequence token (benchmarks, tests).")
@click.option("--context-policy", "context_policy", type=click.Choice(["trim", "sink", "error"]), default="trim",
              show_default=True,
              help="When the conversation outgrows the model's window: trim leaves the oldest turns out "
                   "of the window (the history keeps them); sink keeps the first tokens and the most "
                   "recent ones, shifting the kept keys in place so nothing is re-prefilled; error "
                   "refuses the turn.")
@click.option("--sink-tokens", "sink_tokens", default=4, show_default=True, type=click.IntRange(min=0),
              help="With --context-policy sink: tokens at the start always kept (rounded up to KV blocks).")
@click.option("--plain", is_flag=True, help="Plain line input without line editing or history.")
def repl(session_id: str | None, system: str | None, system_file: Path | None, model: str | None,
         dtype: str | None, compile_mode: str | None, kv_quant: str | None, disk_format: str, max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
         stop: tuple[str, ...], ignore_eos: bool, context_policy: str, sink_tokens: int, plain: bool) -> None:
    """Chat in the terminal, streaming replies; the session persists across restarts.

    Ctrl-C stops a reply (kept, marked interrupted); Ctrl-D or /exit saves and
    quits; /help lists the slash commands. Exit code 5 if the session is open
    in another process, 3 for an unknown model.
    """
    from chatkv import Chat, EngineConfig, TierConfig

    if system is not None and system_file is not None:
        raise CliError("give --system or --system-file, not both", ExitCode.USAGE)
    if system_file is not None:
        system = system_file.read_text(encoding="utf-8").strip()
    if kv_quant is not None:
        from chatkv.quant import check_scheme

        try:
            check_scheme(kv_quant)
        except ValueError as exc:
            raise CliError(str(exc), ExitCode.USAGE) from exc
    sid = session_id or fresh_session_id()
    options: dict[str, Any] = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   top_k=top_k, seed=seed, stop=stop, ignore_eos=ignore_eos,
                                   context_policy=context_policy, sink_tokens=sink_tokens)
    with open_store() as store:
        note(f"loading model {model or 'default'}…")
        chat = Chat(sid, system=system, model=model, store=store, kv_quant=kv_quant,
                    tiers=TierConfig(disk_format=disk_format) if disk_format != "exact" else None,
                    engine_config=EngineConfig(dtype=dtype, compile=compile_mode) if dtype or compile_mode else None,
                    **options)
        try:
            dtype_name = str(chat.engine.loaded.dtype).removeprefix("torch.")
            note(f"chatkv · session {sid} · model {chat.engine.loaded.name} ({dtype_name}) · "
                 "/help for commands, Ctrl-D to exit")
            click.echo(restore_summary(chat))
            session = Repl(chat, store, make_reader(store.home, plain), options)
            session.run()
            chat = session.chat
        finally:
            chat.close()
        note(f"saved session {chat.session_id}; resume with: chatkv repl --session {chat.session_id}")
