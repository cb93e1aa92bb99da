"""benchmarks/longformer_recipe.py: the short model's pieces and the long models' windows score
the same masked bytes, and the three rows are what the script says they are."""

import json

import numpy as np
import pytest

from benchmarks import longformer_recipe as recipe


def test_the_corpus_is_bytes_shifted_past_padding():
  train, val = recipe.corpus()
  assert train.min() >= 1 and max(train.max(), val.max()) <= 256
  assert abs(len(train) - 19 * len(val)) <= 20            # 95 / 5 by position


@pytest.mark.slow
def test_a_tiny_recipe_run_reports_three_finite_losses(tmp_path, capsys):
  out = tmp_path / "r.json"
  assert recipe.main(["--steps", "2", "--windows", "2", "--width", "16", "--layers", "1",
                      "--json", str(out)]) == 0
  loss = json.loads(out.read_text())["loss"]
  assert len(loss) == 3 and all(np.isfinite(v) for v in loss.values())
  printed = capsys.readouterr().out
  assert "positions: 128 copied to 512" in printed and printed.count("| imported") == 2
