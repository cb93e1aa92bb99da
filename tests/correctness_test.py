"""Combinations the configs allow, checked against references written from the definitions.

Memory (models/memory.py) with dilated and per-head dilated band layers, with reordered
sublayers (Sandwich), and Transformer-XL's `same_length` evaluation: segments through the memory
equal one dense pass over the whole stream with the explicit mask of the definition (query p
sees key j when the band pattern holds per head, the memory reaches j, and with `same_length`
when p - j < M). One count of attention sublayers for the config check, the trainer's check and
the model. Rotary positions: the explicit-positions path is as exact as float64 angles, and
interleaved (RoFormer) weights load through `half_split_order`. `init_length` longer than the
run is refused.

The second half compares with small NumPy transcriptions of the papers' equations (not of our
code): Transformer-XL's sinusoid and the LRA table, the Compressive Transformer's strided
convolution, key order and reconstruction loss (eq. 2), RoFormer's rotation inside a layer,
Shortformer's infusion, MPNet's query stream, BERT's 80/10/10 over 40,000 draws and MPNet's
round(rate n) predictions. Slips planted one at a time, each failing at least one test here:
sinusoid frequencies over half the range (either table), the convolution's axes swapped, the
reconstruction target from the newest states, the compressed memory after the memory, rotary
base^(-f/D), MPNet queries without their position, a rotary query one position off (layer or
MPNet), a 50/40/10 split, padding chosen, floor instead of round, Shortformer positions also
at the embeddings.
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


# One band pass for all heads (2), one per run of heads ((2, 1, 3); (1, 3) takes that path too).
@pytest.mark.parametrize("dilation", [2, pytest.param((1, 3), marks=pytest.mark.exhaustive),
                                      (2, 1, 3)])
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


@pytest.mark.parametrize("dils", [(1, 2), None])
def test_memory_attention_dilation_and_same_length_by_definition(dils):
  """`memory_attention` against a NumPy transcription of Transformer-XL's logit, per head, with
  a per-head dilated window (or a window without a dilation: contiguous) and a `same_length`
  distance limit."""
  from attention import relative
  b, lq, prefix, h, d, e = 1, 4, 5, 2, 4, 6
  keys = jax.random.split(jax.random.key(7), 6)
  q = jax.random.normal(keys[0], (b, lq, h, d))
  k, v = (jax.random.normal(keys[i], (b, prefix + lq, h, d)) for i in (1, 2))
  u, vb = (jax.random.normal(keys[i], (h, d)) for i in (3, 4))
  w_r = jax.random.normal(keys[5], (e, h, d))
  valid = jnp.ones((b, prefix + lq), bool).at[0, 1].set(False)
  window, limit = 2, 4
  given = {} if dils is None else {"dilation": dils}
  got = memory_lib.memory_attention(q, k, v, u=u, v_bias=vb, w_r=w_r, key_valid=valid,
                                    query_valid=jnp.ones((b, lq), bool), window=window,
                                    max_distance=limit, **given)
  dils = dils or (1, 1)
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
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  recon = lambda p, st: nnx.merge(graphdef, p, rest)(tokens, memory=st)[1:]
  state, _ = jax.jit(recon)(params, state)             # a filled memory: something leaves
  grads = jax.jit(jax.grad(lambda p, st: recon(p, st)[1]))(params, state)
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


# ==============================================================================================
# Independent references: small NumPy transcriptions of the papers' definitions, written from
# the equations. Each block names the slips it is there to catch.


def _np(x):
  return np.asarray(x, np.float64)


def _np_layer_norm(x, ln):
  mean = x.mean(-1, keepdims=True)
  var = np.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + ln.epsilon) * _np(ln.scale[...]) + _np(ln.bias[...])


def _np_softmax_rows(logits, allowed):
  """Softmax over the last axis among `allowed` entries (rows with none give zeros)."""
  z = np.where(allowed, logits, -np.inf)
  top = np.max(np.where(allowed, logits, -1e300), axis=-1, keepdims=True)
  w = np.where(allowed, np.exp(z - top), 0.0)
  return w / np.maximum(w.sum(-1, keepdims=True), 1e-300)


def _randomise(module, seed=0, scale=0.3):
  """Every parameter of `module` drawn anew (biases and u, v included, which start at zero)."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  nnx.update(module, jax.tree.unflatten(tree, leaves))


