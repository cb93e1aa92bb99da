"""Tests for the needle task (lra/data/needle_generator.py, lra/data/needle.py,
lra/tasks/needle.py, configs/needle.py).

The generator is checked against its definition by `violations`, a checker written from the
definition alone (the needle at distance d exactly, its key once before the query, filler
disjoint from keys and values, the answer the paired value), on many draws; planted slips show
the checker catches each kind of mistake. The independence of the value from the key and the
distance is tested statistically, the global query against band attention's own definition
(dense attention with the Longformer mask), and two steps of `lra run needle` of a tiny config
end with finite losses for both variants.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from attention import masks, rotary
from launch import cli
from lra import identity, train
from lra.data import needle, needle_generator
from lra.tasks import get_task
from lra.tasks import needle as needle_task
from lra.tasks.base import weighted_sums

V, L, NK, NV = 40, 64, 8, 8
DISTANCES = (2, 5, 31, 63)


def violations(inputs, targets, distance, *, num_keys, num_values, vocab_size,
               num_distractors=0):
  """What breaks the needle definition in one example drawn at `distance` with
  `num_distractors` other pairs (empty: nothing)."""
  out = []
  n = inputs.size
  q = n - 1
  pairs = 1 + num_distractors
  is_key = inputs < num_keys
  is_value = (inputs >= num_keys) & (inputs < num_keys + num_values)
  if not is_key[q]:
    out.append("the last token is not a key")
  keys_before = np.flatnonzero(is_key[:q])
  matching = keys_before[inputs[keys_before] == inputs[q]]
  if keys_before.size != pairs:
    out.append(f"{keys_before.size} keys before the query, not {pairs}")
  elif len(set(inputs[keys_before].tolist())) != pairs:
    out.append("a key appears twice before the query")
  elif matching.size != 1:
    out.append(f"the query's key appears {matching.size} times before it, not once")
  elif q - matching[0] != distance:
    out.append(f"the key is at distance {q - matching[0]}, not {distance}")
  values = np.flatnonzero(is_value)
  if values.size != pairs:
    out.append(f"{values.size} values, not {pairs}")
  elif keys_before.size == pairs and not np.array_equal(values, keys_before + 1):
    out.append("a value does not follow a key")
  elif matching.size == 1 and targets[q] != inputs[matching[0] + 1]:
    out.append("the answer is not the paired value")
  if (targets[:q] != 0).any():
    out.append("a scored position before the query")
  if (inputs >= vocab_size).any():
    out.append("a token outside the vocabulary")
  filler = np.delete(inputs, [q, *keys_before, *(keys_before + 1)])
  if (filler < num_keys + num_values).any():
    out.append("a filler token among the keys or values")
  return out


def draw(num, seed=0, **kw):
  settings = dict(vocab_size=V, seq_len=L, num_keys=NK, num_values=NV, distances=DISTANCES,
                  num_distractors=0)
  settings.update(kw)
  return needle_generator.generate(num, seed=seed, **settings)


@pytest.mark.parametrize("vocab_size, seq_len, num_keys, num_values, distances", [
    (V, L, NK, NV, DISTANCES), (64, 256, 16, 16, tuple(range(64, 256))),
    (1024, 1024, 128, 128, (512,)), (3, 3, 1, 1, (2,))])
def test_every_example_follows_the_definition(vocab_size, seq_len, num_keys, num_values,
                                              distances):
  rows = needle_generator.generate(300, vocab_size=vocab_size, seq_len=seq_len,
                                   num_keys=num_keys, num_values=num_values,
                                   distances=distances, seed=1, num_distractors=0)
  seen = set()
  for inputs, targets in rows:
    assert inputs.shape == targets.shape == (seq_len,)
    d = needle_generator.distance_of(inputs)
    seen.add(d)
    assert d in distances
    assert violations(inputs.astype(np.int64), targets.astype(np.int64), d,
                      num_keys=num_keys, num_values=num_values, vocab_size=vocab_size) == []
  assert len(seen) == min(len(distances), 300) or len(seen) > 150


def _slips():
  """(name, function of (inputs, targets, distance) that plants one mistake)."""
  def key_one_further(x, y, d):
    q = x.size - 1
    x[q - d - 1], x[q - d] = x[q - d], x[q - d - 1]            # off by one: the key at d + 1

  def key_twice(x, y, d):
    x[3 if x.size - 1 - d != 3 else 4] = x[-1]                  # the key also in the filler

  def value_in_the_filler(x, y, d):
    x[0 if x.size - 1 - d > 1 else x.size - 2] = NK             # a value among the filler

  def wrong_answer(x, y, d):
    y[-1] = NK + (y[-1] - NK + 1) % NV                          # another value answered

  def scored_filler(x, y, d):
    y[0] = NK                                                   # a filler position scored
  return [key_one_further, key_twice, value_in_the_filler, wrong_answer, scored_filler]


@pytest.mark.parametrize("slip", _slips(), ids=lambda f: f.__name__)
def test_the_checker_catches_a_planted_slip(slip):
  for distance in (5, 31):
    inputs, targets = (a.astype(np.int64) for a in draw(1, seed=5, distances=(distance,))[0])
    kw = dict(num_keys=NK, num_values=NV, vocab_size=V)
    assert violations(inputs, targets, distance, **kw) == []
    slip(inputs, targets, distance)
    assert violations(inputs, targets, distance, **kw) != []


def test_a_fixed_distance_is_exact_and_a_list_is_drawn_uniformly():
  for d in (2, 17, L - 1):
    assert {needle_generator.distance_of(x) for x, _ in draw(50, seed=2, distances=(d,))} == {d}
  got = np.array([needle_generator.distance_of(x) for x, _ in draw(4000, seed=3)])
  counts = np.array([(got == d).sum() for d in DISTANCES])
  assert counts.sum() == 4000
  assert _chi_square(counts, np.full(4, 0.25)) < 16.3    # 0.999 quantile, 3 degrees of freedom


def _chi_square(counts, probs):
  expected = counts.sum() * probs
  return float(((counts - expected) ** 2 / expected).sum())


def test_the_value_is_independent_of_the_key_and_the_distance():
  """A chi-square test of independence on 8,000 draws: the value against the key (8 x 8 table,
  49 degrees of freedom, tolerance 85.4, the 0.999 quantile) and against the distance (8 x 4,
  21 degrees of freedom, tolerance 46.8); marginals uniform (7 degrees of freedom, 24.3). A value
  planted as a function of the key scores in the thousands."""
  rows = draw(8000, seed=4)
  keys = np.array([int(x[-1]) for x, _ in rows])
  values = np.array([int(y[-1]) - NK for _, y in rows])
  dist = np.array([DISTANCES.index(needle_generator.distance_of(x)) for x, _ in rows])

  def independence(a, b, na, nb):
    table = np.zeros((na, nb))
    np.add.at(table, (a, b), 1)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum())
  assert independence(keys, values, NK, NV) < 85.4
  assert independence(dist, values, 4, NV) < 46.8
  assert _chi_square(np.bincount(values, minlength=NV), np.full(NV, 1 / NV)) < 24.3
  assert _chi_square(np.bincount(keys, minlength=NK), np.full(NK, 1 / NK)) < 24.3
  planted = (keys + (np.arange(keys.size) % 2)) % NV           # the test can fail
  assert independence(keys, planted, NK, NV) > 1000


def test_filler_is_uniform_over_its_own_range():
  rows = draw(300, seed=6)
  filler = np.concatenate([x[:-1][x[:-1] >= NK + NV] for x, _ in rows]).astype(np.int64)
  assert filler.size == 300 * (L - 3)
  counts = np.bincount(filler, minlength=V)[NK + NV:]
  assert _chi_square(counts, np.full(V - NK - NV, 1 / (V - NK - NV))) < 59.7   # df 23


def test_draws_are_deterministic_for_a_seed():
  a, b, c = draw(20, seed=7), draw(20, seed=7), draw(20, seed=8)
  for (x1, y1), (x2, y2) in zip(a, b):
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
  assert any((x1 != x3).any() for (x1, _), (x3, _) in zip(a, c))


@pytest.mark.parametrize("kw, message", [
    (dict(seq_len=2, distances=(2,)), "at least 3"), (dict(distances=(1,)), "2 <= d"),
    (dict(distances=(64,)), "2 <= d"), (dict(distances=()), "empty"),
    (dict(vocab_size=16), "must exceed"), (dict(num_keys=0), "at least one"),
    (dict(vocab_size=70_000), "uint16")])
def test_impossible_settings_are_refused(kw, message):
  settings = dict(vocab_size=V, seq_len=L, num_keys=NK, num_values=NV, distances=DISTANCES,
                  num_distractors=0)
  settings.update(kw)
  with pytest.raises(ValueError, match=message):
    needle_generator.check(**settings)


def _refusal(settings):
  with pytest.raises(ValueError) as e:
    needle_generator.check(**settings)
  return str(e.value)


def test_the_limits_of_the_settings_are_exact():
  """Each limit of `check` at its edge: the last allowed setting draws examples that follow the
  definition, the first refused one is refused with the numbers of its message."""
  base = dict(vocab_size=V, seq_len=L, num_keys=NK, num_values=NV, distances=DISTANCES,
              num_distractors=0)

  def allowed(**kw):
    settings = {**base, **kw}
    needle_generator.check(**settings)
    for inputs, targets in needle_generator.generate(50, seed=3, **settings):
      d = needle_generator.distance_of(inputs)
      assert d in settings["distances"]
      assert violations(inputs.astype(np.int64), targets.astype(np.int64), d,
                        num_keys=settings["num_keys"], num_values=settings["num_values"],
                        vocab_size=settings["vocab_size"],
                        num_distractors=settings["num_distractors"]) == []

  def refused(message, **kw):
    assert _refusal({**base, **kw}) == message

  allowed(seq_len=3, distances=(2,))
  refused("seq_len=2: a needle example needs at least 3 tokens (key, value, query).",
          seq_len=2, distances=(2,))
  allowed(num_keys=1, num_values=1, vocab_size=3)
  refused("num_keys=0, num_values=8: need at least one of each.", num_keys=0)
  refused("num_keys=8, num_values=0: need at least one of each.", num_values=0)
  allowed(vocab_size=NK + NV + 1)
  refused("vocab_size=16: must exceed num_keys + num_values = 16 (the rest is the filler "
          "vocabulary).", vocab_size=NK + NV)
  refused("vocab_size=12: must exceed num_keys + num_values = 16 (the rest is the filler "
          "vocabulary).", vocab_size=12)
  allowed(vocab_size=65_536)
  refused("vocab_size=65537: tokens are stored as uint16, so at most 65536.",
          vocab_size=65_537)
  allowed(distances=(2, L - 1))
  refused("distances [1]: a distance d puts the key at seq_len - 1 - d and its value after "
          "it, so 2 <= d <= seq_len - 1 = 63.", distances=(1, 2))
  refused("distances [64, 65]: a distance d puts the key at seq_len - 1 - d and its value "
          "after it, so 2 <= d <= seq_len - 1 = 63.", distances=(L - 1, L, L + 1))
  allowed(num_distractors=NK - 1)
  for n in (NK, -1):
    refused(f"num_distractors={n}: the distractors' keys are distinct and not the query's, "
            f"so 0 <= num_distractors <= num_keys - 1 = 7.", num_distractors=n)
  allowed(num_distractors=3, seq_len=17, distances=(2, 9, 16))
  refused("seq_len=16: 3 distractor pairs need seq_len >= 4 (num_distractors + 1) + 1 = 17.",
          num_distractors=3, seq_len=16, distances=(2,))


def _placement_law(free: tuple[bool, ...], n: int) -> dict[frozenset, float]:
  """The law of the distractors' start positions by the definition: each pair on two adjacent
  free positions drawn uniformly, one pair after the other (as unordered sets)."""
  if n == 0:
    return {frozenset(): 1.0}
  starts = [p for p in range(len(free) - 1) if free[p] and free[p + 1]]
  law: dict[frozenset, float] = {}
  for p in starts:
    rest = list(free)
    rest[p] = rest[p + 1] = False
    for placed, prob in _placement_law(tuple(rest), n - 1).items():
      law[placed | {p}] = law.get(placed | {p}, 0.0) + prob / len(starts)
  return law


@pytest.mark.parametrize("n", [1, 2])
def test_distractor_positions_follow_the_sequential_uniform_law(n):
  """Chi-square of the distractors' start positions against the law computed from the
  definition, on 13 tokens with the needle at distance 5 (free runs of 7 and 3 positions)."""
  seq_len, d, draws = 13, 5, 20_000
  q = seq_len - 1
  free = tuple(p not in (q - d, q - d + 1, q) for p in range(seq_len))
  law = _placement_law(free, n)
  rows = draw(draws, seed=11, seq_len=seq_len, distances=(d,), num_keys=4, num_values=4,
              vocab_size=16, num_distractors=n)
  counts = dict.fromkeys(law, 0)
  for inputs, _ in rows:
    starts = frozenset(int(p) for p in np.flatnonzero(inputs[:q] < 4) if p != q - d)
    assert starts in counts, sorted(starts)
    counts[starts] += 1
  sets = list(law)
  df = len(sets) - 1
  # the 0.999 quantile of chi-square with df degrees of freedom (Wilson-Hilferty)
  limit = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3
  stat = _chi_square(np.array([counts[k] for k in sets]), np.array([law[k] for k in sets]))
  assert stat < limit, (stat, limit)


def tiny_overrides(tmp_path):
  return [("data.data_dir", str(tmp_path / "data")), ("data.vocab_size", str(V)),
          ("data.num_keys", str(NK)), ("data.num_values", str(NV)),
          ("data.max_length", str(L)), ("data.distances", str(DISTANCES)),
          ("data.num_train", "64"), ("data.num_val", "16"), ("data.num_test", "16")]


def test_the_dataset_is_the_generators_output(tmp_path):
  config = configs.build_config("needle", size="small", overrides=tiny_overrides(tmp_path))
  task = get_task("needle")
  assert not task.status(config.data).ready
  source = task.get_source(config.data, "test")
  assert task.status(config.data).ready and len(source) == 16
  drawn = draw(16, seed=2)
  spec = task.batch_spec(config.data, 4, "train")
  for i, (inputs, targets) in enumerate(drawn):
    ex = source[i]
    assert {k: v.shape for k, v in ex.items()} == {k: v.shape[1:] for k, v in spec.items()}
    np.testing.assert_array_equal(np.flatnonzero(ex["mask"]), [L - 1])
    np.testing.assert_array_equal(ex["inputs"], inputs.astype(np.int32) + 1)
    assert ex["targets"][L - 1] == targets[L - 1] + 1 and (ex["targets"][:-1] == 0).all()


def _model_cfg(task, kind="dot_product", variant="causal", global_query=False, window=4):
  attention = {"kind": kind, **({"window": window} if kind == "band" else {})}
  return dict(vocab_size=task.vocab_size, num_classes=task.num_classes, max_length=L,
              emb_dim=16, num_heads=2, qkv_dim=16, mlp_dim=32, num_layers=2, dropout=0.0,
              pos_emb="rotary", pool="mean", classifier_dim=16, attention=attention,
              layer_attention=(), variant=variant, global_query=global_query)


def _batch(num=6, seed=10):
  rows = [needle.to_example(x, y, L) for x, y in draw(num, seed=seed)]
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  batch["weights"] = np.array([1] * (num - 1) + [0], np.float32)
  return batch


def test_the_objectives_score_the_query_position_only():
  task = get_task("needle")
  batch = _batch()
  lm = task.build_model(_model_cfg(task), nnx.Rngs(0))
  sums = task.objective(lm, batch, None)
  logits = lm(batch["inputs"])                                       # [B, L, V] in full
  want = weighted_sums(logits, batch["targets"], batch["mask"] * batch["weights"][:, None])
  for key in ("loss_sum", "correct", "weight"):
    np.testing.assert_allclose(float(sums[key]), float(want[key]), rtol=1e-5)
  assert float(sums["weight"]) == 5
  clf = task.build_model(_model_cfg(task, variant="bidirectional"), nnx.Rngs(0))
  assert isinstance(clf, needle_task.BidirectionalReader)
  x, _ = clf.encoder(batch["inputs"])
  assert x.shape == (6, L, 16)                                        # no CLS token
  embedding = np.asarray(clf.encoder.embed.embedding[...])            # [V, E]
  logits = (np.asarray(x[:, -1]) / np.sqrt(16)) @ embedding.T        # the query's, tied
  want = weighted_sums(jnp.asarray(logits), batch["targets"][:, -1], batch["weights"])
  sums = task.objective(clf, batch, None)
  for key in ("loss_sum", "correct", "weight"):
    np.testing.assert_allclose(float(sums[key]), float(want[key]), rtol=1e-5)


def test_evaluation_counts_each_needle_in_its_distance_bin():
  assert needle_task.distance_bins(64) == [(2, 4), (4, 8), (8, 16), (16, 32), (32, 64)]
  assert needle_task.distance_bins(256)[-1] == (128, 256)
  assert needle_task.distance_bins(3) == [(2, 4)]
  task = get_task("needle")
  batch = _batch(num=40, seed=11)
  lm = task.build_model(_model_cfg(task), nnx.Rngs(1))
  sums = task.objective(lm, batch, None)
  right = np.argmax(np.asarray(lm(batch["inputs"]))[:, -1], -1) == batch["targets"][:, -1]
  # Each example's distance, from the generator's definition: the key is the one key token
  # before the query (ids are tokens + 1, keys are tokens below NK).
  distance = np.array([L - 1 - np.flatnonzero(row[:-1] <= NK)[0] for row in batch["inputs"]])
  assert set(distance) <= set(DISTANCES) and len(set(distance)) > 2
  want_correct, want_weight = {}, {}
  for d, ok, w in zip(distance, right, batch["weights"]):
    lo = 2 ** int(np.floor(np.log2(d)))
    want_correct[lo] = want_correct.get(lo, 0) + ok * w
    want_weight[lo] = want_weight.get(lo, 0) + w
  for lo, _ in needle_task.distance_bins(L):
    assert float(sums[f"weight_d{lo}"]) == want_weight.get(lo, 0)
    assert float(sums[f"correct_d{lo}"]) == want_correct.get(lo, 0)
  assert "weight_d2" not in task.objective(lm, batch, jax.random.key(0))  # training: none
  fields = task.result_fields(test_best={k: float(v) for k, v in sums.items()},
                              test_final=None, final_validation=None, best=None)
  want = {f"{lo}-{2 * lo - 1}": want_correct[lo] / want_weight[lo] for lo in want_weight
          if want_weight[lo]}
  assert fields["test_accuracy_by_distance"] == pytest.approx(want)


def test_distractors_follow_the_definition_and_change_nothing_else():
  for seq_len, n, distances in ((64, 7, DISTANCES), (9, 1, (2, 8)),
                                (256, 15, tuple(range(2, 256)))):
    rows = draw(300, seed=4, seq_len=seq_len, num_keys=16, num_values=8, vocab_size=64,
                distances=distances, num_distractors=n)
    for inputs, targets in rows:
      d = needle_generator.distance_of(inputs)
      assert d in distances
      assert violations(inputs, targets, d, num_keys=16, num_values=8, vocab_size=64,
                        num_distractors=n) == []
  # the checker catches a distractor carrying the query's key, and a missing distractor
  inputs, targets = draw(1, seed=5, num_keys=16, num_values=8, vocab_size=64,
                         num_distractors=3)[0]
  d = needle_generator.distance_of(inputs)
  kw = dict(num_keys=16, num_values=8, vocab_size=64, num_distractors=3)
  other = [p for p in np.flatnonzero(inputs[:-1] < 16) if p != inputs.size - 1 - d]
  slipped = inputs.copy()
  slipped[other[0]] = inputs[-1]
  assert violations(slipped, targets, d, **kw)
  assert violations(inputs, targets, d, **{**kw, "num_distractors": 4})
  # distractor keys are uniform over the keys but the query's: chi-square of the 16 x 15
  # off-diagonal counts, 16 x 14 = 224 degrees of freedom (0.999 quantile about 295)
  rows = draw(3000, seed=6, seq_len=64, num_keys=16, num_values=8, vocab_size=64,
              num_distractors=1)
  counts = np.zeros((16, 16))
  for inputs, _ in rows:
    keys = inputs[:-1][inputs[:-1] < 16]
    counts[inputs[-1], keys[keys != inputs[-1]][0]] += 1
  off = counts[~np.eye(16, dtype=bool)].reshape(16, 15)
  expected = off.sum(1, keepdims=True) / 15
  assert ((off - expected) ** 2 / expected).sum() < 295 and np.all(np.diag(counts) == 0)
  # no distractors: the same draws as without the option
  for (a, b), (c, e) in zip(draw(20, seed=7), draw(20, seed=7, num_distractors=0)):
    np.testing.assert_array_equal(a, c) and np.testing.assert_array_equal(b, e)
  with pytest.raises(ValueError, match=r"num_distractors=8: .* num_keys - 1 = 7\."):
    draw(1, num_distractors=8)
  with pytest.raises(ValueError, match="need seq_len >= 4"):
    draw(1, seq_len=16, num_distractors=4, distances=(5,))
  config = configs.build_config("needle", size="small", arg="distractors=15")
  assert config.data.num_distractors == 15
  assert "_distractors15_" in needle.builder_config(config.data).name
  assert "distractors" not in needle.builder_config(
      configs.build_config("needle", size="small").data).name
  with pytest.raises(ValueError, match="num_distractors=16"):
    configs.build_config("needle", size="small", arg="distractors=16")


@pytest.mark.parametrize("causal", [True, False])
def test_the_global_query_is_band_attention_with_the_query_global(causal):
  """The global-query layer against dense attention with the Longformer mask of its window,
  the last real position global (computed here from `masks.longformer_mask`)."""
  task = get_task("needle")
  variant = "causal" if causal else "bidirectional"
  model = task.build_model(_model_cfg(task, "band", variant, global_query=True), nnx.Rngs(1))
  layer = model.encoder.blocks[0].attention
  assert isinstance(layer, needle_task.QueryGlobalBandAttention)
  assert all(isinstance(b.attention, needle_task.QueryGlobalBandAttention)
             for b in model.encoder.blocks)
  x = jax.random.normal(jax.random.key(0), (2, L, 16))
  key_mask = jnp.ones((2, L), bool).at[1, L - 5:].set(False)        # row 1: query at L - 6
  out = layer(x, key_mask)
  proj = lambda w: jnp.einsum("ble,ehd->blhd", x, w[...])
  q, k = (rotary.apply_rotary(proj(w), layer.rotary_base) for w in (layer.query, layer.key))
  v = proj(layer.value)
  last = jnp.array([L - 1, L - 6])
  want = []
  for b in range(2):
    glob = np.zeros(L, bool)
    glob[int(last[b])] = True
    allowed = np.asarray(masks.longformer_mask(L, window=4, global_mask=glob[None],
                                               key_mask=key_mask[b][None], causal=causal))[0, 0]
    logits = jnp.einsum("qhd,khd->hqk", q[b], k[b]) / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(jnp.where(allowed[None], logits, -1e30), axis=-1)
    o = jnp.einsum("hqk,khd->qhd", p, v[b])
    want.append(jnp.einsum("lhd,hde->le", o, layer.out[...]))
  real = np.asarray(key_mask)
  np.testing.assert_allclose(np.asarray(out)[real], np.asarray(jnp.stack(want))[real],
                             atol=1e-5)
  np.testing.assert_array_equal(np.asarray(needle_task.query_position(key_mask)).nonzero()[1],
                                np.asarray(last))


def test_the_global_query_layers_pass_the_configs_splash_tiles(monkeypatch):
  """config.model.splash reaches the kernel of the global-query layers too (they call their
  band function themselves); other backends get no tiles."""
  from attention import splash
  task = get_task("needle")
  tiles = dict(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
               block_kv_dkv=128, block_kv_dkv_compute=128)
  calls = []

  def function(kind, implementation, **_):
    def band(q, k, v, **kwargs):
      calls.append((implementation, kwargs.get("tiles")))
      return jnp.zeros_like(q)
    return band

  monkeypatch.setattr(needle_task.backends, "function", function)
  x = jnp.ones((1, L, 16))
  for implementation, want in (("splash", splash.Tiles(**tiles)), ("xla", None)):
    cfg = _model_cfg(task, "band", "bidirectional", global_query=True)
    cfg["attention"] = {**cfg["attention"], "implementation": implementation}
    model = task.build_model({**cfg, "splash": tiles}, nnx.Rngs(1))
    for block in model.encoder.blocks:
      assert isinstance(block.attention, needle_task.QueryGlobalBandAttention)
      assert block.attention.tiles == want
      calls.clear()
      block.attention(x, None)
      assert calls == [(implementation, want)]


def test_configs_build_and_refuse():
  base = configs.build_config("needle", size="base")
  assert base.data.max_length == 1024 and base.data.distances == tuple(range(256, 1024))
  small = configs.build_config("needle", size="small")
  assert (small.data.max_length, small.model.num_layers, small.model.emb_dim) == (256, 2, 64)
  assert small.data.distances == tuple(range(64, 256))
  assert small.model.attention.kind == "dot_product" and small.model.variant == "causal"
  band = configs.build_config("needle", size="small",
                              arg="attention=band,global=1,distance=128,length=512")
  assert band.model.attention.window * band.model.num_layers == 32 < 128
  assert band.data.distances == (128,) and band.data.max_length == 512 and band.model.global_query
  assert identity.arg(band) == "attention=band,size=small"   # what launch/ compares with
  ranged = configs.build_config("needle", size="base", arg="distance=100-199,length=65535")
  assert ranged.data.distances == tuple(range(100, 200))
  linformer = configs.build_config("needle", size="small", arg="attention=linformer")
  task = get_task("needle")
  with pytest.raises(ValueError, match="cannot be causal.*variant=bidirectional"):
    task.build_model(train.model_config(linformer, task), nnx.Rngs(0))
  configs.build_config("needle", size="small", arg="attention=bigbird,variant=bidirectional")
  with pytest.raises(ValueError, match="needs band layers"):
    configs.build_config("needle", size="small", arg="global=1")
  with pytest.raises(ValueError, match="2 <= d"):
    configs.build_config("needle", size="small", arg="distance=256")
  with pytest.raises(ValueError, match="variant"):
    configs.build_config("needle", size="small", arg="variant=sideways")


def test_a_log_spread_draws_each_power_of_two_bin_equally_often():
  spread = configs.build_config("needle", size="small",
                                arg="distance=2-255,spread=log").data.distances
  for lo, hi in needle_task.distance_bins(256):          # 7 bins of 128 entries each
    inside = [d for d in spread if lo <= d < hi]
    assert len(inside) == 128 and set(inside) == set(range(lo, hi))
    assert len(set(inside.count(d) for d in range(lo, hi))) == 1   # equally within a bin
  assert len(spread) == 7 * 128
  # a range cut inside its bins: bins {2, 3} and {4, 5, 6}, each 6 entries
  assert configs.build_config("needle", size="small", arg="distance=2-6,spread=log"
                              ).data.distances == (2, 2, 2, 3, 3, 3, 4, 4, 5, 5, 6, 6)
  assert configs.build_config("needle", size="small", arg="distance=9,spread=log"
                              ).data.distances == (9,)
  for arg, message in (("spread=cubic", "spread=cubic: must be one of uniform, log"),
                       ("distance=3-1000,length=2048,spread=log", "entries; give a range")):
    with pytest.raises(ValueError, match=message) as e:
      configs.build_config("needle", size="small", arg=arg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("arg", [
    "attention=dot_product", "attention=linformer,variant=bidirectional",
    pytest.param("attention=band,global=1", marks=pytest.mark.slow)])   # global: tested above
def test_two_steps_of_lra_run_give_finite_losses(arg, tmp_path, capsys):
  work = tmp_path / "w"
  tiny = [f"--config.{k}={v}" for k, v in tiny_overrides(tmp_path)] + [
      "--config.model.emb_dim=16", "--config.model.qkv_dim=16", "--config.model.mlp_dim=32",
      "--config.model.classifier_dim=16", "--config.model.num_layers=1",
      "--config.batch_size=8", "--config.eval_batch_size=8", "--config.num_train_steps=2",
      "--config.warmup_steps=1", "--config.log_every=1", "--config.progress=False"]
  assert cli.main(["run", "needle", "--size", "small", "--arg", arg, "--workdir", str(work),
                   "--yes", "--no_preflight", *tiny]) == 0
  assert "test needle accuracy" in capsys.readouterr().out
  results = json.loads((work / "results.json").read_text())
  assert 0.0 <= results["test_accuracy"] <= 1.0
  by_distance = results["test_accuracy_by_distance"]
  assert by_distance and all(0.0 <= a <= 1.0 for a in by_distance.values())
  losses = [json.loads(line)["loss"] for line in (work / "metrics.jsonl").read_text().splitlines()]
  assert losses and all(np.isfinite(losses))
