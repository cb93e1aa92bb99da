"""Tables and plots of the attention benchmark (benchmarks/attention.py): the Markdown report
with each group's first impl against its peers, the issue's targets checked where measured, and
the time and memory plots."""

from __future__ import annotations

import os
import re
import sys

# What each group's first impl should show (the targets); checked when measured.
TARGETS = {
    "band": dict(n=8192, mode="fwdbwd", min_speedup={"torch_sdpa": 4.0, "hf_longformer": 4.0},
                 max_floor_ratio=4.0, memory=(16384, 8192, 2.3)),
}
MODES = ("fwd", "fwdbwd")
BWD_FACTOR = {"fwd": 1.0, "fwdbwd": 3.0}


def _fmt(x, spec="{:.1f}", none="-"):
  return none if x is None else spec.format(x)


def _ratio(a, b):
  return None if not a or not b else a / b


def analyse(header: dict, records: list, impls_order: list) -> dict:
  """Adds floor_s and x_floor to each ok record; returns {group: [impl names in order]}."""
  rate = header.get("matmul", {}).get("flops_per_s")
  groups = {}
  for name in dict.fromkeys(impls_order):
    group = next((r["group"] for r in records if r["impl"] == name), None)
    if group is not None:
      groups.setdefault(group, []).append(name)
  for r in records:
    flops = r.get("flops_fwd")
    r["floor_s"] = flops * BWD_FACTOR[r["mode"]] / rate if flops and rate else None
    r["x_floor"] = _ratio(r.get("median_s"), r["floor_s"]) if r.get("status") == "ok" else None
  return groups


def _lookup(records, impl, mode, n):
  return next((r for r in records if r["impl"] == impl and r["mode"] == mode and r["n"] == n
               and r.get("status") == "ok"), None)


def render_markdown(header: dict, records: list, impls_order: list) -> str:
  groups = analyse(header, records, impls_order)
  mm = header.get("matmul", {})
  m = header.get("machine", {})
  versions = {"jax": mm.get("framework_version")}
  versions.update({r["framework"]: r["framework_version"] for r in records
                   if r.get("framework_version")})
  versions = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()) if v)
  out = [f"Run {header.get('date', '?')} on {m.get('cpu', '?')} ({m.get('cores', '?')} cores, "
         f"{m.get('mem_gib', '?')} GiB), {versions}.",
         f"Command: `{header.get('command', '?')}`",
         f"float32 matmul rate measured in this run: "
         f"{_fmt(mm.get('flops_per_s') and mm['flops_per_s'] / 1e9, '{:.0f}')} GFLOP/s (best of "
         + ", ".join(f"{k}^3: {v / 1e9:.0f}" for k, v in mm.get("rates", {}).items()) + ").",
         "Times are medians (min beside) after one warm-up call; floor = FLOPs of the pattern the "
         "impl computes (x3 for fwd+bwd) / matmul rate; peak RSS = whole process; +RSS = peak "
         "increase over the process's RSS right before the first call. Speedup = peer time / "
         "first-impl time.", ""]
  for group, names in groups.items():
    subject, peers = names[0], names[1:]
    out.append(f"### Group `{group}` (batch {records[0]['batch']}, {records[0]['heads']} heads, "
               f"head_dim {records[0]['head_dim']})")
    out.append("")
    for name in names:
      note = next((r.get("note") for r in records if r["impl"] == name), "")
      out.append(f"- `{name}`: {note}")
    out.append("")
    for mode in MODES:
      rows = [r for r in records if r["group"] == group and r["mode"] == mode]
      if not rows:
        continue
      out.append(f"**{mode}**")
      out.append("")
      out.append(f"| n | impl | median ms | min ms | floor ms | x floor | peak RSS MB | +RSS MB "
                 f"| build s | {subject} speedup |")
      out.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
      for n in sorted({r["n"] for r in rows}):
        base = _lookup(records, subject, mode, n)
        for name in names:
          r = next((x for x in rows if x["impl"] == name and x["n"] == n), None)
          if r is None:
            continue
          if r.get("status") != "ok":
            out.append(f"| {n} | {name} | {r['status']}: {r.get('detail', '')} | | | | | | | |")
            continue
          speed = "-" if name == subject else _fmt(
              _ratio(r["median_s"], base and base["median_s"]), "{:.2f}x")
          out.append(
              f"| {n} | {name} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | "
              f"{_fmt(r['floor_s'] and r['floor_s'] * 1e3)} | {_fmt(r['x_floor'], '{:.1f}')} | "
              f"{r['peak_rss_mb']:.0f} | {_fmt(r.get('rss_increase_mb'), '{:.0f}')} | "
              f"{r['build_s']:.1f} | {speed} |")
      out.append("")
    out.extend(_key_ratios(records, group, subject, peers))
  return "\n".join(out)


