"""The run of `lra.train.train_and_evaluate`: restore, the step loop, the final evaluation.

`run(trainer, config, workdir, ...)` builds a `Run`, which

  restores (`Run.restore`) the train state, the data iterator's position and the open logging
    window's metric sums from the workdir's newest checkpoint (or the parameters from
    `config.init_from`), and the best validation result so far from `best/`;
  trains (`Run.train`): after each step the periodic actions that are due (`Run.periodic`, a
    list of `Periodic(every, action)`: log the train metrics, evaluate on validation, save a
    checkpoint, call the hooks, move the progress bar), then `Run.stop_now` decides whether to
    stop there;
  finishes (`Run.finish`): saves the last step, evaluates the final parameters on validation
    and test and the best ones on test, and writes `results.json`; or, stopped early
    (`Run.stopped`), saves the step it stopped at.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from lra import checkpoint, lock as lock_lib, mesh as mesh_lib, metrics, progress, storage
from lra.data import pipeline
from lra.optim import learning_rate_schedule
from lra.rundir import RunDir
from models import embeddings

SPLITS = ("train", "validation", "test")


@dataclasses.dataclass(frozen=True)
class Periodic:
  """`action(step)` after each train step that is a multiple of `every` (none when `every` is
  0); at the last step `last` decides instead, when given."""

  every: int
  action: Callable[[int], None]
  last: bool | None = None

  def due(self, step: int, total_steps: int) -> bool:
    if step == total_steps and self.last is not None:
      return self.last
    return self.every > 0 and step % self.every == 0


def _backend(spec: dict, causal: bool | None) -> str:
  """The attention backend of the default spec on this platform (the configured one when it
  cannot be resolved here); `causal`: the task's `causal_attention`."""
  from attention import backends
  implementation = str(spec.pop("implementation", backends.AUTO))
  try:
    return backends.choose(spec.pop("kind"), spec, implementation=implementation, causal=causal)
  except (KeyError, ValueError):
    return implementation


def _restore_sums(saved: dict | None) -> dict | None:
  return None if saved is None else {k: np.float32(v) for k, v in saved.items()}


