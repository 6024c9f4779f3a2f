"""Forking: branch a conversation; both branches share the KV of what came before.

    python examples/fork.py [--model tiny:llama]
"""

from __future__ import annotations

import argparse
import secrets

from chatkv import Chat


def main() -> None:
    """Ask one question, fork, and continue the two branches differently."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model spec (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()

    run = secrets.token_hex(3)  # fresh ids on every run; a fork's id must be new
    main_line = Chat(f"fork-demo-{run}", system="You are a terse assistant.", model=args.model, max_new_tokens=32)
    main_line.send("Name a colour.")
    branch = main_line.fork(f"fork-demo-{run}-branch")
    try:
        main_line.send("Now name a fruit of that colour.")
        branch.send("Now name an animal of that colour.")
        print(f"the branch began with {branch.last_stats.reused_tokens} reused tokens "
              f"and prefilled {branch.last_stats.prefilled_tokens}")
        for chat in (main_line, branch):
            print(f"--- {chat.session_id}")
            for m in chat.history:
                print(f"{m.role}: {m.content}")
    finally:
        branch.close()
        main_line.close()


if __name__ == "__main__":
    main()
