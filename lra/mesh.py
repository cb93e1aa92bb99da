"""Device mesh, logical-axis shardings, and global batches.

The mesh has three named axes, `data`, `fsdp` and `tensor`, sized from `config.mesh` (one size
may be -1: all remaining devices). The batch is split over (`data`, `fsdp`); parameters are split
by the rules table `config.axis_rules`, which maps each logical axis name carried by a parameter
(see `models.sharding`) to a mesh axis or None. Axes are `AxisType.Auto` (GSPMD propagation):
`jax.make_mesh` would default to Explicit axes in jax 0.10.2, where contractions over a sharded
axis need annotations everywhere.

`maybe_initialize_distributed()` starts multi-process JAX when `LRA_DISTRIBUTED=1` (or the
config's `distributed` flag) is set; a single process needs nothing. Outside a cluster JAX
detects, JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID say who is who. From
then on a SIGTERM is held for the run's stop request (lra/signals.py `hold_early`) instead of
ending the process, so a job signalled during start-up still stops cleanly with all its
processes.

With several processes, every decision that changes which collectives run must be the same in
all of them. `any_process(flag)` is the blocking agreement (an all-gather of one flag per
process: the workdir lock's refusal, before the first collective). `StopVote` is the stop step's:
every process casts its local "stop requested" flag after each step as a max-reduce over all
devices, dispatched like the step itself (no wait), and reads the previous step's vote, which
was computed before the current step started: so the loop never waits on the host for a step to
finish, all processes read the same vote and stop after the same step, one step after the
first process was asked. That is exact (a collective, not a clock) and cheap (a 4-byte
all-reduce per step, never a host round trip ahead of the device queue). jax's own
`reached_preemption_sync_point` was not used: it sees only SIGTERM, through a handler that
jax.distributed installs, and not Ctrl-C.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "sequence", "tensor")
BATCH_AXES = ("data", "fsdp")


PEER_TIMEOUT_S = 900   # config.peer_timeout_s's default (configs/common.py)


class PeerTimeout(RuntimeError):
  """The other processes did not reach a wait point within `config.peer_timeout_s`."""


def maybe_initialize_distributed(flag: bool = False, timeout_s: int = PEER_TIMEOUT_S) -> None:
  """Calls `jax.distributed.initialize()` when asked to (flag or LRA_DISTRIBUTED=1), once.

  On a cluster JAX detects (Cloud TPU, Slurm, Open MPI) it needs nothing else. Elsewhere (for
  example several processes on one machine) every process sets JAX_COORDINATOR_ADDRESS
  (host:port of process 0, read by JAX), JAX_NUM_PROCESSES and JAX_PROCESS_ID (read here).
  `timeout_s` (config.peer_timeout_s) bounds the start's wait for every process; ten times it
  is the silence after which a process counts as dead (its heartbeats: a peer stopped or
  swapped out for a while is not), three times it the shutdown's wait for the others.
  """
  if not (flag or os.environ.get("LRA_DISTRIBUTED", "0") == "1"):
    return
  if jax.distributed.is_initialized():  # a second run in the same process (phases)
    return
  kwargs = {}
  for name, env in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID")):
    if os.environ.get(env, ""):
      kwargs[name] = int(os.environ[env])
  from lra import signals
  signals.hold_early()         # a SIGTERM from here on is held for the run's stop request ...
  # A peer that misses the waits of `wait_for_peers` ends the run there, with its one line:
  # the heartbeats' limit is longer, so that the distributed service (which ends every
  # process with a C++ stack when it declares one dead) never comes first; at exit a process
  # waits for the others' exit long enough for a peer that was late at a wait.
  timeout_s = int(timeout_s)
  jax.distributed.initialize(**kwargs, initialization_timeout=timeout_s,
                             heartbeat_timeout_seconds=10 * timeout_s,
                             shutdown_timeout_seconds=3 * timeout_s)
  signals.hold_early()         # ... and taken back from jax's preemption notifier


_waits: dict[str, int] = {}


def wait_for_peers(stage: str, timeout_s: int = PEER_TIMEOUT_S) -> None:
  """Waits until every process has reached this point (`stage` names it), at most `timeout_s`
  seconds; raises PeerTimeout naming this process, the stage and the setting otherwise.

  jax's CPU collectives (gloo) give up on a peer after a fixed 30 s: the first collective after
  a stretch where processes take different times (the preflight's and the steps' compiles,
  the data) would fail on a busy host. Waiting here first, on the coordination service with
  the run's own timeout, brings every process to the collective together. Every process must
  call it at the same points, in the same order (each call is its own barrier)."""
  if jax.process_count() == 1:
    return
  from attention import compat   # the coordination client jax.distributed started
  count = _waits[stage] = _waits.get(stage, 0) + 1
  try:
    compat.distributed_client().wait_at_barrier(f"lra-{stage}-{count}", int(timeout_s * 1000))
  except Exception as e:  # noqa: BLE001 - the service's error (a timeout, a dead peer)
    status = str(e).split(":", 1)[0].strip() or type(e).__name__
    raise PeerTimeout(
        f"process {jax.process_index()} of {jax.process_count()} waited for the others at "
        f"{stage} and they did not all come within config.peer_timeout_s = {timeout_s} s "
        f"({status}): rerun the same command when every process can run; it resumes from "
        f"the last checkpoint (raise --config.peer_timeout_s for slow hosts).") from None


def any_process(flag: bool) -> bool:
  """Whether `flag` is true in any process (every process must call it at the same point)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.asarray(multihost_utils.process_allgather(np.asarray([int(flag)]))).any())


