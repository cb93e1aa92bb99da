"""The speed part's runner (`part_speed`: the speed worker, or with `targets` the lease's target
points, in child processes) and the lease's target points (`device_check.py lease`, or
`speed --targets`): each target of the issue "Fast on the GPU we measured" at the lengths
it is stated at, the band kernel's block-size sweep, cuDNN's causal sliding window, and on a TPU
the splash tile sweep; then each target met or not and how far (`target_verdicts`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from benchmarks.device_common import HERE, ROOT, Budget, Recorder, read_jsonl
from benchmarks.device_speed import (TOKENS, WIDTH, _add_rates, _kind_function, _ms,
                                     _peer_function, _point_key, matmul_peak, measure_point,
                                     overtaking, planned_points, speed_cases)

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


def part_speed(rec: Recorder, budget: Budget, toy: bool, out: str, wheels: str,
               targets: bool = False) -> None:
  """Runs `device_speed.speed_worker` (`targets_worker` with `targets`) in a child process;
  when the child dies (a kernel that crashes the process), records the point it was measuring
  as crashed and starts a new child, which continues after it. Then the overtaking lengths, and with `targets`
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
