"""benchmarks/recall_plot.py: the needle table and figure read from run folders (synthetic runs
written as the trainer writes them: config.json and results.json)."""

import json
import statistics

import pytest
from PIL import Image

from benchmarks import recall_plot
from benchmarks.pillow_canvas import overlaps


def _run(root, name, kind, by_distance, *, global_query=False, variant="causal",
         task="needle"):
  run = root / name
  run.mkdir(parents=True)
  config = {"model": {"attention": {"kind": kind}, "global_query": global_query,
                      "variant": variant},
            "data": {"num_values": 16, "max_length": 256}}
  (run / "config.json").write_text(json.dumps(config))
  if by_distance is not None:
    (run / "results.json").write_text(json.dumps(
        {"task": task, "test_accuracy": 0.5, "test_accuracy_by_distance": by_distance}))


@pytest.fixture
def sweep(tmp_path):
  _run(tmp_path, "dense-0", "dot_product", {"2-3": 1.0, "4-7": 1.0, "128-255": 0.9})
  _run(tmp_path, "dense-1", "dot_product", {"2-3": 1.0, "4-7": 0.8, "128-255": 0.7})
  _run(tmp_path, "band-0", "band", {"2-3": 0.9, "4-7": 0.95, "128-255": 0.06})
  _run(tmp_path, "band-global-0", "band", {"2-3": 0.9, "128-255": 0.8}, global_query=True)
  _run(tmp_path, "linformer-0", "linformer", {"2-3": 0.2}, variant="bidirectional")
  _run(tmp_path, "unfinished", "favor", None)
  _run(tmp_path, "mqar", "dot_product", {"2-3": 0.5}, task="mqar")
  return tmp_path


def test_runs_group_by_kind_and_query_over_seeds(sweep):
  lines, data = recall_plot.read_runs(str(sweep))
  assert data == {"num_values": 16, "max_length": 256}
  assert set(lines) == {"dot_product", "band", "band + global query",
                        "linformer (bidirectional)"}
  assert lines["dot_product"] == {2: [1.0, 1.0], 4: [1.0, 0.8], 128: [0.9, 0.7]}
  assert lines["band + global query"] == {2: [0.9], 128: [0.8]}


def test_the_table_shows_the_mean_and_range_over_seeds(sweep):
  lines, _ = recall_plot.read_runs(str(sweep))
  rows = {r.split(" | ")[0].strip("| "): r for r in recall_plot.table(lines).splitlines()}
  header = rows["kind"].split(" | ")
  assert header[2:] == ["d 2-3", "d 4-7", "d 128-255 |"]
  dense = [c.strip(" |") for c in rows["dot_product"].split(" | ")]
  assert dense[1] == "2"
  assert dense[3] == f"{statistics.mean([1.0, 0.8]):.3f} (0.80-1.00)"
  assert dense[4] == "0.800 (0.70-0.90)"
  band_global = [c.strip(" |") for c in rows["band + global query"].split(" | ")]
  assert band_global[2:] == ["0.900", "-", "0.800"]


def test_the_figure_is_drawn_with_its_legend_off_the_panel(sweep, tmp_path):
  lines, _ = recall_plot.read_runs(str(sweep))
  path = tmp_path / "needle.png"
  canvas = recall_plot.plot(lines, str(path), chance=1 / 16, reach=32)
  assert Image.open(path).size == (1300, 640)
  panel = canvas.panels[0]
  assert all(not overlaps(legend, panel) for legend in canvas.legends)


def test_the_command_prints_the_table_and_refuses_a_folder_without_runs(sweep, tmp_path,
                                                                         capsys):
  assert recall_plot.main([str(sweep), "--plot", str(tmp_path / "f.png"), "--reach", "32"]) == 0
  out = capsys.readouterr().out
  assert "| band + global query | 1 |" in out and (tmp_path / "f.png").exists()
  empty = tmp_path / "empty"
  empty.mkdir()
  assert recall_plot.main([str(empty)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "no finished needle run" in err
  assert recall_plot.main([str(tmp_path / "missing")]) == 2


def _mqar_run(root, name, kind, width, accuracy):
  run = root / name
  run.mkdir(parents=True)
  config = {"model": {"attention": {"kind": kind}, "emb_dim": width},
            "data": {"num_kv_pairs": 4, "max_length": 64}}
  (run / "config.json").write_text(json.dumps(config))
  (run / "results.json").write_text(json.dumps({"task": "mqar", "test_accuracy": accuracy}))


def test_mqar_runs_make_the_width_table_and_figure(sweep, tmp_path, capsys):
  for kind, accs in (("dot_product", (1.0, 1.0, 0.98, 1.0)), ("linear", (0.2, 0.3, 0.7, 0.9))):
    for i, (width, acc) in enumerate(zip((32, 32, 64, 128), accs)):
      _mqar_run(sweep, f"{kind}-w{width}-{i}", kind, width, acc)
  lines, data = recall_plot.read_runs(str(sweep), "mqar")
  assert data == {"num_kv_pairs": 4, "max_length": 64}
  assert lines == {"dot_product": {32: [1.0, 1.0], 64: [0.98], 128: [1.0]},
                   "linear": {32: [0.2, 0.3], 64: [0.7], 128: [0.9]}}   # the needle runs left out
  rows = recall_plot.table(lines, "mqar").splitlines()
  assert rows[0] == "| kind | seeds | width 32 | width 64 | width 128 |"
  mean = statistics.mean([0.2, 0.3])
  assert rows[3] == f"| linear | 2 | {mean:.3f} (0.20-0.30) | 0.700 | 0.900 |"
  path = tmp_path / "zoology.png"
  assert recall_plot.main([str(sweep), "--task", "mqar", "--plot", str(path)]) == 0
  assert Image.open(path).size == (1300, 640)
  assert "| dot_product | 2 |" in capsys.readouterr().out
  lines, _ = recall_plot.read_runs(str(sweep))                      # needle: no MQAR run in it
  assert "linear" not in lines