class Run:
  """One call of `train_and_evaluate` on an allocated trainer (see the module docstring)."""

  def __init__(self, trainer: Any, config: ml_collections.ConfigDict, workdir: str, *,
               hooks: Sequence[Callable[[int], None]], stop: Any, lock: lock_lib.WorkdirLock,
               started: float, on_start: Callable[[], None] | None = None):
    self.trainer, self.task, self.config, self.workdir = trainer, trainer.task, config, workdir
    self.hooks, self.stop, self.lock, self.started = hooks, stop, lock, started
    self.vote = mesh_lib.StopVote(lambda: self.stop.requested)   # one stop step for all
    self.eval_batch = mesh_lib.batch_size_per_process(config.eval_batch_size, trainer.mesh)
    self.shard = dict(shard_index=jax.process_index(), shard_count=jax.process_count())
    self.sources = {split: self.task.get_source(config.data, split) for split in SPLITS}
    self.train_iter = pipeline.train_iterator(
        self.sources["train"], batch_size=config.batch_size, seed=int(config.seed), **self.shard)
    self.ckpt = checkpoint.Checkpointer(RunDir(workdir).checkpoints,
                                        every=config.checkpoint_every,
                                        keep=config.keep_checkpoints)
    self.best_ckpt = checkpoint.Checkpointer(RunDir(workdir).best, every=0, keep=1)
    self.total_steps = int(config.num_train_steps)
    self.restore()
    start, total = self.start_step, self.total_steps
    if start > total:
      raise ValueError(f"the checkpoints in {self.ckpt.directory} are at step {start}, past "
                       f"num_train_steps {total}: a finished run is not rewritten with an "
                       f"earlier step; pass a new --workdir (or a num_train_steps >= {start}).")
    self.stored = self._stored_results() if start == total else None
    if self.stored is None and on_start is not None:
      on_start()
    self.writer = metrics.MetricWriter(workdir)
    if self.stored is not None:   # finished: nothing is evaluated or written again
      return
    # Records written after the step resumed from (by a run killed before its next checkpoint),
    # and the final evaluation's, are written again: drop them so each step has one record.
    self.writer.keep_only(lambda r: r["step"] < start or (
        r["step"] == start and not (start == total and r["split"] != "train")))
    self.bar = progress.Progress(total, start) if config.get("progress", True) else None
    self.last_loss, self.last_loss_step, self.t_log = None, None, time.perf_counter()
    self.periodic = [Periodic(int(config.log_every), self.log_train_metrics, last=True),
                     Periodic(int(config.eval_every), self.evaluate, last=False),
                     Periodic(self.ckpt.every, self.save_checkpoint)]
    if hooks:
      self.periodic.append(Periodic(1, self.call_hooks))
    if self.bar is not None:
      self.periodic.append(Periodic(1, self.show_progress))

  # Restore.

  def restore(self) -> None:
    """Sets `state`, `start_step`, `train_sums` (the open logging window) and `best`: from the
    newest checkpoint (which also moves the train iterator to its position), else the fresh
    state, with the parameters of `config.init_from` when given."""
    config = self.config
    self.state, self.start_step, self.train_sums = self.trainer.state, 0, None
    restored = self.ckpt.restore_latest(self.trainer.abstract_state())
    if restored is not None:
      self.state, saved, self.start_step = restored
      self.train_iter.set_state(saved["train_iterator"])
      self.train_sums = _restore_sums(saved.get("train_sums"))
      print(f"Resumed from {self.ckpt.directory} at step {self.start_step}.", flush=True)
    elif config.get("init_from"):
      self.state = {**self.state, "params": self._initial_params()}
    elif config.get("init_from_hf"):
      self.state = {**self.state, "params": self._hf_params()}
    self.best = {"accuracy": -1.0, "step": -1}
    if self.best_ckpt.steps():
      try:
        best = self.best_ckpt.restore_latest({"params": self._abstract_params()}, warn=False)
      except checkpoint.CheckpointError as e:
        self._rebuild_best(e)
        return
      if best is not None:
        self.best = best[1]["best"]

  def _rebuild_best(self, error: checkpoint.CheckpointError) -> None:
    """A `best/` that cannot be restored while the train state could: it is moved aside to
    `best.damaged/`, and the best is rebuilt from the best validation record whose parameters
    a training checkpoint still holds (the restored step's included); with none, the next
    evaluation saves the best. One warning line."""
    damaged = storage.join(self.workdir, "best.damaged")
    if jax.process_index() == 0:
      storage.makedirs(damaged)
      for step in self.best_ckpt.steps():
        source = storage.join(self.best_ckpt.directory, str(step))
        target = storage.join(damaged, str(step))
        storage.rmtree(target)
        storage.replace(source, target)
    multihost_utils.sync_global_devices("lra best moved aside")
    self.best_ckpt.manager.reload()
    cause = "; ".join(error.errors) or str(error)
    best, params = self._best_from_records(), None
    if best is not None:
      params = self.state["params"] if best["step"] == self.start_step else \
          self.ckpt.restore_params(best["step"], self._abstract_params())
      self.best = best
      self.best_ckpt.save(best["step"], {"params": params}, {"best": best}, force=True)
      rebuilt = (f"rebuilt from step {best['step']} of {self.ckpt.directory} (validation "
                 f"accuracy {best['accuracy']:.4f})")
    else:
      rebuilt = "rebuilt at the next evaluation"
    print(f"WARNING: the best checkpoint in {self.best_ckpt.directory} cannot be used ({cause}); "
          f"it was moved to {damaged}, and the best is {rebuilt}.", flush=True)

  def _best_from_records(self) -> dict[str, Any] | None:
    """The best validation record up to the restored step (by the task's rule, as `validate`
    chose it) among the steps whose parameters can be restored: the restored step, or a
    training checkpoint's; None when there is none."""
    start, total = self.start_step, self.total_steps
    try:
      records = metrics.read_metrics(self.workdir)
    except ValueError:
      return None
    available = set(self.ckpt.steps())
    best = {"accuracy": -1.0, "step": -1}
    for r in records:
      if r.get("split") != "validation" or not (
          r["step"] < start or (r["step"] == start and start < total)):
        continue
      if r["step"] != start and r["step"] not in available:
        continue
      if self.task.better(r, best):
        best = {"accuracy": r["accuracy"], "step": r["step"], "loss": r["loss"]}
    return None if best["step"] < 0 else best

  def _stored_results(self) -> dict[str, Any] | None:
    """The results.json of this run finished at `total_steps`, or None."""
    try:
      results = storage.read_json(RunDir(self.workdir).results)
    except ValueError:   # unreadable: the final evaluation writes it again
      return None
    if isinstance(results, dict) and results.get("steps") == self.total_steps:
      return results
    return None

  def _initial_params(self):
    """The parameters of `config.init_from`; with `config.init_length` (the source's max_length,
    when shorter) its learned position tables are tiled to this run's length."""
    config, params = self.config, self.state["params"]
    target = checkpoint.abstract_like(params)
    fewer = (self.trainer.model_cfg["max_length"] - int(config.init_length)
             if config.get("init_length") else 0)
    loaded, from_step = checkpoint.load_params(
        config.init_from, embeddings.shorter_tables(target, fewer) if fewer else target)
    if fewer:
      loaded = embeddings.extend_tables(loaded, params)
    print(f"Initialised the parameters from {config.init_from} (step {from_step}).", flush=True)
    return loaded

  def _hf_params(self):
    """The parameters of a fresh model whose encoder (or whole encoder-decoder, from a BART or
    LED checkpoint) holds the weights of the Hugging Face checkpoint `config.init_from_hf` (its
    positions copied over a longer table), placed as the state's parameters are."""
    from models import pretrained
    path = str(self.config.init_from_hf)
    model = self.trainer.task.build_model(self.trainer.model_cfg,
                                          nnx.Rngs(int(self.config.seed)))
    whole = pretrained.read_config(path)["model_type"] in pretrained.SEQ2SEQ
    report = pretrained.assign(model if whole else getattr(model, "encoder", model), path)
    params = nnx.split(model, nnx.Param, ...)[1]
    params = jax.tree.map(lambda x, s: jax.device_put(x, s), params, self.trainer.param_sh)
    notes = "".join(f"; {note}" for note in report.notes)
    what = "model" if whole else "encoder"
    print(f"Initialised the {what} from the {report.architecture} checkpoint {path} "
          f"({len(report.mapped)} tensors{notes}).", flush=True)
    return params

  def _abstract_params(self):
    return checkpoint.abstract_like(self.state["params"])

  # The loop.

  def train(self) -> int | None:
    """Takes the steps after the restored one, each followed by the periodic actions due;
    returns the step it stopped at when `stop_now` said so, None when it reached the last."""
    step, total = self.start_step, self.total_steps
    stopped = self.stop_now(step)   # asked during start-up or compilation: no step at all
    try:
      if not stopped:
        for step in range(self.start_step + 1, total + 1):
          self.take_step()
          for periodic in self.periodic:
            if periodic.due(step, total):
              periodic.action(step)
          if self.stop_now(step):
            stopped = True
            break
    finally:   # also on a failure: its one line then starts a line of its own
      if self.bar is not None:
        self.bar.close()
    return step if stopped else None

  def stop_now(self, step: int) -> bool:
    """Whether to stop after `step` (the restored step before the first one is taken): whether
    a process was asked to (Ctrl-C, SIGTERM). With several processes all of them agree on the
    step (lra/mesh.py `StopVote`: one step after the first request), so all save the same one."""
    return self.vote.now() if step == self.start_step else self.vote.after_step()

  def take_step(self) -> None:
    batch = mesh_lib.global_batch(next(self.train_iter), self.trainer.mesh)
    options = self.trainer.step_options(self.state["params"])   # adaptive span's windows
    self.state, sums = self.trainer.train_step(self.state, batch, self.trainer.rest, **options)
    self.train_sums = metrics.add_sums(self.train_sums, sums)

  def data_state(self) -> dict[str, Any]:
    """What a checkpoint saves beside the train state: the iterator's position and the sums of
    the open logging window."""
    sums = None if self.train_sums is None else {
        k: float(np.asarray(v)) for k, v in self.train_sums.items()}
    self.lock.heartbeat()
    return {"train_iterator": self.train_iter.get_state(), "train_sums": sums}

  # The periodic actions.

  def log_train_metrics(self, step: int) -> None:
    """Writes the window's train metrics, with the rate and the learning rate; a new window."""
    m = self.trainer.summarise({k: v for k, v in self.train_sums.items() if k != "grad_norm"})
    now = time.perf_counter()
    m["steps_per_second"] = self.config.log_every / max(now - self.t_log, 1e-9)
    m["learning_rate"] = float(learning_rate_schedule(self.config)(step))
    m.update(self.trainer.span_summary(self.state["params"]))
    self.writer.write(step, "train", m)
    self.last_loss, self.last_loss_step, self.train_sums, self.t_log = m["loss"], step, None, now

  def evaluate(self, step: int) -> None:
    """Evaluates on validation (a line for it when there is no progress bar)."""
    m = self.validate(step)
    if self.bar is None:
      print(f"step {step}: validation accuracy {m['accuracy']:.4f}", flush=True)

  def save_checkpoint(self, step: int) -> None:
    self.ckpt.save(step, self.state, self.data_state())

  def call_hooks(self, step: int) -> None:
    for hook in self.hooks:
      hook(step)

  def show_progress(self, step: int) -> None:
    self.bar.update(step, self.last_loss, loss_step=self.last_loss_step)

  # Evaluation and the end of the run.

  def _eval_batches(self, split: str):
    return pipeline.eval_batches(self.sources[split],
                                 batch_size=self.eval_batch * jax.process_count(), **self.shard)

  def validate(self, step: int) -> dict[str, float]:
    """The validation metrics of the current parameters, written; a new best is saved."""
    params = self.state["params"]
    m = self.trainer.evaluate(params, self._eval_batches("validation"))
    self.writer.write(step, "validation", m)
    if self.task.better(m, self.best):
      self.best = {"accuracy": m["accuracy"], "step": step, "loss": m["loss"]}
      self.best_ckpt.save(step, {"params": params}, {"best": self.best}, force=True)
    return m

  def close(self) -> None:
    self.ckpt.close()
    self.best_ckpt.close()
    self.writer.close()

  def stopped(self, step: int) -> dict[str, Any]:
    """Saves the step the run stopped at and says how to continue."""
    saved = self.ckpt.save(step, self.state, self.data_state(), force=True)
    self.close()
    where = f"Saved a checkpoint at step {step} in {self.ckpt.directory}" if saved else \
        f"Stopped at step {step} (its checkpoint is already in {self.ckpt.directory})"
    print(f"{where}; rerun the same command to continue.", flush=True)
    return {"interrupted": True, "step": step, "state": self.state}

  def finish(self) -> dict[str, Any]:
    """Saves the last step, evaluates, writes `results.json`; returns the results."""
    total, task, trainer, state = self.total_steps, self.task, self.trainer, self.state
    self.ckpt.save(total, state, self.data_state(), force=True)
    final_val = self.validate(total)
    chance = task.chance_reference()
    chance_counts = None if chance is None else np.zeros(chance[1], np.int64)
    test_final = trainer.evaluate(state["params"], self._eval_batches("test"),
                                  chance_counts=chance_counts)
    self.writer.write(total, "test", test_final)
    if chance_counts is not None and jax.process_count() > 1:  # each process saw its own rows
      chance_counts = np.asarray(multihost_utils.process_allgather(chance_counts)).sum(0)
    best_params = self.best_ckpt.restore_latest({"params": self._abstract_params()})
    test_best = test_final
    if best_params is not None and self.best["step"] != total:
      test_best = trainer.evaluate(best_params[0]["params"], self._eval_batches("test"))
    results = {
        "task": task.name,
        "attention": self.config.model.attention.kind,
        "steps": total,
        "test_accuracy": test_best["accuracy"],
        "test_loss": test_best["loss"],
        "best_validation_accuracy": self.best["accuracy"],
        "best_validation_step": self.best["step"],
        "final_test_accuracy": test_final["accuracy"],
        "final_validation_accuracy": final_val["accuracy"],
        "test_examples": int(test_final["examples"]),
        "param_count": trainer.param_count,
        "wall_seconds_this_run": round(time.time() - self.started, 1),
        "train_step_traces": trainer.traces,
        **({"span_window_sets": len(trainer.span_windows_used),
            **trainer.span_summary(state["params"])} if trainer.span_layers else {}),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "mesh": {k: int(v) for k, v in trainer.mesh.shape.items()},
        "platform": jax.default_backend(),
        "attention_backend": _backend(self.config.model.attention.to_dict(),
                                      task.causal_attention(self.config.model)),
    }
    if chance_counts is not None and chance_counts.sum():
      results[chance[0]] = float(chance_counts.max() / chance_counts.sum())
    results.update(task.result_fields(test_best=test_best, test_final=test_final,
                                      final_validation=final_val, best=self.best))
    if jax.process_index() == 0:   # one process writes the shared file
      storage.write_json(RunDir(self.workdir).results, results)
    self.close()
    return {**results, "interrupted": False, "state": state}


