"""A line now and then while a long step runs, so a long wait never looks like a hang.

The demo's engine start and the CLI's long reads (a large config built on the meta device,
shard headers fetched from the hub) show progress the same way: a line saying what runs,
one every ``every_s`` seconds with the time so far, and one when it is done. A step that
is usually quick can ask for nothing at all unless it outlasts ``after_s``, so the common
case stays silent and scripts reading the output see no change.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import IO, Iterator


@contextmanager
def progress(what: str, *, every_s: float = 10.0, after_s: float = 0.0, note: str = "",
             stream: IO[str] | None = None) -> Iterator[None]:
    """Report on ``what`` while the ``with`` body runs (to ``stream``, default stdout)."""
    out = stream if stream is not None else sys.stdout
    done = threading.Event()
    started = time.monotonic()
    shown = threading.Event()

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    def tick() -> None:
        if after_s and done.wait(after_s):
            return
        say(f"{what}" + (f" ({note})" if note else "") + (" ..." if after_s else ""))
        shown.set()
        while not done.wait(every_s):
            say(f"  ... {what}: {time.monotonic() - started:.0f} s")

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    if not after_s:
        shown.wait()  # the start line before anything the body prints
    try:
        yield
    except BaseException:
        done.set()
        thread.join()
        raise  # no "done": the error says what happened
    done.set()
    thread.join()
    if shown.is_set():
        say(f"{what}: done in {time.monotonic() - started:.0f} s")
