"""The backends of the attention kinds (attention/backends.py): which one `auto` picks on each
platform, the refusals of a backend that cannot compute a layer, the tokamax backend against the
dense reference, and the layer and config check choosing them."""

import importlib.util

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention
import configs
from attention import backends, cudnn_backend, kinds, masks, tokamax_backend
from lra import schema
from models.attention_layer import MultiHeadAttention

# tokamax is an optional extra: its tests run where it is installed.
needs_tokamax = pytest.mark.skipif(importlib.util.find_spec("tokamax") is None,
                                   reason="tokamax is not installed (pip install '.[tokamax]')")

# What `auto` must pick, written from the table in docs/accelerators.md (not from the code):
# (kind, args, global tokens) -> backend on gpu, tpu, cpu, for a layer whose causality is not
# known (the config check); causal layers below.
AUTO = [
    ("dot_product", {}, False, ("cudnn", "splash", "xla")),
    ("flash", {"block_size": 64}, False, ("cudnn", "splash", "xla")),
    ("band", {"window": 64}, False, ("pallas", "splash", "xla")),
    ("band", {"window": 64, "dilation": 1}, False, ("pallas", "splash", "xla")),
    ("band", {"window": 64, "dilation": (1, 1, 1, 1)}, False, ("pallas", "splash", "xla")),
    ("band", {"window": 64, "dilation": 2}, False, ("pallas", "splash", "xla")),
    ("band", {"window": 64, "dilation": (1, 1, 2, 4)}, False, ("pallas", "splash", "xla")),
    ("band", {"window": 64}, True, ("pallas", "splash", "xla")),
    ("bigbird", {"block_size": 32}, False, ("pallas", "splash", "xla")),
    ("sparse", {"pattern": "fixed", "stride": 32}, False, ("pallas", "splash", "xla")),
    ("sparse", {"pattern": "strided", "stride": 32}, False, ("pallas", "splash", "xla")),
    ("block_local", {"block_size": 32}, False, ("pallas", "splash", "xla")),
    ("block_sparse", {"block_size": 32}, False, ("pallas", "splash", "xla")),
    ("adaptive_span", {}, False, ("xla", "xla", "xla")),
    ("entmax", {}, False, ("xla", "xla", "xla")),
    ("favor", {}, False, ("xla", "xla", "xla")),
    ("linear", {}, False, ("xla", "xla", "xla")),
    ("linformer", {"k": 32}, False, ("xla", "xla", "xla")),
    ("lsh", {}, False, ("xla", "xla", "xla")),
    ("synthesizer", {}, False, ("xla", "xla", "xla")),
]


@pytest.mark.parametrize("kind,args,global_tokens,expected", AUTO)
def test_auto_picks_the_fastest_exact_backend_of_each_platform(kind, args, global_tokens,
                                                               expected):
  got = tuple(backends.choose(kind, args, platform=p, global_tokens=global_tokens)
              for p in ("gpu", "tpu", "cpu"))
  assert got == expected


# (kind, args, global tokens, causal) -> backend on gpu, tpu, cpu.
AUTO_CAUSAL = [
    ("dot_product", {}, False, True, ("cudnn", "splash", "xla")),
    ("flash", {}, False, False, ("cudnn", "splash", "xla")),
    ("band", {"window": 64}, False, True, ("cudnn", "splash", "xla")),
    ("band", {"window": 64, "dilation": (1, 2, 4, 4)}, False, True, ("cudnn", "splash", "xla")),
    ("band", {"window": 64}, False, False, ("pallas", "splash", "xla")),
    ("band", {"window": 64}, True, True, ("pallas", "xla", "xla")),
    ("band", {"window": 64}, True, False, ("pallas", "splash", "xla")),
]


@pytest.mark.parametrize("kind,args,global_tokens,causal,expected", AUTO_CAUSAL)
def test_auto_gives_causal_band_layers_to_cudnn_and_two_sided_ones_to_pallas(
    kind, args, global_tokens, causal, expected):
  got = tuple(backends.choose(kind, args, platform=p, global_tokens=global_tokens,
                              causal=causal) for p in ("gpu", "tpu", "cpu"))
  assert got == expected


