"""Checkpoints of the train state and the data iterator, saved together with orbax.

A step directory holds two items: `state` (the pytree `{"params", "opt", "step"}`, restored
directly into its shardings) and `data` (the input iterator's JSON state, so a resumed run sees
exactly the batches an uninterrupted run would). Resuming picks the latest step that restores;
a step that fails to restore (corrupt or partial files) is reported loudly and the previous one
is tried; when the workdir has checkpoints and none restores, `CheckpointError` is raised rather
than silently starting from scratch. Orbax writes each step to a temporary directory and renames
it when complete, so an interrupted save never looks like a finished step.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

class CheckpointError(RuntimeError):
  """The workdir has checkpoints but none of them can be restored."""


class Checkpointer:
  """Saves every `every` steps (and on request), keeps the newest `keep`, restores the latest."""

  def __init__(self, directory: str, *, every: int, keep: int):
    self.directory = os.path.abspath(os.path.expanduser(directory))
    self.every = int(every)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=int(keep), create=True, enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data"))

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def _step_dirs_on_disk(self) -> list[str]:
    if not os.path.isdir(self.directory):
      return []
    return sorted(d for d in os.listdir(self.directory) if d.split(".")[0].isdigit())

  def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
    """Saves when `step` is on the period (or `force`); returns whether it saved."""
    if not force and (self.every <= 0 or step % self.every):
      return False
    if step in self.manager.all_steps():
      return False
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)
    self.manager.wait_until_finished()
    return True

  def restore_latest(self, abstract_state: Any) -> tuple[Any, dict, int] | None:
    """Restores the newest restorable step as (state, data_state, step), or None if none exist.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct`s with shardings: the target.
    """
    steps = self.steps()
    if not steps:
      leftovers = self._step_dirs_on_disk()
      if leftovers:
        raise CheckpointError(
            f"{self.directory} holds step directories {leftovers} but none is a finished "
            f"checkpoint (partial saves?). Move them away to start from scratch, or point "
            f"--workdir elsewhere.")
      return None
    errors = []
    for step in reversed(steps):
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 - any failure means: try the previous step
        errors.append(f"step {step}: {type(e).__name__}: {str(e)[:300]}")
        print(f"WARNING: checkpoint step {step} in {self.directory} failed to restore; "
              f"falling back to the previous step. Cause: {errors[-1]}", flush=True)
        continue
      data_state = restored["data"]
      if data_state is None:
        errors.append(f"step {step}: the data iterator state is missing")
        continue
      return restored["state"], data_state, step
    raise CheckpointError(
        f"none of the checkpoints in {self.directory} (steps {steps}) could be restored:\n  "
        + "\n  ".join(errors)
        + "\nThe config or code may have changed shapes since they were written, or the files "
          "are damaged. Use a fresh --workdir, or delete the checkpoints to start from scratch.")

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) for a pytree of arrays: the restore target."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def load_params(directory: str, abstract_params: Any) -> tuple[Any, int]:
  """The newest parameters saved in a checkpoint directory (or a workdir's `checkpoints/`).

  Only `params` is read (partial restore), so the source run may have had another optimizer or
  schedule; the shapes must match. Returns (params, step); raises CheckpointError naming the
  directory when there is nothing to restore.
  """
  directory = os.path.abspath(os.path.expanduser(directory))
  if os.path.isdir(os.path.join(directory, "checkpoints")):
    directory = os.path.join(directory, "checkpoints")
  manager, step = None, None
  if os.path.isdir(directory):
    manager = ocp.CheckpointManager(directory, item_names=("state", "data"))
    step = manager.latest_step()
  if step is None:
    if manager is not None:
      manager.close()
    raise CheckpointError(
        f"config.init_from = {directory} holds no finished checkpoint to initialise from; "
        f"finish that run first or clear init_from.")
  target = {"params": abstract_params}
  try:
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True)))
  except Exception as e:  # noqa: BLE001 - report which directory and why, whatever failed
    raise CheckpointError(
        f"could not read the parameters of step {step} in {directory} (config.init_from): "
        f"{type(e).__name__}: {str(e)[:300]}. The model config must match that run's "
        f"(parameter shapes may not depend on the sequence length).") from e
  finally:
    manager.close()
  return restored["state"]["params"], step
