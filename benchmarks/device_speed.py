"""The `speed` and `grid` parts of the device check (see benchmarks/device_check.py).

`speed --targets` (what `lease` runs) measures `target_points` instead of the tiers: each target
of the issue at its length, the band kernel's block-size sweep, cuDNN's causal sliding window and
on a TPU the splash tile sweep; then `target_verdicts`, each target met or not and how far.

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
    config_args = {k: v for k, v in kwargs.items() if k in ("window", "dilation")}
    backend = backends.choose(kind, config_args, implementation=implementation,
                              global_tokens=bool(num_global))
    fn = backends.function(kind, implementation, args=config_args,
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


def part_speed(rec: Recorder, budget: Budget, toy: bool, out: str, wheels: str,
               targets: bool = False) -> None:
  """Runs `speed_worker` (`targets_worker` with `targets`) in a child process; when the child
  dies (a kernel that crashes the process), records the point it was measuring as crashed and
  starts a new child, which continues after it. Then the overtaking lengths, and with `targets`
  the table of targets (records `target`)."""
  key = _target_key if targets else _point_key
  for attempt in range(8):
    if budget.left() < 10:
      break
    cmd = [sys.executable, os.path.join(HERE, "device_check.py"), "speed", "--worker", "--out", out,
           "--budget", f"{budget.left() - 5:.0f}", "--wheels", wheels] + (["--toy"] if toy
                                                                          else [])
    cmd += ["--targets"] if targets else []
    current = None
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    # The part ends at its budget even while a point compiles: the worker is killed then.
    watchdog = threading.Timer(max(1.0, budget.left()), proc.kill)
    watchdog.start()
    try:
      for line in proc.stdout:
        if line.startswith("START "):
          current = json.loads(line[len("START "):])
        elif line.strip():
          print(line, end="", flush=True)
      proc.wait(timeout=max(1.0, budget.left()))
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
    watchdog.cancel()
    if proc.returncode == 0 or budget.left() < 1.0:
      if proc.returncode != 0 and current is not None:
        rec.log(f"budget spent while measuring {current}: stopped")
      break
    if current is None:
      rec.log(f"speed worker failed (rc={proc.returncode}) before its first point")
      break
    if key(current) not in {key(r) for r in read_jsonl(rec.jsonl)
                            if r.get("name") == "attention"}:
      rec.record(name="attention", **current, status=f"crashed: rc={proc.returncode}")
      rec.log(f"the point {current} ended the worker (rc={proc.returncode}); continuing after it")
  rows = [r for r in read_jsonl(rec.jsonl) if r.get("name") == "attention"]
  crashed = {_point_key(r)[:3] for r in rows if r.get("status", "").startswith("crashed")}
  measured_keys = {key(r) for r in rows}
  if targets:
    import jax
    planned = [{k: p[k] for k in _RECORD_FIELDS} | dict(target_point=True)
               for p in target_points(toy, jax.default_backend())]
  else:
    planned = planned_points(toy)
  for row in planned:
    if key(row) not in measured_keys:
      why = ("crashed at a shorter length" if not targets and _point_key(row)[:3] in crashed
             else "budget")
      rec.record(name="attention", **row, status=f"skipped: {why}")
      measured_keys.add(key(row))
  rows = [r for r in read_jsonl(rec.jsonl) if r.get("name") == "attention"]
  plain = [r for r in rows if not r.get("variant")]
  for reference in ("cudnn_dense", "tokamax_dense"):
    if any(r["case"] == reference and r.get("fwdbwd_s") for r in plain):
      for o in overtaking(plain, reference):
        rec.record(name="overtaking", **o)
        rec.log(f"{o['case']} {o['dtype']} d={o['head_dim']} overtakes {reference} at "
                f"{o['overtakes_at']}")
      break
  if targets:
    verdicts = target_verdicts(rows, toy)
    for v in verdicts:
      rec.record(name="target", **v)
    rec.log("targets:\n" + verdicts_table(verdicts))
  measured = sum(1 for r in rows if r.get("status") == "ok")
  skipped = sum(1 for r in rows if r.get("status", "").startswith("skipped"))
  rec.log(f"{measured} points measured, {skipped} skipped")


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




# ------------------------------------------------------------------------------------------------
# The lease's target points (`device_check.py lease`, or `speed --targets`): each target of the
# issue "Fast on the GPU we measured" at the lengths it is stated at, the band kernel's
# block-size sweep, cuDNN's causal sliding window, and on a TPU the splash tile sweep.

# The band kernel's launch settings swept (block_q, block_k, num_warps, num_stages); a setting
# the kernel's entry point does not take is recorded "not available".
BAND_SWEEP_ARGS = ("block_q", "block_k", "num_warps", "num_stages")
BAND_SWEEP = ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3),
              (128, 64, 8, 3), (128, 128, 8, 2))
# The splash kernel's tiles swept on a TPU (attention.splash.Tiles fields).
SPLASH_SWEEP = (dict(block_q=512, block_kv=512, block_kv_compute=512),
                dict(block_q=256, block_kv=512, block_kv_compute=256),
                dict(block_q=1024, block_kv=512, block_kv_compute=512),
                dict(block_q=512, block_kv=1024, block_kv_compute=512),
                dict(block_q=512, block_kv=512, block_kv_compute=512, use_fused_bwd_kernel=True))
CUDNN_WINDOWS = (256, 512)
PRECISION_VALUES = ("fast", "exact")
# Toy sizes of the rehearsal: lengths and head dims mapped down, the sweeps cut to two.
TOY_LENGTH = {4096: 128, 16384: 256, 32768: 256, 65536: 512}
TOY_HEAD_DIM = {128: 16, 64: 8}


def precision_argument(kind: str) -> str | None:
  """The name of the kind's precision setting (FAVOR+ and linear's fast bfloat16 path), read at
  run time from its record in attention.kinds (an argument naming a precision), else from its
  function's signature; None when it has none."""
  import inspect

  from attention import kinds
  record = kinds.get(kind)
  names = [a for a in record.arguments if "precision" in a]
  if not names:
    import attention
    names = [p for p in inspect.signature(attention.get(kind)).parameters if "precision" in p]
  return names[0] if names else None