def test_auto_never_picks_tokamax_whatever_its_probe_says(monkeypatch):
  monkeypatch.setattr(tokamax_backend, "fast_kernels", lambda *a, **k: True)
  monkeypatch.setattr(backends, "_tokamax_installed", lambda: True)
  for kind, args, global_tokens, _ in AUTO:
    for causal in (None, False, True):
      if causal and not kinds.get(kind).supports_causal:
        continue
      assert "tokamax" not in {backends.choose(kind, args, platform=p, causal=causal,
                                               global_tokens=global_tokens)
                               for p in backends.PLATFORMS}


def test_tokamax_not_installed_is_refused_in_one_line(monkeypatch):
  monkeypatch.setattr(backends, "_tokamax_installed", lambda: False)
  reason = backends.unable("dot_product", "tokamax", {})
  assert "pip install '.[tokamax]'" in reason and "\n" not in reason
  with pytest.raises(ValueError, match="tokamax is not installed"):
    backends.choose("band", {"window": 4}, implementation="tokamax")


def test_cudnn_refuses_the_band_its_sliding_window_cannot_express():
  assert "causal band layers only" in backends.unable("band", "cudnn", {}, causal=False)
  assert "no global tokens" in backends.unable("band", "cudnn", {}, global_tokens=True,
                                               causal=True)
  assert backends.unable("band", "cudnn", {"dilation": (1, 2)}, causal=True) is None
  assert backends.unable("band", "cudnn", {}) is None     # causality not known: the layer checks
  assert "has no cudnn" in backends.unable("bigbird", "cudnn", {})
  with pytest.raises(ValueError, match="one-sided.*Use implementation=auto"):
    backends.choose("band", {}, implementation="cudnn", causal=False)


def test_every_kind_is_in_the_table_and_auto_picks_only_listed_backends():
  assert {row[0] for row in AUTO} == set(kinds.names())
  for kind, args, global_tokens, _ in AUTO:
    for platform in backends.PLATFORMS:
      assert backends.choose(kind, args, platform=platform,
                             global_tokens=global_tokens) in kinds.get(kind).backends


def test_auto_on_this_machine_is_xla():
  assert jax.default_backend() == "cpu"
  assert backends.choose("band", {"window": 8}) == "xla"
  assert backends.function("band") is attention.band_attention


@pytest.mark.parametrize("kind,implementation,args,global_tokens,message", [
    ("favor", "splash", {}, False, "'favor' has no splash implementation"),
    ("bigbird", "tokamax", {}, False, "'bigbird' has no tokamax implementation"),
    ("dot_product", "pallas", {}, False, "'dot_product' has no pallas implementation"),
    pytest.param("band", "tokamax", {"dilation": (1, 2)}, False, "no dilation",
                 marks=needs_tokamax),
    pytest.param("band", "tokamax", {}, True, "no global tokens", marks=needs_tokamax),
    ("band", "cuda", {}, False, "unknown; valid: auto, xla, cudnn, tokamax, splash, pallas"),
])
def test_a_backend_that_cannot_compute_the_layer_is_refused(kind, implementation, args,
                                                            global_tokens, message):
  with pytest.raises(ValueError, match=message):
    backends.choose(kind, args, implementation=implementation, global_tokens=global_tokens)


def test_splash_is_not_picked_for_a_causal_band_with_global_tokens():
  with pytest.raises(ValueError, match="bidirectional band layers only"):
    backends.choose("band", {}, implementation="splash", global_tokens=True, causal=True)
  assert backends.choose("band", {}, platform="tpu", global_tokens=True, causal=True) == "xla"
  assert backends.choose("band", {}, platform="tpu", global_tokens=True) == "splash"


