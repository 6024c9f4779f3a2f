"""Streaming: print a reply piece by piece as it is generated, then its timing.

    python examples/streaming.py [--model tiny:llama] [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import sys

from chatkv import Chat


def main() -> None:
    """Stream one reply to stdout and report time to first token and decode speed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model spec (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", default="Tell me a short story about a cache.")
    args = parser.parse_args()

    with Chat("streaming-demo", model=args.model, max_new_tokens=64) as chat:
        chat.reset()  # start fresh on every run
        pieces = 0
        for piece in chat.stream(args.prompt):
            sys.stdout.write(piece)
            sys.stdout.flush()
            pieces += 1
        print()
        s = chat.last_stats
        rate = f"{s.decode_tokens_per_s:.1f} tok/s" if s.decode_tokens_per_s else "n/a"
        print(f"{pieces} pieces, {s.generated_tokens} tokens; first token after "
              f"{(s.ttft_s or 0) * 1000:.0f} ms, then {rate} (finished: {s.finish_reason})")


if __name__ == "__main__":
    main()
