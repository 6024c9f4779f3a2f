"""The heap an engine made while loading and warming up stays out of the garbage collector's walks until it closes."""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = """
import gc, os, sys
from chatkv import Chat, EngineConfig
from chatkv.engine import Engine
from chatkv.models import load_model

def engine(**kw):
    e = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=64, block_size=4, **kw))
    e.wait_warm()
    return e

out = []
a = engine()
out.append(gc.get_freeze_count())            # warmed: frozen
chat = Chat("heap", engine=a, persist=False, max_new_tokens=4)
chat.send("Hello")
chat.close()
out.append(gc.get_freeze_count())            # a turn adds nothing to it
b = engine()
a.close()
out.append(gc.get_freeze_count())            # b still holds it
b.close()
out.append(gc.get_freeze_count())            # the last one out unfreezes
c = engine(warmup=False)
out.append(gc.get_freeze_count())            # no warm-up: not frozen
c.close()
again = engine()
out.append(gc.get_freeze_count())            # frozen again (everything collected first)
again.close()
os.environ["CHATKV_GC_FREEZE"] = "0"
d = engine()
out.append(gc.get_freeze_count())            # switched off
d.close()
print("counts", *out)
"""


def test_a_warmed_engine_freezes_the_heap_until_the_last_one_closes() -> None:
    # In a fresh interpreter: an engine another test left open would hold the heap frozen.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("CHATKV_GC_FREEZE", None)
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = (int(x) for x in done.stdout.split("counts")[-1].split())
    warmed, after_turn, one_left, none_left, no_warmup, refrozen, off = counts
    assert warmed > 10_000  # torch, transformers, the model: what the process had made
    assert 0 < after_turn <= warmed  # the turn's objects are walked as usual (frozen ones may die)
    assert one_left >= after_turn
    assert none_left == 0 and no_warmup == 0 and off == 0
    assert refrozen > 10_000
