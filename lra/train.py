"""Trains and evaluates an LRA task: `train_and_evaluate(config, workdir)`.

The task object (`lra.tasks.get_task(config.task)`) says what differs between tasks: the data,
the model, the objective, derived metrics, which validation result is best and the result
fields; the attention kind comes from the config. The step is functional: the NNX model is
split once into (graphdef, params, rest), the jitted train step takes the state pytree
`{"params", "opt", "step"}` (donated) and a global batch, merges the model inside, and applies
optax AdamW directly. Parameters are created directly sharded (`jax.jit` with `out_shardings`
from their logical names and `config.axis_rules`).

The workdir holds: `config.json` (the resolved config), `checkpoints/` (state + data iterator
position, periodic and final, newest `keep_checkpoints` kept), `best/` (the parameters with the
best validation result by the task's rule: accuracy, or loss for language models),
`metrics.jsonl`, `tensorboard/` (the same metrics as TensorBoard scalars) and `results.json`
(final test evaluation, the parameter count, plus the task's own fields, such as bits per
character). The run itself (restore, the loop and its periodic actions, the final evaluation)
is `lra.loop`; a `Trainer.abstract` plan (the preflight's) may be passed to it. The workdir may
be a bucket (`gs://...`): every file goes through `lra.storage` (etils.epath), and only process
0 writes the shared files.
Re-running in the same workdir resumes exactly where the last checkpoint left off. Ctrl-C saves
a checkpoint and returns with `results["interrupted"] = True`. `config.init_from` (optional) names
another run's checkpoint directory (or its workdir) whose newest parameters initialise a run
that has no checkpoint of its own (`lra.checkpoint.load_params`); `lra.phases` chains the
phases of a staged schedule this way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from attention import kinds as attention_kinds
from lra import lock as lock_lib, loop, mesh as mesh_lib, metrics, signals, storage
from lra import tasks as tasks_lib
from models import attention_extras as extras_lib
from lra.optim import learning_rate_schedule, make_optimizer  # noqa: F401 (one re-exported)
from lra.rundir import RunDir

log = logging.getLogger(__name__)


def model_config(config: ml_collections.ConfigDict, task) -> dict[str, Any]:
  """The model constructor's fields: `config.model` plus what the task fixes."""
  cfg = config.model.to_dict()
  cfg["attention"] = dict(cfg["attention"])
  cfg["layer_attention"] = tuple(dict(x) for x in (cfg.get("layer_attention") or ()))
  # Evaluation windows may be longer than the training ones (character LMs, `eval_length`).
  max_length = max(int(config.data.max_length), int(config.data.get("eval_length", 0) or 0))
  cfg.update(vocab_size=task.vocab_size, num_classes=task.num_classes, max_length=max_length,
             remat=str(config.get("remat", "none")), dtype=str(config.get("dtype", "float32")))
  if config.get("init_from_hf"):   # the architecture of a Hugging Face checkpoint
    from lra.tasks.seq2seq import Seq2SeqTask
    from models import pretrained
    cfg = pretrained.task_settings(str(config.init_from_hf), cfg,
                                   seq2seq=isinstance(task, Seq2SeqTask))
  return cfg


def check_layers(config: ml_collections.ConfigDict, task) -> None:
  """What the task asks of every layer's attention kind (causal for a language model, a pattern
  for MPNet's permutation masks); one-line ValueError saying what to change. The config's own
  values are checked by `lra.schema.check`, once, by the entry point (`lra run`, or
  `train_and_evaluate` when no preflight planned the run)."""
  from lra.schema import attention_sublayers   # the one count of attention sublayers
  from models.settings import layer_specs
  specs = layer_specs(config.model.attention.to_dict(), config.model.layer_attention,
                      attention_sublayers(config.model))
  task.check_layers([attention_kinds.get(spec.get("kind")).name for spec in specs])


def check_init_length(config: ml_collections.ConfigDict, max_length: int) -> None:
  """`init_length` (the `init_from` run's max_length, whose learned position tables are tiled
  to this run's `max_length` rows) must not exceed `max_length`: a longer table cannot be tiled,
  and keeping its first rows would drop positions silently."""
  init_length = int(config.get("init_length", 0) or 0)
  if init_length > max_length:
    raise ValueError(f"config.init_length = {init_length} is longer than this run's max_length "
                     f"{max_length}: a run can start only from a run at most as long (its "
                     f"position table is tiled); use 0 for the same length or a longer "
                     f"config.data.max_length.")


