"""Tests for lra/signals.py: the first SIGINT or SIGTERM asks to stop, a second Ctrl-C stops at
once, a second SIGTERM changes nothing, and the handlers are put back afterwards."""

import signal
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
