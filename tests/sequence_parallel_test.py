"""Sequence-parallel band attention (attention/sequence_parallel.py) against one-device
`band_attention` on the whole sequence: outputs and gradients, on a 4-device sequence axis, with
dilation per head, causal, padding (an all-padding row and a chunk that is all padding), global
tokens spread over devices, chunks not a multiple of the block and shorter than one block.
FAVOR+ and linear attention the same way, at precision "exact" and (bfloat16 operands) "fast"."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import attention
from attention import sequence_parallel
from tests import favor_test

DEVICES = 4
RTOL, ATOL = 1e-5, 1e-5


def mesh():
  return Mesh(np.array(jax.devices()[:DEVICES]), ("sequence",))


def inputs(batch, length, heads=4, dim=8, seed=0, pad=True, globals_at=()):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(batch, length, heads, dim)), jnp.float32)
             for _ in range(3))
  key_mask = np.ones((batch, length), bool)
  if pad:
    key_mask[-1, length - length // 3:] = False       # the last chunk(s) all padding
    if batch > 2:
      key_mask[1] = False                              # an all-padding row
  glob = np.zeros((batch, length), bool)
  for row, pos in globals_at:
    glob[row, pos] = True
  return q, k, v, jnp.asarray(key_mask), jnp.asarray(glob)


def sharded(fn, **kwargs):
  spec = P(None, "sequence")
  return jax.jit(jax.shard_map(functools.partial(fn, **kwargs), mesh=mesh(),
                               in_specs=(spec,) * 5, out_specs=spec, check_vma=False))


def out_and_grads(fn, cotangent=None):
  """fn(q, k, v) and the gradients to q, k, v of sum(sin(out) * arange(dim)) (of
  sum(cotangent * out) when given), compiled as one program: op by op, and as separate forward
  and gradient programs, the references cost more than the functions they check."""
  def loss(q, k, v):
    out = fn(q, k, v)
    if cotangent is None:
      return jnp.sum(jnp.sin(out) * jnp.arange(out.shape[-1])), out
    return jnp.sum(cotangent * out), out

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))

  def run(q, k, v):
    grads, out = grad(q, k, v)
    return out, grads
  return run


CASES = [
    # (length, window, dilation, causal, block_size, globals)
    (64, 3, 1, False, 8, ()),
    (64, 5, 1, True, 8, ()),
    (60, 4, (1, 2, 2, 3), False, 8, ()),        # chunks of 15: not a multiple of the block
    (60, 4, (1, 1, 2, 3), True, None, ()),
    (24, 6, 1, False, 32, ()),                 # chunks of 6, shorter than one block
    (48, 0, 1, False, 4, ()),                  # window 0: no halo at all
    (64, 3, 1, False, 8, ((0, 2), (0, 40), (2, 17), (2, 18), (2, 63))),
    (64, 3, (1, 2, 1, 2), True, 8, ((0, 5), (0, 50), (2, 31), (2, 33))),
]


@pytest.mark.slow
@pytest.mark.parametrize("length,window,dilation,causal,block,globals_at", CASES)
def test_equals_band_attention_on_the_whole_sequence(length, window, dilation, causal, block,
                                                     globals_at):
  q, k, v, key_mask, glob = inputs(3, length, globals_at=globals_at)
  use_glob = bool(globals_at)
  args = dict(window=window, dilation=dilation, causal=causal, block_size=block)

  def one_device(q, k, v, key_mask, glob):
    return attention.band_attention(q, k, v, key_mask=key_mask,
                                    global_mask=glob if use_glob else None,
                                    max_global=8 if use_glob else None, **args)

  def split(q, k, v, key_mask, glob, **kw):
    return sequence_parallel.sequence_parallel_band_attention(
        q, k, v, key_mask=key_mask, global_mask=glob if use_glob else None,
        max_global=2 if use_glob else 0, **kw)

  many = sharded(split, **args)
  want, grads = out_and_grads(lambda q, k, v: one_device(q, k, v, key_mask, glob))(q, k, v)
  got, grads_many = out_and_grads(lambda q, k, v: many(q, k, v, key_mask, glob))(q, k, v)
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
  assert np.all(np.asarray(got)[~np.asarray(key_mask)] == 0)
  for g_many, g in zip(grads_many, grads):
    np.testing.assert_allclose(g_many, g, rtol=RTOL, atol=ATOL)


def test_only_the_halo_crosses_devices():
  q, k, v, key_mask, glob = inputs(2, 64, pad=False)
  fn = sharded(lambda q, k, v, m, g: sequence_parallel.sequence_parallel_band_attention(
      q, k, v, key_mask=m, window=3, block_size=8))
  text = fn.lower(q, k, v, key_mask, glob).as_text()
  assert "all-gather" not in text and "all_gather" not in text
  assert "collective_permute" in text or "collective-permute" in text


def test_too_many_globals_on_one_device_poisons_the_row():
  q, k, v, key_mask, glob = inputs(2, 32, pad=False, globals_at=((0, 1), (0, 2), (0, 3)))
  fn = sharded(lambda q, k, v, m, g: sequence_parallel.sequence_parallel_band_attention(
      q, k, v, key_mask=m, global_mask=g, max_global=2, window=2, block_size=4))
  out = np.asarray(fn(q, k, v, key_mask, glob))
  assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize("kwargs,message", [
    (dict(window=9, block_size=4), "each device holds 8 positions but the band reaches 9"),
    (dict(window=2, dilation=(1, 5, 1, 1)), "reaches 10"),
    (dict(window=2, global_mask=True), "max_global >= 1"),
])
def test_impossible_settings_are_refused(kwargs, message):
  q, k, v, key_mask, glob = inputs(1, 32, pad=False)
  if kwargs.pop("global_mask", False):
    kwargs["global_mask"] = glob
  fn = sharded(lambda q, k, v, m, g, **kw: sequence_parallel.sequence_parallel_band_attention(
      q, k, v, key_mask=m, **kw), **{k_: v_ for k_, v_ in kwargs.items()
                                     if k_ != "global_mask"})
  if "global_mask" in kwargs:
    fn = sharded(lambda q, k, v, m, g: sequence_parallel.sequence_parallel_band_attention(
        q, k, v, key_mask=m, global_mask=g, window=2))
  with pytest.raises(ValueError, match=message):
    fn(q, k, v, key_mask, glob)


def split_jit(fn):
  """fn(q, k, v, key_mask) on the 4-device sequence axis, jitted (call it again for a cache hit)."""
  spec = P(None, "sequence")
  return jax.jit(jax.shard_map(fn, mesh=mesh(), in_specs=(spec,) * 4, out_specs=spec,
                               check_vma=False))


def run_split(fn, q, k, v, key_mask):
  return split_jit(fn)(q, k, v, key_mask)


LINEAR_CASES = [("favor", "softmax", False), ("favor", "softmax", True), ("favor", "relu", False),
                ("favor", "relu", True), ("linear", None, False), ("linear", None, True)]


def favor_features():
  return attention.favor_features(jax.random.key(5), 16, 8)


def linear_pair(name, kernel, causal, chunk=4, precision="exact"):
  """(one-device function, split function) of (q, k, v, key_mask), both at `precision`."""
  args = dict(causal=causal, chunk_size=chunk, precision=precision)
  if name == "favor":
    args.update(features=favor_features(), kernel=kernel)
    one = lambda q, k, v, m: attention.favor_attention(q, k, v, key_mask=m, **args)
    split = lambda q, k, v, m: sequence_parallel.sequence_parallel_favor_attention(
        q, k, v, key_mask=m, **args)
  else:
    one = lambda q, k, v, m: attention.linear_attention(q, k, v, key_mask=m, **args)
    split = lambda q, k, v, m: sequence_parallel.sequence_parallel_linear_attention(
        q, k, v, key_mask=m, **args)
  return one, split


# Chunks of 11 (not a power of two, nor a multiple of the chunk size 4) and of 3 (shorter than
# one chunk). Only the causal prefix reads the chunk size: the bidirectional split cases at 12
# take the paths of their cases at 44, and the causal relu one at 12 those of linear's at 12
# (the same `_linear_parts`) and relu's at 44 (its features); they run in the exhaustive tier.
LENGTHS = [(case, length) for length in (44, 12) for case in LINEAR_CASES]


@pytest.mark.slow
@pytest.mark.parametrize("name,kernel,causal,length", [
    pytest.param(*case, length, marks=pytest.mark.exhaustive)
    if length == 12 and (not case[2] or case[1] == "relu") else (*case, length)
    for case, length in LENGTHS])
def test_favor_and_linear_equal_one_device(name, kernel, causal, length):
  q, k, v, key_mask, _ = inputs(3, length)
  one, split = linear_pair(name, kernel, causal)
  split = split_jit(split)
  want, grads = out_and_grads(lambda q, k, v: one(q, k, v, key_mask))(q, k, v)
  got, grads_split = out_and_grads(lambda q, k, v: split(q, k, v, key_mask))(q, k, v)
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
  assert np.all(np.asarray(got)[~np.asarray(key_mask)] == 0)
  for g_split, g in zip(grads_split, grads):
    np.testing.assert_allclose(g_split, g, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("name,kernel", [("favor", "softmax"), ("favor", "relu"),
                                         ("linear", None)])
def test_causal_positions_do_not_depend_on_later_devices(name, kernel, precision):
  q, k, v, key_mask, _ = inputs(2, 64, pad=False)
  _, split = linear_pair(name, kernel, True, precision=precision)
  split = split_jit(split)                  # one program for both calls
  before = np.asarray(split(q, k, v, key_mask))
  later = np.arange(64) >= 40                        # device 2 (from 40) and device 3
  k2 = jnp.where(later[None, :, None, None], 50.0 * k, k)   # huge keys: a max would move
  v2 = jnp.where(later[None, :, None, None], -v, v)
  after = np.asarray(split(q, k2, v2, key_mask))
  np.testing.assert_array_equal(after[:, :32], before[:, :32])   # devices 0 and 1, bit for bit
  assert not np.allclose(after[:, 40:], before[:, 40:])


def fast_bound(name, q, k, v):
  """The one-device fast tests' bound on |out_fast - out_exact| (tests/favor_test.py,
  tests/linear_test.py): bfloat16 rounding of the projection (FAVOR+) and of every matmul
  operand, at most D relative on any weight of the average, so (exp(2 D) - 1) 2 max |v|."""
  if name == "favor":
    return favor_test._fast_bound(q, k, v, favor_features())           # noqa: SLF001
  return (np.exp(2 * 5 * favor_test.U) - 1) * 2 * float(np.abs(np.asarray(v)).max())


@pytest.mark.slow
@pytest.mark.parametrize("name,kernel,causal", LINEAR_CASES)
def test_fast_precision_split_agrees_with_one_device(name, kernel, causal):
  """precision="fast" over 4 devices (chunks of 11) against the one-device function at "fast"
  and at "exact", outputs and gradients, with padding: within the one-device fast tests'
  bfloat16 bound (`fast_bound`; gradients within 4 times it relative to their largest entry,
  and closer than a zero gradient by 10x; relu: dv only, its dq, dk jump where a rounded
  projection crosses 0), and it did round."""
  q, k, v, key_mask, _ = inputs(3, 44)
  one_fast, split_fast = linear_pair(name, kernel, causal, precision="fast")
  one_exact, split_exact = linear_pair(name, kernel, causal, precision="exact")
  split_fast = split_jit(split_fast)
  run = {"split": lambda q, k, v: split_fast(q, k, v, key_mask),
         "fast": lambda q, k, v: one_fast(q, k, v, key_mask),
         "exact": lambda q, k, v: one_exact(q, k, v, key_mask)}
  ct = jnp.asarray(np.random.default_rng(1).normal(size=v.shape), jnp.float32)
  outs, grads = {}, {}
  for p in run:
    outs[p], grads[p] = out_and_grads(run[p], ct)(q, k, v)
  got, fast, exact = (np.asarray(outs[p]) for p in ("split", "fast", "exact"))
  bound = fast_bound(name, q, k, v)
  assert np.abs(got - fast).max() <= bound and np.abs(got - exact).max() <= bound
  assert np.abs(got - np.asarray(run_split(split_exact, q, k, v, key_mask))).max() > 0
  assert np.all(got[~np.asarray(key_mask)] == 0)

  scale = 4 * bound / float(np.abs(np.asarray(v)).max())
  for i, name_ in enumerate("qkv"):
    if kernel == "relu" and name_ != "v":
      continue
    gs = np.asarray(grads["split"][i])
    for p in ("fast", "exact"):
      g = np.asarray(grads[p][i])
      err = np.abs(gs - g).max()
      assert err <= scale * np.abs(g).max() + 1e-6, (name_, p)
      assert err <= 0.1 * np.abs(g).max(), (name_, p)


def _equations(jaxpr):
  """The equations of a jaxpr and of every jaxpr nested in it."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        sub = getattr(sub, "jaxpr", sub)                        # a ClosedJaxpr's jaxpr
        if hasattr(sub, "eqns"):
          yield from _equations(sub)


