"""Sessions survive a restart: run this twice; the second run resumes from disk.

    python examples/resume.py [--model tiny:llama]   # first run: a new session
    python examples/resume.py [--model tiny:llama]   # again: history and KV come back

The KV cache is saved after each turn under $CHATKV_HOME, so the second run's
new turn prefills only the new message, not the whole conversation.
"""

from __future__ import annotations

import argparse

from chatkv import Chat


def main() -> None:
    """Open (or resume) the session, report how it came back, and add one turn."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model spec (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--session", default="resume-demo", help="session id")
    args = parser.parse_args()

    chat = Chat(args.session, system="You are a terse assistant.", model=args.model, max_new_tokens=32)
    try:
        chat.wait_restored()
        r = chat.restore
        print(f"restore: source={r.source} turns={r.turns} cached_tokens={r.cached_tokens} "
              f"in {r.seconds * 1000:.0f} ms")
        turn = r.turns + 1
        reply = chat.send(f"This is turn {turn}. What did I say before?")
        s = chat.last_stats
        print(f"turn {turn}: reused {s.reused_tokens} tokens, prefilled {s.prefilled_tokens}")
        print("reply:", reply)
    finally:
        chat.close()  # saves the session; a crash would still leave the last completed turn on disk


if __name__ == "__main__":
    main()
