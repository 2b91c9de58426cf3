"""Calls that run in a child process under a memory and a time limit, so that a computation that grows without
bound (the PRV accountant's grid at a huge epsilon needs tens of GB) fails cleanly instead of taking the
machine down.

One child is forked on first use and serves the calls that follow (a fork of a process with torch loaded
costs tens of milliseconds); its address space may grow by at most the memory limit, and a call that
overruns its time is killed with the child, which is forked again for the next call. The child also ends by
itself when its parent is gone (even one killed by SIGKILL: the child then holds no pipe or terminal of its
own for long). The child ignores SIGINT, SIGTERM and SIGHUP: they reach a whole process group (Ctrl-C, a
scheduler's preemption), and the parent, which decides, still needs the child to account the steps taken.
Warnings the call emits are re-emitted in the caller.
"""

from __future__ import annotations

import math
import multiprocessing
import pickle
import resource
import signal
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

CHILD_START = multiprocessing.get_context("fork")


class LimitExceeded(ValueError):
    """A bounded call ran out of memory or time, or its process died; the message names the key to raise."""


@dataclass(frozen=True)
class Limits:
    """How many more bytes a call may map and how many seconds it may run; the keys name them in messages."""

    memory_bytes: int
    timeout_s: float
    memory_key: str = "memory"
    timeout_key: str = "timeout"


class BoundedCalls:
    """``calls(fn, *args, what=..., **kwargs)``: ``fn(*args, **kwargs)`` in the child under ``limits``.

    Returns its result or raises its exception (re-created in this process); raises :class:`LimitExceeded`
    when it needs more memory than the limit (a MemoryError anywhere in its exception chain), runs out of
    time, or its process dies. ``fn`` and its arguments must pickle (module-level functions do). Close it (or
    use it as a context manager) to end the child.
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._process: Any = None
        self._conn: Any = None

    def __enter__(self) -> BoundedCalls:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, fn: Callable[..., Any], /, *args: Any, what: str, **kwargs: Any) -> Any:
        if self._process is None:
            self._start()
        try:
            self._conn.send((fn, args, kwargs))
            answer = self._conn.recv() if self._conn.poll(self.limits.timeout_s) else None
        except (EOFError, BrokenPipeError):
            raise LimitExceeded(f"{what}: {_death(self._stop(), self.limits.memory_key)}") from None
        except BaseException:  # an interrupt while waiting: the child's answer would be out of step
            self._stop()
            raise
        if answer is None:
            self._stop()
            raise LimitExceeded(
                f"{what} ran longer than {self.limits.timeout_key}={self.limits.timeout_s:g} s and was "
                f"stopped; raise {self.limits.timeout_key} to wait longer."
            )
        outcome, value, caught = answer
        for message, category in caught:
            warnings.warn(message, category, stacklevel=2)
        if outcome == "ok":
            return value
        if outcome == "memory":
            self._stop()  # its heap may stay bloated
            raise LimitExceeded(
                f"{what} needs more memory than {self.limits.memory_key}="
                f"{self.limits.memory_bytes / 2**30:g} GiB allows ({value}); raise it if the machine has "
                "the memory."
            )
        raise value

    def close(self) -> None:
        """End the child (a later call forks a new one)."""
        self._stop()

    def _start(self) -> None:
        ours, theirs = CHILD_START.Pipe()
        self._process = CHILD_START.Process(
            target=_serve, args=(theirs, ours, self.limits.memory_bytes, self.limits.timeout_s), daemon=True
        )
        self._process.start()
        theirs.close()
        self._conn = ours

    def _stop(self) -> int | None:
        """Kill the child if it runs; its exit code (negative: the signal that ended it)."""
        if self._process is None:
            return None
        process, self._process = self._process, None
        self._conn.close()
        if process.is_alive():
            process.kill()
        process.join()
        return process.exitcode


def _death(code: int | None, memory_key: str) -> str:
    """Why the child died, from its exit code: a SIGKILL is most likely the kernel's out-of-memory killer."""
    if code is not None and code < 0:
        signum = signal.Signals(-code)
        if signum != signal.SIGKILL:
            return f"its process was stopped by signal {signum.name} from outside; run it again."
        died = f"signal {signum.name}"
    else:
        died = f"exit {code}"
    return f"its process died ({died}), most likely out of memory; lower the demand or raise {memory_key}."


def _serve(conn: Any, parents_end: Any, memory_bytes: int, timeout_s: float) -> None:
    """The child: answer calls until the parent's end of the pipe closes (the parent closed it, or died)."""
    parents_end.close()  # or the pipe would never report the parent's end closed
    # Ctrl-C, a scheduler's preemption (Slurm signals every process of a job step) and `kill -- -pgid` reach
    # the whole process group: the parent decides, and still needs this child to account the steps it took
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    _limit_address_space(memory_bytes)
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except EOFError:
            return
        signal.alarm(math.ceil(timeout_s) + 1)  # ends this process if its parent died during the call
        answer = _answer(fn, args, kwargs)
        signal.alarm(0)
        conn.send(answer)


def _limit_address_space(extra_bytes: int) -> None:
    """Let this process map at most ``extra_bytes`` beyond what it maps now (allocations beyond fail)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = psutil.Process().memory_info().vms + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _answer(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> tuple[str, Any, list]:
    """(outcome, value, warnings): ``ok`` and the result, ``memory`` and the message, or ``error`` and the
    exception (or a RuntimeError carrying its text, if it does not pickle)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            outcome, value = "ok", fn(*args, **kwargs)
        except Exception as error:
            if _out_of_memory(error):
                outcome, value = "memory", str(error)
            else:
                outcome, value = "error", _picklable(error)
    return outcome, value, [(str(w.message), w.category) for w in caught]


def _out_of_memory(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, MemoryError):
            return True
        error = error.__cause__ or error.__context__
    return False


def _picklable(error: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
