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


def test_the_pairs_corpus_writes_each_symbol_twice_at_even_offsets():
  train, val = recipe.pairs_corpus(16, 1000, seed=3)
  for ids in (train, val):
    assert len(ids) % 2 == 0 and ids.min() >= 1 and ids.max() <= 16
    assert np.array_equal(ids[0::2], ids[1::2])          # (x, x) pairs from offset 0
    assert not np.array_equal(ids[1:-1:2], ids[2::2])    # and not across pairs
  assert len(set(train.tolist())) == 16
  assert abs(len(train) - 19 * len(val)) <= 40


@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["text", "pairs"])
def test_a_tiny_recipe_run_reports_four_finite_losses(corpus, tmp_path, capsys):
  out = tmp_path / "r.json"
  assert recipe.main(["--steps", "2", "--windows", "2", "--width", "16", "--layers", "1",
                      "--corpus", corpus, "--json", str(out)]) == 0
  loss = json.loads(out.read_text())["loss"]
  assert len(loss) == 4 and all(np.isfinite(v) for v in loss.values())
  printed = capsys.readouterr().out
  assert "positions: 128 copied to 512" in printed and printed.count("| imported") == 3
  assert "fresh N(0, 0.02)" in printed and f"corpus ({corpus})" in printed