def _stop_message(signum: int) -> str:
  """What the run prints on the first SIGINT (Ctrl-C) or SIGTERM (what a TPU VM or a cluster
  sends before preemption): it stops after the current step and saves. The request is installed
  for the whole run, so one during start-up or compilation lets it finish instead of
  interrupting XLA; a second Ctrl-C interrupts at once, a second SIGTERM changes nothing."""
  again = " (Ctrl-C again to abort)" if signum == signal.SIGINT else ""
  return (f"\nInterrupted by {signals.signal_label(signum)}: saving a checkpoint after this "
          f"step{again}.")


def _with_shardings(tree: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs of `tree`'s leaves carrying the matching leaf of `shardings`."""
  return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                      tree, shardings)


def _write_json(path: str, obj: Any) -> None:
  if jax.process_index() != 0:
    return
  storage.write_json(path, obj)


def _save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  if jax.process_index() != 0:  # one process reads, renames and writes the shared file
    return
  path = RunDir(workdir).config
  text = config.to_json_best_effort(indent=2, sort_keys=True)
  saved = storage.read_text(path)
  if saved is not None and saved != text:
    print(f"WARNING: the config differs from the one saved in {path}; resuming with the "
          f"new one (the old one is kept as config.previous.json).", flush=True)
    storage.replace(path, storage.join(workdir, "config.previous.json"))
  storage.write_text(path, text)


def _steps_key(config: ml_collections.ConfigDict) -> str:
  """What determines the steps of `config`: all of it but the initial values (`init_from`,
  `init_length`)."""
  fields = config.to_dict()
  fields.pop("init_from", None)
  fields.pop("init_length", None)
  return json.dumps(fields, sort_keys=True, default=str)




