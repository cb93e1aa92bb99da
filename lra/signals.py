"""Stopping cleanly on SIGINT (Ctrl-C) and SIGTERM: the one rule the trainer and `lra sweep` share.

The first SIGINT or SIGTERM (what a TPU VM or a cluster sends before preemption) is a request to
stop cleanly: `requested` turns true, a message is printed once and `on_request` runs (the
sweep passes SIGTERM on to its runs there); the program stops where it can save, for the trainer
after the current step. A second Ctrl-C means stop now: `on_abort` runs, by default raising
KeyboardInterrupt (the sweep passes SIGINT on to its runs instead). A second SIGTERM changes
nothing.

  with StopRequest(message) as stop:
    while not stop.requested:
      ...

The handlers are installed for the `with` block only, and only from the main thread (the only
one Python delivers signals to); elsewhere the block runs with the handlers it had. Pure
standard library: the command line imports it before jax.

`hold_early()` makes a SIGTERM that arrives before the run's StopRequest (while a process of a
multi-process job starts up: jax.distributed, the preflight's compilation) a pending request
instead of the end of the process: the next StopRequest entered takes it as its first signal.
lra/mesh.py calls it around `jax.distributed.initialize`, whose preemption notifier would
otherwise swallow the SIGTERM, so that a job signalled during start-up stops with all its
processes instead of leaving the others waiting in a collective. From its first call on, SIGTERM
never goes back to the default action when a `with` block ends (it is held), and is ignored
once the process exits (an `atexit` function): a process that has stopped
cleanly, saved and is tearing down (jax.distributed's shutdown barrier, the runtime's
destructors, after Python has put back the default handlers) is not killed by a SIGTERM that
reaches it late, as a cluster's signal reaches its tasks seconds apart.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_label(signum: int) -> str:
  """`Ctrl-C` for SIGINT, the signal's name (`SIGTERM`) otherwise."""
  return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


_held: list[int] = []


def _hold(signum: int, frame=None) -> None:
  del frame
  _held.append(signum)


def _ignore_sigterm() -> None:
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


_at_exit: list[bool] = []


def hold_early() -> None:
  """From now until a StopRequest is entered, SIGTERM is held for it, and from the process's
  exit on it is ignored (main thread only)."""
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _hold)
    if not _at_exit:
      # atexit runs last what it was given first: after jax.distributed's shutdown, which
      # registers later, and before Python restores the default handlers (SIG_IGN stays).
      atexit.register(_ignore_sigterm)
      _at_exit.append(True)


def _restore(sig: int, previous) -> None:
  """Puts back `previous` as `sig`'s handler, except that once `hold_early` has run SIGTERM
  never goes back to the default action: the handler a process had before its first
  `hold_early` (the default, in `lra run`'s StartUp) would otherwise be back after the run,
  while jax.distributed's shutdown still waits for the other processes, and a late SIGTERM
  would kill a process that had stopped cleanly. It is held instead (and ignored at exit)."""
  if sig == signal.SIGTERM and _at_exit and previous in (signal.SIG_DFL, None):
    previous = _hold
  signal.signal(sig, previous)


def _raise_interrupt(signum: int) -> None:
  raise KeyboardInterrupt


class StopRequest:
  """The first SIGINT or SIGTERM asks to stop cleanly; a second Ctrl-C stops at once.

  `message`: printed (flushed, to stdout) on the first signal; text, or a function of the
  signal number. `on_request(signum)`: called on the first signal, after the message.
  `on_abort(signum)`: called on each later SIGINT; by default it raises KeyboardInterrupt.
  `count` is the number of signals received, `requested` whether there was one.
  """

  def __init__(self, message: str | Callable[[int], str] | None = None, *,
               on_request: Callable[[int], None] | None = None,
               on_abort: Callable[[int], None] = _raise_interrupt):
    self.message = message
    self.on_request = on_request
    self.on_abort = on_abort
    self.count = 0
    self._previous: dict[int, object] = {}

  @property
  def requested(self) -> bool:
    return self.count > 0

  def handle(self, signum: int, frame=None) -> None:
    """The signal handler (callable directly, as a test or a caller forwarding a signal)."""
    del frame
    self.count += 1
    if self.count > 1:
      if signum == signal.SIGINT:
        self.on_abort(signum)
      return
    text = self.message(signum) if callable(self.message) else self.message
    if text:
      print(text, flush=True)
    if self.on_request is not None:
      self.on_request(signum)

  def __enter__(self) -> "StopRequest":
    if threading.current_thread() is threading.main_thread():
      for sig in SIGNALS:
        self._previous[sig] = signal.signal(sig, self.handle)
      if _held:   # a SIGTERM held since start-up (hold_early): the first request
        self.handle(_held[0])
        _held.clear()
    return self

  def __exit__(self, *exc) -> bool:
    for sig, previous in self._previous.items():
      _restore(sig, previous)
    self._previous.clear()
    return False


class StartUp:
  """`lra run` from its first line to its training loop (imports, checks, the preflight's
  compiles, the data): the first SIGINT or SIGTERM is held (printing `message` once), so that
  no KeyboardInterrupt lands in a library's callback, where it is lost (jax's gc callback) or
  aborts the process (a compile thread still inside XLA at exit). `requested` says whether one
  was held: the command stops at its next stage with one line; a run of several processes
  instead leaves it for the training loop's StopRequest, which takes a held signal as its first
  request, so that all processes stop at one step. A second Ctrl-C (in one process, a second
  signal of either kind) stops at once: `abort` is printed to stderr and the process ends with
  status 130 without running Python's exit (nothing has been trained; a compile thread would
  otherwise abort the interpreter's shutdown).
  Main thread only, like StopRequest."""

  def __init__(self, message: Callable[[int], str], abort: str):
    self.message = message
    self.abort = abort
    self._previous: dict[int, object] = {}

  @property
  def requested(self) -> bool:
    return bool(_held)

  @property
  def signum(self) -> int | None:
    return _held[0] if _held else None

  def handle(self, signum: int, frame=None) -> None:
    del frame
    alone = os.environ.get("LRA_DISTRIBUTED", "0") != "1"
    if _held and (signum == signal.SIGINT or alone):
      print(self.abort, file=sys.stderr, flush=True)
      sys.stdout.flush()
      os._exit(130)
    # Held before the message is out: the message is what tells a user (or a test) that a
    # second signal now stops at once, and that signal's handler can run inside this one's
    # print (Python runs a handler between any two bytecodes of the main thread), where it must
    # already see the first as held. Recorded after the message, a second signal sent on seeing
    # it was taken for a first one and a third was needed.
    first = not _held
    _held.append(signum)
    if first:
      print(self.message(signum), flush=True)

  def __enter__(self) -> "StartUp":
    if threading.current_thread() is threading.main_thread():
      for sig in SIGNALS:
        self._previous[sig] = signal.signal(sig, self.handle)
    return self

  def __exit__(self, *exc) -> bool:
    for sig, previous in self._previous.items():
      _restore(sig, previous)
    if self._previous and _held:
      # The command ends on the signal it held (it said so). A second Ctrl-C while the
      # interpreter shuts down (XLA's thread pools take a moment) would end the process killed
      # by the signal instead of with status 130; nothing is left to stop, so it is ignored
      # (Python keeps an ignored signal ignored through its shutdown).
      signal.signal(signal.SIGINT, signal.SIG_IGN)
    self._previous.clear()
    _held.clear()   # taken by the run's StopRequest, or it ended the command
    return False