def test_explicit_backends_are_returned_whatever_the_platform():
  for platform in backends.PLATFORMS:
    assert backends.choose("band", {"dilation": 3}, implementation="pallas",
                           platform=platform) == "pallas"
    assert backends.choose("band", {}, implementation="xla", platform=platform) == "xla"


def test_function_finds_each_backends_function_by_the_kinds_name(monkeypatch):
  monkeypatch.setattr(backends, "_tokamax_installed", lambda: True)
  for kind in ("band", "flash", "dot_product"):
    fn = getattr(cudnn_backend, kinds.get(kind).function)
    assert backends.function(kind, "cudnn") is fn
    assert backends.function(kind, platform="gpu", causal=True) is fn
  assert backends.function("band", "tokamax") is tokamax_backend.band_attention
  assert backends.function("flash", "tokamax") is tokamax_backend.flash_attention
  assert backends.function("dot_product", "tokamax") is tokamax_backend.dot_product_attention
  assert backends.function("favor", "xla") is attention.favor_attention
  from attention import pallas_band, pallas_block_sparse, splash
  assert backends.function("band", "pallas") is pallas_band.band_attention
  for kind in ("bigbird", "sparse", "block_local", "block_sparse"):
    assert backends.function(kind, "pallas") is getattr(pallas_block_sparse,
                                                        kinds.get(kind).function)
    assert backends.function(kind, platform="gpu") is getattr(pallas_block_sparse,
                                                              kinds.get(kind).function)
  for kind in ("band", "bigbird", "sparse", "block_local", "block_sparse", "dot_product",
               "flash"):
    assert backends.function(kind, "splash") is getattr(splash, kinds.get(kind).function)


# ---- the tokamax backend against the dense reference ----

def _inputs(rng, b, length, h, d, dtype=jnp.float32):
  return [jnp.asarray(rng.normal(size=(b, length, h, d)), dtype) for _ in range(4)]


def _out_and_grads(fn, q, k, v, ct):
  out, vjp = jax.vjp(fn, q, k, v)
  return dict(zip(("out", "dq", "dk", "dv"), (out, *vjp(ct))))


def _key_mask(rng, b, length):
  lengths = rng.integers(1, length + 1, size=b)
  lengths[-1] = 0                                    # an all-padding row
  return jnp.asarray(np.arange(length)[None] < lengths[:, None])


# (length, heads, head_dim, window, causal, padding): lengths that are not a multiple of any
# block, shorter than a block, a window of 0 and one longer than the sequence.
TOKAMAX_BAND = [
    (37, 3, 8, 5, False, True),
    (37, 3, 8, 5, True, True),
    (5, 2, 16, 3, False, True),
    (130, 1, 8, 0, False, False),
    (130, 2, 8, 200, True, False),
    (64, 4, 4, 16, False, False),
]


@needs_tokamax
@pytest.mark.parametrize("length,heads,head_dim,window,causal,padding", TOKAMAX_BAND)
def test_tokamax_band_equals_the_dense_reference(length, heads, head_dim, window, causal,
                                                 padding):
  rng = np.random.default_rng(length * 7 + window)
  q, k, v, ct = _inputs(rng, 3, length, heads, head_dim)
  key_mask = _key_mask(rng, 3, length) if padding else None
  mask = masks.longformer_mask(length, window=window, causal=causal, key_mask=key_mask)
  got = _out_and_grads(lambda q, k, v: tokamax_backend.band_attention(
      q, k, v, window=window, causal=causal, key_mask=key_mask), q, k, v, ct)
  want = _out_and_grads(lambda q, k, v: attention.dot_product_attention(
      q, k, v, mask=mask, key_mask=key_mask), q, k, v, ct)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  if padding:   # padded queries output exactly 0
    assert np.all(np.asarray(got["out"])[~np.asarray(key_mask)] == 0)


