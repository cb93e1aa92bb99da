"""The training progress bar on stderr (tqdm): step of total, loss, steps/s and ETA.

`Progress(total_steps, start_step)` starts at the resumed step, so the rate and ETA count only
this run's steps; `update(step, loss)` moves it to `step` (redrawn at most every `interval`
seconds, as tqdm's `mininterval`); `close()` draws the final line and ends it with a newline.
"""

from __future__ import annotations

import sys
from typing import TextIO

import tqdm


class Progress:
  """A tqdm bar over training steps, with the last logged loss as its postfix."""

  def __init__(self, total_steps: int, start_step: int = 0, *, interval: float = 1.0,
               stream: TextIO | None = None):
    self.total = total_steps
    self.start_step = start_step
    self.bar = tqdm.tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         file=stream or sys.stderr, mininterval=interval, dynamic_ncols=True)

  def update(self, step: int, loss: float | None = None, force: bool = False) -> None:
    """Moves the bar to `step`; `loss` (if given) is shown; `force` redraws it now."""
    if loss is not None:
      self.bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
    self.bar.update(step - self.bar.n)
    if force:
      self.bar.refresh()

  def close(self) -> None:
    """Draws the final state and ends the line (calling it again does nothing)."""
    self.bar.close()
