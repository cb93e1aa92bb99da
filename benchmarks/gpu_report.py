"""The GPU results page: Markdown from a device check's records folder (docs/gpu/DATE/).

    .venv/bin/python benchmarks/gpu_report.py docs/gpu/h100-2026-11-27 [--plot PNG]

A records folder holds what `benchmarks/device_check.py` wrote: env.jsonl (versions, the
machine, float32 matmul errors), tests.jsonl (the pytest part's counts) and speed.jsonl (the
matmul peaks and one `attention` record per point). The report is built from those files alone
and imports no jax, so it runs on any machine and benchmarks/doc_tables.py keeps docs/gpu.md's
tables equal to the records. Each section is its own function returning Markdown, and
doc_tables registers each between its own markers.

Nothing is silently left out: every point the speed part planned (device_speed.planned_points)
or recorded gets a cell, "not measured" when no record holds it (with the reason when the record
says "skipped: ..."), and the short error (the exception's type) where it failed, the full
messages listed under the table. The overtaking lengths are recomputed with
device_speed.overtaking from the attention records, and the targets of the issue "Measured on a
GPU" are each stated with the measured value, how far it is, and met / not met / not measured.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.device_common import read_jsonl  # noqa: E402
from benchmarks.device_speed import _ms, overtaking, planned_points  # noqa: E402

REFERENCE = "cudnn_dense"
NOT_MEASURED = "not measured"
GIB = 2.0 ** 30


def _length(n: int) -> str:
  return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def load(folder: str) -> dict[str, list[dict]]:
  """The records of each part: {"env": [...], "tests": [...], "speed": [...]}."""
  return {part: read_jsonl(os.path.join(folder, f"{part}.jsonl"))
          for part in ("env", "tests", "speed")}


def attention_rows(records: dict) -> list[dict]:
  """The speed part's points of the plain configurations (a `variant`: a precision setting, a
  sweep's setting, cuDNN's window, has its own table, `variants_table`)."""
  return [r for r in records["speed"] if r.get("name") == "attention" and not r.get("variant")]


def variant_rows(records: dict) -> list[dict]:
  return [r for r in records["speed"] if r.get("name") == "attention" and r.get("variant")]


def point(rows: list[dict], case: str, dtype: str, head_dim: int, length: int) -> dict | None:
  """The last record of a point (None when there is none)."""
  got = [r for r in rows if (r["case"], r["dtype"], r["head_dim"], r["length"]) ==
         (case, dtype, head_dim, length)]
  return got[-1] if got else None


def _seconds(r: dict | None, mode: str = "fwdbwd") -> float | None:
  return r.get(f"{mode}_s") if r and r.get("status") == "ok" else None


def short_status(r: dict | None) -> str:
  """What a cell shows when the point has no time: not measured (and why), or the error's type."""
  if r is None:
    return NOT_MEASURED
  status = r.get("status", "")
  if status.startswith("skipped"):
    return f"{NOT_MEASURED} ({status.split(':', 1)[1].strip()})"
  if status.startswith("error"):
    return "error: " + status.split(":")[1].strip()
  if status.startswith("crashed"):
    return "crashed"
  for mode in ("fwdbwd", "fwd"):
    if r.get(f"{mode}_status"):
      return r[f"{mode}_status"]
  return NOT_MEASURED


# ------------------------------------------------------------------------------------------------
# machine


