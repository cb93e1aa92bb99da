"""What every part of the device check shares: its budget, its records and the machine they
describe (see benchmarks/device_check.py)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class Budget:
  """A wall-clock budget: `left()` seconds remain of `seconds` from creation."""

  def __init__(self, seconds: float):
    self.seconds, self.start = float(seconds), time.monotonic()

  def used(self) -> float:
    return time.monotonic() - self.start

  def left(self) -> float:
    return self.seconds - self.used()



def nvidia_smi() -> dict | None:
  """GPU name, memory, clocks, power limit and driver from nvidia-smi (None without it)."""
  if shutil.which("nvidia-smi") is None:
    return None
  fields = ("name", "memory.total", "clocks.current.sm", "clocks.max.sm",
            "clocks.current.memory", "clocks.max.memory", "power.limit", "power.draw",
            "temperature.gpu", "pstate", "driver_version")
  try:
    proc = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                           "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired) as e:
    return {"error": f"{type(e).__name__}: {e}"}
  if proc.returncode != 0:          # a field this driver does not know: say so, keep going
    return {"error": (proc.stdout + proc.stderr).strip()[:500]}
  gpus = [dict(zip(fields, (x.strip() for x in line.split(","))))
          for line in proc.stdout.strip().splitlines() if line.strip()]
  return {"gpus": gpus}


def machine() -> dict:
  """What a figure depends on: GPU, its clocks and power limit, the numerical stack."""
  from attention import compat

  info = dict(host=os.uname().nodename, python=sys.version.split()[0],
              cpus=os.cpu_count(), nvidia_smi=nvidia_smi(), versions=compat.versions())
  try:
    import jax
    devices = jax.devices()
    info["devices"] = [f"{d.platform}:{d.device_kind}" for d in devices]
    stats = devices[0].memory_stats() or {}
    info["device_memory_bytes"] = stats.get("bytes_limit")
  except Exception as e:  # recorded, not fatal: env reports the failure itself
    info["devices"] = f"{type(e).__name__}: {e}"
  return info


class Recorder:
  """Appends records to DIR/<part>.jsonl and lines to DIR/<part>.log (and stdout)."""

  def __init__(self, out: str, part: str, command: str, info: dict):
    os.makedirs(out, exist_ok=True)
    self.part, self.command, self.machine = part, command, info
    self.jsonl = os.path.join(out, f"{part}.jsonl")
    self.logfile = open(os.path.join(out, f"{part}.log"), "a", buffering=1)

  def log(self, text: str) -> None:
    line = f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {text}"
    print(line, flush=True)
    self.logfile.write(line + "\n")

  def record(self, **fields: Any) -> dict:
    rec = dict(part=self.part, time=datetime.datetime.now().isoformat(timespec="seconds"),
               **fields, machine=self.machine, command=self.command)
    with open(self.jsonl, "a") as f:
      f.write(json.dumps(rec, default=str) + "\n")
    return rec



def read_jsonl(path: str) -> list[dict]:
  """The records of a JSON lines file ([] when it does not exist)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
