"""The ``chatkv`` command line: ``chatkv repl`` and friends."""

from __future__ import annotations

import sys

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="chatkv")
def main() -> None:
    """chatkv: multi-turn chat whose KV cache persists across turns and restarts."""


@main.command()
@click.option("--session", "session_id", default=None, help="Session id to resume or create (default: a fresh id).")
@click.option("--system", default=None, help="System prompt.")
@click.option("--model", default=None, help="Model spec: 'default', a model directory, a .gguf file or tiny:<arch>.")
@click.option("--max-new-tokens", default=512, show_default=True, type=int, help="Longest reply, in tokens.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--seed", default=None, type=int)
def repl(session_id, system, model, max_new_tokens, temperature, top_p, top_k, seed) -> None:
    """Chat in the terminal, streaming replies. Ctrl-C stops a reply; Ctrl-D exits."""
    import secrets

    from chatkv import Chat
    from chatkv.errors import ChatKVError

    session_id = session_id or f"chat-{secrets.token_hex(3)}"
    try:
        chat = Chat(session_id, system=system, model=model, max_new_tokens=max_new_tokens,
                    temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except ChatKVError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"session {session_id} on {chat.engine.loaded.name} (Ctrl-D to exit, /exit to quit)", err=True)
    while True:
        try:
            text = input(">>> ")
        except EOFError:
            click.echo("", err=True)
            break
        except KeyboardInterrupt:
            click.echo("", err=True)
            continue
        if text.strip() in ("/exit", "/quit"):
            break
        if not text.strip():
            continue
        try:
            for piece in chat.stream(text):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [interrupted]")
        except ChatKVError as exc:
            click.echo(f"error: {exc}", err=True)
            continue
        sys.stdout.write("\n")
        stats = chat.last_stats
        if stats is not None and stats.ttft_s is not None:
            rate = f", {stats.decode_tokens_per_s:.1f} tok/s" if stats.decode_tokens_per_s else ""
            click.echo(
                f"[reused {stats.reused_tokens}, prefilled {stats.prefilled_tokens} tokens; "
                f"first token {stats.ttft_s * 1000:.0f} ms{rate}]", err=True)
    chat.close()


if __name__ == "__main__":
    main()