@pytest.mark.parametrize("name,kernel,causal", LINEAR_CASES)
def test_fast_precision_rounds_every_contraction_and_nothing_else(name, kernel, causal):
  """Every matmul of the split function and of its gradient takes bfloat16 operands with float32
  results at "fast", as on one device (a contraction left in float32 is closer to exact and
  passes any error bound), and float32 operands at "exact"; and at "fast" nothing but a matmul
  takes a bfloat16 value (or a call passing it on: the gradient's residuals), so no maximum,
  exp, sum, normaliser or state is rounded."""
  q, k, v, key_mask, _ = inputs(1, 32, heads=2)
  for precision, operand in (("fast", jnp.bfloat16), ("exact", jnp.float32)):
    _, split = linear_pair(name, kernel, causal, precision=precision)
    loss = lambda q, k, v: jnp.sum(run_split(split, q, k, v, key_mask))
    for fn in (loss, jax.grad(loss, argnums=(0, 1, 2))):
      eqns = list(_equations(jax.make_jaxpr(fn)(q, k, v).jaxpr))
      dots = [eqn for eqn in eqns if eqn.primitive.name == "dot_general"]
      assert dots
      for eqn in dots:
        assert [x.aval.dtype for x in eqn.invars] == [operand] * 2, (precision, eqn)
        assert eqn.outvars[0].aval.dtype == jnp.float32, (precision, eqn)
      rounded = [eqn for eqn in eqns if eqn.primitive.name not in ("dot_general", "jit",
                                                                    "shard_map")
                 and any(getattr(x.aval, "dtype", None) == jnp.bfloat16 for x in eqn.invars)]
      assert not rounded, (precision, rounded)


