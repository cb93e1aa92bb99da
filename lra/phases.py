"""Staged training: a config with a non-empty `phases` runs one training run per phase.

Phase k (from 1) runs `train_and_evaluate` in `<workdir>/phase<k>` with the phase's steps,
sequence length, window multiplier, learning rate, batch size and warmup (`phase_config`),
starting from phase k-1's final parameters (`config.init_from`). A phase whose `results.json`
exists is skipped and an interrupted one resumes, so rerunning the same command continues the
schedule. The character-LM configs (Longformer's five phases) use it.

Each phase logs to its own `metrics.jsonl` and `tensorboard/` with its own steps (1 to its
`steps`), which its resumption relies on. `RunLog` keeps the whole run's log beside them, in
`<workdir>/metrics.jsonl` and `<workdir>/tensorboard/`: every phase's records with its steps
continued after the earlier phases' (phase k's step s is logged at s plus the steps of phases 1
to k-1; the record keeps `phase` and `phase_step`), copied from the phase's file while it trains
(at most every `SYNC_SECONDS`, through a step hook) and when it ends. A phase's file that no
longer starts with what was copied (a resumed phase drops the records after its checkpoint) has
the run's log rebuilt from all the phases' files, so each step is logged once.

`plans` (optional) are the trainers the preflight planned and compiled (the `trainer` of each
`lra.preflight.check` report), for the run or any of its phases: each run takes the one made
for its steps (`Trainer.is_plan_for`), and plans its own when there is none.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Sequence

import ml_collections

from lra import storage
from lra.rundir import RunDir

# The fields a phase sets (`config.phases` is a tuple of dicts with exactly these keys).
PHASE_KEYS = ("steps", "max_length", "window_scale", "learning_rate", "batch_size",
              "warmup_steps")
# Optional: the task a phase trains (`config.protocol = "spt"` pretrains `<task>+<objective>`
# in phase 1, see configs/common.py `apply_protocol`).
OPTIONAL_KEYS = ("task",)
SYNC_SECONDS = 30.0   # how often a training phase's new records reach the run's own log
# Fields of a metrics record that are not TensorBoard scalars.
NOT_SCALARS = ("step", "split", "time", "phase", "phase_step")


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
  done = storage.read_json(RunDir(run_dir).results)
  return None if done is None else {**done, "interrupted": False}


def results_path(workdir: str, results: dict[str, Any]) -> str:
  """Where the results of a run (or of the last phase of a staged run) were written."""
  if results.get("phases"):
    return RunDir(workdir).phase(len(results["phases"])).results
  return RunDir(workdir).results


class RunLog:
  """The staged run's log in `<workdir>/metrics.jsonl` and `<workdir>/tensorboard/`: every
  phase's records, steps continued across the phases (process 0 writes it; see the module
  docstring). `steps[k]` is phase k+1's number of steps."""

  def __init__(self, workdir: str, steps: Sequence[int], *, enabled: bool = True):
    self.workdir = workdir
    self.offsets = [sum(steps[:k]) for k in range(len(steps))]
    self.enabled = enabled
    self.lines = storage.LineFile(RunDir(workdir).metrics)
    self.tensorboard_dir = RunDir(workdir).tensorboard
    self.copied: list[list[dict[str, Any]]] = [[] for _ in steps]
    self.summaries = None   # a tensorboardX.SummaryWriter, opened on the first record
    self.synced = 0.0
    if enabled:
      self.rebuild()

  def phase_dir(self, k: int) -> str:
    return RunDir(self.workdir).phase(k + 1).path

  def rebuild(self) -> None:
    """Writes the run's log anew from every phase's metrics.jsonl."""
    self.close()
    storage.makedirs(self.workdir)
    if storage.exists(self.tensorboard_dir):
      storage.rmtree(self.tensorboard_dir)
    self.lines.rewrite([])
    self.copied = [[] for _ in self.offsets]
    for k in range(len(self.offsets)):
      self.sync(k)

  def sync(self, k: int, *, every: float = 0.0) -> None:
    """Copies phase k's (0-based) new records into the run's log; with `every`, only when the
    last copy is at least that many seconds old."""
    if not self.enabled or (every and time.monotonic() - self.synced < every):
      return
    from lra import metrics   # imports jax: not at import time (`lra results` reads phases)
    self.synced = time.monotonic()
    records = metrics.read_metrics(self.phase_dir(k))
    done = self.copied[k]
    if records[:len(done)] != done:
      self.rebuild()
      return
    for record in records[len(done):]:
      self.write(k, record)
      done.append(record)
    if self.summaries is not None:
      self.summaries.flush()

  def write(self, k: int, record: dict[str, Any]) -> None:
    step = self.offsets[k] + int(record["step"])
    self.lines.append(json.dumps({**record, "step": step, "phase": k + 1,
                                  "phase_step": int(record["step"])}))
    if self.summaries is None:
      import tensorboardX   # only a staged run that logs needs it here
      if storage.is_remote(self.tensorboard_dir):
        storage.register_tensorboard_writers()
      self.summaries = tensorboardX.SummaryWriter(self.tensorboard_dir, flush_secs=2,
                                                  filename_suffix=".run")
    for name, value in record.items():
      if (name not in NOT_SCALARS and isinstance(value, (int, float))
          and not isinstance(value, bool)):
        self.summaries.add_scalar(f"{record['split']}/{name}", float(value), step,
                                  walltime=record.get("time"))

  def close(self) -> None:
    if self.summaries is not None:
      self.summaries.close()
      self.summaries = None


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
  import jax
  from lra import tasks, train  # the trainer imports jax and the models
  count = len(config.phases)
  summary = []
  results: dict[str, Any] = {}
  log = RunLog(workdir, [int(p["steps"]) for p in config.phases],
               enabled=jax.process_index() == 0)
  try:
    for k in range(count):
      phase_dir = RunDir(workdir).phase(k + 1).path
      c = phase_config(config, k)
      if k > 0:   # from the previous phase (in init_from_hf's architecture, if given)
        with c.unlocked():
          c.init_from = RunDir(workdir).phase(k).checkpoints
      earlier = finished_results(phase_dir)
      if earlier is not None:
        results = earlier
        print(f"Phase {k + 1}/{count}: finished earlier ({phase_dir}); skipped.", flush=True)
      else:
        print(f"Phase {k + 1}/{count}: {c.num_train_steps} steps of batch {c.batch_size}, "
              f"length {c.data.max_length}, windows x{config.phases[k]['window_scale']}, "
              f"learning rate {c.learning_rate:g}, in {phase_dir}", flush=True)
        copy = lambda step, k=k: log.sync(k, every=SYNC_SECONDS)
        results = train.train_and_evaluate(c, phase_dir, hooks=(*hooks, copy),
                                           plan=_plan_for(plans, c))
        log.sync(k)
        if results["interrupted"]:
          return {**results, "phases": summary}
        if k + 1 < count:   # the last phase's line is the run's own last line
          line = tasks.get_task(c.task).result_line(
              results, RunDir(phase_dir).results)
          print(f"Phase {k + 1}/{count}: {line}", flush=True)
      summary.append({key: v for key, v in results.items()
                      if key not in ("state", "interrupted")})
  finally:
    log.close()
  return {**results, "phases": summary}


def run(config: ml_collections.ConfigDict, workdir: str, *,
        hooks: Sequence[Callable[[int], None]] = (), plans: Sequence[Any] = ()) -> dict[str, Any]:
  """Trains `config` in `workdir`: all its phases when it has any, else one run."""
  if config.get("phases"):
    return run_phases(config, workdir, hooks=hooks, plans=plans)
  from lra import train
  return train.train_and_evaluate(config, workdir, hooks=hooks, plan=_plan_for(plans, config))
