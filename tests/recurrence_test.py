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
  _, state, _ = jax.jit(lambda t, m: model(t, memory=m))(tokens, model.init_memory(2))

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
  run = jax.jit(lambda t, m: model(t, memory=m))
  for s in range(3):
    _, state, _ = run(tokens[:, s * seg:(s + 1) * seg], state)
    states.append(state)
  # After segment 3 the memory holds segment 3's inputs; segment 2's (which left) compressed
  # into seg / rate slots at the end of the compressed memory, segment 1's before them.
  s2, s3 = states[2], states[3]
  expect = jax.jit(model.compress[0])(s2["memory"][0])                    # [B, 2, E]
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
  _, state, _ = jax.jit(lambda t, m: model(t, memory=m))(tokens, model.init_memory(2))
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
  loss = jax.jit(lambda p: nnx.merge(graphdef, p, rest)(tokens, memory=state)[2])
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
# Evaluation: a memory longer than in training, clamped distances, the split as contiguous rows.


def test_longer_evaluation_memory_equals_the_restricted_concatenation():
  from lra import tasks
  from lra.tasks.base import weighted_sums
  seg, m_len, eval_len, total = 5, 3, 7, 15
  model = models.LanguageModel(_cfg(memory_length=m_len, eval_memory_length=eval_len,
                                    segment_length=seg), rngs=nnx.Rngs(0))
  longer = models.LanguageModel(_cfg(memory_length=eval_len), rngs=nnx.Rngs(0))
  same = lambda a, b: jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), a, b))
  assert same(nnx.state(model, nnx.Param), nnx.state(longer, nnx.Param))  # no length inside
  tokens = jax.random.randint(jax.random.key(6), (2, total + 1), 1, V)
  ref = _reference(model, tokens[:, :-1], _span_mask(range(0, total, seg), total, eval_len))
  run = jax.jit(lambda t, st: model(t, memory=st)[:2])
  for length in (eval_len, m_len):        # the evaluation memory, then the training one
    state, outs = model.init_memory(2, length), []
    for s in range(0, total, seg):
      logits, state = run(tokens[:, s:s + seg], state)
      outs.append(logits)
    got = jnp.concatenate(outs, 1)
    if length == eval_len:
      np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    else:                                 # the test sees the length
      assert np.abs(np.asarray(got - ref)).max() > 1e-3
  # The evaluation objective: the eval memory, a row of 13 (the last segment padded), masked.
  n = 13
  batch = {"inputs": tokens[:, :n], "targets": tokens[:, 1:n + 1],
           "mask": jnp.ones((2, n), jnp.int32).at[0, :4].set(0)}
  got = jax.jit(lambda b: tasks.get_task("enwik8").objective(model, b, None))(batch)
  want = weighted_sums(ref[:, :n], batch["targets"], batch["mask"].astype(jnp.float32))
  assert float(got["weight"]) == float(want["weight"]) == 2 * n - 4
  np.testing.assert_allclose(got["loss_sum"] / got["weight"], want["loss_sum"] / want["weight"],
                             atol=1e-5)


@pytest.mark.parametrize("clamp", [0, 2])
def test_memory_attention_positions_and_clamp_by_definition(clamp):
  from attention import relative
  b, lq, prefix, h, d, e = 1, 3, 4, 2, 4, 6
  keys = jax.random.split(jax.random.key(7), 6)
  q = jax.random.normal(keys[0], (b, lq, h, d))
  k, v = (jax.random.normal(keys[i], (b, prefix + lq, h, d)) for i in (1, 2))
  u, vb = (jax.random.normal(keys[i], (h, d)) for i in (3, 4))
  w_r = jax.random.normal(keys[5], (e, h, d))
  valid = jnp.ones((b, prefix + lq), bool).at[0, 0].set(False)
  got = memory_lib.memory_attention(q, k, v, u=u, v_bias=vb, w_r=w_r, key_valid=valid,
                                    query_valid=jnp.ones((b, lq), bool), clamp_len=clamp)
  q, k, v, u, vb, w_r = map(np.asarray, (q, k, v, u, vb, w_r))
  want = np.zeros_like(got)
  for i in range(lq):
    keys_seen = [j for j in range(1, prefix + i + 1)]      # key 0 invalid; causal at P + i
    dist = [prefix + i - j for j in keys_seen]
    dist = [min(x, clamp) if clamp else x for x in dist]
    r = np.einsum("ne,ehd->nhd", relative.sinusoid(dist, e), w_r)
    logit = (np.einsum("hd,nhd->hn", q[0, i] + u, k[0, keys_seen]) +
             np.einsum("hd,nhd->hn", q[0, i] + vb, r)) / np.sqrt(d)
    p = np.exp(logit - logit.max(1, keepdims=True))
    want[0, i] = np.einsum("hn,nhd->hd", p / p.sum(1, keepdims=True), v[0, keys_seen])
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size,rows", [(50, 3), (50, 7), (9, 16), (2, 4)])
def test_stream_evaluation_scores_every_character_once(size, rows):
  from lra.data import charlm as charlm_data
  stream = (np.arange(size) % 10).astype(np.uint8)
  source = charlm_data.eval_streams(stream, rows)
  assert len(source) <= rows
  scored = []
  for i in range(len(source)):
    mask = source[i]["mask"]
    scored += [int(source.starts[i]) + j + 1 for j in np.flatnonzero(mask)]
    np.testing.assert_array_equal(source[i]["targets"][mask > 0] - 1,
                                  stream[[int(source.starts[i]) + j + 1
                                          for j in np.flatnonzero(mask)]])
  assert sorted(scored) == list(range(1, size))                # each character after the first
  if (size, rows) == (50, 3):                                  # through the model: weight = 49
    from lra import tasks
    from lra.data import pipeline
    model = models.LanguageModel(_cfg(memory_length=3, eval_memory_length=6, segment_length=4),
                                 rngs=nnx.Rngs(0))
    batch = next(iter(pipeline.eval_batches(source, batch_size=8)))
    evaluate = lambda: jax.jit(lambda b: tasks.get_task("enwik8").objective(model, b, None))
    sums = evaluate()(batch)
    assert float(sums["weight"]) == size - 1
    model.clamp_len = 2                                        # the evaluation clamps distances
    assert abs(float(evaluate()(batch)["loss_sum"] - sums["loss_sum"])) > 1e-3


