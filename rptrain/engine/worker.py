"""A single background thread that runs queued tasks in order: the optimizer thread.

Started on first use (importing rptrain starts no threads) and stopped by ``close()`` or when its
owner is garbage-collected. A task's exception is kept with its ticket and re-raised in the
caller's thread by whoever waits on the ticket. With ``inline=True`` tasks run in the submitting
thread instead (same tickets, same error handling).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Optional

import torch


class Ticket:
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: Optional[BaseException] = None

    def finish(self, error: Optional[BaseException] = None) -> None:
        self.error = error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        while not self._done.wait(timeout=0.5):  # short waits keep Ctrl-C responsive
            pass


class TaskThread:
    def __init__(self, name: str, inline: bool = False, threads: Optional[int] = None):
        """``threads``: intra-op (OpenMP) threads for the tasks; OpenMP keeps this per thread, so
        the submitting thread's own setting is untouched."""
        self._name = name
        self._inline = inline
        self._threads = threads
        self._queue: "queue.Queue[Optional[tuple[Callable[[], None], Ticket]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, task: Callable[[], None]) -> Ticket:
        ticket = Ticket()
        if self._inline:
            _run(task, ticket)
            return ticket
        with self._lock:
            if self._thread is None:
                self._start()
            self._queue.put((task, ticket))
        return ticket

    def _start(self) -> None:
        """Start the thread; with ``threads``, give the process its thread count back afterwards:
        ``torch.set_num_threads`` also sets the count every thread started later begins with (a
        process-wide default), so the device threads of this and later engines would compute with
        the optimizer's count, and their sums would differ from the caller's."""
        caller = torch.get_num_threads()
        ready = threading.Event()
        self._thread = threading.Thread(target=_loop, args=(self._queue, self._threads, ready), name=self._name, daemon=True)
        self._thread.start()
        if self._threads is not None:
            ready.wait()
            torch.set_num_threads(caller)  # the caller's count is unchanged; the default is the caller's again

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()


def _loop(tasks: "queue.Queue", threads: Optional[int], ready: threading.Event) -> None:
    # Holds only the queue, not the engine, so an unused engine can be garbage-collected.
    if threads is not None:
        torch.set_num_threads(threads)
        # torch sets a thread's count lazily, from the process default, at its first parallel call: take it
        # now, while the default is ours (the caller puts its own back once ``ready`` is set). On the H200's
        # torch the step function otherwise ran with the caller's 16 threads.
        torch.get_num_threads()
    ready.set()
    while True:
        item = tasks.get()
        if item is None:
            return
        _run(*item)
        del item


def _run(task: Callable[[], None], ticket: Ticket) -> None:
    try:
        task()
    except BaseException as e:  # handed to the caller through the ticket
        ticket.finish(e)
    else:
        ticket.finish()
