"""The `speed` and `grid` parts of the device check (see benchmarks/device_check.py).

`speed --targets` (what `lease` runs) measures `device_targets.target_points` instead of the
tiers: each target of the issue at its length, the band kernel's block-size sweep, cuDNN's causal
sliding window and on a TPU the splash tile sweep; then `device_targets.target_verdicts`, each
target met or not and how far. `device_targets.part_speed` runs either in child processes.

`speed` runs its measurements in a child process (`device_check.py speed --worker`): a kernel
that kills the process costs only the point it was measuring, which is recorded as crashed, and
a new child continues after it (the case's longer lengths of that tier are skipped).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from benchmarks.device_common import HERE, ROOT, Budget, Recorder, read_jsonl

TOKENS = 16384          # batch x length of every speed point
WIDTH = 2048            # heads x head dim


# ------------------------------------------------------------------------------------------------
# speed


def _dilated_band_pairs(n: int, window: int, dilation: int) -> int:
  """Keys per query summed over queries of the two-sided band with this dilation."""
  import numpy as np

  i = np.arange(n, dtype=np.int64)
  lo = np.minimum(window, i // dilation)
  hi = np.minimum(window, (n - 1 - i) // dilation)
  return int(np.sum(lo + hi + 1))


def band_case(window: int, dilated: bool, num_global: int) -> dict:
  """A band configuration: dilations 1,1,2,2,4,4,... per head when dilated."""
  name = f"band_w{window}" + ("_dil" if dilated else "") + (f"_g{num_global}" if num_global
                                                              else "")

  def args(n: int, heads: int) -> dict:
    out: dict[str, Any] = dict(window=window)
    if dilated:
      out["dilation"] = tuple(2 ** min(h // 2, 2) for h in range(heads))
    if num_global:
      out["max_global"] = num_global
    return out

  def pairs(n: int, heads: int) -> float:
    dil = args(n, heads).get("dilation", (1,) * heads)
    band = sum(_dilated_band_pairs(n, window, d) for d in dil)
    return band + heads * 2.0 * num_global * n   # global rows and columns (overlap ignored)

  return dict(name=name, kind="band", args=args, pairs=pairs, num_global=num_global)


def _strided_case() -> dict:
  from benchmarks import impls_sparse

  return dict(name="sparse_strided", kind="sparse",
              args=lambda n, h: dict(pattern="strided", stride=impls_sparse.STRIDE),
              pairs=lambda n, h: h * impls_sparse.strided_pairs(n, False))


def _bigbird_case() -> dict:
  from benchmarks import impls_sparse

  return dict(name="bigbird", kind="bigbird",
              args=lambda n, h: dict(block_size=impls_sparse.BB_BLOCK,
                                     num_global_blocks=impls_sparse.BB_GLOBAL,
                                     num_random_blocks=impls_sparse.BB_RANDOM,
                                     seed=impls_sparse.BB_SEED),
              pairs=lambda n, h: _bigbird_pairs(n, h))


def _bigbird_pairs(n: int, heads: int) -> float:
  from benchmarks import impls_sparse

  return float(impls_sparse.bigbird_pairs(n, heads))


def _flops_case(name: str, kind: str, args: Callable, flops: Callable) -> dict:
  return dict(name=name, kind=kind, args=args, flops=flops)


def speed_cases() -> list[dict]:
  """Every configuration of the speed part, in the order measured (the peers first, so that
  every kind has its reference)."""
  from benchmarks import impls_linear, impls_lowrank

  def favor_args(n, h, d=None):
    return {}

  cases = [
      dict(name="cudnn_dense", peer="cudnn"),
      dict(name="tokamax_dense", peer="tokamax"),
      # Our dense kind through `auto` (tokamax on a GPU): within 10% of the peers is the aim.
      dict(name="dot_product", kind="dot_product", args=lambda n, h: {},
           pairs=lambda n, h: h * float(n) * n),
      band_case(256, False, 16), band_case(256, False, 0), band_case(256, True, 16),
      band_case(256, True, 0), band_case(512, False, 16), band_case(512, False, 0),
      band_case(512, True, 16), band_case(512, True, 0),
      _bigbird_case(), _strided_case(),
      _flops_case("favor", "favor", favor_args,
                  lambda n, b, h, d: impls_linear.favor_flops(n, b, h, d)),
      _flops_case("linear", "linear", lambda n, h: dict(chunk_size=impls_linear.CHUNK),
                  lambda n, b, h, d: impls_linear.linear_flops(n, b, h, d)),
      _flops_case("linformer", "linformer", lambda n, h: {},
                  lambda n, b, h, d: impls_lowrank.linformer_flops(n, b, h, d)),
      dict(name="flash", kind="flash", args=lambda n, h: {}, pairs=lambda n, h: h * float(n) * n),
  ]
  return cases


def _kind_function(case: dict, n: int, batch: int, heads: int, head_dim: int, dtype,
                   implementation: str, with_function: bool = False) -> tuple:
  """(attend(q, k, v, **more), backend used) of a kind configuration, and with
  `with_function` the backend's function itself (its signature says what it takes)."""
  import jax
  import jax.numpy as jnp

  kind = case["kind"]
  kwargs = case["args"](n, heads)
  if kind == "favor":
    from attention import favor_features
    from benchmarks import impls_linear
    kwargs = dict(features=favor_features(jax.random.key(1), impls_linear.NUM_FEATURES,
                                          head_dim), chunk_size=impls_linear.CHUNK)
  elif kind == "linformer":
    from benchmarks import impls_lowrank
    k1, k2 = jax.random.split(jax.random.key(2))
    scale = 1.0 / math.sqrt(n)
    kwargs = dict(proj_k=jax.random.normal(k1, (n, impls_lowrank.PROJECTED)) * scale,
                  proj_v=jax.random.normal(k2, (n, impls_lowrank.PROJECTED)) * scale)
  num_global = case.get("num_global", 0)
  try:
    from attention import backends
    kind_args = {k: v for k, v in kwargs.items() if k in ("window", "dilation")}
    backend = backends.choose(kind, kind_args, implementation=implementation,
                              global_tokens=bool(num_global))
    fn = backends.function(kind, implementation, args=kind_args,
                           global_tokens=bool(num_global))
  except ImportError:      # before attention/backends.py: the kind's portable function
    import attention
    backend, fn = "xla", attention.get(kind)
  if num_global:
    glob = jnp.zeros((batch, n), bool).at[:, :num_global].set(True)
    kwargs["global_mask"] = glob
  attend = lambda q, k, v, **more: fn(q, k, v, **kwargs, **more)
  return (attend, backend, fn) if with_function else (attend, backend)


