"""Transformer-XL memory and compressive memory (models/memory.py): segments with memory equal one
pass over their concatenation with the attention span restricted accordingly (dense relative
attention with an explicit mask as the reference), no gradient reaches the memory, the
compression follows the paper and the reconstruction loss trains only the compression."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import memory as memory_lib

jax.config.update("jax_disable_most_optimizations", True)   # small programs: compile fast
V = 11


def _cfg(kind="dot_product", layers=2, **extra):
  attention = {"kind": kind} if kind == "dot_product" else {"kind": kind, "window": 4}
  cfg = dict(vocab_size=V, max_length=64, emb_dim=12, num_heads=2, qkv_dim=8, mlp_dim=16,
             num_layers=layers, dropout=0.0, pos_emb="relative", attention=attention,
             layer_attention=())
  cfg.update(extra)
  return cfg


def _span_mask(starts, total, m_len, window=None):
  """[total, total]: query p of the segment starting at s sees keys s - m_len <= j <= p."""
  mask = np.zeros((total, total), bool)
  bounds = list(starts) + [total]
  for s, e in zip(bounds[:-1], bounds[1:]):
    for p in range(s, e):
      lo = max(0, s - m_len)
      if window is not None:
        lo = max(lo, p - window)
      mask[p, lo:p + 1] = True
  return mask


def _reference(model, tokens, mask):
  """The model's own dense relative path over the whole sequence, with `mask` on every layer."""
  saved = []
  for block in model.encoder.blocks:
    a = block.attention
    saved.append((a.kind, dict(a.args)))
    a.kind, a.args = "dot_product", {"mask": tuple(map(tuple, mask.tolist()))}
  try:
    return jax.jit(lambda t: model(t))(tokens)   # pylint: disable=unnecessary-lambda
  finally:
    for block, (kind, args) in zip(model.encoder.blocks, saved):
      block.attention.kind, block.attention.args = kind, args


@pytest.mark.parametrize("kind,seg,m_len", [("dot_product", 5, 3), ("dot_product", 5, 7),
                                            ("band", 7, 3), ("band", 7, 5)])
def test_segments_with_memory_equal_the_restricted_concatenation(kind, seg, m_len):
  model = models.LanguageModel(_cfg(kind, memory_length=m_len), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 3 * seg), 1, V)
  state = model.init_memory(2)
  outs = []
  run = jax.jit(lambda t, st: model(t, memory=st))
  for s in range(3):
    logits, state, _ = run(tokens[:, s * seg:(s + 1) * seg], state)
    outs.append(logits)
  got = jnp.concatenate(outs, axis=1)
  window = 4 if kind == "band" else None
  ref = _reference(model, tokens, _span_mask(range(0, 3 * seg, seg), 3 * seg, m_len, window))
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
  full = _reference(model, tokens, _span_mask([0], 3 * seg, 0, window))
  if window is not None and m_len >= window:
    # The band window reaches into the memory: a memory as long as the window changes nothing.
    np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)
  else:  # without the restriction the outputs differ: the test sees the span
    assert np.abs(np.asarray(full - got)).max() > 1e-3


def test_no_gradient_flows_into_the_memory():
  model = models.LanguageModel(_cfg(memory_length=4), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(2), (2, 6), 1, V)
  _, state, _ = model(tokens, memory=model.init_memory(2))

  def loss(mem):
    logits, new, _ = model(tokens, memory=dict(state, memory=mem))
    return jnp.sum(logits) + jnp.sum(new["memory"])

  # The memory is an input to the forward pass, but the next memory is stop-gradient.
  g_new = jax.jit(jax.grad(lambda m: jnp.sum(model(tokens, memory=dict(state, memory=m))[1]["memory"])))
  assert float(jnp.abs(g_new(state["memory"])).max()) == 0.0
  assert float(jnp.abs(jax.jit(jax.grad(loss))(state["memory"])).max()) > 0  # it is read


@pytest.mark.parametrize("kind", ["mean", "max", "conv"])
def test_compression_takes_the_oldest_states_by_rate(kind):
  seg, m_len, n_cm, rate = 6, 6, 4, 3
  model = models.LanguageModel(_cfg(memory_length=m_len, compressed_length=n_cm,
                                    compression=kind, compression_rate=rate), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(3), (2, 3 * seg), 1, V)
  state = model.init_memory(2)
  states = [state]
  for s in range(3):
    _, state, _ = model(tokens[:, s * seg:(s + 1) * seg], memory=state)
    states.append(state)
  # After segment 3 the memory holds segment 3's inputs; segment 2's (which left) compressed
  # into seg / rate slots at the end of the compressed memory, segment 1's before them.
  s2, s3 = states[2], states[3]
  expect = model.compress[0](s2["memory"][0])                             # [B, 2, E]
  np.testing.assert_allclose(s3["compressed"][0][:, -seg // rate:], expect, atol=1e-6)
  assert s3["compressed"].shape == (2, 2, n_cm, 12)
  assert np.asarray(s3["cvalid"]).all() and not np.asarray(states[1]["cvalid"]).any()
  if kind == "mean":
    np.testing.assert_allclose(expect[:, 0], s2["memory"][0][:, :rate].mean(1), atol=1e-6)
  if kind == "max":
    np.testing.assert_allclose(expect[:, 1], s2["memory"][0][:, rate:].max(1), atol=1e-6)


def _recon_setup():
  model = models.LanguageModel(_cfg(memory_length=4, compressed_length=4, compression="conv",
                                    compression_rate=2), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(4), (2, 8), 1, V)
  _, state, _ = model(tokens, memory=model.init_memory(2))
  return model, state


def test_reconstruction_gradient_reaches_only_the_compression():
  model, state = _recon_setup()
  tokens = jax.random.randint(jax.random.key(5), (2, 8), 1, V)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  grads = jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p, rest)(tokens, memory=state)[2]))(
      params)
  flat = nnx.to_flat_state(grads)
  compression = [abs(float(jnp.abs(v[...]).max())) for k, v in flat if k[0] == "compress"]
  others = {k: float(jnp.abs(v[...]).max()) for k, v in flat if k[0] != "compress"}
  assert compression and all(g > 0 for g in compression)
  assert others and all(g == 0.0 for g in others.values()), others