class StopVote:
  """The stop step all processes agree on (see the module docstring): `now()` before the first
  step (blocking), `after_step()` after each step; both say whether to stop there. With one
  process they return `local()` itself."""

  def __init__(self, local):
    self.local = local
    self.multi = jax.process_count() > 1
    self._pending = None
    if self.multi:
      mesh = Mesh(np.asarray(jax.devices(), dtype=object), ("processes",))
      self._sharding = NamedSharding(mesh, P("processes"))
      self._reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))

  def _cast(self) -> jax.Array:
    flags = np.full((jax.local_device_count(),), int(bool(self.local())), np.int32)
    return self._reduce(jax.make_array_from_process_local_data(self._sharding, flags))

  @staticmethod
  def _read(vote: jax.Array) -> bool:
    return bool(np.asarray(vote.addressable_data(0)))

  def now(self) -> bool:
    if not self.multi:
      return bool(self.local())
    self._pending = None
    return self._read(self._cast())

  def after_step(self) -> bool:
    if not self.multi:
      return bool(self.local())
    previous, self._pending = self._pending, self._cast()
    return previous is not None and self._read(previous)


def mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """Resolves {data, fsdp, sequence, tensor} sizes (one may be -1) against the device count."""
  unknown = [k for k in sizes if k not in MESH_AXES]
  if unknown:
    raise ValueError(f"unknown mesh axes {unknown}; valid axes: {', '.join(MESH_AXES)}.")
  shape = [int(sizes.get(a, 1)) for a in MESH_AXES]
  if shape.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, shape))}.")
  known = int(np.prod([s for s in shape if s != -1]))
  if any(s == 0 or s < -1 for s in shape) or num_devices % known:
    raise ValueError(
        f"mesh {dict(zip(MESH_AXES, shape))} does not fit {num_devices} devices: the product "
        f"of the sizes must divide the device count (use -1 for 'the rest').")
  # Explicit sizes whose product is below the device count use the first devices only.
  if -1 in shape:
    shape[shape.index(-1)] = num_devices // known
  return tuple(shape)


def make_mesh(sizes: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
  """A (data, fsdp, sequence, tensor) mesh with Auto axes over `devices` (default: all devices)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(sizes, len(devices))
  devices = devices[:int(np.prod(shape))]
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_size_per_process(global_batch: int, mesh: Mesh) -> int:
  """Checks the global batch splits evenly over the batch axes and processes."""
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if global_batch % shards or global_batch % jax.process_count():
    raise ValueError(
        f"batch size {global_batch} must be a multiple of the data x fsdp mesh size ({shards}) "
        f"and of the process count ({jax.process_count()}).")
  return global_batch // jax.process_count()


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Batch-leading arrays: first axis over (data, fsdp), the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles this process's numpy batch into global arrays sharded over the batch axes."""
  return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, np.ndim(v)),
                                                    np.asarray(v))
          for k, v in batch.items()}


def state_shardings(abstract_state: nnx.State, mesh: Mesh,
                    rules: Sequence[tuple[str, Any]]) -> Any:
  """NamedShardings for an (abstract) nnx.State from its logical names and the rules table."""
  with nnx.logical_axis_rules(tuple((k, v) for k, v in rules)):
    specs = nnx.get_partition_spec(abstract_state)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec if isinstance(spec, P) else P()),
                      specs, is_leaf=lambda x: isinstance(x, P))


def match_param_shardings(tree: Any, params: Any, mesh: Mesh) -> Any:
  """Shardings for a tree holding copies of the params (optimizer moments): matched by path.

  A leaf whose key path ends with a parameter's key path (and has its shape) gets that
  parameter's sharding; everything else (step counts, scalars) is replicated.
  """
  by_path = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    by_path[_path_key(path)] = (leaf.shape, leaf.sharding)

  def pick(path, leaf):
    key = _path_key(path)
    for start in range(len(key)):
      hit = by_path.get(key[start:])
      if hit is not None and hit[0] == leaf.shape:
        return hit[1]
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(pick, tree)


def _path_key(path) -> tuple[str, ...]:
  return tuple(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)
