"""Compiling in the background and keeping what was compiled.

`compile_cache()` turns on JAX's persistent compilation cache in the user's cache folder
(`cache_directory()`) for the duration of a block; `Compiling` runs one compilation in a daemon
thread (XLA does not hold Python's lock while it compiles or loads a program, so the caller can
trace the next one meanwhile); `CacheHits` counts the persistent-cache hits of the compilations
in its thread. `lra.preflight` uses all three.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes")


def cache_directory() -> str:
  """Where compiled programs are kept: `$XDG_CACHE_HOME/lra/jax`, else `~/.cache/lra/jax`."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "lra", "jax")


@contextlib.contextmanager
def compile_cache(enabled: bool = True, directory: str | None = None) -> Iterator[str | None]:
  """JAX's persistent compilation cache in `directory` (default `cache_directory()`, or the
  folder JAX was already given) for the duration of the block, every program cached however
  small or fast to compile; yields the folder, or None when disabled or not writable. The
  previous settings are restored afterwards (callers in the same process are unaffected)."""
  if not enabled:
    yield None
    return
  before = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
  path = before["jax_compilation_cache_dir"] or directory or cache_directory()
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    print(f"WARNING: no compile cache ({path}: {e.strerror}); every program is compiled.",
          flush=True)
    yield None
    return
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  compilation_cache.reset_cache()   # JAX opens its cache once per process: open it here
  try:
    yield path
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()



class Compiling:
  """A compilation running in a daemon thread (an interrupted run does not wait for it)."""

  def __init__(self, fn):
    self._out: list = []
    self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
    self._thread.start()

  def _run(self, fn) -> None:
    try:
      self._out.append((True, fn()))
    except BaseException as e:   # raised again in the caller's thread by result()
      self._out.append((False, e))

  def result(self):
    self._thread.join()
    ok, value = self._out[0]
    if not ok:
      raise value
    return value


class CacheHits:
  """Counts persistent-cache hits while active in this thread (JAX's monitoring events fire in
  the thread that compiles)."""

  listening: dict[int, "CacheHits"] = {}

  def __init__(self):
    self.count = 0

  def __enter__(self):
    CacheHits.listening[threading.get_ident()] = self
    if not getattr(CacheHits, "_registered", False):
      jax.monitoring.register_event_listener(CacheHits._event)
      CacheHits._registered = True
    return self

  def __exit__(self, *exc):
    CacheHits.listening.pop(threading.get_ident(), None)
    return False

  @staticmethod
  def _event(name: str, **kwargs) -> None:
    del kwargs
    hits = CacheHits.listening.get(threading.get_ident())
    if name == "/jax/compilation_cache/cache_hits" and hits is not None:
      hits.count += 1