def _peer_function(peer: str, head_dim: int, dtype) -> Callable:
  """The peer called directly: cuDNN through jax, or tokamax with the implementations of its
  default order that build on this jax (`tokamax_backend.implementations`: tokamax 0.0.12's
  own default fails on jax 0.11)."""
  import jax

  if peer == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
  from attention import tokamax_backend

  tokamax = tokamax_backend._tokamax()
  implementation = tokamax_backend.implementations(dtype, head_dim)
  return lambda q, k, v: tokamax.dot_product_attention(q, k, v, implementation=implementation)


def _tokamax_implementations(dtype, head_dim: int, case: dict) -> list[str] | str:
  """What tokamax was asked for at a point whose backend is tokamax (the record says which of
  its kernels could run)."""
  from attention import tokamax_backend

  window = None
  if case.get("kind") == "band":
    w = case["args"](1, 1)["window"]
    window = (w, w)
  got = tokamax_backend.implementations(dtype, head_dim, window=window)
  return got if isinstance(got, str) else list(got)


def _time(fn: Callable, args: tuple, reps: int, seconds: float) -> float:
  """Median seconds of `fn(*args)` over up to `reps` calls or `seconds` of calls (after the
  first call, which the caller makes)."""
  import jax

  times = []
  stop = time.monotonic() + seconds
  while len(times) < reps and (len(times) < 2 or time.monotonic() < stop):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def measure_point(attend: Callable, n: int, batch: int, heads: int, head_dim: int, dtype,
                  reps: int, seconds: float, memory_limit: float | None) -> dict:
  """Compiles and times forward and forward+backward of `attend`; returns times (s), the
  compiled programs' memory and compile seconds."""
  import jax

  keys = jax.random.split(jax.random.key(0), 4)
  shape = (batch, n, heads, head_dim)
  q, k, v, ct = (jax.random.normal(key, shape, dtype) for key in keys)

  def fwdbwd(q, k, v, ct):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(ct)

  result: dict[str, Any] = {}
  for mode, fn, args in (("fwd", attend, (q, k, v)), ("fwdbwd", fwdbwd, (q, k, v, ct))):
    t0 = time.monotonic()
    compiled = jax.jit(fn).lower(*args).compile()
    result[f"{mode}_compile_s"] = round(time.monotonic() - t0, 2)
    try:
      mem = compiled.memory_analysis()
      need = int(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes)
    except Exception:  # not every backend reports it
      need = None
    result[f"{mode}_memory_bytes"] = need
    if memory_limit and need and need > 0.9 * memory_limit:
      result[f"{mode}_s"] = None
      result[f"{mode}_status"] = "oom (predicted)"
      continue
    jax.block_until_ready(compiled(*args))
    result[f"{mode}_s"] = _time(compiled, args, reps, seconds)
  return result