def _zero_mlps(model_or_encoder):
  """The feed-forward sublayers' output layers set to zero: they then add nothing, so a
  reference need only transcribe the attention (the MLP is not what these tests are about)."""
  encoder = getattr(model_or_encoder, "encoder", model_or_encoder)
  for block in encoder.blocks:
    if hasattr(block, "mlp"):
      block.mlp.fc2.kernel[...] = jnp.zeros_like(block.mlp.fc2.kernel[...])
      block.mlp.fc2.bias[...] = jnp.zeros_like(block.mlp.fc2.bias[...])


# --- Sinusoids. Slips: frequencies over half the range (either table).


def test_relative_sinusoid_is_transformer_xl_s():
  """Dai et al. (2019), their code: inv_freq = 1 / 10000^(arange(0, d, 2) / d); R = [sin, cos]."""
  from attention import relative
  d, dist = 16, np.array([0, 1, 5, 37, 400])
  inv = 1.0 / 10000.0 ** (np.arange(0.0, d, 2.0) / d)
  angles = dist[:, None] * inv[None]
  want = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
  np.testing.assert_allclose(relative.sinusoid(dist, d), want, atol=1e-6)


def test_absolute_sinusoids_span_wavelengths_2pi_to_2pi_10000():
  """The embeddings' table: sin on the first half, cos on the second, frequencies geometric from
  1 down to 1 / 10000 over the half (the LRA/flax table)."""
  from models.embeddings import sinusoidal_table
  length, d = 50, 12
  half = d // 2
  freq = 10000.0 ** (-np.arange(half) / (half - 1))
  angles = np.arange(length)[:, None] * freq[None]
  want = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
  np.testing.assert_allclose(sinusoidal_table(length, d), want, atol=1e-6)


# --- Compression. Slips: the convolution's input and output axes swapped.