@pytest.mark.parametrize("name", ["favor", "linear"])
def test_a_bad_precision_is_refused(name):
  q, k, v, key_mask, _ = inputs(1, 16, pad=False)
  _, split = linear_pair(name, "softmax", False, precision="bf16")
  with pytest.raises(ValueError, match="precision must be one of 'auto', 'exact', 'fast', got "
                                       "'bf16'") as error:
    run_split(split, q, k, v, key_mask)
  assert "\n" not in str(error.value)


# --- The sequence axis of the mesh in a whole training step (models/sequence.py) ---------------

def train_losses(kind, mesh, *, pool="mean", dropout="0.1", steps=2, hlo=False):
  import configs
  from lra import mesh as mesh_lib, train
  overrides = [("data.max_length", "32"), ("model.num_layers", "2"), ("batch_size", "8"),
               ("eval_batch_size", "8"), ("model.pool", pool), ("model.dropout", dropout),
               ("warmup_steps", "1"), *[(f"mesh.{k}", str(v)) for k, v in mesh.items()]]
  if kind == "band":
    overrides.append(("model.attention.window", "4"))
  trainer = train.Trainer(configs.build_config("listops", size="small", attention=kind,
                                               overrides=overrides))
  rng = np.random.default_rng(0)
  batch = {"inputs": rng.integers(1, 10, (8, 32)).astype(np.int32),
           "targets": rng.integers(0, 10, (8,)).astype(np.int32)}
  batch["inputs"][-1, 20:] = 0
  batch = mesh_lib.global_batch(batch, trainer.mesh)
  state, losses = trainer.state, []
  for _ in range(steps):
    state, sums = trainer.train_step(state, batch, trainer.rest)
    losses.append(float(sums["loss_sum"]))
  if hlo:   # the compiled step's text, for the runs that look at it
    hlo = trainer.train_step.lower(state, batch, trainer.rest).compile().as_text()
  return losses, jax.tree.leaves(state["params"]), hlo


