"""lra/host_memory.py: glibc keeps the blocks XLA:CPU frees, so a step does not fault its
temporaries in again; the settings are made for CPU processes only, and `LRA_MALLOC` is checked."""

import os
import subprocess
import sys
import textwrap

import pytest

from launch import cli
from lra import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeLibc:
  def __init__(self, answer=1):
    self.calls, self.answer = [], answer

  def mallopt(self, option, value):
    self.calls.append((option, value))
    return self.answer


def test_a_cpu_process_gets_one_arena_without_mmap_and_a_high_trim_threshold():
  libc = FakeLibc()
  assert host_memory.keep_freed_memory({"JAX_PLATFORMS": "cpu"}, libc) == "kept"
  # glibc's malloc.h: M_ARENA_MAX -8, M_MMAP_MAX -4, M_TRIM_THRESHOLD -1
  assert libc.calls == [(-8, 1), (-4, 0), (-1, 2 ** 31 - 1)]
  libc = FakeLibc()
  assert host_memory.keep_freed_memory({"JAX_PLATFORMS": "cpu,cuda", "LRA_MALLOC": "keep"},
                                       libc) == "kept"
  assert len(libc.calls) == 3


@pytest.mark.parametrize("environ, why", [
    ({"JAX_PLATFORMS": "cuda"}, "accelerator"), ({"JAX_PLATFORMS": "tpu,cpu"}, "accelerator"),
    ({"JAX_PLATFORM_NAME": "gpu"}, "accelerator"),
    ({"JAX_PLATFORMS": "cpu", "LRA_MALLOC": "system"}, "LRA_MALLOC=system"),
    ({"JAX_PLATFORMS": "cpu", "LRA_MALLOC": " System "}, "LRA_MALLOC=system")])
def test_accelerators_and_the_opt_out_leave_glibc_alone(environ, why):
  libc = FakeLibc()
  assert host_memory.keep_freed_memory(environ, libc) == why
  assert libc.calls == []


def test_a_refused_setting_is_reported():
  assert host_memory.keep_freed_memory({"JAX_PLATFORMS": "cpu"}, FakeLibc(0)) == "mallopt refused"


def test_without_platforms_an_installed_plugin_decides(monkeypatch):
  monkeypatch.setattr(host_memory, "accelerator_installed", lambda: True)
  assert not host_memory.cpu_backend({})
  monkeypatch.setattr(host_memory, "accelerator_installed", lambda: False)
  assert host_memory.cpu_backend({})
  assert host_memory.cpu_backend({"JAX_PLATFORMS": " CPU "})


def test_a_gpu_plugin_entry_point_counts_as_an_accelerator(monkeypatch):
  monkeypatch.setattr(host_memory.importlib.util, "find_spec", lambda name: None)
  monkeypatch.setattr(host_memory.importlib.metadata, "entry_points",
                      lambda group: ["xla_cuda12"] if group == "jax_plugins" else [])
  assert host_memory.accelerator_installed()
  monkeypatch.setattr(host_memory.importlib.metadata, "entry_points", lambda group: [])
  assert not host_memory.accelerator_installed()


def test_this_machine_has_no_accelerator_plugin():
  # CI's machines and this suite compute on the CPU: the settings are made for the suite.
  assert host_memory.cpu_backend({})


@pytest.mark.parametrize("value", ["off", "1", "mmap"])
def test_a_bad_value_is_refused_in_one_line(value, capsys, monkeypatch):
  monkeypatch.setenv("LRA_MALLOC", value)
  with pytest.raises(ValueError, match="LRA_MALLOC=keep .* or LRA_MALLOC=system"):
    host_memory.keep_freed_memory()
  assert cli.main(["list"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith(f"error: LRA_MALLOC={value!r}")


def test_every_lra_process_makes_the_settings(monkeypatch):
  # `lra` and `python -m launch.cli` (sweep, SLURM and TPU workers) come through cli.main, the
  # multi-process tests' `python -m launch.train` through train.main.
  seen = []
  monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: seen.append(1) or "kept")
  assert cli.main(["list"]) == 0
  assert seen == [1]
  env = dict(os.environ, LRA_MALLOC="bogus", PYTHONPATH=ROOT)
  for module in ("launch.cli", "launch.train"):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: LRA_MALLOC='bogus'"), module
    assert done.stderr.count("\n") == 1 and not done.stdout


FAULTS = textwrap.dedent("""
    import resource, sys
    from lra import host_memory
    print(host_memory.keep_freed_memory())
    import jax, jax.numpy as jnp
    x = jnp.ones((2048, 8192), jnp.float32)                 # 64 MiB
    f = jax.jit(lambda x: jnp.sum(jnp.cumsum(x * 2.0, axis=0) ** 2))   # 64 MiB temporaries
    faults = []
    for _ in range(30):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      f(x).block_until_ready()
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(sum(faults[-10:]))
""")


def _faults(choice: str) -> tuple[str, int]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", LRA_MALLOC=choice, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  done = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, env=env,
                        cwd=ROOT, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  what, faults = done.stdout.split()
  return what, int(faults)


@pytest.mark.skipif(not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"),
                    reason="glibc's allocator only")
def test_kept_blocks_stop_the_page_faults_of_each_execution():
  """With glibc's defaults each execution maps its temporaries afresh and faults every page in
  (4 KiB pages: 16,384 per 64 MiB); with the settings the last 10 of 30 executions reuse them."""
  (kept, kept_faults), (system, system_faults) = _faults("keep"), _faults("system")
  assert (kept, system) == ("kept", "LRA_MALLOC=system")
  assert system_faults > 10 * 16_384, system_faults
  assert kept_faults < system_faults / 4, (kept_faults, system_faults)
