"""Combinations the configs allow, checked against references written from the definitions.

Memory (models/memory.py) with dilated and per-head dilated band layers, with reordered
sublayers (Sandwich), and Transformer-XL's `same_length` evaluation: segments through the memory
equal one dense pass over the whole stream with the explicit mask of the definition (query p
sees key j when the band pattern holds per head, the memory reaches j, and with `same_length`
when p - j < M). One count of attention sublayers for the config check, the trainer's check and
the model. Rotary positions: the explicit-positions path is as exact as float64 angles, and
interleaved (RoFormer) weights load through `half_split_order`. `init_length` longer than the
run is refused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import models
from attention import rotary
from lra import schema, tasks, train
from models import memory as memory_lib

jax.config.update("jax_disable_most_optimizations", True)   # small programs: compile fast
V = 11


def _lm_cfg(attention, layers=2, heads=2, **extra):
  cfg = dict(vocab_size=V, max_length=64, emb_dim=12, num_heads=heads, qkv_dim=4 * heads,
             mlp_dim=16, num_layers=layers, dropout=0.0, pos_emb="relative",
             attention=attention, layer_attention=())
  cfg.update(extra)
  return cfg


def _stream_mask(total, seg, m_len, heads, window=None, dilation=1, max_distance=None):
  """`[H, total, total]`, from the definition: query p (in the segment starting at s) sees key j
  when j <= p, j >= s - m_len (what the memory holds), with a band window w and dilation d_h
  when p - j <= w d_h and d_h divides p - j, and with `max_distance` when p - j <= it."""
  dils = [dilation] * heads if isinstance(dilation, int) else list(dilation)
  mask = np.zeros((heads, total, total), bool)
  for h in range(heads):
    for p in range(total):
      s = p - p % seg
      for j in range(total):
        t = p - j
        ok = 0 <= t and j >= s - m_len
        if window is not None:
          ok = ok and t <= window * dils[h] and t % dils[h] == 0
        if max_distance is not None:
          ok = ok and t <= max_distance
        mask[h, p, j] = ok
  return mask


def _nested_tuples(a):
  return tuple(map(_nested_tuples, a)) if np.ndim(a) else bool(a)


def _dense_reference(model, tokens, mask):
  """The model's own dense relative path over the whole sequence with `mask` on every attention
  sublayer (the model's band layers swapped for dot_product with the explicit mask)."""
  saved = []
  layers = [b.attention for b in model.encoder.blocks if hasattr(b, "attention")]
  for a in layers:
    saved.append((a.kind, dict(a.args)))
    a.kind, a.args = "dot_product", {"mask": _nested_tuples(mask)}   # static: hashable
  try:
    return jax.jit(lambda t: model(t))(tokens)   # pylint: disable=unnecessary-lambda
  finally:
    for a, (kind, args) in zip(layers, saved):
      a.kind, a.args = kind, args


def _through_memory(model, tokens, seg, **kwargs):
  state, outs = model.init_memory(tokens.shape[0]), []
  run = jax.jit(lambda t, st: model(t, memory=st, **kwargs)[:2])
  for s in range(0, tokens.shape[1], seg):
    logits, state = run(tokens[:, s:s + seg], state)
    outs.append(logits)
  return jnp.concatenate(outs, axis=1)


# ----------------------------------------------------------------------------------------------
# Memory with dilated band layers: the band layer's own pattern, per head.


@pytest.mark.parametrize("dilation", [2, (1, 3), (2, 1, 3)])
def test_memory_with_dilated_band_equals_the_dense_pattern(dilation):
  heads = 2 if dilation != (2, 1, 3) else 3
  seg, m_len, window = 6, 7, 2
  model = models.LanguageModel(_lm_cfg({"kind": "band", "window": window, "dilation": dilation},
                                       heads=heads, memory_length=m_len), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 3 * seg), 1, V)
  got = _through_memory(model, tokens, seg)
  mask = _stream_mask(3 * seg, seg, m_len, heads, window, dilation)
  np.testing.assert_allclose(got, _dense_reference(model, tokens, mask), atol=1e-5, rtol=1e-5)
  # The first segment (empty memory) equals the model's own band layer without memory.
  np.testing.assert_allclose(got[:, :seg], jax.jit(lambda t: model(t))(tokens[:, :seg]),
                             atol=1e-5, rtol=1e-5)
  # A contiguous window of w * d keys (the slip) is visibly different.
  wide = _stream_mask(3 * seg, seg, m_len, heads, window * max(np.ravel(dilation)))
  assert np.abs(np.asarray(_dense_reference(model, tokens, wide) - got)).max() > 1e-3