def accepted(fn: Callable, names: tuple[str, ...]) -> list[str]:
  """Which of `names` the function takes as keywords (`inspect.signature`)."""
  import inspect

  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return []
  if any(p.kind == p.VAR_KEYWORD for p in params.values()):
    return list(names)
  return [n for n in names if n in params]


def _causal_band_pairs(n: int, window: int) -> float:
  return float(n * (window + 1) - window * (window + 1) / 2)


def _target(case: str, length: int, head_dim: int = 128, variant: str = "", **extra) -> dict:
  return dict(case=case, variant=variant, dtype="bfloat16", head_dim=head_dim, length=length,
              **extra)


def target_points(toy: bool, platform: str = "gpu") -> list[dict]:
  """The lease's points in the order measured (most important first); `variant` tells apart
  points of one case (precision, sweep setting)."""
  pts = [_target(c, n) for n in (4096, 16384, 32768) for c in ("cudnn_dense", "dot_product")]
  pts += [_target("band_w256_g16", 32768), _target("band_w512_dil", 32768),
          _target("bigbird", 32768)]
  pts += [_target(c, 16384, variant="precision=fast", precision="fast")
          for c in ("favor", "linear")]
  pts += [_target("sparse_strided", n) for n in (4096, 65536)]
  pts += [_target("cudnn_window", 32768, variant=f"window={w}", window=w) for w in CUDNN_WINDOWS]
  sweep = BAND_SWEEP[:2] if toy else BAND_SWEEP
  pts += [_target("band_w256_g16", 32768, variant=",".join(
      f"{k}={v}" for k, v in zip(BAND_SWEEP_ARGS, s)), sweep=dict(zip(BAND_SWEEP_ARGS, s)))
          for s in sweep]
  pts += [_target(c, n, variant=f"precision={p}", precision=p) for c in ("favor", "linear")
          for n, p in ((4096, "fast"), (16384, "exact"))]
  pts += [_target(c, n, head_dim=64) for n in (4096, 16384, 32768)
          for c in ("cudnn_dense", "dot_product")]
  if platform == "tpu" or toy:
    for tiles in (SPLASH_SWEEP[:2] if toy else SPLASH_SWEEP):
      pts.append(_target("band_w256_g16", 32768, variant="splash " + ",".join(
          f"{k}={v}" for k, v in tiles.items()), tiles=tiles))
  tokens, width = (256, 32) if toy else (TOKENS, WIDTH)
  for p in pts:
    if toy:
      p["length"], p["head_dim"] = TOY_LENGTH[p["length"]], TOY_HEAD_DIM[p["head_dim"]]
    p["batch"], p["heads"] = max(1, tokens // p["length"]), max(1, width // p["head_dim"])
  return pts


def _target_key(r: dict) -> tuple:
  return (r["case"], r.get("variant", ""), r["dtype"], r["head_dim"], r["length"])


_RECORD_FIELDS = ("case", "variant", "dtype", "head_dim", "length", "batch", "heads")


def _target_case(point: dict) -> dict:
  """The `speed_cases` entry a target point measures (or the cuDNN window's)."""
  if point["case"] == "cudnn_window":
    w = point["window"]
    return dict(name="cudnn_window", peer="cudnn_window",
                pairs=lambda n, h: h * _causal_band_pairs(n, w))
  return next(c for c in speed_cases() if c["name"] == point["case"])


def _target_function(point: dict, case: dict, dtype) -> tuple[Callable | None, str, str]:
  """(attend(q, k, v) or None, backend, why None)."""
  import jax

  n, batch, heads, head_dim = (point[k] for k in ("length", "batch", "heads", "head_dim"))
  if case.get("peer") == "cudnn_window":
    w = point["window"]
    return (lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="cudnn", is_causal=True, local_window_size=(w, 0))), "cudnn", ""
  if "peer" in case:
    return _peer_function(case["peer"], head_dim, dtype), case["peer"], ""
  extra: dict[str, Any] = {}
  implementation = "auto"
  if "precision" in point:
    name = precision_argument(case["kind"])
    if name is None:
      return None, "", f"not available: {case['kind']} has no precision setting"
    extra[name] = point["precision"]
  if "sweep" in point:
    implementation = "pallas"
  if "tiles" in point:
    implementation = "splash"
    extra["tiles"] = point["tiles"]
  attend, backend, fn = _kind_function(case, n, batch, heads, head_dim, dtype, implementation,
                                       with_function=True)
  if "sweep" in point:
    takes = accepted(fn, BAND_SWEEP_ARGS)
    lacking = [k for k in BAND_SWEEP_ARGS if k not in takes]
    if lacking:
      return None, backend, f"not available: the band kernel takes no {', '.join(lacking)}"
    extra.update(point["sweep"])
  elif extra and len(accepted(fn, tuple(extra))) < len(extra):
    lacking = [k for k in extra if k not in accepted(fn, tuple(extra))]
    return None, backend, f"not available: {backend} {case['kind']} takes no {', '.join(lacking)}"
  return (lambda q, k, v: attend(q, k, v, **extra)), backend, ""