def run(trainer: Any, config: ml_collections.ConfigDict, workdir: str, *,
        hooks: Sequence[Callable[[int], None]], stop: Any, lock: lock_lib.WorkdirLock,
        started: float, on_start: Callable[[], None] | None = None) -> dict[str, Any]:
  """Trains `trainer` (an allocated `lra.train.Trainer`) on `config` in `workdir` from where its
  checkpoints left off, then evaluates. `stop.requested` (the stop flag) asks it to save and
  stop, `lock.heartbeat()` is called at each save, and `started` is the `time.time()` the run's
  wall time counts from. `on_start()` (writing config.json) runs once the restored step is
  known to leave something to do: never for a refused or a finished run."""
  r = Run(trainer, config, workdir, hooks=hooks, stop=stop, lock=lock, started=started,
          on_start=on_start)
  if r.stored is not None:
    r.close()
    print(f"The run in {workdir} finished earlier; its results are unchanged.", flush=True)
    return {**r.stored, "interrupted": False, "state": r.state}
  # Restoring and the data pipeline take each process its own time: the first step's
  # collectives start together (lra/mesh.py wait_for_peers).
  mesh_lib.wait_for_peers("the first training step",
                          int(config.get("peer_timeout_s", mesh_lib.PEER_TIMEOUT_S)))
  step = r.train()
  return r.finish() if step is None else r.stopped(step)
