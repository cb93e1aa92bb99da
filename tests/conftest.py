"""Test setup shared by the whole suite: 8 fake CPU devices, set before any JAX backend starts."""

import os

# XLA:CPU ends the process when one of the 8 device threads reaches a collective more than 40 s
# after the others. On a loaded machine (two test workers beside other jobs on 2 cores) a
# thread can be starved that long, so the suite gives the collectives 10 minutes.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_cpu_collective_call_terminate_timeout_seconds=600 "
                      "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import tempfile  # noqa: E402

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
