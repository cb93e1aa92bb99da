"""glibc's allocator set up for XLA:CPU: freed blocks are kept for the next step, not unmapped.

XLA:CPU allocates the buffers of each execution (the program's temporaries in one block, and
its outputs) with malloc on a worker thread and frees them when the step is done. glibc serves
a block that large with its own mmap and returns it with munmap (the largest threshold it
allows is 32 MiB; a worker thread's arena holds at most 64 MiB), so every step asks the kernel
for its memory again and page-faults every page of it in, zeroed. At MQAR's size small
(`lra run mqar --size small`, 2 layers of width 32) the block is 185 MB, and 38% of the XLA
threads' time went to those faults; with one arena that never maps its own blocks and a trim
threshold of 2 GiB, the block of one step is reused by the next: 1.34x the steps per second
alone on 2 cores, 1.75x two at a time (docs/training.md has the measurement and the command).

`keep_freed_memory` makes those three `mallopt` settings when the process will compute on the
CPU (no accelerator plugin installed, or `JAX_PLATFORMS` naming the CPU first), unless
`LRA_MALLOC=system`. It has to run before the first thread allocates: before JAX starts its
backend (`command_start` in the commands' `main`, `tests/conftest.py`). Memory freed stays in
the process: its resident size stays near its peak, which a training process reaches on its first
step anyway. Importing this module imports nothing but the standard library and lra.cpus.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import sys

from lra import cpus

ENV = "LRA_MALLOC"        # "keep" (the default) or "system": leave glibc's defaults
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8   # glibc's malloc.h
SETTINGS = ((M_ARENA_MAX, 1),            # every thread allocates from the main arena ...
            (M_MMAP_MAX, 0),             # ... which grows its heap rather than mapping blocks
            (M_TRIM_THRESHOLD, 2 ** 31 - 1))   # and keeps up to 2 GiB of free heap at its top
ACCELERATOR_MODULES = ("libtpu",)        # JAX's TPU runtime; GPU plugins are entry points


def accelerator_installed() -> bool:
  """Whether a JAX accelerator plugin is installed: an entry point of the `jax_plugins` group
  (jax-cuda12-plugin, jax-cuda13-plugin, ROCm's), a `jax_plugins` namespace module, or libtpu."""
  if any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_MODULES):
    return True
  if importlib.metadata.entry_points(group="jax_plugins"):
    return True
  spec = importlib.util.find_spec("jax_plugins")
  return spec is not None and any(
      entry for path in (spec.submodule_search_locations or ())
      for entry in (os.listdir(path) if os.path.isdir(path) else ()) if not entry.startswith("_"))


def cpu_backend(environ=os.environ) -> bool:
  """Whether JAX will compute on the CPU: `JAX_PLATFORMS` (or the older JAX_PLATFORM_NAME)
  names it first, or neither is set and no accelerator plugin is installed."""
  platforms = environ.get("JAX_PLATFORMS", "") or environ.get("JAX_PLATFORM_NAME", "")
  if platforms.strip():
    return platforms.split(",")[0].strip().lower() == "cpu"
  return not accelerator_installed()


def keep_freed_memory(environ=os.environ, libc=None) -> str:
  """Makes glibc keep freed blocks (`SETTINGS`) for a CPU process; returns what it did: "kept",
  or why not ("LRA_MALLOC=system", "not glibc", "accelerator", "mallopt refused"). Raises
  ValueError (one line) for another value of LRA_MALLOC."""
  choice = environ.get(ENV, "").strip().lower() or "keep"
  if choice not in ("keep", "system"):
    raise ValueError(f"{ENV}={environ[ENV]!r}: use {ENV}=keep (the default: freed memory is "
                     f"kept for the next step) or {ENV}=system (glibc's own settings).")
  if choice == "system":
    return f"{ENV}=system"
  if libc is None:
    if not sys.platform.startswith("linux") or "glibc" not in (
        os.confstr("CS_GNU_LIBC_VERSION") or ""):
      return "not glibc"
    libc = ctypes.CDLL(None)
  if not cpu_backend(environ):
    return "accelerator"
  refused = [option for option, value in SETTINGS if libc.mallopt(option, value) != 1]
  return "mallopt refused" if refused else "kept"


def command_start() -> int | None:
  """`keep_freed_memory` and `lra.cpus.restrict` (the CPUs `lra sweep --parallel` gives a run)
  at the start of a command (`lra`, `python -m launch.cli`, `python -m launch.train`): None, or
  2 after the one line that refuses a bad LRA_MALLOC or LRA_CPUS."""
  try:
    keep_freed_memory()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if (error := cpus.restrict()) is not None:
    print(error, file=sys.stderr)
    return 2
  return None
