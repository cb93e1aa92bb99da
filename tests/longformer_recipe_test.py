"""benchmarks/longformer_recipe.py: the short model's pieces and the long models' windows score
the same masked bytes, the rows are what the script says they are, and the no-order row's
encoder cannot see the order."""

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


def _runs(ids):
  """(symbol, length) of each run of equal neighbours."""
  edges = np.flatnonzero(np.diff(ids)) + 1
  return [(int(r[0]), len(r)) for r in np.split(ids, edges)]


def test_the_runs_corpus_writes_runs_of_two_to_four_that_differ_from_their_neighbours():
  train, val = recipe.runs_corpus(16, 20_000, seed=5)
  for ids in (train, val):
    assert ids.min() >= 1 and ids.max() <= 16 and ids.dtype == np.int32
    lengths = [n for _, n in _runs(ids)[1:-1]]            # the ends may be cut
    assert set(lengths) == {2, 3, 4}
    same = (ids[1:-1] == ids[:-2]) | (ids[1:-1] == ids[2:])
    assert same.all()                                     # every symbol has an equal neighbour
  counts = np.bincount(train, minlength=17)[1:]
  assert counts.min() > 0.8 * counts.mean()               # every symbol, about equally often
  lengths = np.array([n for _, n in _runs(train)[1:-1]])
  assert abs(np.mean(lengths == 2) - 1 / 3) < 0.03        # the lengths uniform over 2-4
  assert abs(len(train) - 19 * len(val)) <= 20
  assert np.array_equal(recipe.runs_corpus(16, 20_000, seed=5)[0], train)


@pytest.mark.parametrize("flags, word", [(["--alphabet", "1"], "--alphabet 1"),
                                         (["--alphabet", "300"], "--alphabet 300"),
                                         (["--dropout", "1.0"], "--dropout 1.0"),
                                         (["--dropout", "-0.1"], "--dropout -0.1")])
def test_bad_corpus_and_dropout_flags_are_one_line_and_exit_2(flags, word, capsys):
  with pytest.raises(SystemExit) as e:
    recipe.main(["--corpus", "runs"] + flags)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert word in err[-1] and "give" in err[-1]


def test_an_export_folder_that_holds_files_is_refused_before_training(tmp_path, capsys):
  (tmp_path / "keep.txt").write_text("x")
  with pytest.raises(SystemExit) as e:
    recipe.main(["--export", str(tmp_path)])
  assert (tmp_path / "keep.txt").read_text() == "x"
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert f"--export {tmp_path}: exists and is not an empty folder" in err[-1]


@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["text", "pairs", "runs"])
def test_a_tiny_recipe_run_reports_six_finite_losses(corpus, tmp_path, capsys):
  out = tmp_path / "r.json"
  export = ["--export", str(tmp_path / "roberta")] if corpus == "runs" else []
  assert recipe.main(["--steps", "2", "--windows", "2", "--width", "16", "--layers", "1",
                      "--corpus", corpus, "--json", str(out)] + export) == 0
  loss = json.loads(out.read_text())["loss"]
  assert len(loss) == 6 and all(np.isfinite(v) for v in loss.values())
  if corpus == "runs":   # the kept checkpoint loads, and is the short model
    from models import pretrained
    kept, _ = pretrained.load(str(tmp_path / "roberta"))
    assert kept.positions.table.shape[0] == recipe.SHORT + 2
  printed = capsys.readouterr().out
  assert "positions: 128 copied to 512" in printed and printed.count("| imported") == 4
  assert "fresh N(0, 0.02)" in printed and f"corpus ({corpus})" in printed
  assert "all 512 positions fresh" in printed and "no order" in printed


def test_with_the_orderless_table_the_encoder_reads_a_bag_of_bytes():
  from flax import nnx

  from models import pretraining
  from models.encoder import Encoder
  model = Encoder(dict(recipe.settings(1, 16), dropout=0.0), rngs=nnx.Rngs(0))
  table = np.random.default_rng(1).normal(0, 1, model.positions.table.shape).astype(np.float32)
  tokens = np.random.default_rng(2).integers(1, recipe.VOCAB, (1, 24)).astype(np.int32)
  shown = np.zeros((1, 24), bool)
  perm = np.random.default_rng(3).permutation(24)

  def logits(t):
    return np.asarray(pretraining.masked_logits(model, t, shown))

  model.positions.table.set_value(recipe.orderless(table))
  assert np.allclose(logits(tokens)[:, perm], logits(tokens[:, perm]), atol=1e-5)
  assert np.array_equal(recipe.orderless(table)[:2], table[:2])
  model.positions.table.set_value(table)                   # with positions the order counts
  assert not np.allclose(logits(tokens)[:, perm], logits(tokens[:, perm]), atol=1e-3)