def test_reconstruction_loss_falls_training_the_compression():
  model, state = _recon_setup()
  tokens = jax.random.randint(jax.random.key(5), (2, 8), 1, V)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = lambda p: nnx.merge(graphdef, p, rest)(tokens, memory=state)[2]
  step = jax.jit(lambda p: jax.tree.map(lambda x, g: x - 0.5 * g, p, jax.grad(loss)(p)))
  first = float(loss(params))
  for _ in range(30):
    params = step(params)
  assert float(loss(params)) < 0.7 * first


def test_memory_refuses_a_position_kind_without_relative():
  model = models.LanguageModel(_cfg(memory_length=3, pos_emb="sinusoidal"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="pos_emb='relative'"):
    model(jnp.ones((1, 4), jnp.int32), memory=model.init_memory(1))


# ----------------------------------------------------------------------------------------------
# The trainer carries the memory (Task.init_state) and a resumed run equals an uninterrupted one.


def _train_config(tmp_path, **overrides):
  from tests import charlm_test
  write = charlm_test.write_zip
  write(tmp_path / "manual", charlm_test.corpus(charlm_test.enwik8), charlm_test.enwik8_bytes(1400))
  c = charlm_test.tiny_config(charlm_test.enwik8, tmp_path, sizes=(1300, 60, 40), **{
      "model.attention": {"kind": "dot_product"}, "model.layer_attention": (),
      "model.pos_emb": "relative", "model.memory_length": 8, "model.compressed_length": 4,
      "model.compression_rate": 2, "data.streams": 8, "num_train_steps": 4,
      "checkpoint_every": 2, **overrides})
  return c


def test_streams_are_contiguous_rows():
  from lra.tasks import charlm as charlm_tasks
  from lra.data import charlm as charlm_data
  w = charlm_data.train_windows(np.arange(200, dtype=np.uint8), 10)
  s = charlm_tasks.streams(w, 3)
  assert s.shuffle is False and len(s) == 3 * (len(w) // 3)
  starts = s.starts.reshape(-1, 3)                                         # [t, r]
  assert (np.diff(starts, axis=0) == 10).all()                             # each row continues


def test_trainer_carries_memory_and_resume_equals_uninterrupted(tmp_path):
  import os, signal
  from lra import train
  config = _train_config(tmp_path)
  plan = train.Trainer.abstract(config)   # one plan (traced, compiled once) for the three runs
  plan.keep()
  full = train.train_and_evaluate(config, str(tmp_path / "full"))
  mem = np.asarray(full["state"]["task"]["memory"])
  assert np.asarray(full["state"]["task"]["valid"]).all() and np.abs(mem).max() > 0
  assert np.asarray(full["state"]["task"]["cvalid"]).all()

  def stop_at_2(step):
    if step == 2:
      os.kill(os.getpid(), signal.SIGINT)

  plan.keep()
  part = train.train_and_evaluate(config, str(tmp_path / "part"), hooks=[stop_at_2])
  assert part["interrupted"] and part["step"] == 2
  plan.keep()
  resumed = train.train_and_evaluate(config, str(tmp_path / "part"))
  for a, b in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(resumed["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert resumed["test_bpc"] == full["test_bpc"]


@pytest.mark.parametrize("overrides,words", [
    ({"model.memory_length": -1}, "memory_length = -1"),
    ({"model.compressed_length": 8, "model.compression_rate": 3}, "must divide the segment"),
    ({"model.compression": "avg"}, "mean, max, conv"),
    ({"model.pos_emb": "sinusoidal"}, "pos_emb='relative'"),
    ({"model.attention": {"kind": "linformer"}}, "linformer"),
    ({"data.streams": 0}, "must equal config.batch_size"),
    ({"model.memory_length": 0, "model.compressed_length": 4}, "needs config.model.memory_"),
])
def test_bad_memory_settings_are_one_line_errors(overrides, words):
  import configs
  from configs import validate
  c = configs.build_config("enwik8", size="small", attention="dot_product")
  c.model.memory_length, c.data.streams, c.data.max_length = 64, c.batch_size, 128
  for key, value in overrides.items():
    node, *path = key.split(".")
    c[node][path[0]] = value
  with pytest.raises(ValueError, match=words) as e:
    validate.check(c)
  assert "\n" not in str(e.value)
