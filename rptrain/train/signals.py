"""SIGTERM/SIGINT -> a flag the training loop checks after each step, or a stop right away.

Cluster pre-emption sends SIGTERM and waits a grace period; Ctrl-C sends SIGINT. Inside a training
step (and a checkpoint write), the windows the loop marks with `request.deferred()`, the signal
only sets the flag: the loop finishes the step, writes a checkpoint and exits with 128 + the signal
number. Anywhere else (setup, data preparation, a chat template, an evaluation, waiting for a
batch), when the request is `immediate` (one process), the handler raises StopNow at once: the
loop writes the checkpoint of the last finished step if there is one to write, and the run ends
within seconds instead of after the next step. Under torchrun the ranks must agree on the step
they stop after, so there every signal waits for the end of a step. A second signal
stops at once, for when the checkpoint itself hangs: with `on_abort` (the CLI) the process calls
it (to write status.json) and exits with 128 + that signal right there, wherever the main thread
was (in the optimizer step, in a checkpoint write: the previous checkpoint is untouched, since
a checkpoint only replaces it by a rename once complete); without, KeyboardInterrupt is raised.

A StopNow raised where Python cannot propagate it (a __del__, a weakref callback during a garbage
collection) would be printed as "Exception ignored" with a traceback and lost: the run went on and
finished as if no signal came (issue 31's campaign). sys.unraisablehook catches it and has the same
signal sent again 10 ms later, which then stops the run at an ordinary line.

Under torchrun the launcher forwards the signal to every rank, and SLURM may signal the ranks
directly as well: there the same signal again within `duplicate_s` seconds is one request, not
a second one.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopNow(BaseException):
    """A signal outside a step (BaseException, like KeyboardInterrupt: no `except Exception` may swallow it)."""

    def __init__(self, request: "StopRequest") -> None:
        super().__init__(f"{request.name} outside a training step")
        self.request = request


class StopRequest:
    def __init__(self, immediate: bool = False) -> None:
        self.signum: Optional[int] = None
        self.since = 0.0  # time.monotonic() of the first request
        self.immediate = immediate  # outside deferred() windows a signal raises StopNow at once
        self.resent = False  # a StopNow was swallowed (a __del__, a weakref callback) and the signal sent again
        self._deferring = 0

    def set(self, signum: int) -> None:
        self.signum, self.since = signum, time.monotonic()

    @property
    def stops_now(self) -> bool:
        """Whether a signal now raises StopNow (instead of waiting for the end of the step)."""
        return self.immediate and not self._deferring

    @contextlib.contextmanager
    def deferred(self, then_stop: bool = False) -> Iterator[None]:
        """A window a signal does not cut short (a training step, a checkpoint write). `then_stop`: a signal that
        arrived within it raises StopNow when it ends (the loop does not check the flag right after it)."""
        before = self.signum
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if then_stop and before is None and self.signum is not None and self.stops_now:
            raise StopNow(self)

    def __bool__(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)


class Interrupted(Exception):
    """Raised by the loop once the checkpoint after a stop request is written."""

    def __init__(self, request: StopRequest, step: int, checkpoint: str) -> None:
        super().__init__(f"{request.name} at step {step}")
        self.request, self.step, self.checkpoint = request, step, checkpoint


@contextlib.contextmanager
def stop_on_signals(
    announce: bool = True, duplicate_s: float = 0.0, on_abort: Optional[Callable[[int], None]] = None, immediate: bool = False
) -> Iterator[StopRequest]:
    """Within the block, SIGINT/SIGTERM set the returned request instead of killing the process.
    `announce`: say so on stderr (under torchrun only rank 0 does). `on_abort(signum)`: see above.
    `immediate`: outside the request's deferred() windows a signal raises StopNow (see above)."""
    request = StopRequest(immediate)
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield request
        return
    owner = os.getpid()

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != owner:
            # A forked DataLoader worker inherited this handler. Ctrl-C reaches the whole process
            # group: the worker keeps serving batches and leaves the stopping to the trainer.
            return
        if request.signum is not None:
            if signum == request.signum and time.monotonic() - request.since < duplicate_s:
                return  # the same request delivered twice (launcher and scheduler)
            _say("rptrain: second signal, stopping now without a checkpoint\n")
            if on_abort is None:
                raise KeyboardInterrupt
            try:
                on_abort(signum)
            finally:
                # Not an exception: raised inside the optimizer step or a checkpoint write, it would
                # surface as that code's failure (and a traceback) instead of a stop.
                os._exit(128 + signum)
        resent, request.resent = request.resent, False
        request.set(signum)
        now = request.stops_now
        if announce and not resent:
            then = "stopping now" if now else "finishing the current step"
            _say(f"\nrptrain: {signal.Signals(signum).name} received: {then}, then writing a checkpoint if there is one to write\n")
        if now:
            raise StopNow(request)

    def unraisable(info: Any) -> None:
        if isinstance(info.exc_value, StopNow) and info.exc_value.request is request and request.signum is not None:
            signum, request.signum, request.resent = request.signum, None, True  # the first signal again, not a second
            # From another thread, a moment later: its handler then runs on this thread after this hook returned.
            threading.Timer(0.01, os.kill, (owner, signum)).start()
            return
        previous_hook(info)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield request
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if sys.unraisablehook is unraisable:
            sys.unraisablehook = previous_hook


def _say(text: str) -> None:
    # os.write, not print: a handler may interrupt a print on the main thread, and print is not reentrant.
    try:
        os.write(2, text.encode())
    except OSError:
        pass