def _key_ratios(records, group, subject, peers) -> list:
  """The first impl's speedups, distance to the floor and memory growth, plus target checks."""
  out = [f"Key ratios for `{subject}`: speedup = peer median / {subject} median; memory ratio = "
         f"value at n / value at n/2.", "",
         "| mode | n | x floor | " + " | ".join(f"vs {p}" for p in peers)
         + " | +RSS ratio | peak RSS ratio |",
         "|---|---:|---:|" + "---:|" * len(peers) + "---:|---:|"]
  for mode in MODES:
    for n in sorted({r["n"] for r in records if r["group"] == group and r["mode"] == mode}):
      s = _lookup(records, subject, mode, n)
      if s is None:
        continue
      half = _lookup(records, subject, mode, n // 2)
      cells = [_fmt(_ratio((_lookup(records, p, mode, n) or {}).get("median_s"), s["median_s"]),
                    "{:.2f}x") for p in peers]
      out.append(f"| {mode} | {n} | {_fmt(s['x_floor'], '{:.1f}')} | " + " | ".join(cells)
                 + f" | {_fmt(_ratio(s.get('rss_increase_mb'), half and half.get('rss_increase_mb')), '{:.2f}')}"
                 f" | {_fmt(_ratio(s['peak_rss_mb'], half and half['peak_rss_mb']), '{:.2f}')} |")
  out.append("")
  target = TARGETS.get(group)
  if target:
    mode, n = target["mode"], target["n"]
    s = _lookup(records, subject, mode, n)
    out.append(f"Targets ({subject}, {mode}, n={n}):")
    out.append("")
    for peer, want in target["min_speedup"].items():
      got = _ratio((_lookup(records, peer, mode, n) or {}).get("median_s"), s and s["median_s"])
      out.append(_check(f"speedup vs {peer}", got, f">= {want}x", got is not None and got >= want))
    got = s and s["x_floor"]
    want = target["max_floor_ratio"]
    out.append(_check("time / FLOP floor", got, f"<= {want}", got is not None and got <= want))
    big, small, want = target["memory"]
    b, sm = _lookup(records, subject, mode, big), _lookup(records, subject, mode, small)
    for key, label in (("rss_increase_mb", "+RSS"), ("peak_rss_mb", "peak RSS")):
      got = _ratio(b and b.get(key), sm and sm.get(key))
      out.append(_check(f"{label} n={big} / n={small}", got, f"<= {want}",
                        got is not None and got <= want))
    out.append("")
  return out


def _check(label, got, want, ok) -> str:
  verdict = "not measured" if got is None else ("met" if ok else "NOT met")
  return f"- {label}: {_fmt(got, '{:.2f}')} (target {want}): {verdict}"


# ------------------------------------------------------------------------------------------------
# Plot


def _pyplot():
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  return plt


def figure(header: dict, records: list, group: str, names: list):
  """The figure of one group: median time vs n (with the first impl's FLOP floor) and +RSS vs
  n, log-log, solid forward and dashed forward+backward; one legend for both panels, right of
  them (off the data); titles name the shape, the machine and the date."""
  plt = _pyplot()
  fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
  styles = {"fwd": "-", "fwdbwd": "--"}
  for i, name in enumerate(names):
    color = f"C{i}"
    for mode in MODES:
      pts = sorted(((r["n"], r) for r in records if r["impl"] == name and r["mode"] == mode
                    and r.get("status") == "ok"), key=lambda p: p[0])
      if not pts:
        continue
      ns = [n for n, _ in pts]
      ax_t.plot(ns, [r["median_s"] * 1e3 for _, r in pts], styles[mode], color=color,
                marker="o", label=f"{name} {mode}")
      mem = [(n, r.get("rss_increase_mb")) for n, r in pts if r.get("rss_increase_mb")]
      if mem:
        ax_m.plot([n for n, _ in mem], [m for _, m in mem], styles[mode], color=color,
                  marker="o")
      if i == 0:
        floor = [(n, r["floor_s"]) for n, r in pts if r.get("floor_s")]
        ax_t.plot([n for n, _ in floor], [f * 1e3 for _, f in floor], styles[mode],
                  color="black", linewidth=1, label=f"FLOP floor of {name} {mode}")
  rate = header.get("matmul", {}).get("flops_per_s") or 0
  ok = [r for r in records if r["group"] == group and r.get("status") == "ok"]
  shape = ok[0] if ok else {}
  sizes = ", ".join(text.format(shape[k]) for k, text in (
      ("batch", "batch {}"), ("heads", "{} heads"), ("head_dim", "head dim {}")) if k in shape)
  ax_t.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="median time (ms)",
           title=f"{group}: time per call ({sizes})" if sizes else f"{group}: time per call")
  ax_m.set(xscale="log", yscale="log", xlabel="sequence length n",
           ylabel="peak RSS increase over baseline (MB)",
           title=f"{group}: peak memory above the process baseline")
  lengths = sorted({r["n"] for r in records if r["group"] == group})
  for ax in (ax_t, ax_m):
    ax.set_xticks(lengths, [str(n) for n in lengths], minor=False)
    ax.set_xticks([], minor=True)
    ax.grid(True, which="both", alpha=0.3)
  fig.legend(*ax_t.get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.0, 0.93),
             fontsize=8, title="solid: forward; dashed: fwd+bwd", title_fontsize=8)
  machine = header.get("machine", {})
  fig.suptitle(f"{machine.get('cpu', '')}, {header.get('date', '')}; FLOP floor at the measured "
               f"float32 matmul rate, {rate / 1e9:.0f} GFLOP/s", fontsize=9)
  fig.tight_layout()
  return fig