def machine_table(records: dict) -> str:
  """The GPU, the versions, the matmul peaks and the commands that recorded them."""
  env = next((r for r in records["env"] if r.get("name") == "versions"), {})
  gpu = (env.get("machine", {}).get("nvidia_smi", {}).get("gpus") or [{}])[0]
  versions = env.get("versions") or env.get("machine", {}).get("versions", {})
  speed_gpu = next((r["machine"]["nvidia_smi"]["gpus"][0] for r in records["speed"]
                    if r.get("name") == "matmul_peak" and r.get("machine")), {})
  rows = [("GPU", gpu.get("name")), ("memory", gpu.get("memory.total")),
          ("driver", gpu.get("driver_version")),
          ("SM clock (max; while timing)", f"{gpu.get('clocks.max.sm')}; "
           f"{speed_gpu.get('clocks.current.sm', NOT_MEASURED)}"),
          ("memory clock", gpu.get("clocks.max.memory")), ("power limit", gpu.get("power.limit")),
          ("platform", versions.get("platform_version")), ("python", env.get("machine", {})
                                                           .get("python"))]
  for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax",
               "orbax-checkpoint", "tokamax"):
    if versions.get(name) or name != "jax-cuda12-plugin":
      rows.append((name, versions.get(name)))
  for r in records["speed"]:
    if r.get("name") == "matmul_peak":
      rows.append((f"{r['dtype']} matmul peak", f"{r['tflops']:.1f} TFLOP/s"))
  for r in records["env"]:
    if r.get("name") == "matmul_f32":
      rows.append((f"float32 matmul {r['n']}^3, precision {r['precision']}",
                   f"relative error {r['rel_error']:.2e}"))
  lines = ["| | |", "|---|---|"]
  lines += [f"| {k} | {NOT_MEASURED if v is None else v} |" for k, v in rows]
  commands = list(dict.fromkeys(r["command"] for part in ("env", "tests", "speed")
                                for r in records[part] if "--worker" not in r.get("command", "")
                                and r.get("command")))
  lines += ["", "Commands (as the records name them):", ""]
  lines += [f"    {c}" for c in commands]
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# tests


def budget_percent(folder: str) -> int | None:
  """The last progress percentage of pytest -v in tests.log (None without the log)."""
  path = os.path.join(folder, "tests.log")
  if not os.path.exists(path):
    return None
  last = None
  with open(path) as f:
    for line in f:
      if "%]" in line and "[" in line:
        try:
          last = int(line.split("%]")[0].rsplit("[", 1)[1])
        except ValueError:
          pass
  return last


def tests_table(records: dict, folder: str | None = None) -> str:
  """Totals, per file, the failing test ids, and where the part's budget stopped it."""
  r = next((x for x in records["tests"] if x.get("name") == "pytest"), None)
  if r is None:
    return f"Tests: {NOT_MEASURED}."
  t = r["totals"]
  head = (f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
          f"{t['skipped']} skipped")
  if r.get("timed_out"):
    pct = budget_percent(folder) if folder else None
    head += (f"; stopped by budget at {pct}% after {r['seconds']:.0f} s" if pct is not None
             else f"; stopped by budget after {r['seconds']:.0f} s")
  lines = [head + ".", "", "| file | passed | failed | errors | skipped |",
           "|---|---:|---:|---:|---:|"]
  for name, c in r["per_file"].items():
    lines.append(f"| {name} | {c['passed']} | {c['failed']} | {c['errors']} | {c['skipped']} |")
  ran = set(r["per_file"])
  unrun = [os.path.basename(f) for f in r.get("files", []) if os.path.basename(f) not in ran]
  if unrun:
    lines += ["", f"Not reached before the budget: {', '.join(unrun)}."]
  lines += ["", "Failing:", ""] + [f"- `{x}`" for x in r.get("failing", [])]
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# speed


def groups(rows: list[dict]) -> list[tuple[str, int]]:
  """(dtype, head dim) in the order measured."""
  return list(dict.fromkeys((r["dtype"], r["head_dim"]) for r in rows))


def _cases_and_lengths(rows, dtype, head_dim):
  mine = [r for r in rows if (r["dtype"], r["head_dim"]) == (dtype, head_dim)]
  try:
    planned = [p for p in planned_points(False) if (p["dtype"], p["head_dim"]) == (dtype, head_dim)]
  except Exception:  # the case list needs the benchmark modules
    planned = []
  cases = list(dict.fromkeys([r["case"] for r in mine] + [p["case"] for p in planned]))
  lengths = sorted({r["length"] for r in mine} | {p["length"] for p in planned})
  return cases, lengths