@needs_tokamax
@pytest.mark.parametrize("fn", ["dot_product_attention", "flash_attention"])
@pytest.mark.parametrize("causal", [False, True])
def test_tokamax_dense_equals_the_dense_reference(fn, causal):
  rng = np.random.default_rng(3)
  q, k, v, ct = _inputs(rng, 2, 45, 3, 16)
  key_mask = _key_mask(rng, 2, 45)
  got = _out_and_grads(lambda q, k, v: getattr(tokamax_backend, fn)(
      q, k, v, causal=causal, key_mask=key_mask), q, k, v, ct)
  want = _out_and_grads(lambda q, k, v: attention.dot_product_attention(
      q, k, v, causal=causal, key_mask=key_mask), q, k, v, ct)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


@needs_tokamax
def test_tokamax_in_bfloat16_is_within_bfloat16_tolerance():
  rng = np.random.default_rng(4)
  q, k, v, _ = _inputs(rng, 2, 70, 2, 32, jnp.bfloat16)
  mask = masks.longformer_mask(70, window=9)
  got = tokamax_backend.band_attention(q, k, v, window=9)
  assert got.dtype == jnp.bfloat16
  want = attention.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                         mask=mask)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2)


@needs_tokamax
def test_tokamax_band_refuses_what_its_window_cannot_express():
  q = jnp.ones((1, 8, 2, 4))
  with pytest.raises(ValueError, match="no dilation.*implementation=pallas"):
    tokamax_backend.band_attention(q, q, q, window=2, dilation=(1, 2))
  with pytest.raises(ValueError, match="no global tokens"):
    tokamax_backend.band_attention(q, q, q, window=2, global_mask=jnp.ones((1, 8), bool))
  with pytest.raises(ValueError, match="no general mask"):
    tokamax_backend.dot_product_attention(q, q, q, mask=jnp.ones((8, 8), bool))


# ---- tokamax implementations that do not build on this jax ----
# tokamax 0.0.12 on jax 0.11.2 (the H100 of docs/gpu.md): these two errors, raised while tracing.
BROKEN = {"mosaic": TypeError("Mesh.__init__() got an unexpected keyword argument 'out_shape'"),
          "triton": AttributeError("pl.dot was deprecated in JAX v0.11.0")}


@pytest.fixture
def fresh_probes():
  tokamax_backend._usable.cache_clear()
  yield
  tokamax_backend._usable.cache_clear()


def test_an_implementation_that_does_not_build_is_dropped_once_with_one_log_line(
    fresh_probes, monkeypatch, caplog):
  probed = []

  def builds(implementation, dtype, head_dim, causal, window, masked):
    probed.append((implementation, dtype, head_dim, causal, window, masked))
    return BROKEN.get(implementation)

  monkeypatch.setattr(tokamax_backend, "_builds", builds)
  with caplog.at_level("WARNING", logger="attention.tokamax_backend"):
    got = tokamax_backend.implementations(jnp.bfloat16, 64, window=(8, 8), platform="gpu")
    assert got == ("cudnn", "xla")
    assert tokamax_backend.implementations("bfloat16", 64, window=[8, 8],
                                           platform="gpu") == got
  assert [p[0] for p in probed] == ["mosaic", "triton", "cudnn"]   # xla is never probed
  assert probed[0][1:] == ("bfloat16", 64, False, (8, 8), False)
  lines = [r.getMessage() for r in caplog.records]
  assert len(lines) == 2 and "mosaic" in lines[0] and "out_shape" in lines[0]
  assert "triton" in lines[1] and "pl.dot" in lines[1]
  # Elsewhere than on a GPU: tokamax's XLA implementation, nothing probed.
  assert tokamax_backend.implementations("float32", 16, platform="cpu") == "xla"
  assert len(probed) == 3


