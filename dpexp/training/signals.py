"""SIGTERM (schedulers, preemption) and SIGINT (Ctrl-C) as a clean stop of a run.

Inside :meth:`InterruptGuard.step` a signal is held until the step has ended, so the run stops at a step
boundary, where its state can be checkpointed; a second signal does not wait (the same signal again within
half a second is taken as one request delivered twice: Ctrl-C reaches a whole process group, and a launcher
may pass it on to its workers as well). Outside a step (loading data,
evaluating, writing the record) the signal stops the run at once. Either way the run sees
:exc:`RunInterrupted`, a BaseException like KeyboardInterrupt, so that no ``except Exception`` swallows it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_WINDOW = 0.5  # seconds: the same signal again within this of the last is one request twice


def announce(text: str) -> None:
    """Write the line ``text`` to stderr from a signal handler. Not through logging or ``print``: the
    handler runs between two bytecodes of the main code, which may be inside a write to the same buffered
    stream, where a second write raises ``RuntimeError: reentrant call`` (logging then prints a traceback
    of its own and drops the line); a write to the file descriptor has no such state. Where stderr has no
    descriptor (captured in-process), the stream's own write, the line dropped if the stream is busy."""
    try:
        os.write(sys.stderr.fileno(), f"{text}\n".encode(errors="replace"))
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        with contextlib.suppress(RuntimeError):
            sys.stderr.write(f"{text}\n")


class RunInterrupted(BaseException):
    """The run was stopped by ``signum``; ``mid_step``: in the middle of a training step (a second signal),
    where the state is not a step boundary and cannot be checkpointed."""

    def __init__(self, signum: int, mid_step: bool = False) -> None:
        self.signum = signum
        self.mid_step = mid_step
        where = "in the middle of a step" if mid_step else "at a step boundary"
        super().__init__(f"{signal.Signals(signum).name} received; stopped {where}")

    def __reduce__(self) -> tuple[type[RunInterrupted], tuple[int, bool]]:
        """Pickled as its signal (an exception pickles as its message by default, which this class cannot
        be re-created from): a launcher's worker may return it to the launching process."""
        return type(self), (self.signum, self.mid_step)

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum


class InterruptGuard:
    """A context manager that turns SIGTERM and SIGINT into :exc:`RunInterrupted` while it is active (in the
    main thread only: Python delivers signals there), restoring the previous handlers on exit."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._in_step = False
        self._pending: int | None = None
        self._last: tuple[int, float] = (0, -DUPLICATE_WINDOW)  # the last signal and when (time.monotonic)

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @contextmanager
    def step(self, agree: Callable[[int], int] | None = None) -> Iterator[None]:
        """A training step: a signal received inside it raises :exc:`RunInterrupted` once it has ended.

        ``agree``: the processes of a job that must stop after the same step (the ranks of a sharded job,
        which gather its checkpoint together): called with this process' held signal (0: none) at the end of
        every step, still inside it, it returns the signal any process held (0: none), and all of them stop
        if one did; a signal received after it waits for the next step's agreement."""
        self._in_step = True
        agreed = 0
        try:
            yield
            if agree is not None:
                agreed = agree(self._pending or 0)
        finally:
            self._in_step = False
        if agree is not None:
            if agreed:
                self._pending = None
                raise RunInterrupted(agreed)
            return
        if self._pending is not None:
            signum, self._pending = self._pending, None
            raise RunInterrupted(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if signum == self._last[0] and now - self._last[1] < DUPLICATE_WINDOW:
            return  # one request delivered twice (to a process group, and passed on by a launcher)
        self._last = (signum, now)
        if self._in_step and self._pending is None:
            self._pending = signum
            announce(f"{name} received: stopping after this step (send it again to stop at once)")
            return
        announce(f"{name} received: stopping now")
        raise RunInterrupted(signum, mid_step=self._in_step)
