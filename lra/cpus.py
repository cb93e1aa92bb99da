"""Which CPUs a run computes on: `lra sweep --parallel K` gives each of its K runs its own cores.

XLA:CPU sizes its thread pool from the CPUs the process may use. K runs started side by side
each start a pool as large as the machine, and their threads then share every core: on a
2-core machine two MQAR runs of the zoology sweep (band attention, width 64) made 4.5 steps/s
each that way, and 4.9 each when each was held to its own core (docs/training.md, "Runs side by
side", has every kind). So the sweep splits the CPUs it may use into K disjoint sets (`slots`) and
starts each run with the set of a slot no running run holds, named in `ENV`; the run's command
restricts itself to those CPUs (`restrict`) before JAX starts its threads, so every thread it
starts inherits them. Importing this module imports nothing but the standard library.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Sequence

ENV = "LRA_CPUS"   # comma-separated CPU numbers, as `format_cpus` writes them


def available() -> list[int] | None:
  """The CPUs this process may run on, sorted; None where the system cannot say (macOS)."""
  if not hasattr(os, "sched_getaffinity"):
    return None
  return sorted(os.sched_getaffinity(0))


def slots(parallel: int, cpus: Sequence[int]) -> list[tuple[int, ...]]:
  """`parallel` sets of CPUs for as many runs at once: disjoint and as equal as they can be
  (the last ones one CPU larger) when there are at least as many CPUs as runs, otherwise one
  CPU each, in turn, so that runs share a CPU only when they must."""
  if parallel < 1 or not cpus:
    raise ValueError(f"slots needs at least one run and one CPU, not {parallel} and {len(cpus)}")
  n = len(cpus)
  if parallel >= n:
    return [(cpus[i % n],) for i in range(parallel)]
  return [tuple(cpus[i * n // parallel:(i + 1) * n // parallel]) for i in range(parallel)]


def format_cpus(cpus: Sequence[int]) -> str:
  return ",".join(str(c) for c in cpus)


def parse_cpus(text: str) -> set[int]:
  """`ENV`'s value as a set of CPU numbers; ValueError, saying what is wrong, for anything else."""
  try:
    cpus = {int(part) for part in text.split(",")}
  except ValueError:
    raise ValueError(f"{ENV}={text!r} is not a list of CPU numbers such as 0,1") from None
  if not cpus or min(cpus) < 0:
    raise ValueError(f"{ENV}={text!r} is not a list of CPU numbers such as 0,1")
  return cpus


def restrict(environ: Mapping[str, str] = os.environ) -> str | None:
  """Restricts this process to the CPUs `ENV` names, when it is set; returns an error line for a
  value that is not a list of CPUs this process may use, None otherwise. It has to run before
  JAX starts its threads (the commands' `main`), which then inherit the set."""
  text = environ.get(ENV, "").strip()
  if not text:
    return None
  try:
    cpus = parse_cpus(text)
  except ValueError as e:
    return f"error: {e}; unset it to use every CPU."
  allowed = available()
  if allowed is None:
    return None   # no affinity on this system: the run uses every CPU
  if not cpus <= set(allowed):
    return (f"error: {ENV}={text} names CPUs this process may not use (it may use "
            f"{format_cpus(allowed)}); unset it to use every CPU.")
  os.sched_setaffinity(0, cpus)
  return None


def cpu_threads(environ=os.environ) -> None:
  """XLA:CPU runs each device's share of a program on one pool of max(cores, devices) threads.
  With as many CPU devices as cores (8 devices faked on a 2-core machine to rehearse a mesh, or
  2 on 2), a chain of steps that each end in a collective, which a training loop is, deadlocks
  within a few hundred steps and XLA ends the process. NPROC sets the pool's size; when CPU
  devices are asked for (XLA_FLAGS' --xla_force_host_platform_device_count or
  JAX_NUM_CPU_DEVICES) and NPROC is not set, it is set to four times their number, which no
  stress run deadlocked (tests/cpu_threads_test.py). Runs before JAX starts its backend."""
  flag = re.search(r"--xla_force_host_platform_device_count=(\d+)", environ.get("XLA_FLAGS", ""))
  counts = [int(flag.group(1))] if flag else []
  if environ.get("JAX_NUM_CPU_DEVICES", "").strip().isdigit():
    counts.append(int(environ["JAX_NUM_CPU_DEVICES"]))
  if counts and max(counts) > 1:
    environ.setdefault("NPROC", str(4 * max(counts)))