def speed_tables(records: dict) -> str:
  """Per (dtype, head dim): fwd+bwd milliseconds per case and length; then fwd ms, own TFLOP/s
  of fwd+bwd and the compiled fwd+bwd program's memory; then the errors' full messages."""
  rows = attention_rows(records)
  out = []
  for dtype, head_dim in groups(rows):
    cases, lengths = _cases_and_lengths(rows, dtype, head_dim)
    head = "| case | " + " | ".join(_length(n) for n in lengths) + " |"
    rule = "|---|" + "---:|" * len(lengths)
    t1, t2 = [head, rule], [head, rule]
    errors: dict[str, dict[str, list[str]]] = {}
    for case in cases:
      c1, c2 = [], []
      for n in lengths:
        r = point(rows, case, dtype, head_dim, n)
        if r and r.get("status", "").startswith("error"):
          errors.setdefault(r["status"], {}).setdefault(case, []).append(_length(n))
        fb, fw = _seconds(r), _seconds(r, "fwd")
        c1.append(_ms(fb).strip()[:-3] if fb else short_status(r))
        if fw or fb:
          mem = r.get("fwdbwd_memory_bytes")
          tf = r.get("fwdbwd_tflops_own")
          c2.append(f"{_ms(fw).strip()[:-3] if fw else '-'} / {f'{tf:.1f}' if tf else '-'} / "
                    f"{f'{mem / GIB:.2f}' if mem else '-'}")
        else:
          c2.append(short_status(r))
      backend = next((r.get("backend") for r in rows if r["case"] == case and r.get("backend")
                      and (r["dtype"], r["head_dim"]) == (dtype, head_dim)), "-")
      t1.append(f"| {case} [{backend}] | " + " | ".join(c1) + " |")
      t2.append(f"| {case} | " + " | ".join(c2) + " |")
    b = next(r for r in rows if (r["dtype"], r["head_dim"]) == (dtype, head_dim))
    shape = f"{b['heads']} heads, batch x length = {b['batch'] * b['length']} tokens"
    out += [f"**{dtype}, head dim {head_dim}** ({shape}): forward+backward ms "
            "[the backend `auto` chose]", "", *t1, "",
            f"**{dtype}, head dim {head_dim}**: forward ms / own TFLOP/s of forward+backward / "
            "forward+backward memory GiB (compiled)", "", *t2, ""]
    if errors:
      out += ["Errors:", ""] + [
          f"- `{status}`: " + "; ".join(f"{c} ({', '.join(ns)})" for c, ns in where.items())
          for status, where in errors.items()] + [""]
  return "\n".join(out).rstrip()


def overtaking_table(records: dict) -> str:
  """The length from which each case's forward+backward is faster than cudnn_dense's at every
  longer measured length (device_speed.overtaking over the attention records)."""
  rows = attention_rows(records)
  found = [o for o in overtaking(rows, REFERENCE) if o["compared"]]
  lines = [f"| case | dtype | head dim | overtakes {REFERENCE} at | lengths compared |",
           "|---|---|---:|---:|---|"]
  for o in found:
    at = _length(o["overtakes_at"]) if o["overtakes_at"] else "not within the lengths compared"
    lines.append(f"| {o['case']} | {o['dtype']} | {o['head_dim']} | {at} | "
                 f"{', '.join(_length(n) for n in o['compared'])} |")
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# targets


def _verdict(met: bool | None) -> str:
  return NOT_MEASURED if met is None else "met" if met else "not met"