class Trainer:
  """Builds the mesh, model, optimizer and jitted steps for one config.

  `Trainer(config)` allocates the parameters and optimizer state (`state`) directly in their
  shardings. `Trainer.abstract(config)` builds the same mesh, shardings and jitted steps with
  only abstract state (`abstract_state()`, `abstract_rest`: ShapeDtypeStructs with shardings),
  allocating nothing: a plan, on which `lra.preflight` lowers and compiles the steps.
  `Trainer(config, plan)` (and `train_and_evaluate(config, workdir, plan=plan)`) then allocates
  with the plan's traced and compiled steps instead of building its own.
  """

  def __init__(self, config: ml_collections.ConfigDict, plan: Trainer | None = None):
    """Plans `config` (or takes `plan`, a `Trainer.abstract` of the same steps) and allocates."""
    if plan is None:
      self._plan(config)
    else:
      if not plan.is_plan_for(config):
        raise ValueError("the plan was made for a config with other steps than this one (they "
                         "may differ in init_from and init_length only).")
      vars(self).update(vars(plan))   # the plan's mesh, shardings and steps; the plan stays
      self.config = config            # abstract, for other runs
      self.span_windows_used = set()
    self.allocate()

  @classmethod
  def abstract(cls, config: ml_collections.ConfigDict) -> "Trainer":
    """The trainer of `config` without parameters: mesh, shardings, abstract state and steps."""
    self = cls.__new__(cls)
    self._plan(config)
    return self

  def _plan(self, config: ml_collections.ConfigDict) -> None:
    """Everything but the arrays: the mesh, abstract state with shardings, the jitted steps."""
    self.config = config
    self.task = tasks_lib.get_task(config.task)
    self.mesh = mesh_lib.make_mesh(config.mesh.to_dict())
    for field in ("batch_size", "eval_batch_size"):
      try:
        mesh_lib.batch_size_per_process(int(config[field]), self.mesh)
      except ValueError as e:
        raise ValueError(f"config.{field} = {config[field]}: {e}") from None
    self.rules = tuple(tuple(r) for r in config.axis_rules)
    cfg = self.model_cfg = model_config(config, self.task)
    check_init_length(config, cfg["max_length"])
    seed = int(config.seed)
    task = self.task

    graphdefs, span_layers = [], []

    def init_arrays():
      model = task.build_model(cfg, nnx.Rngs(seed))
      span_layers.append(extras_lib.span_layers(model))
      graphdef, params, rest = nnx.split(model, nnx.Param, ...)
      graphdefs.append(graphdef)   # at trace time
      return params, rest

    # One function object for the abstract shapes here and the jitted initialisation in
    # `allocate`: jax caches its trace by function, so the model is constructed once.
    self._init_arrays = init_arrays
    abs_params, abs_rest = jax.eval_shape(init_arrays)
    graphdef = self.graphdef = graphdefs[0]
    # Adaptive-span layers (path -> module, whose settings give each layer's band window for
    # its current spans): the steps take the windows as a static argument (`step_options`).
    self.span_layers = span_layers[0]
    self.span_windows_used: set = set()
    self.param_sh = mesh_lib.state_shardings(abs_params, self.mesh, self.rules)
    self.rest_sh = mesh_lib.state_shardings(abs_rest, self.mesh, self.rules)
    abs_params = _with_shardings(abs_params, self.param_sh)
    self.abstract_rest = _with_shardings(abs_rest, self.rest_sh)
    # The spans are kept out of the weight decay (the models without them keep the optimizer
    # state they always had).
    self.tx = make_optimizer(config, extras_lib.decayed if self.span_layers else None)
    abs_opt = jax.eval_shape(self.tx.init, abs_params)
    self.opt_sh = mesh_lib.match_param_shardings(abs_opt, abs_params, self.mesh)
    repl = mesh_lib.replicated(self.mesh)
    self.state_sh = {"params": self.param_sh, "opt": self.opt_sh, "step": repl}
    self._abstract_state = {"params": abs_params, "opt": _with_shardings(abs_opt, self.opt_sh),
                            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=repl)}
    # The task's own state carried across training steps (Task.init_state), checkpointed with
    # the rest of the train state.
    self._init_task_state = lambda: task.init_state(cfg, int(config.batch_size))
    abs_task = jax.eval_shape(self._init_task_state)
    if abs_task is not None:
      self.state_sh["task"] = jax.tree.map(lambda _: repl, abs_task)
      self._abstract_state["task"] = _with_shardings(abs_task, self.state_sh["task"])
    # What `allocate` runs: one jit each, so that what a preflight compiled is reused.
    self._init_jit = jax.jit(init_arrays, out_shardings=(self.param_sh, self.rest_sh))
    self._opt_init_jit = jax.jit(self.tx.init, out_shardings=self.opt_sh)
    if "task" in self.state_sh:
      self._task_init_jit = jax.jit(self._init_task_state, out_shardings=self.state_sh["task"])
    traces = self._traces = [0]   # shared with a Trainer that adopts this plan
    objective = task.objective
    base_key = jax.random.key(seed + 1)
    tx = self.tx

    # With a sequence axis, the models read the mesh while tracing (models/sequence.py).
    split = self.mesh.shape.get("sequence", 1) > 1
    in_mesh = lambda: (jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh) if split
                       else contextlib.nullcontext())

    def merged(params, rest, windows):
      model = nnx.merge(graphdef, params, rest)
      if windows:
        extras_lib.set_windows(model, windows)
      return model

    def train_step(state, batch, rest, windows=()):
      with in_mesh():
        return _train_step(state, batch, rest, windows)

    def _train_step(state, batch, rest, windows):
      traces[0] += 1  # runs at trace time only
      rng = jax.random.fold_in(base_key, state["step"])

      def loss_fn(params):
        model = merged(params, rest, windows)
        if "task" in state:
          sums, task_state = task.objective_with_state(model, batch, rng, state["task"])
        else:
          sums, task_state = objective(model, batch, rng), None
        # Auxiliary terms of the attention layers (adaptive span's L1 on the spans) join the
        # differentiated loss; the reported sums stay the task's.
        loss = sums["loss_sum"] / jnp.maximum(sums["weight"], 1.0) + extras_lib.penalty(model)
        return loss, (sums, task_state)

      (_, (sums, task_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
      updates, opt_state = tx.update(grads, state["opt"], state["params"])
      # Parameters kept in a range are projected back into it (adaptive span's spans).
      params = extras_lib.project(optax.apply_updates(state["params"], updates))
      sums["grad_norm"] = optax.tree.norm(grads)
      new = {"params": params, "opt": opt_state, "step": state["step"] + 1}
      if task_state is not None:
        new["task"] = task_state
      return new, sums

    def eval_step(params, batch, rest, windows=()):
      with in_mesh():
        return objective(merged(params, rest, windows), batch, None)

    self.train_step = jax.jit(train_step, out_shardings=(self.state_sh, repl),
                              donate_argnums=0, static_argnames="windows")
    self.eval_step = jax.jit(eval_step, out_shardings=repl, static_argnames="windows")

  def allocate(self) -> "Trainer":
    """Creates the parameters, the rest of the model's state and the optimizer state (`state`);
    returns the trainer."""
    self.params, self.rest = self._init_jit()
    opt = self._opt_init_jit(self.params)
    step = jax.device_put(np.zeros((), np.int32), self.state_sh["step"])
    self.state = {"params": self.params, "opt": opt, "step": step}
    if "task" in self.state_sh:
      self.state["task"] = self._task_init_jit()
    return self

  def initialisers(self) -> list[tuple[Any, tuple]]:
    """The jitted functions `allocate` calls, with abstract arguments: a preflight compiles
    them beside the steps, and `allocate` then runs what they compiled."""
    out = [(self._init_jit, ()), (self._opt_init_jit, (self._abstract_state["params"],))]
    if "task" in self.state_sh:
      out.append((self._task_init_jit, ()))
    return out

  @property
  def traces(self) -> int:
    """How many times the train step was traced (once, unless its input shapes changed)."""
    return self._traces[0]

  def is_plan_for(self, config: ml_collections.ConfigDict) -> bool:
    """Whether this trainer's steps are those of `config` (the configs differ at most in the
    initial values, `init_from` and `init_length`)."""
    return _steps_key(self.config) == _steps_key(config)

  @property
  def param_count(self) -> int:
    """The number of values in the model's parameters."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(self._abstract_state["params"]))

  def abstract_state(self):
    """The train state as ShapeDtypeStructs with their shardings (a restore target)."""
    return self._abstract_state

  def step_options(self, params) -> dict[str, Any]:
    """The steps' keyword arguments for `params`: {} for most models; with adaptive-span
    layers, `windows`, each layer's band window for its current spans (ceil(max z) + R rounded
    up to a block). Reading the spans waits for the step that wrote them; a new set of windows
    compiles the steps once more (`span_windows_used` counts the sets)."""
    if not self.span_layers:
      return {}
    values = [_host(x) for x in extras_lib.span_parameters(params, self.span_layers)]
    windows = extras_lib.span_windows(self.span_layers, values)
    self.span_windows_used.add(windows)
    return {"windows": windows}

  def span_summary(self, params) -> dict[str, float]:
    """Per adaptive-span layer i: `span_mean_i`, `span_max_i` (tokens) and `span_window_i`
    (the band window its spans need); {} without such layers."""
    out = {}
    values = [_host(x) for x in extras_lib.span_parameters(params, self.span_layers)]
    for i, ((_, m), (_, window)) in enumerate(zip(
        self.span_layers.items(), extras_lib.span_windows(self.span_layers, values))):
      z = m.max_span * np.clip(np.asarray(values[i], np.float64), 0.0, 1.0)
      out.update({f"span_mean_{i}": float(z.mean()), f"span_max_{i}": float(z.max()),
                  f"span_window_{i}": float(window)})
    return out

  def evaluate(self, params, batches: Iterable[dict], *, chance_counts: np.ndarray | None = None
               ) -> dict[str, float]:
    """Sums over every example of a split (filler examples have weight 0); adds the ids of the
    task's chance reference to `chance_counts` when given."""
    total = None
    options = self.step_options(params)
    for batch in batches:
      if chance_counts is not None:
        np.add.at(chance_counts, self.task.chance_ids(batch), 1)
      sums = self.eval_step(params, mesh_lib.global_batch(batch, self.mesh), self.rest,
                            **options)
      total = metrics.add_sums(total, sums)
    if total is None:
      raise ValueError("the evaluation split is empty.")
    return self.summarise(total)

  def summarise(self, sums) -> dict[str, float]:
    """Loss, accuracy and examples from summed metrics, plus the task's derived metrics."""
    m = metrics.summarise(sums)
    m.update(self.task.derived_metrics(m))
    return m


def _host(x) -> np.ndarray:
  """A (small) array's values on the host, gathered from every process when it is split."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       hooks: Sequence[Callable[[int], None]] = (),
                       plan: Trainer | None = None) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming from its checkpoints) and evaluates on test.

  `hooks` are called with the step number after every train step. `plan` is a
  `Trainer.abstract` of the same steps whose compiled steps the run uses (the preflight's,
  `lra.preflight.check(config).trainer`); without one the run plans its own. Returns the
  results written to `results.json`, plus `"state"` (the final train state) and
  `"interrupted"`. The run itself is `lra.loop`.
  """
  if plan is None:   # a plan comes from a preflight, after the entry point's checks
    from lra import schema
    schema.check(config)
    check_layers(config, tasks_lib.get_task(config.task))
  timeout_s = int(config.get("peer_timeout_s", mesh_lib.PEER_TIMEOUT_S))
  mesh_lib.maybe_initialize_distributed(bool(config.get("distributed", False)), timeout_s)
  mesh_lib.wait_for_peers("the workdir lock", timeout_s)   # the first collective follows
  workdir = storage.resolve(workdir)
  storage.makedirs(workdir)
  # A lock file on a local disk (O_EXCL), a lock object in a gs:// bucket (generation
  # preconditions; lra/lock.py). Process 0 takes it and every process learns the outcome
  # before any collective.
  lock_here = jax.process_index() == 0
  agree = mesh_lib.any_process if jax.process_count() > 1 else None
  with (signals.StopRequest(_stop_message) as stop,
        lock_lib.WorkdirLock(workdir, enabled=lock_here, agree=agree) as lock):
    started = time.time()
    trainer = Trainer(config, plan)
    # config.json is written once the run is known to train (not for a refused or finished one)
    return loop.run(trainer, config, workdir, hooks=hooks, stop=stop, lock=lock, started=started,
                    on_start=lambda: _save_config(config, workdir))
