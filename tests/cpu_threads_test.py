"""XLA:CPU's thread pool with several CPU devices: the `lra` command sizes it (lra/cpus.py
`cpu_threads`), and a training-like chain of collective steps then runs to the end instead of
deadlocking, as it does with the default pool on a machine with as many cores as devices."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lra import cpus

# A chain of steps over 8 CPU devices, each ending in an all-reduce (the shape of a training
# loop), dispatched without waiting, as the trainer does. XLA ends a deadlocked process after
# the collective timeout, set short here so that a deadlock fails the test in seconds.
CHAIN = """
import jax, jax.numpy as jnp
mesh = jax.make_mesh((8,), ("d",))
x = jax.device_put(jnp.ones((8 * 128, 128)) / 128, jax.NamedSharding(mesh, jax.P("d")))
w = jnp.eye(128)
step = jax.jit(lambda x, w: x + jnp.mean(jnp.tanh(x @ w) @ w))
for _ in range(300):
  x = step(x, w)
x.block_until_ready()
print("done", len(jax.devices()))
"""


@pytest.mark.parametrize("environ,expected", [
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, "32"),
    ({"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=3"}, "12"),
    ({"JAX_NUM_CPU_DEVICES": "2"}, "8"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_NUM_CPU_DEVICES": "5"}, "20"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NPROC": "6"}, "6"),  # kept
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}, None),
    ({"JAX_NUM_CPU_DEVICES": "many"}, None),
    ({}, None),
])
def test_the_pool_is_sized_only_for_several_cpu_devices(environ, expected):
  environ = dict(environ)
  cpus.cpu_threads(environ)
  assert environ.get("NPROC") == expected


@pytest.mark.slow
def test_a_chain_of_collective_steps_on_8_cpu_devices_runs_to_the_end():
  env = {k: v for k, v in os.environ.items() if k != "NPROC"}   # conftest's NPROC left out
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8 "
             "--xla_cpu_collective_call_terminate_timeout_seconds=10 "
             "--xla_cpu_collective_call_warn_stuck_timeout_seconds=5")
  cpus.cpu_threads(env)                                        # what `lra` does first
  assert env["NPROC"] == "32"
  for _ in range(3):
    done = subprocess.run([sys.executable, "-c", CHAIN], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["done", "8"]


# Runs `python -m launch.cli list` as the sweep starts a run and prints the NPROC it ended with.
AS_MAIN = """
import os, runpy, sys
sys.argv = ["launch.cli", "list"]
try:
  runpy.run_module("launch.cli", run_name="__main__")
except SystemExit as e:
  assert not e.code, e.code
print("NPROC", os.environ.get("NPROC"))
"""


@pytest.mark.parametrize("flags,expected", [("--xla_force_host_platform_device_count=4", "16"),
                                            ("", "None")])
def test_python_m_launch_cli_sizes_the_pool_as_the_command_does(flags, expected):
  env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "JAX_NUM_CPU_DEVICES")}
  env["XLA_FLAGS"] = flags
  done = subprocess.run([sys.executable, "-c", AS_MAIN], env=env, capture_output=True,
                        text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split()[-2:] == ["NPROC", expected]