def targets(records: dict) -> list[dict]:
  """Each target of the issue: {target, measured, met (True, False or None: not measured)}."""
  rows = attention_rows(records)
  dt, d = "bfloat16", 128
  out = []

  ref32, band32 = point(rows, REFERENCE, dt, d, 32768), point(rows, "band_w256_g16", dt, d, 32768)
  if _seconds(ref32) and _seconds(band32):
    ratio = _seconds(ref32) / _seconds(band32)
    out.append(dict(target="band w256 + 16 globals fwd+bwd at 32K >= 10x faster than cudnn_dense",
                    measured=f"{_seconds(band32) * 1e3:.2f} ms vs {_seconds(ref32) * 1e3:.2f} ms ="
                             f" {ratio:.1f}x ({ratio / 10:.0%} of the target)",
                    met=ratio >= 10, value=ratio))
    own, dense = band32["fwdbwd_tflops_own"], ref32["fwdbwd_tflops_own"]
    out.append(dict(target="band w256 + 16 globals own TFLOP/s at 32K >= half of cuDNN's",
                    measured=f"{own:.1f} vs {dense:.1f} TFLOP/s = {own / dense:.0%} "
                             "(target 50%)", met=own >= 0.5 * dense, value=own / dense))
  else:
    for target in ("band w256 + 16 globals fwd+bwd at 32K >= 10x faster than cudnn_dense",
                   "band w256 + 16 globals own TFLOP/s at 32K >= half of cuDNN's"):
      why = [f"{name} {short_status(r)}" for name, r in (("band", band32), (REFERENCE, ref32))
             if not _seconds(r)]
      out.append(dict(target=target, measured=f"{NOT_MEASURED}: at 32K " + ", ".join(why),
                      met=None, value=None))

  ours = [r for r in rows if (r["case"], r["dtype"], r["head_dim"]) == ("dot_product", dt, d)]
  worst, why = None, []
  for r in sorted(ours, key=lambda r: r["length"]):
    peers = [_seconds(point(rows, p, dt, d, r["length"])) for p in (REFERENCE, "tokamax_dense")]
    peers = [p for p in peers if p]
    if _seconds(r) and peers:
      worst = max(worst or 0.0, _seconds(r) / min(peers))
    else:
      why.append(f"{_length(r['length'])}: {short_status(r) if not _seconds(r) else 'no peer'}")
  out.append(dict(target="dot_product (auto) fwd+bwd within 10% of tokamax/cuDNN dense",
                  measured=(f"slowest {worst:.2f}x the faster peer" if worst is not None else
                            f"{NOT_MEASURED}: " + ("; ".join(why) or "no points")),
                  met=None if worst is None else worst <= 1.1, value=worst))

  over = {o["case"]: o for o in overtaking(rows, REFERENCE) if (o["dtype"], o["head_dim"]) ==
          (dt, d)}
  for case in ("favor", "linear"):
    r16, ref16 = point(rows, case, dt, d, 16384), point(rows, REFERENCE, dt, d, 16384)
    o = over.get(case)
    at = o["overtakes_at"] if o and 4096 in o["compared"] else None
    parts, met = [], True
    if o is None or 4096 not in o["compared"]:
      parts.append(f"overtaking by 4K {NOT_MEASURED}")
      met = None
    else:
      parts.append(f"overtakes at {_length(at)}" if at else "does not overtake at the lengths "
                   f"compared ({', '.join(_length(n) for n in o['compared'])})")
      met = at is not None and at <= 4096
    if _seconds(r16) and _seconds(ref16):
      ratio = _seconds(ref16) / _seconds(r16)
      parts.append(f"{ratio:.1f}x faster at 16K ({_seconds(r16) * 1e3:.2f} vs "
                   f"{_seconds(ref16) * 1e3:.2f} ms; target 5x)")
      met = None if met is None else met and ratio >= 5
    else:
      parts.append(f"16K {short_status(r16)}")
      met = None
    out.append(dict(target=f"{case} overtakes cudnn_dense by 4K and is >= 5x faster at 16K",
                    measured="; ".join(parts), met=met, value=None))
  out.append(dict(target="ListOps base accuracy", measured=f"{NOT_MEASURED}: not run yet",
                  met=None, value=None))
  return out


def targets_table(records: dict) -> str:
  lines = ["| target (bf16, head dim 128) | measured | |", "|---|---|---|"]
  lines += [f"| {t['target']} | {t['measured']} | {_verdict(t['met'])} |"
            for t in targets(records)]
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# plot

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94")


def plot_series(records: dict, dtype: str = "bfloat16", head_dim: int = 128) -> dict:
  """{case: [(length, fwd+bwd ms), ...]} of the measured points, the reference first."""
  out: dict[str, list] = {}
  for r in attention_rows(records):
    if (r["dtype"], r["head_dim"]) == (dtype, head_dim) and _seconds(r):
      out.setdefault(r["case"], []).append((r["length"], _seconds(r) * 1e3))
  return {c: sorted(out[c]) for c in sorted(out, key=lambda c: (c != REFERENCE, c))}


