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

# JAX's persistent compilation cache, for the whole run: a folder of its own (never the user's
# ~/.cache, whatever JAX_COMPILATION_CACHE_DIR the shell holds), made by the first pytest process
# of the run and shared through the environment with xdist's workers and every process the tests
# start, removed when that process exits. Every program is kept however small or fast to compile
# (JAX's defaults keep only those that took a second): the suite compiles the same tiny steps in
# many tests and processes. Tests of the compile cache itself opt out
# (`without_suite_compile_cache` below). LRA_TEST_COMPILE_CACHE=off runs the suite without it (to
# measure what it saves).
SUITE_COMPILE_CACHE = os.environ.get("LRA_TEST_COMPILE_CACHE")
if SUITE_COMPILE_CACHE == "off":
  pass
elif not SUITE_COMPILE_CACHE or not os.path.isdir(SUITE_COMPILE_CACHE):
  import atexit  # noqa: E402
  import shutil  # noqa: E402
  import tempfile  # noqa: E402
  SUITE_COMPILE_CACHE = tempfile.mkdtemp(prefix="lra-test-compile-cache-")
  os.environ["LRA_TEST_COMPILE_CACHE"] = SUITE_COMPILE_CACHE
  atexit.register(shutil.rmtree, SUITE_COMPILE_CACHE, True)
if SUITE_COMPILE_CACHE == "off":
  os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
else:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = SUITE_COMPILE_CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

# glibc keeps the blocks XLA:CPU frees instead of unmapping them, as in every `lra` process
# (lra/host_memory.py); before JAX starts its threads.
from lra import host_memory  # noqa: E402

host_memory.keep_freed_memory()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import signal  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

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
  config.addinivalue_line(
      "markers", "exhaustive: more cases of a path another case of the same test already takes "
      "(further shapes, kinds or sizes); skipped unless `-m` names `exhaustive` or "
      f"{EXHAUSTIVE_ENV}=1 (`make test-exhaustive`)")


# The exhaustive tier: parametrizations that repeat a code path one of their siblings already
# takes run only when asked for, by `-m` naming the marker (`-m exhaustive` runs only them) or by
# LRA_TEST_EXHAUSTIVE=1 (everything, `make test-exhaustive`).
EXHAUSTIVE_ENV = "LRA_TEST_EXHAUSTIVE"


def exhaustive_wanted(markexpr: str, env: str | None) -> bool:
  """Whether the run asked for the exhaustive tier: by its `-m` expression or the variable."""
  return "exhaustive" in (markexpr or "") or (env or "").strip() not in ("", "0")


def pytest_collection_modifyitems(config, items):
  if exhaustive_wanted(config.getoption("markexpr", ""), os.environ.get(EXHAUSTIVE_ENV)):
    return
  skip = pytest.mark.skip(reason=f"exhaustive tier: run with -m exhaustive or {EXHAUSTIVE_ENV}=1")
  for item in items:
    if item.get_closest_marker("exhaustive") is not None:
      item.add_marker(skip)


# The suite's time guard: with LRA_SUITE_LIMIT_S set (.ci/run sets it), a run whose wall time
# exceeds that many seconds fails after its tests, naming its 10 slowest. Unset (a developer's
# `make test`, on a machine as loaded as it happens to be) nothing is checked. Measured in the
# process that reports (xdist's controller, which receives every worker's reports).
SUITE_LIMIT_ENV = "LRA_SUITE_LIMIT_S"
_suite = {"start": None, "durations": {}}


def _reporting(config) -> bool:
  return not hasattr(config, "workerinput")   # not one of xdist's workers


def suite_limit() -> float | None:
  """LRA_SUITE_LIMIT_S in seconds, None when unset or empty; a ValueError for anything else."""
  value = os.environ.get(SUITE_LIMIT_ENV, "").strip()
  if not value:
    return None
  try:
    limit = float(value)
  except ValueError:
    limit = -1.0
  if not limit > 0:
    raise ValueError(f"{SUITE_LIMIT_ENV}={value!r}: give the suite's limit in seconds, such as "
                     f"900, or leave it unset for no limit")
  return limit


def over_limit(seconds: float, limit: float | None, durations: dict[str, float]) -> str | None:
  """The guard's report when `seconds` exceeds `limit`: one line, then the 10 slowest tests
  (setup, call and teardown together), slowest first; None within the limit or without one."""
  if limit is None or seconds <= limit:
    return None
  slowest = sorted(durations.items(), key=lambda item: -item[1])[:10]
  lines = [f"error: the suite took {seconds:.0f} s, over its limit of {limit:.0f} s "
           f"({SUITE_LIMIT_ENV}); its slowest tests:"]
  lines += [f"  {secs:8.1f} s  {nodeid}" for nodeid, secs in slowest]
  return "\n".join(lines)


def pytest_sessionstart(session):
  if _reporting(session.config):
    suite_limit()   # a bad value fails before the tests run, not after
    _suite["start"] = time.monotonic()


def pytest_runtest_logreport(report):
  durations = _suite["durations"]
  durations[report.nodeid] = durations.get(report.nodeid, 0.0) + report.duration


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
  if not _reporting(session.config) or _suite["start"] is None:
    return
  report = over_limit(time.monotonic() - _suite["start"], suite_limit(), _suite["durations"])
  _suite["report"] = report
  if report is not None and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
  if _suite.get("report"):
    terminalreporter.write_line(_suite["report"], red=True, bold=True)


@pytest.fixture
def without_suite_compile_cache(monkeypatch):
  """No suite-wide compile cache in this test or the processes it starts: for the tests of the
  compile cache itself (which folder a run uses, what it leaves there, a first compile that
  must miss)."""
  from jax.experimental.compilation_cache import compilation_cache
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_compilation_cache_dir", before)
  compilation_cache.reset_cache()


@pytest.fixture(autouse=True)
def _python_sigint_handler():
  """Puts Python's Ctrl-C handler back after each test. A start-up that ends on its held Ctrl-C
  leaves SIGINT ignored for the process's exit (lra/signals.py StartUp); run in-process by a
  test, that would leave the xdist worker ignoring it, and every process the worker's later tests
  start would inherit the ignored signal (a start-up test's Ctrl-C then did nothing)."""
  yield
  if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.default_int_handler)
