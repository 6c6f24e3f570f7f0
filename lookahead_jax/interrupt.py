"""Ctrl-C for the command line: stop between steps, never lose the interrupt, never crash.

    with CtrlC() as ctrl_c:                        # SIGINT handled here (main thread)
        with ctrl_c.deferred():                    # a call that runs decode steps
            generate(..., on_step=ctrl_c.check)    # raises KeyboardInterrupt at a step boundary

* The first Ctrl-C, while a call is `deferred`, is noted and raised as KeyboardInterrupt
  by the next `check` (between two steps: the rows hold what they have verified, the
  streamed text stays). Raised by the signal handler itself it could land anywhere, also
  inside a callback that swallows exceptions: JAX's garbage-collection callback printed
  a KeyboardInterrupt raised there and the run went on to its end. Elsewhere (loading,
  encoding the prompts) it is raised at once, as Python does, and raised again by the
  next `check` should something have swallowed it.
* A second Ctrl-C ends the process at once: standard output flushed, "interrupted" on
  standard error, exit status 130 (`exit_now`), without the interpreter's teardown, which
  background compilation threads could otherwise crash (SIGSEGV was seen).

Host only: no jax.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that Ctrl-C ended


def exit_now(code: int = EXIT_INTERRUPTED, message: str = "interrupted") -> None:
    """Flush standard output, print `message` on standard error and end the process with
    `code` at once (`os._exit`: no teardown, no atexit, no waiting for threads)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe: nothing more to keep
            pass
    if message:
        try:
            os.write(2, (message + "\n").encode())
        except OSError:
            pass
    os._exit(code)


class CtrlC:
    """SIGINT handling for a command (module docstring). `count`: the Ctrl-Cs so far.
    Outside the main thread (where Python cannot take signals) it changes nothing."""

    def __init__(self, exit: Callable[[int], None] = exit_now):
        self.count = 0
        self._exit = exit
        self._deferring = 0
        self._old = None

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None

    @contextlib.contextmanager
    def deferred(self):
        """While inside, a first Ctrl-C waits for the next `check` instead of raising."""
        self._deferring += 1
        try:
            yield self
        finally:
            self._deferring -= 1

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C was pressed (a step boundary: `on_step`)."""
        if self.count:
            raise KeyboardInterrupt

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:
            self._exit(EXIT_INTERRUPTED)
        elif not self._deferring:
            raise KeyboardInterrupt