def test_memory_attention_dilation_and_same_length_by_definition():
  """`memory_attention` against a NumPy transcription of Transformer-XL's logit, per head, with
  a per-head dilated window and a `same_length` distance limit."""
  from attention import relative
  b, lq, prefix, h, d, e = 1, 4, 5, 2, 4, 6
  keys = jax.random.split(jax.random.key(7), 6)
  q = jax.random.normal(keys[0], (b, lq, h, d))
  k, v = (jax.random.normal(keys[i], (b, prefix + lq, h, d)) for i in (1, 2))
  u, vb = (jax.random.normal(keys[i], (h, d)) for i in (3, 4))
  w_r = jax.random.normal(keys[5], (e, h, d))
  valid = jnp.ones((b, prefix + lq), bool).at[0, 1].set(False)
  window, dils, limit = 2, (1, 2), 4
  got = memory_lib.memory_attention(q, k, v, u=u, v_bias=vb, w_r=w_r, key_valid=valid,
                                    query_valid=jnp.ones((b, lq), bool), window=window,
                                    dilation=dils, max_distance=limit)
  q, k, v, u, vb, w_r = map(np.asarray, (q, k, v, u, vb, w_r))
  want = np.zeros(got.shape, np.float64)
  for head in range(h):
    for i in range(lq):
      p = prefix + i
      seen = [j for j in range(prefix + lq) if j != 1 and 0 <= p - j <= window * dils[head]
              and (p - j) % dils[head] == 0 and p - j <= limit]
      r = np.asarray(relative.sinusoid([p - j for j in seen], e)) @ w_r[:, head]   # [n, D]
      logit = (k[0, seen, head] @ (q[0, i, head] + u[head]) +
               r @ (q[0, i, head] + vb[head])) / np.sqrt(d)
      w = np.exp(logit - logit.max())
      want[0, i, head] = (w / w.sum()) @ v[0, seen, head]
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_charlm_memory_sizes_with_band_build_and_step():
  """`xl-small --attention band` (per-head dilation on its last layer) takes a training step;
  `xl-base` and `compressive-base` with band pass the checks and trace their forward pass."""
  task = tasks.get_task("enwik8")
  for size in ("xl-base", "compressive-base", "xl-small"):
    c = configs.build_config("enwik8", size=size, attention="band")
    schema.check(c)
    train.check_layers(c, task)
    cfg = train.model_config(c, task)
    seg = int(c.data.max_length)
    if size != "xl-small":
      def shapes(cfg=cfg, seg=seg):
        model = task.build_model(cfg, nnx.Rngs(0))
        return model(jnp.ones((1, seg), jnp.int32), memory=task.init_state(cfg, 1))[0]
      assert jax.eval_shape(shapes).shape == (1, seg, task.vocab_size)
      continue
    model = task.build_model(cfg, nnx.Rngs(0))
    assert any(isinstance(a, tuple) for a in (b.attention.args.get("dilation")
                                              for b in model.encoder.blocks))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = task.init_state(cfg, 2)
    batch = {"inputs": jax.random.randint(jax.random.key(0), (2, seg), 1, 200),
             "targets": jax.random.randint(jax.random.key(1), (2, seg), 1, 200),
             "mask": jnp.ones((2, seg), jnp.int32)}

    def loss(p, st):
      sums, new = task.objective_with_state(nnx.merge(graphdef, p, rest), batch, None, st)
      return sums["loss_sum"] / sums["weight"], new

    (value, new), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, state)
    assert np.isfinite(float(value)) and bool(new["valid"].all())
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


# ----------------------------------------------------------------------------------------------
# Memory with reordered sublayers: every attention sublayer carries one.