def plot(records: dict, path: str, dtype: str = "bfloat16", head_dim: int = 128):
  """Forward+backward ms against length, log-log, one line per case; cudnn_dense thick and
  black. Drawn with Pillow (benchmarks/pillow_canvas.py), as the other plots are."""
  from benchmarks.pillow_canvas import Axes, Canvas, length_label, load_font

  series = plot_series(records, dtype, head_dim)
  xs = [x for pts in series.values() for x, _ in pts]
  ys = [y for pts in series.values() for _, y in pts]
  font, small = load_font(22), load_font(16)
  canvas = Canvas((1300, 700))
  ax = Axes(canvas, (100, 70, 900, 600), (min(xs), max(xs)), (min(ys), max(ys)), True, True)
  ax.frame(f"Attention forward+backward, {dtype}, head dim {head_dim} (H100)",
           "sequence length (batch x length = 16K tokens)", "ms", xticks=sorted(set(xs)),
           font=font, small=small, xlabel_of=length_label)
  legend_x, y = 940, 80
  for i, (case, pts) in enumerate(series.items()):
    color = "black" if case == REFERENCE else COLORS[i % len(COLORS)]
    if case == REFERENCE:
      ax.draw.line([ax.xy(*a) for a in pts], fill=color, width=7)
    ax.series(pts, color)
    canvas.draw.line([(legend_x, y + 9), (legend_x + 35, y + 9)], fill=color,
                     width=7 if case == REFERENCE else 4)
    canvas.text((legend_x + 43, y), case, small)
    y += 26
  canvas.legends.append((legend_x, 80, 1290, y))
  return canvas.save(path)


# ------------------------------------------------------------------------------------------------


def variants_table(records: dict) -> str:
  """The points of the lease's variants (`device_targets.target_points`): FAVOR+ and linear per
  precision, the band kernel's block-size sweep, cuDNN's causal window, splash's tiles."""
  lines = ["| case | variant | length | head dim | backend | fwd ms | fwd+bwd ms | "
           "own TFLOP/s |", "|---|---|---:|---:|---|---:|---:|---:|"]
  for r in variant_rows(records):
    fb, fw = _seconds(r), _seconds(r, "fwd")
    if fb:
      cells = f"{fw * 1e3:.2f} | {fb * 1e3:.2f} | {r.get('fwdbwd_tflops_own', 0):.1f}"
    else:
      status = r.get("status", "")
      cells = f"{status if status.startswith('not available') else short_status(r)} | | "
    lines.append(f"| {r['case']} | {r['variant']} | {_length(r['length'])} | {r['head_dim']} | "
                 f"{r.get('backend') or '-'} | {cells} |")
  return "\n".join(lines)


def lease_targets_table(records: dict) -> str:
  """The targets of the lease's speed part (`device_targets.target_verdicts`), recomputed from
  its points: met or not, and how far."""
  from benchmarks.device_targets import target_verdicts, verdicts_table
  rows = [r for r in records["speed"] if r.get("name") == "attention"]
  return verdicts_table(target_verdicts(rows))


def report(folder: str) -> str:
  records = load(folder)
  sections = [
      "## Machine", machine_table(records), "## Tests", tests_table(records, folder),
      "## Speed", speed_tables(records), "## Overtaking", overtaking_table(records),
      "## Targets", targets_table(records)]
  if variant_rows(records) or any(r.get("name") == "target" for r in records["speed"]):
    sections += ["## Variants", variants_table(records), "## The lease's targets",
                 lease_targets_table(records)]
  return "\n\n".join(sections)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("folder", help="a device check's records folder (docs/gpu/DATE)")
  parser.add_argument("--plot", help="also draw forward+backward time against length to this PNG")
  args = parser.parse_args(argv)
  print(report(args.folder))
  if args.plot:
    plot(load(args.folder), args.plot)
  return 0


if __name__ == "__main__":
  sys.exit(main())