def test_auto_on_a_gpu_picks_cudnn_whether_or_not_a_tokamax_kernel_builds(fresh_probes,
                                                                           monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  for builds in (lambda i, *a: BROKEN.get(i), lambda i, *a: None):
    monkeypatch.setattr(tokamax_backend, "_builds", builds)
    tokamax_backend._usable.cache_clear()
    assert backends.choose("band", {"window": 64}, causal=True) == "cudnn"
    assert backends.choose("band", {"window": 64}, causal=False) == "pallas"
    assert backends.choose("dot_product") == "cudnn"
    assert backends.choose("flash") == "cudnn"


@needs_tokamax
def test_the_calls_ask_tokamax_for_what_builds_and_stay_exact(fresh_probes, monkeypatch):
  monkeypatch.setattr(tokamax_backend, "_builds", lambda i, *a: BROKEN.get(i))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  real = tokamax_backend._tokamax()
  asked = []

  class Spy:
    def dot_product_attention(self, *args, implementation, **kwargs):
      asked.append(implementation)
      return real.dot_product_attention(*args, implementation="xla", **kwargs)

  monkeypatch.setattr(tokamax_backend, "_tokamax", Spy)
  rng = np.random.default_rng(8)
  q, k, v, _ = _inputs(rng, 2, 37, 2, 8)
  key_mask = _key_mask(rng, 2, 37)
  got = tokamax_backend.band_attention(q, k, v, window=5, key_mask=key_mask)
  want = attention.dot_product_attention(
      q, k, v, mask=masks.longformer_mask(37, window=5, key_mask=key_mask), key_mask=key_mask)
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert asked == [("cudnn", "xla")]


@needs_tokamax
def test_a_probe_keeps_what_compiles_or_refuses_and_drops_any_other_error(monkeypatch):
  real = tokamax_backend._tokamax()

  class Stub:
    def dot_product_attention(self, q, k, v, *, implementation, **kwargs):
      if implementation in BROKEN:
        raise BROKEN[implementation]
      if implementation == "cudnn":
        raise NotImplementedError("cudnn takes no float32")    # tokamax moves on by itself
      return real.dot_product_attention(q, k, v, implementation="xla", **kwargs)

  monkeypatch.setattr(tokamax_backend, "_tokamax", Stub)
  for implementation in ("mosaic", "triton"):
    error = tokamax_backend._builds(implementation, "float32", 16, True, None, True)
    assert error is BROKEN[implementation]
  assert tokamax_backend._builds("cudnn", "float32", 16, False, (4, 4), False) is None
  assert tokamax_backend._builds("xla", "float32", 16, False, (4, 4), True) is None
  monkeypatch.setattr(tokamax_backend, "_tokamax", lambda: real)
  error = tokamax_backend._builds("no_such_kernel", "float32", 16, False, None, False)
  assert isinstance(error, ValueError) and "no_such_kernel" in str(error)


# ---- the layer and the config ----

@pytest.mark.parametrize("spec,backend", [
    pytest.param({"kind": "band", "window": 3}, "tokamax", marks=needs_tokamax),
    pytest.param({"kind": "dot_product"}, "tokamax", marks=needs_tokamax),
    pytest.param({"kind": "flash", "block_size": 8}, "tokamax", marks=needs_tokamax),
    ({"kind": "flash", "block_size": 8}, "splash"),
    ({"kind": "dot_product"}, "cudnn"), ({"kind": "flash", "block_size": 8}, "cudnn"),
    ({"kind": "band", "window": 3, "dilation": (1, 2, 1, 3)}, "cudnn"),
    ({"kind": "band", "window": 3, "dilation": (1, 2, 1, 3)}, "pallas"),
    ({"kind": "band", "window": 3, "dilation": (1, 2, 1, 3)}, "splash"),
    ({"kind": "bigbird", "block_size": 4, "num_random_blocks": 2}, "pallas"),
    ({"kind": "sparse", "pattern": "fixed", "stride": 8, "summary_width": 2}, "pallas"),
    ({"kind": "block_local", "block_size": 5}, "pallas"),
    ({"kind": "block_sparse", "block_size": 4, "window_blocks": 1, "global_blocks": 1},
     "pallas")])
def test_the_layer_through_a_backend_equals_the_layer_through_xla(spec, backend):
  x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 21, 16)), jnp.float32)
  key_mask = jnp.asarray(np.arange(21)[None] < np.array([[21], [13]]))
  outs = {}
  for implementation in ("xla", backend):
    layer = MultiHeadAttention(16, 4, 16, {**spec, "implementation": implementation},
                               max_length=21, causal=spec["kind"] in ("band", "sparse"),
                               rngs=nnx.Rngs(0))
    assert layer.implementation == implementation
    outs[implementation] = layer(x, key_mask)
  np.testing.assert_allclose(outs[backend], outs["xla"], atol=1e-5)