@pytest.mark.parametrize("order", [{"sandwich": 1}, {"sublayers": "sfssff"}])
def test_memory_with_reordered_sublayers_equals_the_dense_pattern(order):
  seg, m_len = 5, 4
  model = models.LanguageModel(_lm_cfg({"kind": "dot_product"}, memory_length=m_len, **order),
                               rngs=nnx.Rngs(0))
  attention_sublayers = sum(hasattr(b, "attention") for b in model.encoder.blocks)
  assert model.init_memory(1)["memory"].shape[0] == attention_sublayers == 3 - ("sandwich" in order)
  tokens = jax.random.randint(jax.random.key(2), (2, 3 * seg), 1, V)
  got = _through_memory(model, tokens, seg)
  mask = _stream_mask(3 * seg, seg, m_len, 2)
  np.testing.assert_allclose(got, _dense_reference(model, tokens, mask), atol=1e-5, rtol=1e-5)


def test_compressed_memory_with_sandwich_order_runs_and_trains_the_compression():
  cfg = _lm_cfg({"kind": "dot_product"}, layers=3, memory_length=4, compressed_length=4,
                compression_rate=2, sandwich=1)
  model = models.LanguageModel(cfg, rngs=nnx.Rngs(0))
  assert len(model.compress) == 3
  state = tasks.get_task("enwik8").init_state(cfg, 2)
  assert state["memory"].shape[0] == state["compressed"].shape[0] == 3
  tokens = jax.random.randint(jax.random.key(3), (2, 4), 1, V)
  _, state, _ = model(tokens, memory=state)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  grads = jax.grad(lambda p: nnx.merge(graphdef, p, rest)(tokens, memory=state)[2])(params)
  flat = nnx.to_flat_state(grads)
  assert all(float(jnp.abs(g[...]).max()) > 0 for path, g in flat if path[0] == "compress")


# ----------------------------------------------------------------------------------------------
# One count of attention sublayers.


def test_sublayers_with_per_layer_attention_pass_every_check_and_build():
  c = configs.build_config("enwik8", size="small", attention="band")
  c.model.num_layers, c.model.sublayers = 2, "ssssff"
  c.model.layer_attention = tuple({"window": w} for w in (2, 4, 6, 8))
  schema.check(c)
  task = tasks.get_task("enwik8")
  train.check_layers(c, task)          # the same count as the schema's
  model = task.build_model(train.model_config(c, task), nnx.Rngs(0))
  windows = [b.attention.args["window"] for b in model.encoder.blocks if hasattr(b, "attention")]
  assert windows == [2, 4, 6, 8]
  c.model.layer_attention = c.model.layer_attention[:3]
  with pytest.raises(ValueError, match="has 3 entries"):
    schema.check(c)


# ----------------------------------------------------------------------------------------------
# Transformer-XL's same_length evaluation.


@pytest.mark.parametrize("seg,m_len", [(4, 6), (5, 3)])
def test_same_length_evaluation_is_a_sliding_window_of_the_memory_length(seg, m_len):
  """With same_length every query sees its last M keys, itself included (Dai et al.'s
  evaluation): segments through the memory equal causal attention with window M - 1 over the
  whole stream, whatever the segment length."""
  from lra.tasks.base import weighted_sums
  total = 3 * seg
  model = models.LanguageModel(_lm_cfg({"kind": "dot_product"}, memory_length=m_len,
                                       segment_length=seg, same_length=True), rngs=nnx.Rngs(0))
  assert model.same_length
  tokens = jax.random.randint(jax.random.key(4), (2, total + 1), 1, V)
  got = _through_memory(model, tokens[:, :-1], seg, same_length=True)
  sliding = _stream_mask(total, total, 0, 2, max_distance=m_len - 1)
  ref = _dense_reference(model, tokens[:, :-1], sliding)
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
  plain = _through_memory(model, tokens[:, :-1], seg)      # without it: a varying number of keys
  assert np.abs(np.asarray(plain - ref)).max() > 1e-3
  # The evaluation objective applies it.
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "mask": jnp.ones((2, total), jnp.int32)}
  sums = jax.jit(lambda bt: tasks.get_task("enwik8").objective(model, bt, None))(batch)
  want = weighted_sums(ref, batch["targets"], batch["mask"].astype(jnp.float32))
  np.testing.assert_allclose(sums["loss_sum"], want["loss_sum"], rtol=1e-5)


def test_xl_base_evaluates_with_same_length_and_the_docs_say_so():
  c = configs.build_config("enwik8", size="xl-base", attention="dot_product")
  assert c.model.same_length and c.model.eval_memory_length == 2100
  assert not configs.build_config("enwik8", size="xl-small").model.same_length
  import pathlib
  doc = (pathlib.Path(__file__).parent.parent / "docs" / "recurrence.md").read_text()
  assert "same_length" in doc


