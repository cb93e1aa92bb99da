"""What each task of an `lra launch slurm` job runs: the `lra` command, with a clean stop
reported to the batch script (`launch/slurm.py`) instead of as a failure. Its own module so that
the launcher does not import the command line it launches."""

from __future__ import annotations

import os

from launch import cli, slurm


def main(argv: list[str]) -> int:
  """A task's `lra` command. A clean stop (130) exits 0 and is noted in `LRA_STOP_MARKER`
  instead: srun's --kill-on-bad-exit would otherwise kill the tasks still saving or shutting
  down when the first one ends, and the batch script reads the note."""
  rc = cli.main(argv)
  marker = os.environ.get("LRA_STOP_MARKER")
  if rc == slurm.STOPPED and marker:
    with open(marker, "a") as f:
      f.write(f"{os.environ.get('SLURM_PROCID', '?')}\n")
    return 0
  return rc