def test_the_layer_refuses_an_impossible_backend_and_relative_positions_with_one():
  with pytest.raises(ValueError, match="no splash implementation"):
    MultiHeadAttention(8, 2, 8, {"kind": "linear", "implementation": "splash"}, max_length=8,
                       rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="relative positions"):
    MultiHeadAttention(8, 2, 8, {"kind": "band", "window": 2, "implementation": "tokamax"},
                       max_length=8, positions={"kind": "relative"}, rngs=nnx.Rngs(0))
  layer = MultiHeadAttention(8, 2, 8, {"kind": "band", "window": 2}, max_length=8,
                             positions={"kind": "relative"}, rngs=nnx.Rngs(0))
  assert layer.implementation == "xla"


# ---- the splash kernel's tiles (config.model.splash) reach a splash layer's kernel only ----

# Forward and dK/dV tiles of 128 on a 256-token layer: two tiles a side, where the defaults
# (512, cut to the lane-padded length) would run one.
SMALL_TILES = dict(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                   block_kv_dkv=128, block_kv_dkv_compute=128)


def _spy_calls(monkeypatch) -> list[dict]:
  """The keyword arguments of every attention function a layer calls (`backends.function`)."""
  calls, function = [], backends.function

  def spying(kind, implementation=backends.AUTO, **kw):
    fn = function(kind, implementation, **kw)

    def called(*args, **kwargs):
      calls.append(dict(kwargs, implementation=implementation))
      return fn(*args, **kwargs)
    return called
  monkeypatch.setattr(backends, "function", spying)
  return calls


def test_a_splash_layer_passes_its_tiles_to_the_kernel(monkeypatch):
  from attention import splash
  kernels = []                           # the (fitted) tiles each splash kernel is built with
  build = splash._kernel
  monkeypatch.setattr(splash, "_kernel", lambda *a: kernels.append(a[4]) or build(*a))
  calls = _spy_calls(monkeypatch)
  length = 256
  x = jnp.asarray(np.random.default_rng(11).normal(size=(2, length, 16)), jnp.float32)
  key_mask = jnp.asarray(np.arange(length)[None] < np.array([[length], [200]]))
  spec = {"kind": "band", "window": 40, "dilation": (1, 2, 1, 3)}
  outs = {}
  for implementation in ("xla", "splash"):
    layer = MultiHeadAttention(16, 4, 16, {**spec, "implementation": implementation},
                               max_length=length, causal=True, tiles=SMALL_TILES,
                               rngs=nnx.Rngs(0))
    outs[implementation] = layer(x, key_mask)
  want = splash.Tiles(**SMALL_TILES)
  assert layer.tiles == want
  assert [c.get("tiles") for c in calls] == [None, want]       # xla got none, splash these
  assert kernels and all(t == want for t in kernels)           # not cut: they fit the length
  np.testing.assert_allclose(outs["splash"], outs["xla"], atol=1e-5)


@pytest.mark.parametrize("implementation,positions", [
    ("xla", "none"), ("pallas", "none"), ("cudnn", "none"),
    ("auto", "relative")])               # relative positions: xla on every platform
