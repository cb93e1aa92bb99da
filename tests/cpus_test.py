"""lra/cpus.py: the CPUs `lra sweep --parallel K` gives each run. The split is disjoint and
even; a command started with `LRA_CPUS` runs, every thread JAX starts included, on those CPUs
only; a bad value is refused in one line with exit status 2."""

import os
import subprocess
import sys
import textwrap

import pytest

from lra import cpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_AFFINITY = hasattr(os, "sched_getaffinity")


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("parallel", range(1, 10))
def test_slots_split_the_cpus_evenly_and_share_one_only_when_they_must(n, parallel):
  machine = [3 * i + 1 for i in range(n)]   # CPU numbers need not start at 0 nor be adjacent
  slots = cpus.slots(parallel, machine)
  assert len(slots) == parallel
  assert all(slots) and all(set(s) <= set(machine) for s in slots)
  taken = [c for s in slots for c in s]
  if parallel <= n:   # disjoint, every CPU used, sizes within one of each other
    assert sorted(taken) == machine
    assert max(map(len, slots)) - min(map(len, slots)) <= 1
  else:               # one CPU each, every CPU used, no CPU more than once above another
    assert all(len(s) == 1 for s in slots) and set(taken) == set(machine)
    counts = [taken.count(c) for c in machine]
    assert max(counts) - min(counts) <= 1


def test_slots_refuse_nothing_to_split():
  with pytest.raises(ValueError):
    cpus.slots(0, [0, 1])
  with pytest.raises(ValueError):
    cpus.slots(2, [])


@pytest.mark.parametrize("text", ["abc", "0,,1", "-1", "0-3", " ", "1.5"])
def test_parse_refuses_what_is_not_a_list_of_cpus(text):
  with pytest.raises(ValueError, match="is not a list of CPU numbers such as 0,1"):
    cpus.parse_cpus(text)


def test_parse_and_format_round_trip():
  assert cpus.parse_cpus("0") == {0}
  assert cpus.parse_cpus("3, 1,3") == {1, 3}
  assert cpus.format_cpus((0, 2, 5)) == "0,2,5"
  assert cpus.parse_cpus(cpus.format_cpus((0, 2, 5))) == {0, 2, 5}


def lra(env_value: str, *args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, cpus.ENV: env_value, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not HAS_AFFINITY, reason="no CPU affinity on this system")
@pytest.mark.parametrize("value, message", [
    ("abc", "error: LRA_CPUS='abc' is not a list of CPU numbers such as 0,1; unset it to use "
            "every CPU.\n"),
    ("100000", "error: LRA_CPUS=100000 names CPUs this process may not use (it may use "
               "{allowed}); unset it to use every CPU.\n")])
def test_a_bad_value_is_refused_in_one_line_with_exit_2(value, message):
  done = lra(value, "list")
  allowed = cpus.format_cpus(sorted(os.sched_getaffinity(0)))
  assert (done.returncode, done.stdout) == (2, "")
  assert done.stderr == message.format(allowed=allowed)


@pytest.mark.skipif(not HAS_AFFINITY, reason="no CPU affinity on this system")
def test_a_command_with_lra_cpus_runs_every_thread_on_those_cpus():
  """After `command_start`, JAX computes on CPU; every thread of the process, XLA's pool
  included, may run on the one CPU named only."""
  one = max(os.sched_getaffinity(0))
  script = textwrap.dedent("""
      import os, sys
      from lra import host_memory
      assert host_memory.command_start() is None
      import jax, jax.numpy as jnp
      x = jnp.ones((512, 512))
      (x @ x).block_until_ready()
      allowed = set()
      for tid in os.listdir("/proc/self/task"):
        allowed.add(frozenset(os.sched_getaffinity(int(tid))))
      print(len(os.listdir("/proc/self/task")), sorted(map(sorted, allowed)))
      """)
  env = {**os.environ, cpus.ENV: str(one), "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  threads, allowed = done.stdout.split(" ", 1)
  assert int(threads) > 1                    # JAX started threads of its own ...
  assert allowed.strip() == str([[one]])     # ... and each runs on the CPU named only
  unset = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={
      **{k: v for k, v in os.environ.items() if k != cpus.ENV}, "JAX_PLATFORMS": "cpu"},
      capture_output=True, text=True, timeout=120)
  assert unset.stdout.split(" ", 1)[1].strip() == str([sorted(os.sched_getaffinity(0))])


def test_the_pinning_benchmark_reads_each_runs_rate_from_its_log(tmp_path):
  from benchmarks import sweep_pinning
  for name, lines in (("a", ["train: step 150/300 (50%), loss 5.5, 3.10 steps/s, ETA 48s",
                             "train: step 300/300 (100%), loss 5.4489, 3.72 steps/s, took 1m 47s"]),
                      ("b", ["[sweep 2026-11-28] starting: lra run mqar",
                             "train: step 300/300 (100%), loss 5.4483, 4.64 steps/s, took 1m 26s",
                             "test MQAR accuracy 0.0333"]),
                      ("c", ["train: step 10/300 (3%), loss 9.0, 1.00 steps/s, ETA 5m"]),
                      ("d", ["train: step 300/300 (100%), loss 5.3, 1.25 s/step, took 6m 15s"])):
    (tmp_path / name).mkdir()
    (tmp_path / name / "log.txt").write_text("\n".join(lines) + "\n")
  assert sweep_pinning.rates(str(tmp_path)) == [3.72, 4.64, 0.8]   # c never finished
  assert sweep_pinning.main(["--steps", "0"]) == 2


@pytest.mark.skipif(not HAS_AFFINITY, reason="no CPU affinity on this system")
def test_a_sweep_pins_runs_on_the_cpu_only_and_not_with_no_pin(monkeypatch):
  from launch import sweep
  monkeypatch.setattr(cpus, "available", lambda: [0, 1, 2, 3])
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert sweep.cpu_slots(2, pin=True) == [(0, 1), (2, 3)]
  assert sweep.cpu_slots(3, pin=True) == [(0,), (1,), (2, 3)]
  assert sweep.cpu_slots(1, pin=True) is None          # one run: every CPU
  assert sweep.cpu_slots(2, pin=False) is None         # --no_pin
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")          # an accelerator's runs keep the host's
  assert sweep.cpu_slots(2, pin=True) is None          # cores for their input pipelines