def matmul_peak(dtype, toy: bool) -> float:
  """Measured TFLOP/s of a large square matmul in `dtype` (precision highest for float32)."""
  import jax
  import jax.numpy as jnp

  n = 256 if toy else 8192
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  fn = jax.jit(lambda x: jnp.matmul(x, x, precision="highest"))
  jax.block_until_ready(fn(a))
  seconds = _time(fn, (a,), 10, 2.0)
  return 2 * n ** 3 / seconds / 1e12


def overtaking(rows: list[dict], reference: str) -> list[dict]:
  """Per (case, dtype, head dim): the shortest measured length from which the case's
  forward+backward is faster than `reference`'s at every longer measured length."""
  ref = {(r["dtype"], r["head_dim"], r["length"]): r["fwdbwd_s"] for r in rows
         if r["case"] == reference and r.get("fwdbwd_s")}
  out = []
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    if r["case"] != reference and r.get("fwdbwd_s"):
      groups.setdefault((r["case"], r["dtype"], r["head_dim"]), []).append(r)
  for (case, dtype, head_dim), rs in sorted(groups.items()):
    pts = sorted((r["length"], r["fwdbwd_s"] < ref[(dtype, head_dim, r["length"])])
                 for r in rs if (dtype, head_dim, r["length"]) in ref)
    length = None
    for i, (n, faster) in enumerate(pts):
      if all(f for _, f in pts[i:]):
        length = n
        break
    out.append(dict(case=case, dtype=dtype, head_dim=head_dim, reference=reference,
                    overtakes_at=length, compared=[n for n, _ in pts]))
  return out


# (head dim, dtype, lengths, share of the part's budget, cases or None for all), measured in
# this order; time a tier leaves unused goes to the next ones. The first tier holds the points
# the targets of the issue "Measured on a GPU" are stated at.
TARGET_CASES = ("cudnn_dense", "tokamax_dense", "dot_product", "band_w256_g16", "favor",
                "linear")
TIERS = ((128, "bfloat16", (4096, 16384, 32768), 0.3, TARGET_CASES),
         (128, "bfloat16", (4096, 16384, 32768), 0.3, None),
         (128, "bfloat16", (1024, 65536), 0.15, None),
         (64, "bfloat16", (4096, 16384, 32768), 0.15, None),
         (128, "float32", (4096, 16384), 0.1, None))