def test_a_layer_of_another_backend_never_gets_tiles(monkeypatch, implementation, positions):
  calls = _spy_calls(monkeypatch)
  spec = {"kind": "band", "window": 3, "implementation": implementation}
  layer = MultiHeadAttention(16, 4, 16, spec, max_length=21, causal=True, tiles=SMALL_TILES,
                             positions={"kind": positions}, rngs=nnx.Rngs(0))
  assert layer.implementation != "splash" and layer.tiles is None
  x = jnp.ones((1, 21, 16), jnp.float32)
  layer(x, None)
  assert calls and all("tiles" not in c for c in calls), calls


def test_a_splash_layer_without_tiles_gets_the_defaults_and_bad_tiles_name_the_config():
  from attention import splash
  layer = MultiHeadAttention(16, 4, 16, {"kind": "band", "window": 3, "implementation": "splash"},
                             max_length=21, rngs=nnx.Rngs(0))
  assert layer.tiles == splash.Tiles(**splash.DEFAULT_TILES)
  with pytest.raises(ValueError, match=r"^config\.model\.splash\.block_q must be a multiple "
                                       r"of 128"):
    MultiHeadAttention(16, 4, 16, {"kind": "band", "window": 3, "implementation": "splash"},
                       max_length=21, tiles={"block_q": 100}, rngs=nnx.Rngs(0))
  # another backend does not read them (the config check refuses bad ones before any layer)
  MultiHeadAttention(16, 4, 16, {"kind": "band", "window": 3, "implementation": "xla"},
                     max_length=21, tiles={"block_q": 100}, rngs=nnx.Rngs(0))


def _attention_layers(model) -> list[MultiHeadAttention]:
  return [m for _, m in nnx.iter_graph(model) if isinstance(m, MultiHeadAttention)]


def test_config_tiles_flow_through_the_model_to_the_kernel(monkeypatch):
  from attention import splash
  from lra import tasks, train
  task = tasks.get_task("listops")
  small = {"model.num_layers": 2, "model.emb_dim": 16, "model.num_heads": 2,
           "model.qkv_dim": 16, "model.mlp_dim": 32, "model.classifier_dim": 16,
           "model.attention.window": 8, "data.max_length": 128}
  config = _config(**small, **{"model.attention.implementation": "splash",
                               "model.splash.block_q": 128, "model.splash.block_kv": 256,
                               "model.splash.block_kv_compute": 128,
                               "model.splash.use_fused_bwd_kernel": True})
  schema.check(config)
  want = splash.Tiles(block_q=128, block_kv=256, block_kv_compute=128, use_fused_bwd_kernel=True)
  model = task.build_model(train.model_config(config, task), nnx.Rngs(0))
  layers = _attention_layers(model)
  assert len(layers) == 2 and all(layer.tiles == want for layer in layers)
  calls = _spy_calls(monkeypatch)
  tokens = jnp.asarray(np.random.default_rng(3).integers(1, task.vocab_size, size=(1, 128)))
  model(tokens)
  assert [c.get("tiles") for c in calls] == [want, want]
  # the defaults when the config leaves them, no tiles on another backend
  default = _config(**small, **{"model.attention.implementation": "splash"})
  model = task.build_model(train.model_config(default, task), nnx.Rngs(0))
  assert all(layer.tiles == splash.Tiles() for layer in _attention_layers(model))
  xla = _config(**small, **{"model.attention.implementation": "xla",
                            "model.splash.block_q": 128})
  model = task.build_model(train.model_config(xla, task), nnx.Rngs(0))
  assert all(layer.tiles is None for layer in _attention_layers(model))


def _config(task="listops", attention="band", **overrides):
  return configs.build_config(task, attention=attention, size="small",
                              overrides=[(k, str(v)) for k, v in overrides.items()])