# ----------------------------------------------------------------------------------------------
# The trainer carries the memory (Task.init_state) and a resumed run equals an uninterrupted one.


def _train_config(tmp_path, **overrides):
  import charlm_test   # tests/ is on the path (pytest rootdir conftest)
  write = charlm_test.write_zip
  write(tmp_path / "manual", charlm_test.corpus(charlm_test.enwik8), charlm_test.enwik8_bytes(1400))
  c = charlm_test.tiny_config(charlm_test.enwik8, tmp_path, sizes=(1300, 60, 40), **{
      "model.attention": {"kind": "dot_product"}, "model.layer_attention": (),
      "model.pos_emb": "relative", "model.memory_length": 8, "model.compressed_length": 4,
      "model.compression_rate": 2, "data.streams": 8, "num_train_steps": 4,
      "model.eval_memory_length": 12, "data.eval_streams": 3,   # evaluation: 3 rows, memory 12
      "model.dropout": 0.0,
      "checkpoint_every": 2, **overrides})
  return c


def test_streams_are_contiguous_rows():
  from lra.data import charlm as charlm_data
  w = charlm_data.train_windows(np.arange(200, dtype=np.uint8), 10)
  s = charlm_data.streams(w, 3)
  assert s.shuffle is False and len(s) == 3 * (len(w) // 3)
  starts = s.starts.reshape(-1, 3)                                         # [t, r]
  assert (np.diff(starts, axis=0) == 10).all()                             # each row continues


@pytest.mark.slow
def test_trainer_carries_memory_and_resume_equals_uninterrupted(tmp_path):
  """... and evaluates each split as 3 contiguous rows with a longer memory, every character
  after the first scored once (the weight)."""
  import os, signal
  from lra import train
  config = _train_config(tmp_path)
  plan = train.Trainer.abstract(config)   # one plan (traced, compiled once) for the three runs
  full = train.train_and_evaluate(config, str(tmp_path / "full"), plan=plan)
  mem = np.asarray(full["state"]["task"]["memory"])
  assert np.asarray(full["state"]["task"]["valid"]).all() and np.abs(mem).max() > 0
  assert np.asarray(full["state"]["task"]["cvalid"]).all()
  # Layer 0's memory holds the embedded last 8 inputs of step 4's batch (items 24..31 of the
  # stream order; row r is window r n + 3, continuing row r): equal vectors exactly where the
  # characters are equal.
  from lra import tasks
  source = tasks.get_task("enwik8").get_source(config.data, "train")
  n = len(source) // 8
  np.testing.assert_array_equal(source.starts[24:32], (np.arange(8) * n + 3) * 16)
  chars = np.stack([source[24 + r]["inputs"][-8:] for r in range(8)]).reshape(-1)
  first = mem[0].reshape(64, -1)
  np.testing.assert_array_equal((first[:, None] == first[None]).all(-1),
                                chars[:, None] == chars[None])
  import json
  records = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]
  assert {r["split"]: r["examples"] for r in records if r["split"] != "train"} == {
      "validation": 59, "test": 39}                   # split sizes 60 and 40, minus the first

  def stop_at_2(step):
    if step == 2:
      os.kill(os.getpid(), signal.SIGINT)

  part = train.train_and_evaluate(config, str(tmp_path / "part"), hooks=[stop_at_2], plan=plan)
  assert part["interrupted"] and part["step"] == 2
  resumed = train.train_and_evaluate(config, str(tmp_path / "part"), plan=plan)
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
    ({"model.eval_memory_length": -2}, "eval_memory_length = -2"),
    ({"model.clamp_len": -3}, "clamp_len = -3"),
    ({"data.eval_streams": -1}, "eval_streams = -1"),
    ({"model.memory_length": 0, "data.streams": 0, "model.eval_memory_length": 256},
     "eval_memory_length = 256: needs config.model.memory_length"),
    ({"model.memory_length": 0, "data.streams": 0, "data.eval_streams": 4},
     "eval_streams = 4: needs config.model.memory_length"),
])
def test_bad_memory_settings_are_one_line_errors(overrides, words):
  import configs
  from lra import schema
  c = configs.build_config("enwik8", size="small", attention="dot_product")
  c.model.memory_length, c.data.streams, c.data.max_length = 64, c.batch_size, 128
  for key, value in overrides.items():
    node, *path = key.split(".")
    c[node][path[0]] = value
  with pytest.raises(ValueError, match=words) as e:
    schema.check(c)
  assert "\n" not in str(e.value)
