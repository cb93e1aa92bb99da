"""The multi-head attention layer: owns the projections, calls a primitive by name.

`spec` is a dict such as `{"kind": "band", "window": 64, "dilation": (1, 1, 2, 2)}`: `kind` is a
name in `attention.kinds.KINDS` and every other entry is a keyword argument of that kind's
primitive (except `implementation`, the backend, and those the kind's extras class consumes;
see `models.attention_extras`). The
kind's record says whether it can be causal, whether q and k are one projection and which
extras class owns its per-layer arrays. The layer computes `q, k, v: [B, L, H, Dh]`, calls
the kind's function through its backend (`attention.backends.function(kind, implementation)`:
the kind's own portable function, or a kernel with the same keyword interface)
`(q, k, v, key_mask=..., **args)` and projects the heads back to `[B, L, E]`. A layer whose
backend is `splash` also passes the kernel's tiles (`tiles=`, from `config.model.splash`); no
other backend receives them.
A kind whose record names a `from_inputs` function is the exception when its extras allow it
(Linformer with length projections shared by the heads): the layer hands it the key and value
inputs and kernels (`attention.linformer.linformer_from_inputs`), which projects along the
length first, the same function with less work.

`positions` (from `config.model.pos_emb`, see docs/positions.md) adds position information
inside the layer, before the kind is called: "rotary" rotates q and k (`attention.rotary`);
"infused" adds sinusoids to the input of the q and k projections, not of v (Shortformer);
"relative" owns Transformer-XL's `w_r`, u and v and calls `attention.relative` (dense) or
appends the factorised relative features to q and k (band).

What pretrained checkpoints need (models/pretrained.py): `bias` adds a bias to the query, key,
value and output projections (BERT, RoBERTa, BART). A call may name global tokens
(`global_mask`, `[B, L]` bool), which a kind with global tokens (band: its record's arguments
include `max_global`) receives. With `global_projections` the layer also owns Longformer's
separate query, key and value projections of global tokens: each global token's output is
replaced by its attention to every real key through those projections (Hugging Face's
`LongformerSelfAttention._compute_global_attn_output_from_hidden`), while the other tokens
attend to global keys through the ordinary projections, inside the kind.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from attention import backends, kinds, validation
from attention import relative, rotary
from models import attention_extras, sequence, settings
from models.embeddings import sinusoidal_table
from models.settings import IN_LAYER
from models.sharding import param


def _kernel(rngs: nnx.Rngs, shape, names, fan_in: int, fan_out: int) -> nnx.Param:
  """A Xavier-uniform kernel with logical axis names."""
  limit = (6.0 / (fan_in + fan_out)) ** 0.5
  init = lambda key, s: jax.random.uniform(key, s, jnp.float32, -limit, limit)
  return param(rngs, init, shape, names)


def _splash_tiles(tiles: Any):
  """`attention.splash.Tiles` of `tiles` (a mapping such as `config.model.splash`, a `Tiles`,
  or None for the defaults); a bad field raises ValueError naming `config.model.splash`."""
  from attention import splash    # the TPU kernel's module: imported for splash layers only
  if tiles is not None and not isinstance(tiles, splash.Tiles):
    tiles = dict(tiles)
  try:
    return splash.splash_tiles(tiles)
  except ValueError as e:
    raise ValueError(f"config.model.splash.{e}") from None


def split_spec(spec: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
  """Returns (kind, args) from an attention spec dict; checks the kind exists. The spec's
  `implementation` (its backend, see `implementation_of`) is not an argument of the kind."""
  spec = dict(spec)
  spec.pop(settings.IMPLEMENTATION, None)
  if "kind" not in spec:
    raise ValueError(f"attention spec {spec} has no 'kind'; give one of: "
                     f"{', '.join(kinds.names())}.")
  kind = spec.pop("kind")
  kinds.get(kind)  # raises with the valid names when unknown
  return kind, spec


def implementation_of(spec: Mapping[str, Any]) -> str:
  """The backend an attention spec asks for: `auto` (the default) or a name in
  `attention.backends.IMPLEMENTATIONS`."""
  return str(spec.get(settings.IMPLEMENTATION) or backends.AUTO)


class MultiHeadAttention(nnx.Module):
  """Self-attention with `num_heads` heads of `qkv_dim // num_heads` features.

  Args:
    emb_dim: model width E.
    num_heads: H.
    qkv_dim: total query/key/value width H * Dh.
    spec: attention kind and its arguments (see module docstring).
    max_length: longest sequence the layer will see (sizes Linformer/Synthesizer arrays).
    causal: autoregressive attention (passed to the primitive as `causal=True`).
    shared_extras: an extras module shared with other layers (built by the encoder when the
      kind's extras class says `shared_across_layers`, e.g. Linformer `sharing="layer"`).
    layer_index: the layer's depth (seeds per-layer patterns such as BigBird's random blocks).
    global_tokens: the layer gives its kind global tokens (LED's encoder), which some backends
      cannot compute.
    bias: biases on the query, key, value and output projections.
    global_projections: Longformer's separate projections of global tokens (module docstring).
    tiles: the TPU splash kernel's tiles (`config.model.splash`: a mapping of
      `attention.splash.Tiles` fields, or a `Tiles`; None or empty: its defaults), given to the
      attention function only when the layer's backend is splash.

  The backend computing the attention (`attention.backends`) is chosen here, once: the spec's
  `implementation`, `auto` by default (by platform and pattern). Relative positions compute
  their attention with `xla` only.
  """

  def __init__(self, emb_dim: int, num_heads: int, qkv_dim: int, spec: Mapping[str, Any], *,
               max_length: int, causal: bool = False, shared_extras: nnx.Module | None = None,
               layer_index: int = 0, positions: Mapping[str, Any] | None = None,
               global_tokens: bool = False, bias: bool = False,
               global_projections: bool = False, tiles: Any = None, rngs: nnx.Rngs):
    settings.check_heads(num_heads, qkv_dim)
    self.kind, args = split_spec(spec)
    record = self.record = kinds.get(self.kind)
    if causal:
      record.check_causal()
    head_dim = qkv_dim // num_heads
    self.num_heads, self.head_dim, self.causal = num_heads, head_dim, causal
    self.shared_qk = record.shared_qk
    consumed = attention_extras.consumed_args(self.kind)
    self.args = {k: (tuple(v) if isinstance(v, list) else v)
                 for k, v in args.items() if k not in consumed}
    names = ("embed", "heads", "head_dim")
    shape = (emb_dim, num_heads, head_dim)
    self.query = _kernel(rngs, shape, names, emb_dim, qkv_dim)
    self.key = None if self.shared_qk else _kernel(rngs, shape, names, emb_dim, qkv_dim)
    self.value = _kernel(rngs, shape, names, emb_dim, qkv_dim)
    self.out = _kernel(rngs, (num_heads, head_dim, emb_dim), ("heads", "head_dim", "embed"),
                       qkv_dim, emb_dim)
    zeros = nnx.initializers.zeros_init()
    heads = lambda: param(rngs, zeros, (num_heads, head_dim), ("heads", "head_dim"))
    self.bias = bool(bias)
    if self.bias:
      self.query_bias, self.value_bias = heads(), heads()
      self.key_bias = None if self.shared_qk else heads()
      self.out_bias = param(rngs, zeros, (emb_dim,), ("embed",))
    self.global_projections = bool(global_projections)
    if self.global_projections:
      self.query_global, self.key_global, self.value_global = (
          _kernel(rngs, shape, names, emb_dim, qkv_dim) for _ in range(3))
      if self.bias:
        self.query_global_bias, self.key_global_bias, self.value_global_bias = (
            heads(), heads(), heads())
    positions = dict(positions or {})
    self.pos_kind = positions.get("kind", "none")
    self.pos_kind = self.pos_kind if self.pos_kind in IN_LAYER else "none"
    self.rotary_base = float(positions.get("rotary_base", rotary.DEFAULT_BASE))
    settings.check_rotary(self.pos_kind, num_heads, qkv_dim)
    if self.pos_kind == "relative":
      if record.relative is None:
        relative_kinds = kinds.names_where(lambda k: k.relative)
        raise ValueError(f"pos_emb='relative' works with attention "
                         f"{', '.join(relative_kinds[:-1])} and {relative_kinds[-1]}, "
                         f"not {self.kind!r}.")
      rel_dim = head_dim + head_dim % 2        # the sinusoid's width E (even)
      self.w_r = _kernel(rngs, (rel_dim, num_heads, head_dim), (None, "heads", "head_dim"),
                         rel_dim, qkv_dim)
      zeros = nnx.initializers.zeros_init()
      self.u = param(rngs, zeros, (num_heads, head_dim), ("heads", "head_dim"))
      self.v_bias = param(rngs, zeros, (num_heads, head_dim), ("heads", "head_dim"))
    requested = implementation_of(spec)
    if self.pos_kind == "relative" and requested not in (backends.AUTO, "xla"):
      raise ValueError(f"implementation={requested} with pos_emb='relative': relative positions "
                       f"are computed by the xla implementation only; use auto or xla.")
    self.takes_global = "max_global" in record.arguments
    global_tokens = global_tokens or (self.global_projections and self.takes_global)
    self.implementation = "xla" if self.pos_kind == "relative" else backends.choose(
        self.kind, self.args, implementation=requested, global_tokens=global_tokens,
        causal=causal)
    # The splash kernel's tiles (a frozen `attention.splash.Tiles`), None for other backends.
    self.tiles = _splash_tiles(tiles) if self.implementation == "splash" else None
    if shared_extras is not None:
      self.extras = shared_extras
    else:
      self.extras = attention_extras.make_extras(
          self.kind, args, num_heads=num_heads, head_dim=head_dim, max_length=max_length,
          rngs=rngs, layer_index=layer_index)

  def _takes_inputs(self) -> bool:
    """Whether the kind's `from_inputs` function can take the layer inputs instead of q, k, v
    (Linformer projects the inputs along the length before the key and value projections, the
    same function with less work: `attention.linformer.linformer_from_inputs`): when its extras
    say so (length projections shared by the heads), with unrotated keys and one device."""
    return (self.record.from_inputs is not None and self.pos_kind != "rotary" and not self.bias
            and bool(getattr(self.extras, "takes_inputs", False)) and sequence.devices() == 1)

  def _inputs_call(self, x, key_mask, rng):
    x_v = x                              # the value projection's input
    if self.pos_kind == "infused":       # positions in the q/k inputs only (Shortformer)
      x = x + jnp.asarray(sinusoidal_table(x.shape[1], x.shape[2]))[None].astype(x.dtype)
    q = jnp.einsum("ble,ehd->blhd", x, self.query[...].astype(x.dtype))  # [B, L, H, Dh]
    fn = getattr(importlib.import_module(self.record.module_path), self.record.from_inputs)
    out = fn(
        q, x, x_v, self.key[...], self.value[...], key_mask=key_mask,
        **self.extras(length=x.shape[1], rng=rng))
    return jnp.einsum("blhd,hde->ble", out, self.out[...].astype(out.dtype))

  def _project(self, x: jax.Array, name: str) -> jax.Array:
    """`[B, L, E]` -> `[B, L, H, Dh]` through the kernel `name` (and its bias, if any)."""
    out = jnp.einsum("ble,ehd->blhd", x, getattr(self, name)[...].astype(x.dtype))
    if self.bias and getattr(self, name + "_bias", None) is not None:
      out = out + getattr(self, name + "_bias")[...].astype(out.dtype)
    return out

  def _output(self, out: jax.Array) -> jax.Array:
    """`[B, L, H, Dh]` -> `[B, L, E]`: the output projection (and its bias)."""
    y = jnp.einsum("blhd,hde->ble", out, self.out[...].astype(out.dtype))
    return y + self.out_bias[...].astype(y.dtype) if self.bias else y

  def _global_rows(self, x, out, key_mask, global_mask):
    """`out` with each global token's row replaced by its attention to every real key through
    the global projections (Longformer's global attention; scores in float32)."""
    num = validation.global_slots(global_mask, self.args.get("max_global"))
    if num == 0:
      return out
    rank = jnp.cumsum(global_mask, axis=1) - 1                              # [B, L]
    sel = ((rank[:, None, :] == jnp.arange(num)[None, :, None])
           & global_mask[:, None, :]).astype(x.dtype)                       # [B, G, L]
    q = self._project(jnp.einsum("bgl,ble->bge", sel, x), "query_global")   # [B, G, H, Dh]
    k, v = self._project(x, "key_global"), self._project(x, "value_global")  # [B, L, H, Dh]
    scores = jnp.einsum("bghd,blhd->bhgl", q.astype(jnp.float32), k.astype(jnp.float32))
    scores = scores / jnp.sqrt(jnp.float32(self.head_dim))
    if key_mask is not None:
      scores = jnp.where(key_mask[:, None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)                               # [B, H, G, L]
    rows = jnp.einsum("bhgl,blhd->bghd", weights, v.astype(jnp.float32))     # [B, G, H, Dh]
    back = jnp.einsum("bgl,bghd->blhd", sel.astype(jnp.float32), rows)       # [B, L, H, Dh]
    return jnp.where(global_mask[:, :, None, None], back.astype(out.dtype), out)

  def __call__(self, x: jax.Array, key_mask: jax.Array | None, *, rng=None,
               global_mask: jax.Array | None = None) -> jax.Array:
    """x: `[B, L, E]`; key_mask: `[B, L]` bool (True = real token); rng: key or None (eval);
    global_mask: `[B, L]` bool global tokens, or None (module docstring)."""
    if global_mask is not None and not (self.takes_global or self.global_projections):
      raise ValueError(f"global tokens: attention {self.kind!r} has none; use band attention "
                       f"(or dense attention with Longformer's global projections).")
    if self._takes_inputs() and global_mask is None:
      return self._inputs_call(x, key_mask, rng)
    x_in = x
    v = self._project(x, "value")                                          # [B, L, H, Dh]
    if self.pos_kind == "infused":       # positions in the q/k inputs only (Shortformer)
      x = x + jnp.asarray(sinusoidal_table(x.shape[1], x.shape[2]))[None].astype(x.dtype)
    q = self._project(x, "query")                                          # [B, L, H, Dh]
    proj_k = lambda: self._project(x, "key")
    if self.pos_kind == "rotary":
      q = rotary.apply_rotary(q, self.rotary_base)
      k = None if self.shared_qk else rotary.apply_rotary(proj_k(), self.rotary_base)
    elif not self.shared_qk:
      k = proj_k()                                                         # [B, L, H, Dh]
    kwargs = dict(self.args)
    if self.extras is not None:
      kwargs.update(self.extras(length=x.shape[1], rng=rng))
    if self.causal:
      kwargs["causal"] = True
    if global_mask is not None and self.takes_global:
      kwargs["global_mask"] = global_mask
    if self.pos_kind == "relative":
      rel = dict(u=self.u[...], v_bias=self.v_bias[...], w_r=self.w_r[...])
      if self.record.relative == "dense" and sequence.devices() == 1 and global_mask is None:
        out = relative.relative_attention(q, k, v, key_mask=key_mask, **rel, **kwargs)
        return self._output(out)
      q, k = relative.factorised_qk(q, k, **rel)                         # [B, L, H, Dh + E]
    if sequence.devices() > 1:                                             # length split
      out = sequence.attend(self.kind, q, k, v, key_mask, kwargs)
      return self._output(out)
    if self.tiles is not None:
      kwargs["tiles"] = self.tiles
    fn = backends.function(self.kind, self.implementation)
    if self.shared_qk:
      out = fn(q, v, key_mask=key_mask, **kwargs)                          # [B, L, H, Dh]
    else:
      out = fn(q, k, v, key_mask=key_mask, **kwargs)                       # [B, L, H, Dh]
    if global_mask is not None and self.global_projections:
      out = self._global_rows(x_in, out, key_mask, global_mask)
    return self._output(out)                                               # [B, L, E]
