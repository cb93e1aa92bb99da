"""Per-layer arrays of the attention kinds that own some, one NNX class per kind.

Most primitives need only q, k, v and their config arguments. A few need arrays that belong to
the layer: FAVOR+ random features (fixed, non-trainable), Linformer's length projections,
Synthesizer's synthetic logits, LSH's hashing key, BigBird's per-layer seed, block_sparse's
layout, entmax's alpha per head. The kind's record in `attention.kinds` names its class here
(`Kind.extras`); the layer builds it with `make_extras(...)` and at call time the instance
returns the keyword arguments handed to the primitive. Config arguments a class consumes itself
(for example `num_features` or `sharing`) are listed in its `CONSUMES` and are not forwarded. A
class whose `shared_across_layers(args)` is true is built once and handed to every layer of that
kind (Linformer's `sharing="layer"`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import attention
from attention import adaptive_span, kinds
from attention.band import default_block_size
from models.sharding import param

class Buffer(nnx.Variable):
  """A non-trainable array that belongs to the model (kept out of the optimizer)."""


class Extras(nnx.Module):
  """Base of the extras classes: the per-layer arrays of one attention kind.

  Built as `cls(args, num_heads=..., head_dim=..., max_length=..., rngs=..., layer_index=...)`
  from the kind's config arguments; called as `extras(length=L, rng=key_or_None)` it returns
  keyword arguments of the primitive. `CONSUMES` lists the config arguments it reads itself.
  """

  CONSUMES: tuple[str, ...] = ()

  @classmethod
  def shared_across_layers(cls, args: dict) -> bool:
    """Whether one instance serves every layer of this kind (built once by the encoder)."""
    del args
    return False


class FavorFeatures(Extras):
  """FAVOR+ random features `[num_features, head_dim]`, drawn once from the layer's key.

  `redraw=True` draws fresh features at every training call from the step's key (the paper's
  feature redrawing, which keeps the model from fitting one draw); evaluation (rng None) uses the
  features drawn at initialisation.
  """

  CONSUMES = ("num_features", "redraw")

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs, layer_index: int = 0):
    del num_heads, max_length, layer_index
    self.num_features = int(args.get("num_features", 256))
    self.head_dim = head_dim
    self.redraw = args.get("redraw", False)
    if not isinstance(self.redraw, bool):
      raise ValueError(f"favor redraw must be true or false, got {self.redraw!r}.")
    self.features = Buffer(attention.favor_features(rngs.params(), self.num_features, head_dim))

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del length
    if self.redraw and rng is not None:
      return {"features": attention.favor_features(rng, self.num_features, self.head_dim)}
    return {"features": self.features[...]}


class LinformerProjections(Extras):
  """Linformer length projections E (keys) and F (values), `[max_length, k]` each.

  `sharing` (config): "none" (separate E and F, shared by the heads), "headwise" (separate E and
  F per head, `[H, max_length, k]`), "kv" (E = F), "layer" (one E = F shared by every layer; the
  encoder hands the same module to each layer). `k` is the projected length.
  """

  CONSUMES = ("k", "sharing")
  SHARINGS = ("none", "headwise", "kv", "layer")

  @classmethod
  def shared_across_layers(cls, args: dict) -> bool:
    return args.get("sharing", "none") == "layer"

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs, layer_index: int = 0):
    del head_dim, layer_index
    sharing = args.get("sharing", "none")
    if sharing not in self.SHARINGS:
      raise ValueError(
          f"unknown Linformer sharing {sharing!r}; valid: {', '.join(self.SHARINGS)}.")
    rank = int(args.get("k", 32))
    init = nnx.initializers.normal(max_length ** -0.5)
    if sharing == "headwise":
      shape, names = (num_heads, max_length, rank), ("heads", "length", None)
    else:
      shape, names = (max_length, rank), ("length", None)
    self.proj_k = param(rngs, init, shape, names)
    self.proj_v = param(rngs, init, shape, names) if sharing in ("none", "headwise") else None

  @property
  def takes_inputs(self) -> bool:
    """Whether `linformer_from_inputs` applies: length projections shared by the heads
    (`[max_length, k]`; per-head ones are `[H, max_length, k]`)."""
    return self.proj_k[...].ndim == 2

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del length, rng  # the primitive uses the first L rows of the [.., max_length, k] arrays
    proj_k = self.proj_k[...]
    return {"proj_k": proj_k, "proj_v": proj_k if self.proj_v is None else self.proj_v[...]}


class SynthesizerParams(Extras):
  """Synthesizer parameter arrays, one set per head, and the learned mixture of components.

  `components` (config): "+"-joined names from dense, random, factorized_dense,
  factorized_random, dot_product; LRA's encoder default is "random+dot_product". `k`: rank of
  factorized_random; `hidden`: width of the dense MLP. With several components, their weights are
  a learned `[H, C]` mixture under a softmax over C, as in the paper.
  """

  CONSUMES = ("components", "k", "hidden")

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs, layer_index: int = 0):
    del layer_index
    import math
    from attention import synthesizer
    names = tuple(str(args.get("components", "random+dot_product")).split("+"))
    unknown = [n for n in names if n not in synthesizer.COMPONENTS]
    if unknown or not names:
      raise ValueError(f"unknown synthesizer components {unknown}; valid: "
                       f"{', '.join(synthesizer.COMPONENTS)} (join several with '+').")
    self.names = tuple(n for n in synthesizer.COMPONENTS if n in names)
    h, d, n = num_heads, head_dim, max_length
    normal, zeros = nnx.initializers.normal(1.0), nnx.initializers.zeros_init()
    scaled = lambda fan_in: nnx.initializers.normal(fan_in ** -0.5)
    if "dense" in self.names:
      f = int(args.get("hidden", d))
      self.dense = nnx.Dict({
          "w1": param(rngs, scaled(d), (h, d, f), ("heads", "head_dim", None)),
          "b1": param(rngs, zeros, (h, f), ("heads", None)),
          "w2": param(rngs, scaled(f), (h, f, n), ("heads", None, "length")),
          "b2": param(rngs, zeros, (h, n), ("heads", "length"))})
    if "random" in self.names:
      self.random = param(rngs, normal, (h, n, n), ("heads", "length", None))
    if "factorized_dense" in self.names:
      fa = int(math.ceil(math.sqrt(n)))
      fb = -(-n // fa)
      self.factorized_dense = nnx.Dict({
          "wa": param(rngs, scaled(d), (h, d, fa), ("heads", "head_dim", None)),
          "ba": param(rngs, zeros, (h, fa), ("heads", None)),
          "wb": param(rngs, scaled(d), (h, d, fb), ("heads", "head_dim", None)),
          "bb": param(rngs, zeros, (h, fb), ("heads", None))})
    if "factorized_random" in self.names:
      rank = int(args.get("k", 32))
      self.factorized_random = nnx.Dict({
          "r1": param(rngs, scaled(rank ** 0.5), (h, n, rank), ("heads", "length", None)),
          "r2": param(rngs, scaled(rank ** 0.5), (h, n, rank), ("heads", "length", None))})
    if len(self.names) > 1:
      self.mix = param(rngs, zeros, (h, len(self.names)), ("heads", None))

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del length, rng
    out: dict[str, Any] = {}
    for name in self.names:
      if name == "dot_product":
        out["dot_product"] = True
      else:
        value = getattr(self, name)
        out[name] = ({k: v[...] for k, v in value.items()} if isinstance(value, nnx.Dict)
                     else value[...])
    if len(self.names) > 1:
      out["mix"] = jax.nn.softmax(self.mix[...], axis=-1)                 # [H, C]
    return out


class LshKey(Extras):
  """LSH hashes with fresh rotations each step (from the step key) and a fixed key in eval."""

  CONSUMES = ()

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs, layer_index: int = 0):
    del args, num_heads, head_dim, max_length, layer_index
    self.eval_key = Buffer(jax.random.key_data(rngs.params()))

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del length
    key = jax.random.wrap_key_data(self.eval_key[...]) if rng is None else rng
    return {"key": key}


class EntmaxAlpha(Extras):
  """entmax's alpha: `alpha` (config) "learned" gives one per head, alpha = 1 + sigmoid(a) in
  (1, 2) (Correia et al. 2019's parametrisation), a initialised at 0 (alpha = 1.5); a number in
  [1, 2] fixes it for every head (1 softmax, 2 sparsemax) and owns no parameter."""

  CONSUMES = ("alpha",)

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs, layer_index: int = 0):
    del head_dim, max_length, layer_index
    alpha = args.get("alpha", "learned")
    self.fixed = None
    if alpha != "learned":
      try:
        self.fixed = float(alpha)
      except (TypeError, ValueError):
        self.fixed = -1.0
      if not 1 <= self.fixed <= 2:
        raise ValueError(f"entmax alpha must be 'learned' or a number in [1, 2], got {alpha!r}.")
      return
    self.logit = param(rngs, nnx.initializers.zeros_init(), (num_heads,), ("heads",))

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del length, rng
    if self.fixed is not None:
      return {"alpha": self.fixed}
    return {"alpha": 1 + jax.nn.sigmoid(self.logit[...])}


class AdaptiveSpan(Extras):
  """Adaptive span's z per head (Sukhbaatar et al. 2019), z = S * p with p one parameter per
  head: `span_init` (config, default 0, the paper's) tokens, p clipped to [0, 1] where used
  (the trainer also projects p into [0, 1] after each update, as the paper clamps it;
  docs/adaptive.md says why that matters); `penalty` is the L1 weight the trainer's loss
  multiplies the sum of the spans by (`penalty_terms`). `train_span=False` keeps every span at
  `span_init` (no gradient, no penalty): the same model at a fixed span. The band's window is
  a static shape, S + R as built (exact at every span); the trainer lowers it to `window_for`
  the current spans before each step (`span_windows`, `set_windows`), so the cost follows
  the spans."""

  CONSUMES = ("max_span", "penalty", "ramp", "span_init", "train_span")

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs, layer_index: int = 0):
    del head_dim, layer_index
    self.max_span = int(args.get("max_span") or max_length)
    self.ramp = int(args.get("ramp") or 32)
    self.penalty = float(args.get("penalty") or 0.0)
    self.num_heads = num_heads
    self.train_span = args.get("train_span", True)
    if not isinstance(self.train_span, bool):
      raise ValueError(f"adaptive_span train_span must be true or false, got "
                       f"{self.train_span!r}.")
    self.window = self.max_span + self.ramp
    # The primitive's query block (`block_size` is forwarded to it): the windows' rounding grid.
    self.block = int(args.get("block_size") or default_block_size(self.max_span + self.ramp))
    # z = S * p with p the parameter, as the paper's code: an optimizer step moves z by about
    # S * learning rate tokens (z itself as the parameter would move by ~1e-3 tokens a step).
    init = float(args.get("span_init") or 0.0) / self.max_span
    self.span = param(rngs, nnx.initializers.constant(init), (num_heads,), ("heads",))

  def spans(self) -> jax.Array:
    """z per head in tokens, clipped to [0, S] (held where `train_span` is false); the clip's
    derivative is 1 at 0 and 1 included (`adaptive_span.clamp`), the authors' at their start."""
    p = self.span[...] if self.train_span else jax.lax.stop_gradient(self.span[...])
    return self.max_span * adaptive_span.clamp(p, 0.0, 1.0)

  def window_for(self, p) -> int:
    """The smallest band window exact for the parameter values `p` (concrete, `[H]`):
    ceil(max z) + R rounded up to a block."""
    z = self.max_span * np.clip(np.asarray(p, np.float64), 0.0, 1.0)
    return adaptive_span.span_window(z, self.ramp, self.max_span, self.block)

  def penalty_terms(self) -> jax.Array:
    """The paper's L1 term of this layer: penalty / M * sum of its clipped spans (M heads per
    layer; the model's penalty sums the layers, as the paper's lambda / M * sum over all z)."""
    if not self.train_span:
      return jnp.zeros(())
    return self.penalty / self.num_heads * jnp.sum(self.spans())

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del length, rng
    return {"span": self.spans(), "max_span": self.max_span, "ramp": self.ramp,
            "window": self.window}


def penalty(model: nnx.Module) -> jax.Array:
  """The sum of every extras module's `penalty_terms()` in `model` (adaptive span's L1 on the
  spans), added by the trainer to the loss it differentiates; 0.0 when there is none."""
  terms = [m.penalty_terms() for _, m in nnx.iter_graph(model)
           if isinstance(m, Extras) and hasattr(m, "penalty_terms")]
  return sum(terms, jnp.zeros(()))


# Parameters kept in a range after every update, by (owner attribute, parameter name): adaptive
# span's p in [0, 1] (the paper clamps it after each optimizer step).
PROJECTED = {("extras", "span"): (0.0, 1.0)}


def _bounds(path) -> tuple[float, float] | None:
  names = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
  names = names[:-1] if names and names[-1] == "value" else names
  return PROJECTED.get(names[-2:])


def decayed(params: Any) -> Any:
  """Bools like `params`: False for the parameters of `PROJECTED` (adaptive span's spans, which
  the paper regularises by its L1 term only), True for the rest; the weight decay's mask."""
  return jax.tree_util.tree_map_with_path(lambda path, _: _bounds(path) is None, params)


def project(params: Any) -> Any:
  """`params` (a state or any pytree of them) with every parameter of `PROJECTED` clipped into
  its range; the trainer applies it after each update. Clipping in the forward pass alone is not
  the same: below 0 its gradient is 0, and adaptive span's L1 term pushed spans starting at 0
  there for good (docs/adaptive.md)."""
  def one(path, x):
    bounds = _bounds(path)
    return x if bounds is None else jnp.clip(x, *bounds)
  return jax.tree_util.tree_map_with_path(one, params)


def span_layers(model: nnx.Module) -> dict[tuple, AdaptiveSpan]:
  """The model's adaptive-span modules by their path in the model's graph."""
  return {tuple(path): m for path, m in nnx.iter_graph(model) if isinstance(m, AdaptiveSpan)}


def span_parameters(params: Any, paths) -> list[Any]:
  """The span parameter p of each adaptive-span module at `paths`, read from a params state."""
  out = []
  for path in paths:
    node = params
    for key in (*path, "span"):
      node = node[key]
    out.append(node[...] if isinstance(node, nnx.Variable) else node)
  return out


def span_windows(layers: dict[tuple, AdaptiveSpan], values) -> tuple[tuple[tuple, int], ...]:
  """(path, window) of each layer for its span parameter values (concrete, in `layers`' order):
  the static argument of the trainer's steps."""
  return tuple((path, m.window_for(p)) for (path, m), p in zip(layers.items(), values))


def set_windows(model: nnx.Module, windows: tuple[tuple[tuple, int], ...]) -> None:
  """Sets each adaptive-span module's band window, as `span_windows` gives them (a smaller one
  would drop keys inside the ramp: only windows computed from the parameters used are exact)."""
  layers = span_layers(model)
  for path, window in windows:
    layers[path].window = int(window)


class BigBirdSeed(Extras):
  """BigBird's random blocks are fixed by an int seed: `seed` (config) plus the layer index, so
  layers differ and training and evaluation use the same pattern."""

  CONSUMES = ("seed",)

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs, layer_index: int = 0):
    del num_heads, head_dim, max_length, rngs
    self.seed = int(args.get("seed", 0)) * 1009 + int(layer_index)

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del length, rng
    return {"seed": self.seed}


class BlockSparseLayout(Extras):
  """A static block layout for `block_sparse`, built from the length at trace time: each query
  block sees `window_blocks` blocks on each side, and the first `global_blocks` blocks see and
  are seen by every block."""

  CONSUMES = ("window_blocks", "global_blocks")

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs, layer_index: int = 0):
    del num_heads, head_dim, max_length, rngs, layer_index
    self.block_size = int(args["block_size"]) if "block_size" in args else None
    self.window_blocks = int(args.get("window_blocks", 1))
    self.global_blocks = int(args.get("global_blocks", 1))
    if self.block_size is None:
      raise ValueError("block_sparse needs block_size (tokens per block) in its arguments.")

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del rng
    nb = -(-length // self.block_size)
    n = np.arange(nb)
    layout = np.abs(n[:, None] - n[None, :]) <= self.window_blocks      # [nb, nb]
    layout |= (n[None, :] < self.global_blocks) | (n[:, None] < self.global_blocks)
    return {"layout": layout}


def extras_class(kind: str) -> type[Extras] | None:
  """The extras class named by `kind`'s record, or None when the kind needs none."""
  name = kinds.get(kind).extras
  if name is None:
    return None
  cls = globals().get(name)
  if not (isinstance(cls, type) and issubclass(cls, Extras)):
    raise ValueError(f"attention {kind!r} names extras {name!r}, which is not an Extras class "
                     f"in models.attention_extras.")
  return cls


def make_extras(kind: str, args: dict, *, num_heads: int, head_dim: int, max_length: int,
                rngs: nnx.Rngs, layer_index: int = 0) -> Extras | None:
  """Builds the extras module for `kind`, or None when the kind needs none."""
  cls = extras_class(kind)
  if cls is None:
    return None
  return cls(args, num_heads=num_heads, head_dim=head_dim, max_length=max_length, rngs=rngs,
             layer_index=layer_index)


def consumed_args(kind: str) -> tuple[str, ...]:
  """Config arguments of `kind` that the layer consumes instead of forwarding."""
  cls = extras_class(kind)
  return cls.CONSUMES if cls is not None else ()