def targets_worker(rec: Recorder, budget: Budget, toy: bool, out: str) -> None:
  """Measures the target points not yet in speed.jsonl, in order, while the budget lasts;
  prints `START <point>` before each (see `part_speed`)."""
  import jax
  import jax.numpy as jnp

  reps, seconds = (2, 0.5) if toy else (10, 0.5)
  rows = [r for r in read_jsonl(rec.jsonl) if r.get("name") == "attention"]
  done = {_target_key(r) for r in rows}
  memory_limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  peaks = {r["dtype"]: r["tflops"] for r in read_jsonl(rec.jsonl)
           if r.get("name") == "matmul_peak"}
  if "bfloat16" not in peaks:
    peaks["bfloat16"] = matmul_peak(jnp.bfloat16, toy)
    rec.record(name="matmul_peak", dtype="bfloat16", tflops=peaks["bfloat16"])
  # A point starts only when the longest point so far (at least `reserve`) still fits.
  longest = 3.0 if toy else 12.0
  for point in target_points(toy, jax.default_backend()):
    if _target_key(point) in done:
      continue
    if budget.left() < longest:
      break
    t0 = time.monotonic()
    row: dict[str, Any] = {k: point[k] for k in _RECORD_FIELDS}
    row["target_point"] = True
    print(f"START {json.dumps(row)}", flush=True)
    case = _target_case(point)
    try:
      attend, backend, why = _target_function(point, case, jnp.bfloat16)
      row["backend"] = backend
      if attend is None:
        row["status"] = why
      else:
        row.update(measure_point(attend, point["length"], point["batch"], point["heads"],
                                 point["head_dim"], jnp.bfloat16, reps, seconds, memory_limit))
        row["status"] = "ok"
    except Exception as e:  # unsupported on this platform, out of memory, ...
      text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
      row["status"] = f"error: {type(e).__name__}: {text}"
    done.add(_target_key(row))
    longest = max(longest, time.monotonic() - t0)
    _add_rates(row, case, peaks["bfloat16"])
    rec.record(name="attention", **row)
    rec.log(f"{row['case']:>16} {row['variant'][:40]:<40} d={row['head_dim']} "
            f"n={row['length']:>6} [{row.get('backend') or '-'}] fwd {_ms(row.get('fwd_s'))} "
            f"fwd+bwd {_ms(row.get('fwdbwd_s'))} "
            f"{row['status'] if row['status'] != 'ok' else ''}")


# Targets: (name, case, variant, length, bound in ms) of the time bounds, bf16 head dim 128.
TIME_TARGETS = (
    ("band w256 + 16 globals, 32K, fwd+bwd <= 2.0 ms", "band_w256_g16", "", 32768, 2.0),
    ("band w512 dilated, 32K, fwd+bwd <= 3.0 ms", "band_w512_dil", "", 32768, 3.0),
    ("BigBird, 32K, fwd+bwd <= 4 ms", "bigbird", "", 32768, 4.0),
    ("FAVOR+ (fast), 16K tokens, fwd+bwd <= 1.4 ms", "favor", "precision=fast", 16384, 1.4),
    ("linear (fast), 16K tokens, fwd+bwd <= 0.5 ms", "linear", "precision=fast", 16384, 0.5),
)
DENSE_TOLERANCE = 1.05
STRIDED_SHARE = 0.7


