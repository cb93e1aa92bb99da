"""A one-line progress display on stderr: step, loss, steps/s and ETA (no tqdm needed)."""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
  """Rewrites one stderr line at most every `interval` seconds; a newline on `close`."""

  def __init__(self, total_steps: int, start_step: int = 0, *, interval: float = 0.5,
               stream=None):
    self.total = total_steps
    self.start_step = start_step
    self.interval = interval
    self.stream = stream or sys.stderr
    self.t0 = time.perf_counter()
    self.last = 0.0
    self.active = False

  def update(self, step: int, loss: float | None = None, force: bool = False) -> None:
    now = time.perf_counter()
    if not force and now - self.last < self.interval:
      return
    self.last = now
    done = step - self.start_step
    rate = done / max(now - self.t0, 1e-9)
    eta = (self.total - step) / rate if rate > 0 else float("inf")
    loss_txt = "" if loss is None else f" loss {loss:.4f}"
    eta_txt = _duration(eta) if eta != float("inf") else "?"
    self.stream.write(f"\rstep {step}/{self.total}{loss_txt} | {rate:.2f} steps/s | "
                      f"ETA {eta_txt}   ")
    self.stream.flush()
    self.active = True

  def close(self) -> None:
    if self.active:
      self.stream.write("\n")
      self.stream.flush()
      self.active = False