def test_conv_compression_is_a_strided_convolution():
  """Rae et al. (2020): f_c a 1D convolution of kernel size and stride c over the time axis:
  out[g, f] = b[f] + sum_t sum_e x[g c + t, e] W[t, e, f] (W laid out [time, in, out])."""
  rate, e, groups = 3, 5, 4
  comp = memory_lib.Compression("conv", rate, e, rngs=nnx.Rngs(0))
  _randomise(comp, seed=1, scale=1.0)
  x = np.asarray(jax.random.normal(jax.random.key(2), (2, groups * rate, e)), np.float64)
  w, b = _np(comp.kernel[...]), _np(comp.bias[...])
  want = np.zeros((2, groups, e))
  for g in range(groups):
    for t in range(rate):
      want[:, g] += x[:, g * rate + t] @ w[t]
  np.testing.assert_allclose(comp(jnp.asarray(x, jnp.float32)), want + b, atol=1e-5)
  for kind, pool in (("mean", np.mean), ("max", np.max)):
    got = memory_lib.Compression(kind, rate, e, rngs=nnx.Rngs(0))(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(got, pool(x.reshape(2, groups, rate, e), axis=2), atol=1e-6)


# --- Memory, compressed memory and the reconstruction loss, from the papers' equations.
# Slips: the compressed memory after the memory instead of before; the reconstruction target
# taken from the newest instead of the oldest states.


def _np_xl_attention(mha, h, prefix, key_valid):
  """Transformer-XL attention of one layer (Dai et al. eq. in section 3.3) for one example:
  h `[L, E]` (normed segment), prefix `[P, E]` (normed [compressed; memory]); query i sits at
  position P + i of the keys [prefix; h]; a_ij = (q_i + u) k_j + (q_i + v) W_r R_{P+i-j}, causal,
  invalid keys masked; returns `[L, E]` after the output projection."""
  from attention import relative
  wq, wk, wv, wo = (_np(getattr(mha, n)[...]) for n in ("query", "key", "value", "out"))
  u, vb, w_r = _np(mha.u[...]), _np(mha.v_bias[...]), _np(mha.w_r[...])
  keys_in = np.concatenate([prefix, h], axis=0)
  p_len, l_len, d = prefix.shape[0], h.shape[0], wq.shape[-1]
  q = np.einsum("le,ehd->lhd", h, wq)
  k, v = np.einsum("le,ehd->lhd", keys_in, wk), np.einsum("le,ehd->lhd", keys_in, wv)
  dist = (p_len + np.arange(l_len))[:, None] - np.arange(p_len + l_len)[None]   # [L, P+L]
  r = _np(relative.sinusoid(dist.reshape(-1), w_r.shape[0])).reshape(dist.shape + (-1,))
  r = np.einsum("lke,ehd->lkhd", r, w_r)
  logits = (np.einsum("lhd,khd->hlk", q + u, k) + np.einsum("lhd,lkhd->hlk", q + vb, r))
  allowed = (dist >= 0) & key_valid[None]
  p = _np_softmax_rows(logits / np.sqrt(d), allowed[None])
  return np.einsum("hlk,khd,hde->le", p, v, wo)


def test_compressive_layer_attends_over_compressed_then_memory_then_segment():
  """One layer of the language model with a compressed memory, against the definition: the
  keys are [compressed memory; memory; segment] in that order (Rae et al. section 3.1), with
  Transformer-XL's relative positions over that sequence. The feed-forward sublayer is zeroed."""
  seg, m_len, n_cm, rate = 4, 4, 4, 2
  model = models.LanguageModel(_lm_cfg({"kind": "dot_product"}, layers=1, memory_length=m_len,
                                       compressed_length=n_cm, compression="mean",
                                       compression_rate=rate), rngs=nnx.Rngs(0))
  _randomise(model, seed=3)
  _zero_mlps(model)
  tokens = jax.random.randint(jax.random.key(4), (1, 4 * seg), 1, V)
  state, run = model.init_memory(1), jax.jit(lambda t, st: model(t, memory=st)[:2])
  for s in range(3):                                   # fills memory and compressed memory
    _, state = run(tokens[:, s * seg:(s + 1) * seg], state)
  assert bool(state["cvalid"].all()) and bool(state["valid"].all())
  logits, _ = run(tokens[:, 3 * seg:], state)
  block, enc = model.encoder.blocks[0], model.encoder
  x = _np(enc.embed.embedding[...])[np.asarray(tokens[0, 3 * seg:])]           # [L, E]
  prefix = np.concatenate([_np(state["compressed"][0, 0]), _np(state["memory"][0, 0])])
  valid = np.ones(n_cm + m_len + seg, bool)
  x = x + _np_xl_attention(block.attention, _np_layer_norm(x, block.ln_attn),
                           _np_layer_norm(prefix, block.ln_attn), valid)
  out = _np_layer_norm(x, enc.ln_final) / np.sqrt(x.shape[-1])
  want = out @ _np(enc.embed.embedding[...]).T
  np.testing.assert_allclose(logits[0], want, atol=2e-4, rtol=1e-4)


def test_reconstruction_loss_is_rae_et_al_equation_2():
  """L_attn = sum over layers of || attn(h, old) - attn(h, f_c(old)) ||^2 (mean squared here,
  averaged over layers), attn the layer's content attention with its own projections, h the
  layer's normed input, old the oldest states leaving the memory [memory; segment]."""
  seg, m_len, n_cm, rate, layers = 4, 6, 4, 2, 2
  model = models.LanguageModel(_lm_cfg({"kind": "dot_product"}, layers=layers,
                                       memory_length=m_len, compressed_length=n_cm,
                                       compression="conv", compression_rate=rate),
                               rngs=nnx.Rngs(0))
  _randomise(model, seed=5)
  tokens = jax.random.randint(jax.random.key(6), (2, 3 * seg), 1, V)
  state, run = model.init_memory(2), jax.jit(lambda t, st: model(t, memory=st)[1:])
  for s in range(2):
    state, _ = run(tokens[:, s * seg:(s + 1) * seg], state)
  new, recon = run(tokens[:, 2 * seg:], state)
  total = 0.0
  for layer, block in enumerate(model.encoder.blocks):
    mha = block.attention
    wq, wk, wv = (_np(getattr(mha, n)[...]) for n in ("query", "key", "value"))
    x = _np(new["memory"][layer])[:, -seg:]                 # this segment's layer inputs
    stream = np.concatenate([_np(state["memory"][layer]), x], axis=1)
    old = stream[:, :seg]                                   # the oldest seg states leave
    comp = _np(model.compress[layer](jnp.asarray(old, jnp.float32)))
    h = _np_layer_norm(x, block.ln_attn)

    def attend(mem, h=h, wq=wq, wk=wk, wv=wv, block=block):
      m = _np_layer_norm(mem, block.ln_attn)
      q, k, v = (np.einsum("ble,ehd->blhd", a, w) for a, w in ((h, wq), (m, wk), (m, wv)))
      logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
      p = _np_softmax_rows(logits, np.ones(logits.shape, bool))
      return np.einsum("bhqk,bkhd->bqhd", p, v)

    total += np.mean(np.square(attend(old) - attend(comp)))
  np.testing.assert_allclose(float(recon), total / layers, rtol=1e-4)


# --- Rotary inside the attention layer, and Shortformer's position infusion.
# Slips: rotary frequencies base^(-f/D); a rotary query one position off; positions added at the
# embeddings as well as in attention (Shortformer).


def _np_rotate_half_split(x, base=10000.0):
  """RoFormer's rotation by position (0 .. L-1) on the pairs (f, f + D/2): x `[L, H, D]`."""
  length, dim = x.shape[0], x.shape[-1]
  theta = base ** (-2.0 * np.arange(dim // 2) / dim)
  angle = np.arange(length)[:, None, None] * theta                         # [L, 1, D/2]
  x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
  return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                         x1 * np.sin(angle) + x2 * np.cos(angle)], axis=-1)


@pytest.mark.parametrize("pos_emb", ["rotary", "infused", "sinusoidal"])
def test_one_layer_encoder_against_the_position_definitions(pos_emb):
  """A one-layer encoder (feed-forward zeroed) against its definition with each position kind:
  rotary rotates q and k by their own positions (Su et al.); infused adds the sinusoids to the
  inputs of the q and k projections only, never to the values or the residual stream (Press et
  al., Shortformer); sinusoidal adds them to the embeddings. Padding keys are masked."""
  from models.embeddings import sinusoidal_table
  length, e, heads = 9, 16, 2
  cfg = dict(vocab_size=V, max_length=length, emb_dim=e, num_heads=heads, qkv_dim=e, mlp_dim=8,
             num_layers=1, dropout=0.0, pos_emb=pos_emb, attention={"kind": "dot_product"},
             layer_attention=())
  encoder = models.encoder.Encoder(cfg, rngs=nnx.Rngs(0))
  _randomise(encoder, seed=7)
  _zero_mlps(encoder)
  tokens = np.array(jax.random.randint(jax.random.key(8), (1, length), 1, V))
  tokens[0, -2:] = 0                                                       # padding
  got, _ = encoder(jnp.asarray(tokens))
  block, mha = encoder.blocks[0], encoder.blocks[0].attention
  x = _np(encoder.embed.embedding[...])[tokens[0]]
  table = _np(sinusoidal_table(length, e))
  if pos_emb == "sinusoidal":
    x = x + table
  h = _np_layer_norm(x, block.ln_attn)
  qk_in = h + table if pos_emb == "infused" else h
  wq, wk, wv, wo = (_np(getattr(mha, n)[...]) for n in ("query", "key", "value", "out"))
  q, k = np.einsum("le,ehd->lhd", qk_in, wq), np.einsum("le,ehd->lhd", qk_in, wk)
  v = np.einsum("le,ehd->lhd", h, wv)
  if pos_emb == "rotary":
    q, k = _np_rotate_half_split(q), _np_rotate_half_split(k)
  real = tokens[0] > 0
  logits = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
  p = _np_softmax_rows(logits, (real[None, :] & real[:, None])[None])
  x = x + np.einsum("hqk,khd,hde->qe", p, v, wo)
  want = np.where(real[:, None], _np_layer_norm(x, encoder.ln_final), 0.0)
  np.testing.assert_allclose(got[0], want, atol=2e-5, rtol=1e-4)


# --- Masked-LM statistics (BERT) and the number of MPNet predictions.
# Slips: a 50/40/10 split; padding chosen for masking; floor instead of round.


def test_bert_corruption_statistics_over_many_draws():
  """Devlin et al. (2019) 3.1: 15% of the (real) tokens chosen; of those 80% shown as [MASK],
  10% replaced by a random token, 10% unchanged. Over 40,000 draws each share is within five
  binomial standard deviations; padding is never chosen."""
  from lra.tasks.pretraining import bert_corruption
  vocab, rate = 50, 0.15
  tokens = np.array(jax.random.randint(jax.random.key(9), (200, 200), 1, vocab))
  tokens[:, 150:] = 0                                            # a quarter is padding
  inputs, shown, chosen = (np.asarray(a) for a in jax.jit(
      lambda t, k: bert_corruption(t, rate, vocab, k))(jnp.asarray(tokens), jax.random.key(10)))
  real = tokens > 0
  assert not chosen[~real].any() and not shown[~chosen].any()
  assert (inputs[~chosen] == tokens[~chosen]).all()

  def near(count, n, p):
    assert abs(count - n * p) <= 5 * np.sqrt(n * p * (1 - p)), (count, n, p)

  near(chosen.sum(), real.sum(), rate)
  n = chosen.sum()
  near(shown.sum(), n, 0.8)
  replaced = chosen & ~shown & (inputs != tokens)
  # A random replacement equals the original with probability 1 / (vocab - 1).
  near(replaced.sum(), n, 0.1 * (1 - 1 / (vocab - 1)))
  near((chosen & ~shown & (inputs == tokens)).sum(), n, 0.1 + 0.1 / (vocab - 1))
  drawn = inputs[replaced]
  assert drawn.min() >= 1 and drawn.max() <= vocab - 1


@pytest.mark.parametrize("n,rate", [(13, 0.15), (7, 0.3), (10, 0.15), (3, 0.1), (20, 0.5)])
def test_mpnet_predicts_round_rate_times_n_tokens(n, rate):
  """Song et al. (2020): the last c = round(rate n) tokens of the permutation are predicted (at
  least one, at most n); padding is never predicted."""
  from lra.tasks.pretraining import permutation
  tokens = np.zeros((4, 24), np.int32)
  tokens[:, :n] = 5
  ranks, predicted = (np.asarray(a) for a in permutation(jnp.asarray(tokens), rate,
                                                          jax.random.key(11)))
  count = min(max(int(np.floor(rate * n + 0.5)), 1), n)
  assert (predicted.sum(1) == count).all()
  assert not predicted[:, n:].any()
  for row in range(4):
    assert sorted(ranks[row, :n]) == list(range(n))
    assert set(ranks[row][predicted[row]]) == set(range(n - count, n))


# --- MPNet's two streams. Slips: queries without their position; a rotary query one position off.


@pytest.mark.parametrize("pos_emb", ["sinusoidal", "rotary"])
def test_mpnet_query_stream_against_the_definition(pos_emb):
  """Song et al. (2020) section 2.2, one layer (feed-forward zeroed): the content stream is the
  tokens plus a mask token per position, each with its position; the query stream of a
  predicted position is the mask token with that position (added at the input, or with rotary
  its query rotated by it), attending to the content stream under the permutation's mask."""
  from models import pretraining as heads
  from models.embeddings import sinusoidal_table
  from attention import masks
  from lra.tasks.pretraining import permutation
  length, e = 10, 16
  cfg = dict(vocab_size=V, max_length=length, emb_dim=e, num_heads=2, qkv_dim=e, mlp_dim=8,
             num_layers=1, dropout=0.0, pos_emb=pos_emb, attention={"kind": "dot_product"},
             layer_attention=())
  encoder = models.encoder.Encoder(cfg, rngs=nnx.Rngs(0))
  _randomise(encoder, seed=12)
  _zero_mlps(encoder)
  tokens = np.array(jax.random.randint(jax.random.key(13), (1, length), 1, V))
  tokens[0, -1] = 0
  ranks, predicted = permutation(jnp.asarray(tokens), 0.4, jax.random.key(14))
  got = heads.mpnet_logits(encoder, [{"kind": "dot_product"}], jnp.asarray(tokens), ranks,
                           predicted)
  emb = _np(encoder.embed.embedding[...])
  table = _np(sinusoidal_table(length, e)) if pos_emb == "sinusoidal" else 0.0
  xc = np.concatenate([emb[tokens[0]] + table, emb[0] + table + np.zeros((length, e))])
  xq = emb[0] + table + np.zeros((length, e))
  block, mha = encoder.blocks[0], encoder.blocks[0].attention
  wq, wk, wv, wo = (_np(getattr(mha, n)[...]) for n in ("query", "key", "value", "out"))
  hc, hq = _np_layer_norm(xc, block.ln_attn), _np_layer_norm(xq, block.ln_attn)
  q, k, v = (np.einsum("le,ehd->lhd", a, w) for a, w in ((hq, wq), (hc, wk), (hc, wv)))
  if pos_emb == "rotary":
    q = _np_rotate_half_split(q)                                     # query i at position i
    k = np.concatenate([_np_rotate_half_split(k[:length]),         # tokens at 0 .. L-1, and
                        _np_rotate_half_split(k[length:])])          # their mask slots too
  _, query_mask = masks.mpnet_position_masks(ranks, predicted, jnp.asarray(tokens > 0))
  logits = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
  p = _np_softmax_rows(logits, np.asarray(query_mask[0])[None])
  xq = xq + np.einsum("hqk,khd,hde->qe", p, v, wo)
  want = _np_layer_norm(xq, encoder.ln_final) / np.sqrt(e) @ emb.T
  rows = np.asarray(predicted[0])
  assert rows.sum() >= 2
  np.testing.assert_allclose(np.asarray(got[0])[rows], want[rows], atol=2e-4, rtol=1e-4)