@pytest.mark.parametrize("attention,overrides,message", [
    ("band", {"model.attention.implementation": "cuda"}, "must be one of auto, xla"),
    ("favor", {"model.attention.implementation": "splash"}, "'favor' has no splash"),
    pytest.param("band", {"model.attention.implementation": "tokamax",
                          "model.attention.dilation": 2},
                 r"\(layer 0\): tokamax's local window has no dilation", marks=needs_tokamax),
    ("linear", {"model.attention.implementation": "cudnn"}, "'linear' has no cudnn"),
    ("band", {"model.attention.implementation": "pallas", "model.pos_emb": "relative"},
     "relative positions"),
    ("band", {"model.attention.implementation": "splash", "mesh.sequence": 2},
     "sequence split over devices"),
])
def test_the_config_check_refuses_a_backend_that_cannot_run_in_one_line(attention, overrides,
                                                                        message):
  with pytest.raises(ValueError, match=message) as e:
    schema.check(_config(attention=attention, **overrides))
  assert "\n" not in str(e.value)


def test_a_layer_of_another_kind_inherits_the_backend_and_is_checked():
  config = _config(**{"model.attention.implementation": "pallas"})
  schema.check(config)
  with config.model.unlocked():
    config.model.layer_attention = tuple(
        {"kind": "dot_product"} if i == 1 else {} for i in range(config.model.num_layers))
  with pytest.raises(ValueError, match=r"\(layer 1\): attention 'dot_product' has no pallas"):
    schema.check(config)


def test_auto_and_xla_pass_the_config_check_for_every_kind():
  for kind in kinds.names():
    for implementation in ("auto", "xla"):
      schema.check(_config(attention=kind, **{"model.attention.implementation": implementation}))


def test_cudnn_passes_the_config_check_for_the_dense_kinds_and_the_band():
  for kind in ("dot_product", "flash", "band"):
    schema.check(_config(attention=kind, **{"model.attention.implementation": "cudnn"}))


def test_pallas_passes_the_config_check_for_the_block_pattern_kinds():
  for kind in ("bigbird", "sparse", "block_local", "block_sparse"):
    schema.check(_config(attention=kind, **{"model.attention.implementation": "pallas"}))


# ---- a short training run through each backend equals the xla run ----

# The interpreted kernels run slowly on the CPU: a few steps (the first at learning rate 0, the
# warmup's start), then full-rate ones whose updates follow the backend's gradients; small
# evaluation splits. The model keeps its two layers at length 128 (two 64-query blocks, the band
# across them); one layer's attention gradient reaches the other's parameters.
STEPS = 4


def _losses(workdir) -> dict[str, float]:
  import json
  records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  return {r["split"]: r["loss"] for r in records if r["step"] == STEPS}


@pytest.fixture(scope="module")
def xla_run(tmp_path_factory):
  return _train(tmp_path_factory.mktemp("xla"), "xla")


def _train(workdir, implementation):
  from launch import cli
  assert cli.main(["run", "listops", "--size", "small", "--attention", "band",
                   "--workdir", str(workdir), "--no_preflight",
                   f"--config.model.attention.implementation={implementation}",
                   f"--config.num_train_steps={STEPS}", "--config.warmup_steps=1",
                   "--config.learning_rate=0.004", "--config.batch_size=8",
                   "--config.eval_batch_size=16", "--config.data.num_train=256",
                   "--config.data.num_val=16", "--config.data.num_test=16"]) == 0
  return _losses(workdir)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", [pytest.param("tokamax", marks=needs_tokamax),
                                            "pallas", "splash"])
def test_training_through_a_backend_equals_training_through_xla(implementation, xla_run,
                                                                 tmp_path):
  got = _train(tmp_path, implementation)
  assert set(got) == {"train", "validation", "test"}
  for split, loss in xla_run.items():
    assert abs(got[split] - loss) < 1e-4, (split, got[split], loss)


def test_only_xla_computes_bigbirds_hugging_face_inference():
  first = {"block_size": 16, "random_blocks": "first"}
  assert backends.unable("bigbird", "xla", first) is None
  for backend in ("pallas", "splash"):
    assert "only xla" in backends.unable("bigbird", backend, first)
    assert backends.unable("bigbird", backend, {"block_size": 16}) is None
  assert backends.choose("bigbird", first, platform="gpu") == "xla"
