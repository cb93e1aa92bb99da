"""Know before you run: the memory a config needs per device, checked before any data work.

`check(config)` builds the trainer's mesh, shardings and jitted steps on abstract state
(`lra.train.Trainer.abstract`: nothing is allocated), lowers and compiles the train step and
the evaluation step for abstract batches of the real shapes and shardings (`Task.batch_spec`,
no data read), and reads XLA's memory analysis of each compiled program per device: arguments,
outputs (those not aliased to donated arguments), temporaries and generated code, plus on a CPU
the copies its YNNPACK/XNNPACK library fusions make (`Program.library`). The run's peak per
device is the larger of

  train step: arguments + outputs - aliased + temporaries + code + library
  eval step:  the same, plus the optimizer state (alive while the model is evaluated, but not
              one of the eval step's arguments)

which `Report.fits` compares with what the devices have (`available_memory`: the allocator's
limit minus what is in use on a GPU or TPU; on a CPU the machine's MemAvailable shared by the
local devices). `Report.refusal()` is the one line a run that cannot fit ends with: both
figures, the largest buffer it can name in the compiled program (for example a dense kind's
attention scores, batch x heads x L x L x 4 bytes) and concrete ways out.

The run does not compile again: the report's `trainer` is the plan the preflight compiled, and
the caller passes it to the run (`train_and_evaluate(config, workdir, plan=report.trainer)`,
`lra.phases.run(..., plans=...)`), whose trainer then uses its traced and compiled steps.
Across runs, `lra.compiling.compile_cache()` turns on JAX's persistent compilation cache in the
user's cache folder (`$XDG_CACHE_HOME/lra/jax`, else `~/.cache/lra/jax`) with no minimum
compile time or entry size, so a rerun, a resume or another run of the same config loads every
program instead of compiling it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from attention import kinds
from lra import identity, mesh as mesh_lib
from lra.compiling import CacheHits, Compiling
from lra import train as train_lib

GB = 1e9


def linear_ways_out() -> tuple[str, ...]:
  """The kinds suggested instead of a quadratic one (`Kind.cost`): linear in the length and
  able to split it over devices too, so they go furthest."""
  return kinds.names_where(lambda k: k.cost == "linear" and k.sequence_parallel)


def exact_copy(model) -> str | None:
  """A kind that computes exactly the attention of `model` (`Kind.copy_of`, flash for
  dot_product) with the same layers and positions, or None."""
  if model.get("layer_attention"):
    return None
  relative = model.get("pos_emb") == "relative"
  copies = kinds.names_where(lambda k: k.copy_of == model.attention.kind
                             and (k.relative or not relative))
  return copies[0] if copies else None
def available_memory(devices) -> tuple[int | None, str]:
  """(bytes free per device, where the figure comes from); (None, why) when unknown."""
  device = devices[0]
  if device.platform == "cpu":
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f if ":" in line)
    free = int(info["MemAvailable"].split()[0]) * 1024
    n = sum(d.process_index == jax.process_index() for d in devices)
    return free // n, f"MemAvailable shared by {n} CPU device{'s' * (n > 1)}"
  free = []
  for d in devices:
    if d.process_index != jax.process_index():
      continue
    stats = d.memory_stats() or {}
    if "bytes_limit" not in stats:
      return None, f"{d.platform} reports no memory limit"
    free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
  return min(free), f"{device.device_kind} allocator limit less what is in use"


@dataclasses.dataclass
class Program:
  """One compiled step: XLA's memory analysis per device, its compile time and text.

  `library` is what XLA's analysis leaves out on a CPU: fusions that XLA hands to the YNNPACK or
  XNNPACK library (dots, reductions) work on copies of their operands that the library
  allocates itself. It is modelled as the largest operand of any such fusion: in the
  measurements behind docs/training.md that accounts for 70-110% of the bytes the analysis
  misses (which reach 40% of an eval step's temporaries at large batches).
  """

  name: str
  argument: int
  output: int
  alias: int
  temp: int
  code: int
  library: int
  compile_seconds: float
  cache_hit: bool
  compiled: Any = dataclasses.field(repr=False, default=None)

  @classmethod
  def compile(cls, name: str, jitted, *args) -> "Program":
    return cls.start(name, jitted, *args).result()

  @classmethod
  def start(cls, name: str, jitted, *args) -> "Compiling":
    """Lowers `jitted` for `args` here and compiles it in a background thread (XLA compiles,
    and loads from the persistent cache, without holding Python's lock, so the next program
    can be traced meanwhile); `.result()` waits for the Program."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    return Compiling(lambda: cls._from_lowered(name, lowered, t0))

  @classmethod
  def _from_lowered(cls, name: str, lowered, t0: float) -> "Program":
    hits = CacheHits()
    with hits:
      compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    program = cls(name, int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                  int(m.alias_size_in_bytes), int(m.temp_size_in_bytes),
                  int(m.generated_code_size_in_bytes), 0, seconds, hits.count > 0, compiled)
    if jax.devices()[0].platform == "cpu":
      program.library = program._library_scratch()
    return program

  @property
  def peak(self) -> int:
    """Live bytes per device while it runs: arguments, new outputs, temporaries, code."""
    return self.argument + self.output - self.alias + self.temp + self.code + self.library

  @functools.cached_property
  def buffers(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """Every array the compiled program's text defines: name -> (dtype, shape, bytes)."""
    out = {}
    for name, dtype, dims in _DEFINITION.findall(self.compiled.as_text()):
      if dtype in _ITEMSIZE:
        shape = tuple(int(d) for d in dims.split(",") if d)
        out[name] = (dtype, shape, math.prod(shape) * _ITEMSIZE[dtype])
    return out

  def largest_buffer(self) -> tuple[str, tuple[int, ...], int]:
    """(dtype, shape, bytes) of the largest array in the compiled program."""
    return max(self.buffers.values(), key=lambda b: b[2], default=("", (), 0))

  def _library_scratch(self) -> int:
    # Only the library fusions' operands are sized: parsing every definition of a large program
    # (`buffers`) costs about 0.1 s, on every start.
    text = self.compiled.as_text()
    operands = {o.strip().lstrip("%") for group in _LIBRARY_FUSION.findall(text)
                for o in group.split(",")}
    if not operands:
      return 0
    return max((math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[dtype]
                for name, dtype, dims in _DEFINITION.findall(text)
                if name in operands and dtype in _ITEMSIZE), default=0)


_DEFINITION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]", re.M)
_LIBRARY_FUSION = re.compile(r" fusion\(([^)]*)\).*\"kind\":\"__[xy]nn_fusion\"")
_ITEMSIZE = {"f64": 8, "s64": 8, "u64": 8, "c64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2,
             "f16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}


# The fraction of a device's float32 matmul rate that a whole training step reaches (attention,
# softmax, layer norms and the optimizer run slower than one large matmul); set from ListOps
# small and base timed on a 2-core CPU (docs/training.md, "How long a run takes").
STEP_EFFICIENCY = 0.35
# A CPU run expected to train longer than this stops and asks for `--yes` (lra run).
LONG_RUN_SECONDS = 3600.0


@functools.lru_cache(maxsize=None)
def matmul_flops() -> float:
  """Float32 FLOP/s of a 1024 x 1024 matmul on the default device (best of five, about 0.1 s
  on a CPU; measured once per process)."""
  n = 1024
  x = jax.numpy.ones((n, n), jax.numpy.float32)
  f = jax.jit(lambda a: a @ a)
  f(x).block_until_ready()
  best = float("inf")
  for _ in range(5):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * n ** 3 / best


def duration_text(seconds: float) -> str:
  """`0.06 s`, `42 s`, `12.5 min` or `127 hours`."""
  if seconds < 1:
    return f"{seconds:.2f} s"
  if seconds < 120:
    return f"{seconds:.0f} s"
  if seconds < 7200:
    return f"{seconds / 60:.1f} min"
  return f"{seconds / 3600:.0f} hours"


def nbytes_per_device(tree: Any) -> int:
  """Bytes one device holds of a pytree of ShapeDtypeStructs with shardings (the largest shard
  when they differ)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def abstract_batch(task, data_cfg: ml_collections.ConfigDict, batch_size: int, mesh,
                   split: str = "train") -> dict[str, jax.ShapeDtypeStruct]:
  """The task's global batch of `split` as ShapeDtypeStructs sharded over the batch axes."""
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                  sharding=mesh_lib.batch_sharding(mesh, len(v.shape)))
          for k, v in task.batch_spec(data_cfg, batch_size, split).items()}


