"""What `lra launch tpu` runs on the TPU workers (launch/tpu.py): stopping what holds the TPU,
unpacking the code and bootstrapping the venv once (`prepare_script`), and the `lra` command on
every worker (`worker_script`)."""

from __future__ import annotations

import hashlib
import os
import re
import shlex

from launch import remote

TARBALL = "lra-src.tar.gz"          # in each worker's home
REMOTE = "$HOME/lra"                # on each worker: src/, venv/, bootstrapped-<hash>
PYTHON = "python3.11"               # the venv's interpreter (setup.py: python_requires >= 3.11)


def jax_version() -> str:
  """The jax version setup.py pins."""
  with open(os.path.join(remote.ROOT, "setup.py")) as f:
    found = re.search(r"[\"']jax==([^\"']+)[\"']", f.read())
  if not found:
    raise remote.LaunchError("setup.py pins no jax version (\"jax==X\"); the TPU bootstrap "
                             "installs jax[tpu] at that version.")
  return found.group(1)


def bootstrap_marker() -> str:
  """The worker-side file whose presence skips the bootstrap: it names setup.py's hash, so a
  change of the pinned dependencies bootstraps again."""
  with open(os.path.join(remote.ROOT, "setup.py"), "rb") as f:
    digest = hashlib.sha1(f.read() + PYTHON.encode()).hexdigest()[:12]
  return f"{REMOTE}/bootstrapped-{digest}"


def stop_script() -> str:
  """Kills the processes holding the TPU and removes libtpu's lock file (MaxText's way)."""
  return ("for p in $(sudo lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | sort -u); do "
          "kill -9 $p 2>/dev/null && timeout 60 tail --pid=$p -f /dev/null; done; "
          "sudo rm -f /tmp/libtpu_lockfile")


def prepare_script() -> str:
  """Step 4: stop what holds the TPU, unpack the code, bootstrap the venv once."""
  venv, marker = f"{REMOTE}/venv", bootstrap_marker()
  pip = f"{venv}/bin/pip install -q"
  bootstrap = (f"(command -v {PYTHON} >/dev/null || (sudo apt-get -qq update && sudo apt-get "
               f"-qq install -y {PYTHON} {PYTHON}-venv)) && rm -rf {venv} && {PYTHON} -m venv "
               f"{venv} && {pip} --upgrade pip && {pip} \"jax[tpu]=={jax_version()}\" && "
               f"{pip} -e \"{REMOTE}/src[gcs]\" && touch {marker}")
  return (f"{stop_script()}; rm -rf {REMOTE}/src && mkdir -p {REMOTE}/src && tar -xzf "
          f"$HOME/{TARBALL} -C {REMOTE}/src && if [ -f {marker} ] && [ -x {venv}/bin/python ]; "
          f"then echo \"lra: the venv is ready\"; else echo \"lra: bootstrapping {venv} (once)\" "
          f"&& {bootstrap}; fi")


def worker_script(env_items: list[tuple[str, str]], command: remote.RunCommand) -> str:
  """Step 5, the same on every worker (`env_items`: the --env NAME=VALUE pairs)."""
  env = " ".join(f"{k}={shlex.quote(v)}" for k, v in env_items)
  return (f"cd {REMOTE} && export LRA_DISTRIBUTED=1 PYTHONPATH={REMOTE}/src{' ' * bool(env)}"
          f"{env} && exec {REMOTE}/venv/bin/python -m launch.cli {shlex.join(command.argv)}")
