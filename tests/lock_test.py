"""Tests for lra/lock.py's liveness check and lock holder as `lra sweep` and `lra results` read
them (the lock taken and taken over by real runs is tested in tests/faults_test.py)."""

import json
import os
import socket
import subprocess
import sys
import time

from lra import lock


def _state(pid: int) -> str:
  with open(f"/proc/{pid}/stat") as f:
    return f.read().rpartition(")")[2].split()[0]


def test_process_alive_counts_a_zombie_as_exited():
  assert lock.process_alive(os.getpid())
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  deadline = time.time() + 30
  while os.path.exists(f"/proc/{child.pid}") and _state(child.pid) != "Z":
    assert time.time() < deadline
    time.sleep(0.05)
  assert not lock.process_alive(child.pid)   # exited, not reaped yet
  child.wait()
  assert not lock.process_alive(child.pid)


def test_a_process_of_another_user_is_alive(monkeypatch):
  def refused(pid, sig):
    raise PermissionError(1, "Operation not permitted")

  monkeypatch.setattr(lock.os, "kill", refused)
  assert lock.process_alive(os.getpid())


def test_live_holder_names_a_live_holder_on_this_host_only(tmp_path):
  assert lock.live_holder(str(tmp_path)) is None and lock.read_holder(str(tmp_path)) is None
  with lock.WorkdirLock(str(tmp_path)):
    assert lock.live_holder(str(tmp_path)) == os.getpid()
  assert lock.live_holder(str(tmp_path)) is None   # released
  path = tmp_path / "lock"
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True).stdout.strip()
  for record in ({"host": "elsewhere", "pid": os.getpid()},
                 {"host": socket.gethostname(), "pid": int(dead)},
                 {"host": socket.gethostname()}):
    path.write_text(json.dumps(record))
    assert lock.live_holder(str(tmp_path)) is None, record
  path.write_text("")   # a holder still writing it
  assert lock.read_holder(str(tmp_path)) == {} and lock.live_holder(str(tmp_path)) is None