@dataclasses.dataclass
class Report:
  """What `check` found for one config: the programs, the peak per device and what is free."""

  config: ml_collections.ConfigDict
  trainer: Any                      # lra.train.Trainer.abstract(config): the run's plan
  train: Program
  eval: Program
  state_bytes: int                  # params + optimizer state + step, per device
  available: int | None
  available_source: str
  compile_seconds: float = 0.0      # wall time to lower and compile every program, overlapped
  _variants: dict = dataclasses.field(default_factory=dict, repr=False)   # see variant_peak

  @property
  def train_peak(self) -> int:
    return self.train.peak

  @property
  def eval_peak(self) -> int:
    """The eval step's peak plus the optimizer state, alive meanwhile but not an argument."""
    params = nbytes_per_device(self.trainer.abstract_state()["params"])
    return self.eval.peak + self.state_bytes - params

  @property
  def peak(self) -> int:
    """The estimated peak bytes per device of the run."""
    return max(self.train_peak, self.eval_peak)

  @property
  def fits(self) -> bool:
    return self.available is None or self.peak <= self.available

  @property
  def param_count(self) -> int:
    return self.trainer.param_count

  @property
  def step_flops(self) -> float:
    """The compiled train step's floating-point operations per device (XLA's cost analysis)."""
    cost = self.train.compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", 0.0))

  def step_seconds(self) -> float:
    """A rough time per train step: its FLOPs at `STEP_EFFICIENCY` of this machine's measured
    matmul rate (`matmul_flops`). `--dry_run=steps:N` times real steps instead."""
    return self.step_flops / (STEP_EFFICIENCY * matmul_flops())

  def blame(self) -> str:
    """The largest buffer of the bigger program, named when it is a known tensor."""
    program = self.train if self.train_peak >= self.eval_peak else self.eval
    dtype, shape, size = program.largest_buffer()
    if not size:
      return ""
    c = self.config
    heads, length = int(c.model.num_heads), int(c.data.max_length)
    text = f"{dtype}[{','.join(map(str, shape))}] = {size / GB:.1f} GB"
    if len(shape) == 4 and shape[1] == heads and shape[2] == shape[3] >= length:
      kind = c.model.attention.kind
      text = (f"the {kind} attention scores {text} (batch x heads x L x L x "
              f"{_ITEMSIZE[dtype]} B)")
    elif len(shape) == 3 and shape[-1] == self.trainer.task.vocab_size:
      text = f"the logits {text} (batch x L x vocabulary x {_ITEMSIZE[dtype]} B)"
    else:
      text = f"a buffer {text}"
    copies = program.temp / size
    times = f" (about {copies:.0f} times that)" if copies >= 1.5 else ""
    return f"largest buffer {text}; temporaries {program.temp / GB:.1f} GB in all{times}"

  def variant_peak(self, field: str, value: Any) -> int:
    """The estimate with `config.<field> = value` (its train step compiled again; the eval
    step's estimate is kept)."""
    return max(self._variant(field, value).result().peak, self.eval_peak)

  def _variant(self, field: str, value: Any) -> "Compiling":
    """The train step of the variant, compiling in the background (started once)."""
    if (field, value) not in self._variants:
      config = copy.deepcopy(self.config)
      with config.unlocked():
        target, _, name = field.rpartition(".")
        (config if not target else config[target] if "." not in target else
         config[target.split(".")[0]][target.split(".")[1]])[name] = value
      trainer = train_lib.Trainer.abstract(config)
      batch = abstract_batch(trainer.task, config.data, int(config.batch_size), trainer.mesh,
                             "train")
      self._variants[field, value] = Program.start(
          "train step", trainer.train_step, trainer.abstract_state(), batch,
          trainer.abstract_rest)
    return self._variants[field, value]

  def _remat_applies(self) -> bool:
    return self.config.get("remat", "none") == "none" and self.train_peak > self.eval_peak

  def _flash_applies(self) -> bool:
    return exact_copy(self.config.model) is not None and self.train_peak > self.eval_peak

  def remat_peak(self) -> int | None:
    """The estimate with `--config.remat=block`, or None when the config already
    rematerialises or the eval step is the bigger program."""
    return self.variant_peak("remat", "block") if self._remat_applies() else None

  def flash_peak(self) -> int | None:
    """The estimate with the exact memory-efficient kind instead of dense attention (the train
    step only), or None when the config is not dense or uses positions flash does not have
    (relative)."""
    return (self.variant_peak("model.attention.kind", exact_copy(self.config.model))
            if self._flash_applies() else None)

  def ways_out(self) -> list[str]:
    """Concrete changes that make the run smaller, each with its estimate where it can say."""
    c, out = self.config, []
    if self._flash_applies():     # both variants compile side by side
      self._variant("model.attention.kind", exact_copy(c.model))
    if self._remat_applies():
      self._variant("remat", "block")
    if identity.size(c) == "base":
      out.append("--size small")
    flash = self.flash_peak()
    if flash is not None and flash < 0.9 * self.peak:
      out.append(f"--attention {exact_copy(c.model)} (exact, memory linear in the length: "
                 f"about {flash / GB:.1f} GB)")
    if kinds.get(c.model.attention.kind).cost == "quadratic":
      out.append(f"a linear-cost --attention such as {' or '.join(linear_ways_out()[:2])}")
    remat = self.remat_peak()
    if remat is not None and remat < 0.9 * self.peak:
      out.append(f"--config.remat=block (about {remat / GB:.1f} GB)")
    shards = self.trainer.mesh.shape["data"] * self.trainer.mesh.shape["fsdp"]
    eval_bigger = self.eval_peak > self.train_peak
    field = "eval_batch_size" if eval_bigger else "batch_size"
    batch = int(c[field])
    grows = max(self.peak - self.state_bytes, 1)          # the part that scales with the batch
    if self.available is not None and self.available > self.state_bytes:
      smaller = batch * (self.available - self.state_bytes) / grows
      fit = shards * 2 ** int(math.floor(math.log2(smaller / shards))) if smaller >= shards else 0
      if 0 < fit < batch:
        need = self.state_bytes + grows * fit / batch
        out.append(f"--config.{field}={fit} (about {need / GB:.1f} GB)")
      devices = math.ceil(grows / (self.available - self.state_bytes)) * shards
      if devices > shards:
        out.append(f"at least {devices} devices on the mesh's data axis")
    else:
      out.append("more devices with the parameters split over them (--config.mesh.fsdp)")
    return out

  def refusal(self) -> str:
    """The one line a run that cannot fit ends with."""
    c = self.config
    blame = self.blame()
    return (f"{c.task} ({identity.label(c)}) needs about {self.peak / GB:.1f} GB per "
            f"device but {self.available / GB:.1f} GB is available ({self.available_source})"
            f"{': ' + blame if blame else ''}. Ways out: {', '.join(self.ways_out())}; or "
            f"--no_preflight to run anyway.")