def target_verdicts(rows: list[dict], toy: bool = False) -> list[dict]:
  """Each target with what was measured, `met` (True, False, None: not measured) and how far
  (`ratio`: measured / bound for a time, the share for a rate). `rows`: the speed part's
  attention records."""
  length = (lambda n: TOY_LENGTH[n]) if toy else (lambda n: n)
  hd = (lambda d: TOY_HEAD_DIM[d]) if toy else (lambda d: d)
  got = {_target_key(dict(r, variant=r.get("variant", ""))): r for r in rows}

  def find(case, n, variant="", d=128):
    return got.get((case, variant, "bfloat16", hd(d), length(n)))

  def secs(r):
    return r.get("fwdbwd_s") if r else None

  def status(r):
    return "no record" if r is None else r.get("status", "?")[:80]

  out = []
  ratios, missing = [], []
  for d in (128, 64):
    for n in (4096, 16384, 32768):
      a, c = find("dot_product", n, d=d), find("cudnn_dense", n, d=d)
      if secs(a) and secs(c):
        ratios.append((secs(a) / secs(c), f"d={d} {n // 1024}K"))
      else:
        missing.append(f"d={d} {n // 1024}K ({status(a) if not secs(a) else status(c)})")
  if ratios:
    worst, where = max(ratios)
    text = (f"worst {worst:.2f}x cuDNN's time at {where} (bound {DENSE_TOLERANCE:.2f}x)" +
            (f"; not measured: {', '.join(missing)}" if missing else ""))
    met = None if missing and worst <= DENSE_TOLERANCE else worst <= DENSE_TOLERANCE
    out.append(dict(target="dense through auto within 5% of cuDNN direct, 4K-32K, d 64 and 128",
                    measured=text, met=met, ratio=worst / DENSE_TOLERANCE))
  else:
    out.append(dict(target="dense through auto within 5% of cuDNN direct, 4K-32K, d 64 and 128",
                    measured="not measured: " + ", ".join(missing), met=None, ratio=None))
  for name, case, variant, n, bound in TIME_TARGETS:
    r = find(case, n, variant)
    if secs(r):
      ms = secs(r) * 1e3
      text = f"{ms:.2f} ms = {ms / bound:.2f}x the bound"
      if case == "band_w256_g16":
        sweep = [x for k, x in got.items() if k[0] == case and k[1].startswith("block_q=")
                 and secs(x)]
        if sweep:
          best = min(sweep, key=secs)
          text += f"; best of the sweep {secs(best) * 1e3:.2f} ms ({best['variant']})"
      out.append(dict(target=name, measured=text, met=ms <= bound, ratio=ms / bound))
    else:
      out.append(dict(target=name, measured=f"not measured: {status(r)}", met=None, ratio=None))
  lo, hi = find("sparse_strided", 4096), find("sparse_strided", 65536)
  if lo and hi and lo.get("fwdbwd_tflops_own") and hi.get("fwdbwd_tflops_own"):
    share = hi["fwdbwd_tflops_own"] / lo["fwdbwd_tflops_own"]
    out.append(dict(target="strided sparse own TFLOP/s at 64K >= 70% of 4K's",
                    measured=f"{hi['fwdbwd_tflops_own']:.3g} vs {lo['fwdbwd_tflops_own']:.3g} "
                             f"TFLOP/s = {share:.0%}", met=share >= STRIDED_SHARE,
                    ratio=share / STRIDED_SHARE))
  else:
    out.append(dict(target="strided sparse own TFLOP/s at 64K >= 70% of 4K's",
                    measured=f"not measured: 4K {status(lo)}, 64K {status(hi)}", met=None,
                    ratio=None))
  ref = find("cudnn_dense", 4096)
  for case in ("favor", "linear"):
    r = find(case, 4096, "precision=fast")
    name = f"{case} (fast) faster than cuDNN dense at 4K"
    if secs(r) and secs(ref):
      out.append(dict(target=name, measured=f"{secs(r) * 1e3:.2f} vs {secs(ref) * 1e3:.2f} ms",
                      met=secs(r) < secs(ref), ratio=secs(r) / secs(ref)))
    else:
      out.append(dict(target=name, measured=f"not measured: {status(r if not secs(r) else ref)}",
                      met=None, ratio=None))
  return out


def verdicts_table(verdicts: list[dict]) -> str:
  lines = ["| target (bf16, head dim 128 unless named) | measured | |", "|---|---|---|"]
  lines += [f"| {v['target']} | {v['measured']} | "
            f"{'not measured' if v['met'] is None else 'met' if v['met'] else 'not met'} |"
            for v in verdicts]
  return "\n".join(lines)
