"""Tests for lra/lock.py: the liveness check and lock holder as `lra sweep` and `lra results` read
them, the heartbeat a holder keeps and the takeover of a lock from another host once it stops,
and the refusal every process of a run learns (the lock taken and taken over by real runs is
tested in tests/faults_test.py, a refused two-task SLURM job in tests/slurm_launch_test.py)."""

import json
import os
import socket
import subprocess
import sys
import threading
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


def _foreign_lock(path, age_s: float) -> None:
  path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "earlier"}))
  then = time.time() - age_s
  os.utime(path, (then, then))


def test_a_lock_from_another_host_is_taken_over_once_its_heartbeat_stops(tmp_path):
  path = tmp_path / "lock"
  _foreign_lock(path, age_s=lock.STALE_AFTER - 30)   # beat 30 s before it would be stale
  try:
    lock.WorkdirLock(str(tmp_path)).acquire()
    raise AssertionError("a live lock on another host was taken over")
  except lock.WorkdirBusy as e:
    assert "in use by another run (pid 1 on elsewhere, started earlier)" in str(e)
  _foreign_lock(path, age_s=lock.STALE_AFTER + 30)
  with lock.WorkdirLock(str(tmp_path)):
    assert lock.live_holder(str(tmp_path)) == os.getpid()
  assert lock.STALE_AFTER <= 300   # minutes, not hours


def test_the_holder_keeps_its_heartbeat_until_it_releases(tmp_path):
  path = tmp_path / "lock"
  with lock.WorkdirLock(str(tmp_path), heartbeat_s=0.05):
    os.utime(path, (0, 0))
    deadline = time.time() + 10
    while os.path.getmtime(path) == 0:
      assert time.time() < deadline, "no heartbeat"
      time.sleep(0.02)
  assert not path.exists()
  deadline = time.time() + 10   # the thread ends at its next beat (later on a busy machine)
  while any(t.name == "workdir-lock-heartbeat" for t in threading.enumerate()):
    assert time.time() < deadline, "the heartbeat thread outlived its lock"
    time.sleep(0.02)


def test_every_process_learns_the_refusal(tmp_path):
  """process 0 (enabled) and another process (not enabled) of a run, with `agree` standing in
  for the all-gather: both raise the same one line when the workdir is busy, neither does when
  it is free."""
  votes = []

  def agree_with(others: bool):
    def agree(refused: bool) -> bool:
      votes.append(refused)
      return refused or others
    return agree

  path = tmp_path / "lock"
  path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                              "started": "then"}))
  messages = []
  for enabled, others in ((True, False), (False, True)):
    try:
      lock.WorkdirLock(str(tmp_path), enabled=enabled, agree=agree_with(others)).acquire()
      raise AssertionError("not refused")
    except lock.WorkdirBusy as e:
      messages.append(str(e))
  assert votes == [True, False] and messages[0] == messages[1], messages
  assert f"pid {os.getppid()} on {socket.gethostname()}" in messages[0]
  path.unlink()
  votes.clear()
  holder = lock.WorkdirLock(str(tmp_path), enabled=True, agree=agree_with(False))
  other = lock.WorkdirLock(str(tmp_path), enabled=False, agree=agree_with(False))
  holder.acquire()
  other.acquire()
  assert votes == [False, False] and lock.live_holder(str(tmp_path)) == os.getpid()
  other.release()
  assert path.exists()   # only the holder removes it
  holder.release()
  assert not path.exists()


def test_a_task_checks_the_lock_before_it_imports_jax(tmp_path, capsys):
  import pytest
  assert lock.refusal(str(tmp_path)) is None
  lock.exit_if_busy(["run", "listops", "--workdir", str(tmp_path)])   # free: returns
  (tmp_path / "lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                             "started": "then"}))   # a live run here
  with pytest.raises(SystemExit) as e:
    lock.exit_if_busy(["run", "listops", "--workdir", str(tmp_path), "--size", "small"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err == (f"error: {tmp_path} is in use by another run (pid {os.getppid()} on "
                 f"{socket.gethostname()}, started then); wait for it to finish, stop it, or use "
                 f"another --workdir (delete {tmp_path}/lock only if that run is gone).\n")
  _foreign_lock(tmp_path / "lock", age_s=lock.STALE_AFTER + 30)   # a dead job elsewhere
  assert lock.refusal(str(tmp_path)) is None