def plot(header: dict, records: list, impls_order: list, out_dir: str) -> list:
  """One PNG per group (`figure`), named `<group>_attention.png` in `out_dir`."""
  plt = _pyplot()
  if plt is None:
    print("matplotlib is not installed: skipping the plot (it comes with the `bench` extra).",
          file=sys.stderr)
    return []
  groups = analyse(header, records, impls_order)
  paths = []
  for group, names in groups.items():
    fig = figure(header, records, group, names)
    path = os.path.join(out_dir, f"{group}_attention.png")
    os.makedirs(out_dir, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")   # the legend right of the panels included
    plt.close(fig)
    paths.append(path)
  return paths


# ------------------------------------------------------------------------------------------------
# CLI
#
# The runs behind the docs' plots are kept as their Markdown reports (docs/benchmarks.md,
# docs/performer.md, docs/sparse_attention.md: `render_markdown`'s output, unedited); their raw
# JSON lines stay in the git-ignored benchmarks/results/. `records_from_markdown` reads a report
# back (the floor as FLOPs at the run's matmul rate), so the plots are drawn again from the docs:
#
#   .venv-bench/bin/python benchmarks/attention_report.py docs/benchmarks.md docs/performer.md \
#       docs/sparse_attention.md --out docs

_RUN = re.compile(r"^Run (\S+) on (.+?) \((\d+) cores, ([\d.]+) GiB\), (.*)\.$")
_RATE = re.compile(r"^float32 matmul rate measured in this run: (\d+) GFLOP/s")
_GROUP = re.compile(r"^#+ Group `(\w+)` \(batch (\d+), (\d+) heads, head_dim (\d+)\)$")
_IMPL = re.compile(r"^- `(\w+)`: (.*)$")


def records_from_markdown(text: str) -> tuple[dict, list, list]:
  """(header, records, impl order) of the one run a report holds (ValueError without one)."""
  header, records, order = {}, [], []
  group = mode = None
  for line in text.splitlines():
    line = line.strip()
    if m := _RUN.match(line):
      if header:
        raise ValueError("more than one run in the text")
      header = {"date": m.group(1), "machine": {"cpu": m.group(2), "cores": int(m.group(3)),
                                                "mem_gib": float(m.group(4))}}
    elif m := _RATE.match(line):
      header["matmul"] = {"flops_per_s": float(m.group(1)) * 1e9}
    elif line.startswith("Command: `") and header:
      header["command"] = line[len("Command: `"):-1]
    elif m := _GROUP.match(line):
      group, mode = dict(group=m.group(1), batch=int(m.group(2)), heads=int(m.group(3)),
                         head_dim=int(m.group(4))), None
    elif group and (m := _IMPL.match(line)) and m.group(1) not in order:
      order.append(m.group(1))
      group.setdefault("notes", {})[m.group(1)] = m.group(2)
    elif group and line in (f"**{x}**" for x in MODES):
      mode = line[2:-2]
    elif group and mode and line.startswith("| ") and not line.startswith("| n |"):
      cells = [c.strip() for c in line.strip("|").split("|")]
      base = dict(group=group["group"], impl=cells[1], mode=mode, n=int(cells[0]),
                  batch=group["batch"], heads=group["heads"], head_dim=group["head_dim"],
                  note=group["notes"].get(cells[1], ""))
      if ":" in cells[2] and not cells[3]:   # `status: detail`
        status, _, detail = cells[2].partition(": ")
        records.append(dict(base, status=status, detail=detail))
        continue
      ms = lambda c: float(c) / 1e3 if c not in ("", "-") else None
      rate = header.get("matmul", {}).get("flops_per_s")
      floor = ms(cells[4])
      records.append(dict(base, status="ok", median_s=ms(cells[2]), min_s=ms(cells[3]),
                          flops_fwd=floor * rate / BWD_FACTOR[mode] if floor and rate else None,
                          peak_rss_mb=float(cells[6]),
                          rss_increase_mb=float(cells[7]) if cells[7] != "-" else None,
                          build_s=float(cells[8])))
    elif line.startswith(("Key ratios", "Targets", "## ")):
      mode = None
  if not header or not records:
    raise ValueError("no run report in the text")
  return header, records, order


def main(argv=None) -> int:
  import argparse
  parser = argparse.ArgumentParser(description="Draw the attention plots again from the "
                                   "Markdown reports in the docs.")
  parser.add_argument("docs", nargs="+", help="Markdown files, each holding one run's report")
  parser.add_argument("--out", default="docs", help="folder for <group>_attention.png")
  args = parser.parse_args(argv)
  for doc in args.docs:
    with open(doc) as f:
      header, records, order = records_from_markdown(f.read())
    paths = plot(header, records, order, args.out)
    if not paths:
      return 1
    print(f"{doc}: {', '.join(paths)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