# Length 32 splits evenly: dropout draws are the same too; 33 with the CLS token is padded to
# 36 (exact without dropout). The band's padded case runs in the exhaustive tier: the padding
# and the CLS readout take linear's cls case's path through the model (`pad_length`), the band
# in the model its mean case's, and the band's padded chunks are the function tests' above.
@pytest.mark.parametrize("kind,pool,dropout", [
    ("band", "mean", "0.1"),
    pytest.param("band", "cls", "0.0", marks=pytest.mark.exhaustive),
    ("favor", "mean", "0.1"),
    ("linear", "cls", "0.0"),
])
@pytest.mark.slow
def test_a_split_sequence_trains_like_one_device(kind, pool, dropout):
  losses, params, _ = train_losses(kind, {"data": 2, "sequence": 1}, pool=pool, dropout=dropout)
  losses_split, params_split, hlo = train_losses(kind, {"data": 2, "sequence": 4}, pool=pool,
                                                 dropout=dropout, hlo=kind == "band")
  np.testing.assert_allclose(losses_split, losses, rtol=2e-5)
  for p_split, p in zip(params_split, params):
    np.testing.assert_allclose(p_split, p, rtol=2e-4, atol=5e-5)   # after Adam
  if kind == "band":
    assert "collective-permute" in hlo


