"""Test setup shared by the whole suite: 8 fake CPU devices, set before any JAX backend starts."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# XLA:CPU runs every device's share of a program on one thread pool of max(cores, devices)
# threads: 8 on a 2-core machine. A chain of steps that each end in a collective (a training
# loop) then deadlocks within a few hundred steps: the pool's threads all wait in one step's
# all-reduce while a device's share of it waits for a thread, and XLA ends the process 40 s
# later. NPROC sets the pool's size (XLA's DefaultThreadPoolSize); twice the devices was enough
# in 35 of 35 stress runs (12 threads deadlocked in 15 of 20), so the suite and the processes it
# starts (they inherit the environment) get four times. The tests that start processes with 2
# devices each are covered by the same number.
os.environ["NPROC"] = "32"

# glibc keeps the blocks XLA:CPU frees instead of unmapping them, as in every `lra` process
# (lra/host_memory.py); before JAX starts its threads.
from lra import host_memory  # noqa: E402

host_memory.keep_freed_memory()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import signal  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# Data defaults (~/lra_data) point into a throwaway folder: no test reads or writes the user's
# data, and no test downloads anything (every `download` default is overridden by the tests that
# build from archives, and this folder starts empty).
os.environ["LRA_DATA"] = tempfile.mkdtemp(prefix="lra-test-data-")
# The compile cache of `lra run` (lra/preflight.py: $XDG_CACHE_HOME/lra/jax) goes there too, so
# the tests that call the command in-process leave nothing in the user's ~/.cache.
os.environ["XDG_CACHE_HOME"] = os.path.join(os.environ["LRA_DATA"], "cache")


def pytest_configure(config):
  # `make test` (and CI) runs everything; `make test-fast` leaves the slow tests out.
  config.addinivalue_line(
      "markers", "slow: end to end (trains models, runs the `lra` command or several processes, "
      "soaks faults); `make test-fast` skips these, CI runs them")


@pytest.fixture(autouse=True)
def _python_sigint_handler():
  """Puts Python's Ctrl-C handler back after each test. A start-up that ends on its held Ctrl-C
  leaves SIGINT ignored for the process's exit (lra/signals.py StartUp); run in-process by a
  test, that would leave the xdist worker ignoring it, and every process the worker's later tests
  start would inherit the ignored signal (a start-up test's Ctrl-C then did nothing)."""
  yield
  if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.default_int_handler)
