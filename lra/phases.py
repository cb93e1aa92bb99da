"""Staged training: a config with a non-empty `phases` runs one training run per phase.

Phase k (from 1) runs `train_and_evaluate` in `<workdir>/phase<k>` with the phase's steps,
sequence length, window multiplier, learning rate, batch size and warmup (`phase_config`),
starting from phase k-1's final parameters (`config.init_from`). A phase whose `results.json`
exists is skipped and an interrupted one resumes, so rerunning the same command continues the
schedule. The character-LM configs (Longformer's five phases) use it.

`plans` (optional) are the trainers the preflight planned and compiled (the `trainer` of each
`lra.preflight.check` report), for the run or any of its phases: each run takes the one made
for its steps (`Trainer.is_plan_for`), and plans its own when there is none.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import ml_collections

from lra import storage

# The fields a phase sets (`config.phases` is a tuple of dicts with exactly these keys).
PHASE_KEYS = ("steps", "max_length", "window_scale", "learning_rate", "batch_size",
              "warmup_steps")
# Optional: the task a phase trains (`config.protocol = "spt"` pretrains `<task>+<objective>`
# in phase 1, see configs/common.py `apply_protocol`).
OPTIONAL_KEYS = ("task",)


def _scale_window(spec: Any, scale: float) -> Any:
  """An attention spec dict with its `window` (when it has one) multiplied by `scale`."""
  spec = dict(spec)
  if "window" in spec:
    spec["window"] = int(round(spec["window"] * scale))
  return spec


def phase_config(config: ml_collections.ConfigDict, index: int) -> ml_collections.ConfigDict:
  """The config of phase `index` (0-based): `config` with the phase's fields set and no phases.

  Attention windows (the default spec and every per-layer one) are multiplied by the phase's
  `window_scale`; the model's parameters must not depend on the length (pos_emb "sinusoidal"
  or "none"), since every phase continues the previous one's parameters.
  """
  phases = [dict(p) for p in config.phases]
  for k, phase in enumerate(phases):
    if set(phase) - set(OPTIONAL_KEYS) != set(PHASE_KEYS):
      raise ValueError(f"config.phases[{k}] has keys {sorted(phase)}; a phase needs exactly "
                       f"{', '.join(PHASE_KEYS)} (and may name its {', '.join(OPTIONAL_KEYS)}).")
  if config.model.pos_emb == "learned" and len({p["max_length"] for p in phases}) > 1:
    raise ValueError("the phases change the sequence length, so the model's parameters must "
                     "not depend on it: use --config.model.pos_emb=sinusoidal (or none).")
  phase = phases[index]
  c = ml_collections.ConfigDict(config.to_dict())
  with c.unlocked(), c.ignore_type():
    c.phases = ()
    c.task = str(phase.get("task", c.task))
    c.num_train_steps = int(phase["steps"])
    c.data.max_length = int(phase["max_length"])
    c.learning_rate = float(phase["learning_rate"])
    c.batch_size = int(phase["batch_size"])
    c.warmup_steps = int(phase["warmup_steps"])
    scale = float(phase["window_scale"])
    c.model.attention = ml_collections.ConfigDict(
        _scale_window(config.model.attention.to_dict(), scale), type_safe=False)
    c.model.layer_attention = tuple(_scale_window(x, scale)
                                    for x in (config.model.layer_attention or ()))
    if "init_from" not in c:
      c.init_from = ""
  return c


def finished_results(run_dir: str) -> dict[str, Any] | None:
  """The results.json of a finished run in `run_dir` (with "interrupted": False), or None."""
  done = storage.read_json(storage.join(run_dir, "results.json"))
  return None if done is None else {**done, "interrupted": False}


def results_path(workdir: str, results: dict[str, Any]) -> str:
  """Where the results of a run (or of the last phase of a staged run) were written."""
  if results.get("phases"):
    return storage.join(workdir, f"phase{len(results['phases'])}", "results.json")
  return storage.join(workdir, "results.json")


def _plan_for(plans: Sequence[Any], config: ml_collections.ConfigDict) -> Any:
  """The plan among `plans` made for the steps of `config`, or None."""
  return next((plan for plan in plans if plan.is_plan_for(config)), None)


def run_phases(config: ml_collections.ConfigDict, workdir: str, *,
               hooks: Sequence[Callable[[int], None]] = (),
               plans: Sequence[Any] = ()) -> dict[str, Any]:
  """Runs every phase of `config.phases` in `<workdir>/phase<k>` (k from 1), each starting
  from the previous phase's final parameters; skips finished phases. Returns the results of
  the last phase run (or read), plus "phases" (each phase's results.json) and "interrupted".
  """
  from lra import tasks, train  # the trainer imports jax and the models
  count = len(config.phases)
  summary = []
  results: dict[str, Any] = {}
  for k in range(count):
    phase_dir = storage.join(workdir, f"phase{k + 1}")
    c = phase_config(config, k)
    if k > 0:
      with c.unlocked():
        c.init_from = storage.join(workdir, f"phase{k}", "checkpoints")
    earlier = finished_results(phase_dir)
    if earlier is not None:
      results = earlier
      print(f"Phase {k + 1}/{count}: finished earlier ({phase_dir}); skipped.", flush=True)
    else:
      print(f"Phase {k + 1}/{count}: {c.num_train_steps} steps of batch {c.batch_size}, length "
            f"{c.data.max_length}, windows x{config.phases[k]['window_scale']}, learning rate "
            f"{c.learning_rate:g}, in {phase_dir}", flush=True)
      results = train.train_and_evaluate(c, phase_dir, hooks=hooks, plan=_plan_for(plans, c))
      if results["interrupted"]:
        return {**results, "phases": summary}
      if k + 1 < count:   # the last phase's line is the run's own last line
        line = tasks.get_task(c.task).result_line(
            results, storage.join(phase_dir, "results.json"))
        print(f"Phase {k + 1}/{count}: {line}", flush=True)
    summary.append({key: v for key, v in results.items() if key not in ("state", "interrupted")})
  return {**results, "phases": summary}


def run(config: ml_collections.ConfigDict, workdir: str, *,
        hooks: Sequence[Callable[[int], None]] = (), plans: Sequence[Any] = ()) -> dict[str, Any]:
  """Trains `config` in `workdir`: all its phases when it has any, else one run."""
  if config.get("phases"):
    return run_phases(config, workdir, hooks=hooks, plans=plans)
  from lra import train
  return train.train_and_evaluate(config, workdir, hooks=hooks, plan=_plan_for(plans, config))