TOY_TIERS = ((16, "bfloat16", (128,), 0.3, TARGET_CASES), (16, "bfloat16", (128, 256), 0.4, None),
             (16, "float32", (128,), 0.3, None))


def planned_points(toy: bool) -> list[dict]:
  """Every point the tiers name (case, dtype, head dim, length, batch, heads), once."""
  tokens, width = (256, 32) if toy else (TOKENS, WIDTH)
  out, seen = [], set()
  for head_dim, dtype_name, lengths, _, names in (TOY_TIERS if toy else TIERS):
    for case in speed_cases():
      if (names is not None and case["name"] not in names) or (
          case.get("peer") == "cudnn" and dtype_name != "bfloat16"):
        continue
      for n in lengths:
        row = dict(case=case["name"], dtype=dtype_name, head_dim=head_dim, length=n,
                   batch=max(1, tokens // n), heads=max(1, width // head_dim))
        if _point_key(row) not in seen:
          seen.add(_point_key(row))
          out.append(row)
  return out


def _point_key(r: dict) -> tuple:
  return (r["case"], r["dtype"], r["head_dim"], r["length"])


def speed_worker(rec: Recorder, budget: Budget, toy: bool, out: str) -> None:
  """Measures the points of `TIERS` not yet in speed.jsonl; prints `START <point>` before each
  so that the parent can name the point that killed it."""
  import jax
  import jax.numpy as jnp

  tiers = TOY_TIERS if toy else TIERS
  tokens, width = (256, 32) if toy else (TOKENS, WIDTH)
  reps, seconds = (2, 0.5) if toy else (10, 1.0)
  dtypes = dict(bfloat16=jnp.bfloat16, float32=jnp.float32)
  rows = [r for r in read_jsonl(rec.jsonl) if r.get("name") == "attention"]
  done = {_point_key(r) for r in rows if not r.get("status", "").startswith("skipped")}
  crashed = {_point_key(r)[:3] for r in rows if r.get("status", "").startswith("crashed")}
  memory_limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  peaks = {r["dtype"]: r["tflops"] for r in read_jsonl(rec.jsonl) if r.get("name") ==
           "matmul_peak"}
  for name in sorted({t[1] for t in tiers} - set(peaks)):
    peaks[name] = matmul_peak(dtypes[name], toy)
    rec.record(name="matmul_peak", dtype=name, tflops=peaks[name])
    rec.log(f"{name} matmul peak: {peaks[name]:.1f} TFLOP/s")
  cases = speed_cases()
  for tier_index, (head_dim, dtype_name, lengths, share, names) in enumerate(tiers):
    rest = sum(t[3] for t in tiers[tier_index:])
    tier_end = time.monotonic() + budget.left() * share / rest
    tier_cases = [c for c in cases if (names is None or c["name"] in names)
                  and not (c.get("peer") == "cudnn" and dtype_name != "bfloat16")]
    dtype = dtypes[dtype_name]
    for case_index, case in enumerate(tier_cases):
      stop_at = time.monotonic() + (tier_end - time.monotonic()) / (len(tier_cases) - case_index)
      last = None
      for n in lengths:
        batch, heads = max(1, tokens // n), max(1, width // head_dim)
        row: dict[str, Any] = dict(case=case["name"], dtype=dtype_name, head_dim=head_dim,
                                   length=n, batch=batch, heads=heads)
        if _point_key(row) in done:
          continue
        if _point_key(row)[:3] in crashed:
          continue                        # recorded as skipped by part_speed
        quadratic = "peer" in case or case["name"] in ("flash", "dot_product")
        predicted = 0.0 if last is None else last * (4 if quadratic else 2)
        if time.monotonic() + predicted > min(stop_at, time.monotonic() + budget.left()):
          continue                        # a later tier may have time; else part_speed says
        print(f"START {json.dumps(row)}", flush=True)
        t0 = time.monotonic()
        try:
          if "peer" in case:
            attend, backend = _peer_function(case["peer"], head_dim, dtype), case["peer"]
            row["implementation"] = case["peer"]
          else:
            attend, backend = _kind_function(case, n, batch, heads, head_dim, dtype, "auto")
            row["implementation"] = "auto"
          row["backend"] = backend
          if backend == "tokamax":
            row["tokamax_implementations"] = _tokamax_implementations(dtype, head_dim, case)
          row.update(measure_point(attend, n, batch, heads, head_dim, dtype, reps, seconds,
                                   memory_limit))
          row["status"] = "ok"
        except Exception as e:  # unsupported on this platform, out of memory, ...
          text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
          row["status"] = f"error: {type(e).__name__}: {text}"
        last = time.monotonic() - t0
        done.add(_point_key(row))
        _add_rates(row, case, peaks[dtype_name])
        rec.record(name="attention", **row)
        rec.log(f"{case['name']:>18} {dtype_name} d={head_dim} n={n:>6} b={batch} h={heads} "
                f"[{row.get('backend', '-')}] fwd {_ms(row.get('fwd_s'))} fwd+bwd "
                f"{_ms(row.get('fwdbwd_s'))} own {row.get('fwdbwd_tflops_own', 0):.1f} TFLOP/s "
                f"{row['status'] if row['status'] != 'ok' else ''}")


def _add_rates(row: dict, case: dict, peak: float) -> None:
  """FLOPs of the point (the kind's own forward work and the dense-equivalent) and TFLOP/s."""
  n, batch, heads, head_dim = row["length"], row["batch"], row["heads"], row["head_dim"]
  dense = 4.0 * head_dim * heads * batch * float(n) * n
  if "flops" in case:
    own = case["flops"](n, batch, heads, head_dim)
  elif "pairs" in case:
    own = 4.0 * head_dim * batch * case["pairs"](n, heads)
  else:
    own = dense
  row.update(own_flops_fwd=own, dense_flops_fwd=dense)
  for mode, factor in (("fwd", 1.0), ("fwdbwd", 3.5)):   # the backward pass is ~2.5 forwards
    if row.get(f"{mode}_s"):
      row[f"{mode}_tflops_own"] = factor * own / row[f"{mode}_s"] / 1e12
      row[f"{mode}_tflops_dense_equiv"] = factor * dense / row[f"{mode}_s"] / 1e12
      row[f"{mode}_fraction_of_peak"] = row[f"{mode}_tflops_own"] / peak if peak else None


def part_grid(rec: Recorder, budget: Budget, toy: bool, out: str, scratch: str) -> None:
  """The Text-base training-step grid of benchmarks/lra_speed.py, with the budget left."""
  grid_out = os.path.join(scratch, "lra_speed.jsonl")
  seconds = max(10.0, budget.left() - 5)
  cmd = [sys.executable, os.path.join(HERE, "lra_speed.py"), "--out", grid_out,
         "--plot", os.path.join(scratch, "lra_speed.png"), "--max_seconds", f"{seconds:.0f}"]
  cmd += ["--quick"] if toy else ["--kinds", "band,bigbird,favor,linear", "--lengths",
                                  "1024,4096", "--steps", "5", "--budget", "10"]
  rec.log(f"$ {shlex.join(cmd)}")
  try:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
    rec.logfile.write(proc.stdout + proc.stderr)
    status = f"rc={proc.returncode}"
  except subprocess.TimeoutExpired:
    status = "timeout: the points measured before it are recorded"
  points = read_jsonl(grid_out)
  for p in points:
    rec.record(name="text_base_step", point=p)
  rec.record(name="grid", status=status, points=len(points), grid_command=shlex.join(cmd))
  rec.log(f"Text-base step grid: {len(points)} points, {status}")


def _ms(seconds: float | None) -> str:
  return f"{seconds * 1e3:9.2f} ms" if seconds else "        - ms"
