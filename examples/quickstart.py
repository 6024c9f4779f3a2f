"""Quickstart: open a session, send two messages, see what the second turn reused.

    python examples/quickstart.py                    # the default model (SmolLM2-135M-Instruct)
    python examples/quickstart.py --model tiny:llama # a tiny random model: instant, gibberish replies

Sessions live under $CHATKV_HOME; run it twice and the second run resumes.
"""

from __future__ import annotations

import argparse

from chatkv import Chat


def main() -> None:
    """Send two messages in one session and print the replies and the second turn's stats."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model spec (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--session", default="quickstart", help="session id")
    args = parser.parse_args()

    with Chat(args.session, system="You are a terse assistant.", model=args.model, max_new_tokens=48) as chat:
        print("reply 1:", chat.send("What is a KV cache?"))
        print("reply 2:", chat.send("Why page it?"))
        stats = chat.last_stats
        print(f"turn 2 reused {stats.reused_tokens} cached tokens and prefilled only {stats.prefilled_tokens}")


if __name__ == "__main__":
    main()