@pytest.mark.parametrize("kind", ["favor", "linear"])
def test_a_layer_with_precision_runs_split(kind):
  """A config with mesh.sequence > 1 and model.attention.precision passes the config check, and
  its attention layer hands the precision to the sequence-parallel function: "fast" equals the
  one-device layer at "fast" (bidirectional: the same operands rounded, the states summed in
  another order) and differs from "exact"."""
  import configs
  from flax import nnx
  from lra import schema
  from models.attention_layer import MultiHeadAttention
  config = configs.build_config("listops", size="small", attention=kind, overrides=[
      ("mesh.sequence", "4"), ("model.attention.precision", "fast")])
  schema.check(config)
  assert config.model.attention.precision == "fast"
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 32, 16)), jnp.float32)
  key_mask = jnp.arange(32)[None] < jnp.array([[32], [21]])

  def layer_out(precision, devices):
    spec = {"kind": kind, "precision": precision}
    if kind == "favor":
      spec.update(num_features=16)
    layer = MultiHeadAttention(16, 2, 16, spec, max_length=32, rngs=nnx.Rngs(0))
    if devices == 1:
      return np.asarray(jax.jit(lambda x: layer(x, key_mask))(x))
    with jax.set_mesh(Mesh(np.array(jax.devices()[:devices]), ("sequence",))):
      return np.asarray(jax.jit(lambda x: layer(x, key_mask))(x))

  split = layer_out("fast", 4)
  np.testing.assert_allclose(split, layer_out("fast", 1), rtol=RTOL, atol=ATOL)
  assert np.abs(split - layer_out("exact", 4)).max() > 1e-4


def test_kinds_that_cannot_run_split_are_refused():
  import configs
  from lra import schema
  config = configs.build_config("listops", size="small", attention="dot_product",
                                overrides=[("mesh.sequence", "2")])
  with pytest.raises(ValueError, match=r"config.mesh.sequence = 2: attention 'dot_product' "
                                       r"cannot run with the sequence split"):
    schema.check(config)


@pytest.mark.slow
def test_a_character_lm_with_the_sequence_split_trains_like_one_device():
  """20 steps of a small causal band LM (enwik8 small, dropout on): sequence=4 vs sequence=1."""
  import configs
  from lra import mesh as mesh_lib, train

  def losses(sequence):
    config = configs.build_config("enwik8", size="small", attention="band", overrides=[
        ("data.max_length", "64"), ("data.eval_length", "0"), ("batch_size", "4"),
        ("eval_batch_size", "4"), ("model.num_layers", "2"), ("model.emb_dim", "32"),
        ("model.qkv_dim", "32"), ("model.mlp_dim", "64"), ("model.attention.window", "8"),
        ("mesh.data", "2"), ("mesh.sequence", str(sequence))])
    with config.unlocked():
      config.phases, config.model.layer_attention = (), ()
    trainer = train.Trainer(config)
    rng = np.random.default_rng(1)
    state, out = trainer.state, []
    for _ in range(20):
      text = rng.integers(1, trainer.task.vocab_size, (4, 65)).astype(np.int32)
      mask = np.ones((4, 64), np.int32)
      mask[-1, 50:] = 0
      batch = mesh_lib.global_batch({"inputs": text[:, :-1], "targets": text[:, 1:],
                                     "mask": mask}, trainer.mesh)
      state, sums = trainer.train_step(state, batch, trainer.rest)
      out.append(float(sums["loss_sum"]) / float(sums["weight"]))
    return out

  one, split = losses(1), losses(4)
  assert one[-1] < one[0]                               # it learns
  np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-5)
