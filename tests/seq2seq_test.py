"""Tests for LED (models/seq2seq.py), its decoding (models/decoding.py), the seq2seq family
(lra/tasks/seq2seq.py) and the sort-marked task (lra/data/marked_sort.py, lra/data/sort_marked.py,
lra/tasks/sort_marked.py, configs/sort_marked.py).

The greedy checks run on a tiny LED trained for a few seconds on tiny sort-marked examples (an
untrained one writes the same token everywhere, which would make "cached equals uncached" easy
to pass by accident); the step-by-step logits and the enumeration run on tiny LEDs whose
parameters are shaken by random noise.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import configs
from launch import cli
from lra.data import marked_sort
from lra.tasks import get_task
from models import decoding
from models.seq2seq import LED, GlobalBandAttention

BOS, EOS = 1, 2


def tiny_cfg(**kw):
  cfg = dict(vocab_size=10, num_classes=10, max_length=24, emb_dim=16, num_heads=2, qkv_dim=16,
             mlp_dim=32, num_layers=1, decoder_layers=2, dropout=0.0, pos_emb="sinusoidal",
             attention={"kind": "band", "window": 2}, layer_attention=(), num_global=1,
             target_length=4)
  cfg.update(kw)
  return cfg


def shaken(cfg, seed=0, scale=0.7):
  """A LED with every parameter moved by N(0, scale^2) noise."""
  model = LED(cfg, rngs=nnx.Rngs(seed))
  params = nnx.state(model, nnx.Param)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  noisy = [p + scale * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]
  nnx.update(model, jax.tree.unflatten(tree, noisy))
  return model


GEN = dict(min_length=16, max_length=24, num_values=4, num_fillers=3, min_marks=1, max_marks=3)


def sort_marked_batch(num, seed):
  """Generated examples as padded arrays: inputs [num, 24], targets [num, 4]."""
  rows = marked_sort.generate(num, seed=seed, **GEN)
  x = np.zeros((num, 24), np.int32)
  y = np.zeros((num, 4), np.int32)
  for i, (a, b) in enumerate(rows):
    x[i, :a.size], y[i, :b.size] = a, b
  return jnp.asarray(x), jnp.asarray(y)


@pytest.fixture(scope="module")
def trained():
  """A tiny LED trained for 150 Adam steps on tiny sort-marked (far from perfect, but its
  outputs depend on the input and end with EOS), and test inputs."""
  model = LED(tiny_cfg(), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adam(1e-2)
  x, y = sort_marked_batch(512, seed=0)

  @jax.jit
  def step(params, opt_state, x, y):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p, rest)(x, decoding.shift_right(y, BOS))
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
      return jnp.sum(ce * (y > 0)) / jnp.sum(y > 0)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  for i in range(150):
    j = (i * 32) % 512
    params, opt_state, loss = step(params, opt_state, x[j:j + 32], y[j:j + 32])
  return nnx.merge(graphdef, params, rest), sort_marked_batch(16, seed=9)[0]


@nnx.jit(static_argnames=("length", "cache", "beam"))
def run_decoding(model, inputs, length, cache=True, beam=0):
  memory, mask = model.encode(inputs)
  if beam:
    return decoding.beam_search(model, memory, mask, length=length, beam=beam, bos_id=BOS,
                                eos_id=EOS, cache=cache)
  return decoding.greedy(model, memory, mask, length=length, bos_id=BOS, eos_id=EOS,
                         cache=cache)


def test_greedy_with_the_cache_equals_greedy_without_it(trained):
  model, x = trained
  with_cache = np.asarray(run_decoding(model, x, 4, cache=True))
  without = np.asarray(run_decoding(model, x, 4, cache=False))
  np.testing.assert_array_equal(with_cache, without)
  assert len({tuple(r) for r in with_cache}) > 3               # not one constant answer
  assert (with_cache == EOS).any(axis=1).mean() > 0.5          # most end with EOS
  for row in with_cache:
    ends = np.flatnonzero(row == EOS)
    assert ((row[ends[0] + 1:] == 0).all() if ends.size else True)   # 0 only after EOS
    assert (row[:ends[0] if ends.size else None] > BOS).all()        # never BOS or padding


@nnx.jit
def step_and_full_logits(model, x, tokens):
  memory, mask = model.encode(x)
  full = model.decode(memory, mask, tokens)                                # [B, T, V]
  cache = model.init_cache(memory, mask)
  steps = []
  for t in range(tokens.shape[1]):
    logits, cache = model.step(cache, tokens[:, t], t)
    steps.append(logits)
  return jnp.stack(steps, axis=1), full


def test_cached_step_logits_equal_teacher_forcing():
  model, x = shaken(tiny_cfg(decoder_layers=1), seed=3), sort_marked_batch(6, seed=5)[0]
  tokens = jax.random.randint(jax.random.key(5), (x.shape[0], 4), 2, 10).at[2, 2:].set(0)
  steps, full = step_and_full_logits(model, x, tokens)
  real = np.asarray(tokens > 0)                       # a padded position's logits are unused
  np.testing.assert_allclose(np.asarray(steps)[real], np.asarray(full)[real], atol=1e-4,
                             rtol=1e-4)


@nnx.jit
def scores_of(model, x, tokens):
  memory, mask = model.encode(x)
  return decoding.sequence_scores(model, memory, mask, tokens, bos_id=BOS)


def test_beam_of_one_equals_greedy(trained):
  model, x = trained
  greedy = run_decoding(model, x, 4)
  beam, scores = run_decoding(model, x, 4, beam=1)
  np.testing.assert_array_equal(beam, greedy)
  np.testing.assert_allclose(scores, scores_of(model, x, greedy), atol=1e-4)


def all_hypotheses(words, length):
  """Every output of at most `length` tokens: words then EOS, or `length` words."""
  out = []
  for n in range(length + 1):
    for body in itertools.product(words, repeat=n):
      if n < length:
        out.append(list(body) + [EOS] + [0] * (length - n - 1))
      elif n == length:
        out.append(list(body))
  return np.array(out, np.int32)


def test_beam_search_finds_the_best_hypothesis_by_enumeration():
  cfg = tiny_cfg(vocab_size=5, num_classes=5, target_length=3)   # writes EOS, 3 or 4
  length, batch = 3, 12
  model = shaken(cfg, seed=4, scale=1.5)
  x = jax.random.randint(jax.random.key(7), (batch, 24), 3, 5)
  hyps = all_hypotheses([3, 4], length)                          # 1 + 2 + 4 + 8 = 15
  n = len(hyps)
  scores = np.asarray(scores_of(model, jnp.repeat(x, n, axis=0),
                                jnp.tile(jnp.asarray(hyps), (batch, 1)))).reshape(batch, n)
  beam_tokens, beam_scores = run_decoding(model, x, length, beam=n)
  greedy = np.asarray(run_decoding(model, x, length))
  best = scores.argmax(axis=1)
  np.testing.assert_array_equal(beam_tokens, hyps[best])
  np.testing.assert_allclose(beam_scores, scores.max(axis=1), atol=1e-4)
  g = [next(k for k, h in enumerate(hyps) if (h == greedy[i]).all()) for i in range(batch)]
  greedy_scores = scores[np.arange(batch), g]
  assert (greedy_scores < scores.max(axis=1) - 1e-4).any(), \
      "greedy is optimal everywhere here, so this case cannot tell beam search from greedy"


def test_beam_search_with_the_cache_equals_beam_search_without_it(trained):
  model, x = trained
  with_cache = run_decoding(model, x, 4, beam=3, cache=True)
  without = run_decoding(model, x, 4, beam=3, cache=False)
  np.testing.assert_array_equal(np.asarray(with_cache[0]), np.asarray(without[0]))
  np.testing.assert_allclose(np.asarray(with_cache[1]), np.asarray(without[1]), atol=1e-5)
  assert len({tuple(r) for r in np.asarray(with_cache[0])}) > 3


def test_global_first_token_carries_far_information():
  x = sort_marked_batch(1, seed=3)[0].at[0, :].set(9)   # all fillers: 24 real tokens
  far = x.at[0, 20].set(3 if int(x[0, 20]) != 3 else 4)           # beyond the window of 0
  for num_global, changes in ((1, True), (0, False)):
    model = LED(tiny_cfg(num_layers=2, num_global=num_global), rngs=nnx.Rngs(0))
    assert isinstance(model.encoder.blocks[0].attention, GlobalBandAttention) == changes
    a = nnx.jit(lambda m, t: m.encode(t)[0])(model, x)
    b = nnx.jit(lambda m, t: m.encode(t)[0])(model, far)
    assert bool(jnp.abs(a[0, 0] - b[0, 0]).max() > 1e-4) == changes
    assert bool(jnp.abs(a[0, 10] - b[0, 10]).max() > 1e-4) == changes   # through token 0


def test_generator_is_deterministic_and_sorts_the_marks():
  kw = dict(min_length=40, max_length=60, num_values=6, num_fillers=5, min_marks=1, max_marks=4)
  a = marked_sort.generate(30, seed=3, **kw)
  b = marked_sort.generate(30, seed=3, **kw)
  c = marked_sort.generate(30, seed=4, **kw)
  assert all((x[0] == y[0]).all() and (x[1] == y[1]).all() for x, y in zip(a, b))
  assert any(x[0].shape != y[0].shape or (x[0] != y[0]).any() for x, y in zip(a, c))
  values = range(marked_sort.VALUE0, marked_sort.VALUE0 + 6)
  for inputs, targets in a:
    assert 40 <= inputs.size <= 60 and targets[-1] == marked_sort.EOS_ID
    marks = np.flatnonzero(np.isin(inputs, values))
    k = marks.size
    assert 1 <= k <= 4 and targets.size == k + 1
    np.testing.assert_array_equal(targets[:-1], np.sort(inputs[marks]))
    assert len(set(targets[:-1].tolist())) == k                             # distinct values
    edges = np.linspace(0, inputs.size, k + 1).astype(int)
    segment = np.searchsorted(edges, marks, side="right") - 1               # one per segment
    np.testing.assert_array_equal(segment, np.arange(k))
    assert (inputs >= marked_sort.VALUE0).all()


def test_task_objective_sums():
  task = get_task("sort_marked")
  cfg = tiny_cfg(vocab_size=task.vocab_size, num_classes=task.vocab_size, target_length=6)
  model = shaken(cfg, scale=0.3)
  x = sort_marked_batch(3, seed=2)[0]
  targets = jnp.array([[3, 5, 2, 0, 0, 0], [4, 2, 0, 0, 0, 0], [3, 4, 6, 8, 2, 0]])
  batch = {"inputs": x, "targets": targets, "weights": jnp.array([1.0, 1.0, 0.0])}
  sums = nnx.jit(lambda m, b: task.objective(m, b, None))(model, batch)
  assert float(sums["weight"]) == 2.0 and float(sums["tokens"]) == 5.0
  assert 0.0 <= float(sums["correct"]) <= float(sums["weight"])
  assert float(sums["token_correct"]) <= 5.0 and float(sums["loss_sum"]) > 0.0


BAD = [
    (["--arg", "length=5"], "unknown config argument 'length'"),
    (["--size", "tiny"], "unknown size 'tiny'"),
    (["--config.data.max_marks=20"], "max_marks=20 distinct marks need at least"),
    (["--config.data.min_length=3"], "need max_marks <= min_length <= max_length"),
    (["--config.data.min_length=3000"], "need max_marks <= min_length <= max_length"),
    (["--config.data.num_fillers=300"], "must have at most 256 ids"),
    (["--config.model.target_length=3"], "config.model.target_length = 3"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_settings_are_one_line_errors(args, message, capsys, tmp_path):
  argv = ["run", "sort_marked", *(["--size", "small"] if "--size" not in args else []), *args]
  assert cli.main([*argv, "--workdir", str(tmp_path / "w")]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.startswith("error: ") and err.count("\n") == 1, err
  assert message in err
  assert not (tmp_path / "w").exists()


def test_configs_build_and_name_the_task():
  for size in ("base", "small"):
    c = configs.build_config("sort_marked", size=size)
    assert c.task == "sort_marked" and c.model.attention.kind == "band"
    assert c.model.num_global == 1 and c.model.target_length == c.data.max_marks + 1
  base = configs.build_config("sort_marked", size="base")
  assert (base.model.num_layers, base.model.decoder_layers, base.model.emb_dim) == (6, 6, 768)
  assert base.model.attention.window == 512 and base.data.max_length == 4096


def test_the_dataset_is_the_generators_output_padded_to_the_batch_spec(tmp_path):
  settings = dict(max_length=64, min_length=32, num_train=8, num_val=4, num_test=4)
  config = configs.build_config("sort_marked", size="small", overrides=[
      ("data.data_dir", str(tmp_path)), *((f"data.{k}", str(v)) for k, v in settings.items())])
  task = get_task("sort_marked")
  assert not task.status(config.data).ready
  source = task.get_source(config.data, "validation")
  assert task.status(config.data).ready and len(source) == 4
  spec = task.batch_spec(config.data, 4, "train")
  drawn = marked_sort.generate(4, seed=3 * config.data.seed + 1, min_length=32, max_length=64,
                               num_values=config.data.num_values,
                               num_fillers=config.data.num_fillers,
                               min_marks=config.data.min_marks, max_marks=config.data.max_marks)
  for i, (inputs, targets) in enumerate(drawn):
    example = source[i]
    assert {k: v.shape for k, v in example.items()} == {k: v.shape[1:] for k, v in spec.items()}
    np.testing.assert_array_equal(example["inputs"][:inputs.size], inputs)
    assert (example["inputs"][inputs.size:] == 0).all()
    np.testing.assert_array_equal(example["targets"][:targets.size], targets)