def check(config: ml_collections.ConfigDict, *, initialisers: bool = False) -> Report:
  """Compiles `config`'s train and eval steps on abstract inputs and reports their memory.

  `initialisers`: a run follows, so compile the state's initialisers too (side by side with
  the steps; waited for only when the config fits), for `Trainer.allocate` to reuse. The
  report's `trainer` is the plan to pass to the run (`train_and_evaluate(..., plan=...)`)."""
  timeout_s = int(config.get("peer_timeout_s", mesh_lib.PEER_TIMEOUT_S))
  mesh_lib.maybe_initialize_distributed(bool(config.get("distributed", False)), timeout_s)
  trainer = train_lib.Trainer.abstract(config)
  task, mesh, rest = trainer.task, trainer.mesh, trainer.abstract_rest
  state = trainer.abstract_state()
  train_batch = abstract_batch(task, config.data, int(config.batch_size), mesh, "train")
  eval_batch = abstract_batch(task, config.data, int(config.eval_batch_size), mesh, "test")
  # Each program is lowered here and compiled in its own thread, overlapping the next one's
  # tracing; the initialisers `Trainer.allocate` runs are compiled too (kept by their jits).
  t0 = time.perf_counter()
  compiling = [Program.start("train step", trainer.train_step, state, train_batch, rest),
               Program.start("eval step", trainer.eval_step, state["params"], eval_batch, rest)]
  if initialisers:
    compiling += [Compiling(jitted.lower(*args).compile)
                  for jitted, args in trainer.initialisers()]
  train_program, eval_program = (c.result() for c in compiling[:2])
  seconds = time.perf_counter() - t0
  available, source = available_memory(list(mesh.devices.flat))
  if available is not None and jax.process_count() > 1:   # every process takes one decision
    mesh_lib.wait_for_peers("the preflight's memory check", timeout_s)   # after the compiles
    from jax.experimental import multihost_utils   # (in MiB: jax arrays are 32-bit by default)
    mib = multihost_utils.process_allgather(np.int32(min(available >> 20, 2**31 - 1)))
    available = int(np.min(mib)) << 20
  report = Report(config, trainer, train_program, eval_program, nbytes_per_device(state),
                  available, source, seconds)
  if report.fits:
    for c in compiling[2:]:
      c.result()
    report.compile_seconds = time.perf_counter() - t0
  return report