# ----------------------------------------------------------------------------------------------
# Rotary: float64 angles on every path; the half-split pairing and interleaved weights.


def test_rotary_explicit_positions_are_as_exact_as_float64():
  dim = 64
  positions = np.array([0, 1, 777, 16_384, 100_000, 524_287, rotary.MAX_POSITION])
  inv = 10000.0 ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
  exact = positions[:, None].astype(np.float64) * inv
  for cos, sin in (rotary.position_cos_sin(positions, dim),
                   jax.jit(lambda p: rotary.position_cos_sin(p, dim))(jnp.asarray(positions))):
    assert np.abs(np.asarray(cos, np.float64) - np.cos(exact)).max() < 3e-7
    assert np.abs(np.asarray(sin, np.float64) - np.sin(exact)).max() < 3e-7
  # The rotation itself, explicit positions against float64 NumPy (half-split pairs).
  x = np.asarray(jax.random.normal(jax.random.key(5), (1, len(positions), 1, dim)))
  got = rotary.apply_rotary(jnp.asarray(x), positions=positions)
  x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
  c, s = np.cos(exact)[None, :, None], np.sin(exact)[None, :, None]
  want = np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
  np.testing.assert_allclose(got, want, atol=2e-6)
  # The table path agrees with the explicit one at long offsets.
  np.testing.assert_allclose(rotary.apply_rotary(jnp.asarray(x[:, :3])),
                             rotary.apply_rotary(jnp.asarray(x[:, :3]), positions=[0, 1, 2]),
                             atol=1e-6)
  for bad in ([1.5], [-1], [rotary.MAX_POSITION + 1]):
    with pytest.raises(ValueError, match="integers in"):
      rotary.apply_rotary(jnp.asarray(x[:, :1]), positions=bad)


def _roformer_interleaved(x, positions, base=10000.0):
  """RoFormer (Su et al. 2021, eq. 34): pairs (x_{2f}, x_{2f+1}) rotated by p theta_f, theta_f =
  base^(-2f/D); float64 NumPy."""
  dim = x.shape[-1]
  theta = base ** (-2.0 * np.arange(dim // 2) / dim)
  angle = np.asarray(positions, np.float64)[:, None] * theta               # [L, D/2]
  c, s = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
  even, odd = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x, dtype=np.float64)
  out[..., 0::2], out[..., 1::2] = even * c - odd * s, even * s + odd * c
  return out


def test_interleaved_weights_load_by_permuting_query_and_key_features():
  b, length, h, dim = 1, 9, 2, 8
  q, k = (np.asarray(jax.random.normal(key, (b, length, h, dim)), np.float64)
          for key in jax.random.split(jax.random.key(6), 2))
  theirs = np.einsum("bqhd,bkhd->bhqk", _roformer_interleaved(q, range(length)),
                     _roformer_interleaved(k, range(length)))
  order = rotary.half_split_order(dim)
  ours = jnp.einsum("bqhd,bkhd->bhqk", rotary.apply_rotary(jnp.asarray(q[..., order])),
                    rotary.apply_rotary(jnp.asarray(k[..., order])))
  np.testing.assert_allclose(ours, theirs, atol=1e-5)
  # Without the permutation the logits differ: the pairing matters.
  plain = jnp.einsum("bqhd,bkhd->bhqk", rotary.apply_rotary(jnp.asarray(q)),
                     rotary.apply_rotary(jnp.asarray(k)))
  assert np.abs(np.asarray(plain) - theirs).max() > 1e-2


# ----------------------------------------------------------------------------------------------
# init_length.


def test_init_length_longer_than_the_run_is_refused():
  from configs import listops as listops_config
  c = listops_config.get_config("size=small,attention=dot_product")
  c.data.max_length, c.model.pos_emb = 24, "learned"
  c.model.num_layers, c.model.emb_dim, c.model.qkv_dim, c.model.mlp_dim = 1, 16, 16, 16
  c.init_from, c.init_length = "/nonexistent", 48
  with pytest.raises(ValueError, match="init_length = 48 is longer than this run's max_length "
                                       "24") as e:
    train.Trainer.abstract(c)
  assert "\n" not in str(e.value)
  c.init_length = 24                     # the same length (or shorter) plans
  train.check_init_length(c, 24)
