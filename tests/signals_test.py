"""Tests for lra/signals.py: the first SIGINT or SIGTERM asks to stop, a second Ctrl-C stops at
once, a second SIGTERM changes nothing, and the handlers are put back afterwards."""

import os
import signal
import subprocess
import sys
import threading

import pytest

from lra import signals


def test_first_signal_requests_a_stop_and_a_second_ctrl_c_aborts(capsys):
  before = {s: signal.getsignal(s) for s in signals.SIGNALS}
  requests = []
  with signals.StopRequest(lambda s: f"stopping ({signals.signal_label(s)})",
                           on_request=requests.append) as stop:
    assert not stop.requested
    signal.raise_signal(signal.SIGTERM)
    assert stop.requested and stop.count == 1 and requests == [signal.SIGTERM]
    signal.raise_signal(signal.SIGTERM)   # changes nothing
    assert stop.count == 2 and requests == [signal.SIGTERM]
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signal.SIGINT)
  assert capsys.readouterr().out == "stopping (SIGTERM)\n"
  assert {s: signal.getsignal(s) for s in signals.SIGNALS} == before


def test_the_second_ctrl_c_can_be_passed_on_instead(capsys):
  aborts = []
  with signals.StopRequest("interrupted", on_abort=aborts.append) as stop:
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGINT)
  assert stop.count == 2 and aborts == [signal.SIGINT]
  assert capsys.readouterr().out == "interrupted\n"


def test_outside_the_main_thread_nothing_is_installed():
  before = signal.getsignal(signal.SIGINT)
  seen = []

  def body():
    with signals.StopRequest("x") as stop:
      seen.append((stop.requested, signal.getsignal(signal.SIGINT)))

  t = threading.Thread(target=body)
  t.start()
  t.join()
  assert seen == [(False, before)]


def test_a_sigterm_held_since_start_up_is_the_first_request(capsys):
  before = signal.getsignal(signal.SIGTERM)
  try:
    signals.hold_early()
    signal.raise_signal(signal.SIGTERM)   # held: the process goes on
    with signals.StopRequest(lambda s: f"stopping ({signals.signal_label(s)})") as stop:
      assert stop.requested and stop.count == 1
    assert capsys.readouterr().out == "stopping (SIGTERM)\n"
    with signals.StopRequest("x") as stop:   # taken once
      assert not stop.requested
  finally:
    signal.signal(signal.SIGTERM, before)


def test_a_sigterm_while_the_process_exits_is_ignored_after_hold_early(tmp_path):
  """A task that stopped cleanly and is tearing down is not killed by a late SIGTERM: the check
  below is registered with atexit before hold_early, so it runs after hold_early's own."""
  child = (
      "import atexit, signal, sys\n"
      "def late():\n"
      "  print('ignored' if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN else 'handled',"
      " flush=True)\n"
      "  signal.raise_signal(signal.SIGTERM)\n"
      "atexit.register(late)\n"
      "from lra import signals\n"
      "signals.hold_early()\n"
      "signals.hold_early()\n"   # a second call registers nothing more
      "sys.exit(130)\n")
  out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert (out.returncode, out.stdout) == (130, "ignored\n"), out.stderr


def test_sigterm_stays_held_after_the_blocks_that_came_before_hold_early():
  """`lra run`'s StartUp begins with the default SIGTERM action; hold_early runs inside it (the
  distributed start) and later blocks end. Then, while jax.distributed's shutdown waits for the
  other processes (before hold_early's atexit function), a late SIGTERM must not kill the
  process: the blocks put back a held SIGTERM, not the default."""
  child = (
      "import os, signal, time\n"
      "from lra import signals\n"
      "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
      "with signals.StartUp(lambda s: 'held', 'abort'):\n"
      "  signals.hold_early()\n"
      "  with signals.StopRequest('stopping') as stop:\n"
      "    pass\n"
      "os.kill(os.getpid(), signal.SIGTERM)\n"
      "time.sleep(0.2)\n"
      "print('alive', signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, flush=True)\n")
  out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert (out.returncode, out.stdout) == (0, "alive True\n"), (out.returncode, out.stderr)


def test_a_second_ctrl_c_while_an_interrupted_start_up_exits_leaves_status_130():
  """A start-up that ends on its held Ctrl-C leaves SIGINT ignored, so a second one during the
  interpreter's shutdown does not kill the process (status -2 instead of 130); one that was
  never interrupted puts Python's handler back."""
  child = (
      "import os, signal, sys\n"
      "from lra import signals\n"
      "with signals.StartUp(lambda s: 'held', 'abort'):\n"
      "  pass\n"
      "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)\n"
      "with signals.StartUp(lambda s: 'held', 'abort'):\n"
      "  os.kill(os.getpid(), signal.SIGINT)\n"
      "print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True)\n"
      "os.kill(os.getpid(), signal.SIGINT)\n"
      "sys.exit(130)\n")
  out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert (out.returncode, out.stdout) == (130, "True\nheld\nTrue\n"), (out.returncode,
                                                                     out.stderr)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_start_up_signal_during_the_first_ones_message_stops_at_once(monkeypatch,
                                                                              second):
  """A second signal whose handler runs while the first one's message is being written (sent
  on seeing its first line, its handler runs between two bytecodes of that print) stops the
  process: it is not taken for a first signal."""
  exits = []
  monkeypatch.setattr(signals.os, "_exit", lambda status: exits.append(status))
  monkeypatch.delenv("LRA_DISTRIBUTED", raising=False)
  start = signals.StartUp(lambda signum: "held; a second signal stops at once", "abort")

  class Writing:   # stdout whose first write delivers the second signal
    def __init__(self):
      self.text = ""

    def write(self, text):
      if not self.text:
        self.text += text
        start.handle(second)
      else:
        self.text += text

    def flush(self):
      pass

  out = Writing()
  monkeypatch.setattr(signals.sys, "stdout", out)
  try:
    start.handle(signal.SIGINT)
    assert exits == [130]
    assert out.text.count("held") == 1
  finally:
    signals._held.clear()
