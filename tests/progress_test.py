"""Tests for lra/progress.py: the tqdm bar the trainer drives, from a resumed step to the end."""

import io

from lra import progress


def test_bar_counts_from_the_resumed_step_and_ends_with_a_line():
  stream = io.StringIO()
  bar = progress.Progress(100, 40, stream=stream, interval=0.0)
  bar.update(41)
  for step in range(42, 101):
    bar.update(step, 1.0 / step)
  bar.close()
  bar.close()   # closing twice is fine
  out = stream.getvalue()
  assert out.endswith("\n") and out.count("\n") == 1
  final = out.rsplit("\r", 1)[-1]
  assert "100/100" in final and "loss 0.0100" in final and "step/s" in final
  assert "40/100" in out.split("\r")[1]      # starts at the resumed step, not at 0


def test_updates_within_the_interval_are_not_drawn_unless_forced():
  stream = io.StringIO()
  bar = progress.Progress(10, stream=stream, interval=60.0)
  drawn = stream.getvalue()
  bar.update(3, 2.5)
  assert stream.getvalue() == drawn
  bar.update(4, 2.0, force=True)
  assert "4/10" in stream.getvalue() and "loss 2.0000" in stream.getvalue()
  bar.close()
