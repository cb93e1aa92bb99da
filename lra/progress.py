"""The training progress on stderr: step of total, loss, steps/s and ETA.

`Progress(total_steps, start_step)` starts at the resumed step, so the rate and ETA count only
this run's steps; `update(step, loss)` moves it to `step`; `close()` draws the final state
(unless the last line showed it) and ends it. On a terminal it is a tqdm bar redrawn in place
(at most every `interval` seconds, as tqdm's `mininterval`). Into a pipe or a file (a log, `lra run ... | tee`, a batch job), where
redraws would arrive as carriage returns on one ever-growing line, it writes plain lines
instead, one at most every `line_interval` seconds (and when forced, and at the end):
`train: step 160/1600 (10%), loss 1.2345, 5.50 steps/s, ETA 4m 22s`. The loss is the mean of
the last logged window; drawn at a later step (a stop between log steps), it names its step:
`train: step 138/1600 (9%), loss 1.2345 (step 100), ...`.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

import tqdm


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rest = divmod(seconds, 3600)
  m, s = divmod(rest, 60)
  return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s" if m else f"{s}s"


class Progress:
  """A tqdm bar over training steps on a terminal, plain lines elsewhere (see the module
  docstring); `lines` forces one or the other (default: lines unless `stream` is a terminal)."""

  def __init__(self, total_steps: int, start_step: int = 0, *, interval: float = 1.0,
               stream: TextIO | None = None, lines: bool | None = None,
               line_interval: float = 30.0):
    self.total = total_steps
    self.start_step = start_step
    self.stream = stream or sys.stderr
    if lines is None:
      isatty = getattr(self.stream, "isatty", None)
      lines = not (isatty and isatty())
    self.lines = lines
    self.bar = None
    if not lines:
      self.bar = tqdm.tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                           file=self.stream, mininterval=interval, dynamic_ncols=True)
    self.line_interval = line_interval
    self.step, self.loss, self.loss_step = start_step, None, None
    self.t0 = self.written = time.monotonic()
    self.written_state = None   # (step, loss) of the last plain line
    self.closed = False

  def update(self, step: int, loss: float | None = None, force: bool = False,
             loss_step: int | None = None) -> None:
    """Moves to `step`; `loss` (if given) is shown, with `loss_step` (the step it was logged
    at; default `step`) when that is an earlier one; `force` draws it now."""
    if loss is not None:
      self.loss, self.loss_step = loss, step if loss_step is None else loss_step
    self.step = step
    if self.bar is not None:
      if loss is not None:
        self.bar.set_postfix_str(self._loss(), refresh=False)
      self.bar.update(step - self.bar.n)
      if force:
        self.bar.refresh()
    elif force or time.monotonic() - self.written >= self.line_interval:
      self._line()

  def line(self) -> str:
    """The plain line of the current state."""
    done = self.step - self.start_step
    elapsed = time.monotonic() - self.t0
    parts = [f"train: step {self.step}/{self.total} "
             f"({100 * self.step / max(self.total, 1):.0f}%)"]
    if self.loss is not None:
      parts.append(self._loss())
    if done > 0 and elapsed > 0:
      rate = done / elapsed
      parts.append(f"{rate:.2f} steps/s" if rate >= 1 else f"{1 / rate:.2f} s/step")
      if self.step < self.total:
        parts.append(f"ETA {_duration((self.total - self.step) / rate)}")
      else:
        parts.append(f"took {_duration(elapsed)}")
    return ", ".join(parts)

  def _loss(self) -> str:
    earlier = self.loss_step is not None and self.loss_step != self.step
    return f"loss {self.loss:.4f}" + (f" (step {self.loss_step})" if earlier else "")

  def _line(self) -> None:
    self.stream.write(self.line() + "\n")
    self.stream.flush()
    self.written = time.monotonic()
    self.written_state = (self.step, self.loss, self.loss_step)

  def close(self) -> None:
    """Draws the final state and ends the line (calling it again does nothing)."""
    if self.closed:
      return
    self.closed = True
    if self.bar is not None:
      self.bar.close()
    elif self.step > self.start_step and self.written_state != (self.step, self.loss,
                                                                  self.loss_step):
      self._line()   # unless the last update's line already showed this state
