"""Tests for lra/progress.py: the tqdm bar the trainer drives on a terminal, from a resumed step
to the end, and the plain lines it writes into a pipe or a file."""

import io

from lra import progress


def test_bar_counts_from_the_resumed_step_and_ends_with_a_line():
  stream = io.StringIO()
  bar = progress.Progress(100, 40, stream=stream, interval=0.0, lines=False)
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
  bar = progress.Progress(10, stream=stream, interval=60.0, lines=False)
  drawn = stream.getvalue()
  bar.update(3, 2.5)
  assert stream.getvalue() == drawn
  bar.update(4, 2.0, force=True)
  assert "4/10" in stream.getvalue() and "loss 2.0000" in stream.getvalue()
  bar.close()


class Piped(io.StringIO):
  def isatty(self):
    return False


class Terminal(io.StringIO):
  def isatty(self):
    return True


def test_into_a_pipe_it_writes_plain_lines_at_most_every_line_interval(monkeypatch):
  clock = [100.0]
  monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
  stream = Piped()
  bar = progress.Progress(1000, 100, stream=stream, line_interval=60.0)
  assert stream.getvalue() == ""               # nothing until there is progress to report
  for step in range(101, 1001):
    clock[0] += 0.25                           # 4 steps/s: a line every 240 steps
    bar.update(step, 2.0)
  bar.close()
  bar.close()
  lines = stream.getvalue().splitlines()
  assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()
  assert lines[0] == "train: step 340/1000 (34%), loss 2.0000, 4.00 steps/s, ETA 2m 45s"
  assert [l.split(",")[0] for l in lines] == [
      "train: step 340/1000 (34%)", "train: step 580/1000 (58%)",
      "train: step 820/1000 (82%)", "train: step 1000/1000 (100%)"]
  assert lines[-1].endswith("took 3m 45s")


def test_the_last_step_is_written_once_when_its_update_already_wrote_it(monkeypatch):
  """The update of the last step can fall due for a line; closing then repeats nothing."""
  clock = [0.0]
  monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
  stream = Piped()
  bar = progress.Progress(300, stream=stream, line_interval=30.0)
  for step in range(1, 301):
    clock[0] += 0.1                            # a line every 300 steps: at step 300 exactly
    bar.update(step, 5.5)
  bar.close()
  assert stream.getvalue() == "train: step 300/300 (100%), loss 5.5000, 10.00 steps/s, took 30s\n"
  clock[0] = 0.0
  stream = Piped()                             # a new loss after the line: written at close
  bar = progress.Progress(300, stream=stream, line_interval=30.0)
  for step in range(1, 301):
    clock[0] += 0.1
    bar.update(step, 5.5)
  bar.update(300, 5.25)
  bar.close()
  assert [l.split(", ")[1] for l in stream.getvalue().splitlines()] == ["loss 5.5000",
                                                                         "loss 5.2500"]


def test_a_terminal_gets_the_bar_and_a_forced_update_a_line_in_a_pipe():
  assert progress.Progress(10, stream=Terminal()).bar is not None
  stream = Piped()
  bar = progress.Progress(10, stream=stream, line_interval=3600.0)
  bar.update(2, 1.5, force=True)
  assert stream.getvalue().startswith("train: step 2/10 (20%), loss 1.5000")


def test_a_failing_step_ends_the_bar_line_before_the_error_line():
  """The trainer loop closes the bar when a step or a save fails, so that the command's one
  error line (a full disk) starts a line of its own instead of following the bar's."""
  import types

  import pytest

  from lra import loop

  stream = io.StringIO()
  run = loop.Run.__new__(loop.Run)
  run.start_step, run.total_steps, run.periodic = 0, 10, []
  run.bar = progress.Progress(10, stream=stream, interval=0.0, lines=False)
  run.vote = types.SimpleNamespace(now=lambda: False, after_step=lambda: False)
  steps = []

  def take_step():
    steps.append(len(steps) + 1)
    run.bar.update(len(steps))
    if len(steps) == 3:
      raise OSError(28, "No space left on device")

  run.take_step = take_step
  with pytest.raises(OSError):
    run.train()
  assert stream.getvalue().endswith("\n") and "3/10" in stream.getvalue().rsplit("\r", 1)[-1]


def test_a_loss_from_an_earlier_step_names_its_step(monkeypatch):
  """Stopped at step 138 with the last window logged at step 100: the line shows that loss as
  step 100's, not as the current step's; a loss of the current step is shown plainly."""
  clock = [0.0]
  monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
  stream = Piped()
  bar = progress.Progress(1000, stream=stream, line_interval=3600.0)
  clock[0] = 10.0
  bar.update(100, 2.5, loss_step=100, force=True)
  bar.update(138, 2.5, loss_step=100)
  bar.close()
  lines = stream.getvalue().splitlines()
  assert lines[0].startswith("train: step 100/1000 (10%), loss 2.5000, ")
  assert lines[1].startswith("train: step 138/1000 (14%), loss 2.5000 (step 100), ")
  bar = progress.Progress(1000, stream=Terminal())
  bar.update(138, 2.5, loss_step=100)
  assert bar.bar.postfix == "loss 2.5000 (step 100)"
  bar.update(200, 2.25)
  assert bar.bar.postfix == "loss 2.2500"
  bar.close()
