"""The multi-head attention layer: owns the projections, calls a primitive by name.

`spec` is a dict such as `{"kind": "band", "window": 64, "dilation": (1, 1, 2, 2)}`: `kind` is a
name in `attention.kinds.KINDS` and every other entry is a keyword argument of that kind's
primitive (except `implementation`, the backend, and those the kind's extras class consumes;
see `models.attention_extras`). The
kind's record says whether it can be causal, whether q and k are one projection and which
extras class owns its per-layer arrays. The layer computes `q, k, v: [B, L, H, Dh]`, calls
the kind's function through its backend (`attention.backends.function(kind, implementation)`:
the kind's own portable function, or a kernel with the same keyword interface)
`(q, k, v, key_mask=..., **args)` and projects the heads back to `[B, L, E]`.
A kind whose record names a `from_inputs` function is the exception when its extras allow it
(Linformer with length projections shared by the heads): the layer hands it the key and value
inputs and kernels (`attention.linformer.linformer_from_inputs`), which projects along the
length first, the same function with less work.

`positions` (from `config.model.pos_emb`, see docs/positions.md) adds position information
inside the layer, before the kind is called: "rotary" rotates q and k (`attention.rotary`);
"infused" adds sinusoids to the input of the q and k projections, not of v (Shortformer);
"relative" owns Transformer-XL's `w_r`, u and v and calls `attention.relative` (dense) or
appends the factorised relative features to q and k (band).
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from attention import backends, kinds
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

  The backend computing the attention (`attention.backends`) is chosen here, once: the spec's
  `implementation`, `auto` by default (by platform and pattern). Relative positions compute
  their attention with `xla` only.
  """

  def __init__(self, emb_dim: int, num_heads: int, qkv_dim: int, spec: Mapping[str, Any], *,
               max_length: int, causal: bool = False, shared_extras: nnx.Module | None = None,
               layer_index: int = 0, positions: Mapping[str, Any] | None = None,
               global_tokens: bool = False, rngs: nnx.Rngs):
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
    positions = dict(positions or {})
    self.pos_kind = positions.get("kind", "none")
    self.pos_kind = self.pos_kind if self.pos_kind in IN_LAYER else "none"
    self.rotary_base = float(positions.get("rotary_base", rotary.DEFAULT_BASE))
    settings.check_rotary(self.pos_kind, num_heads, qkv_dim)
    if self.pos_kind == "relative":
      if record.relative is None:
        relative_kinds = kinds.names_where(lambda k: k.relative)
        raise ValueError(f"pos_emb='relative' works with attention {' and '.join(relative_kinds)}"
                         f", not {self.kind!r}.")
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
    self.implementation = "xla" if self.pos_kind == "relative" else backends.choose(
        self.kind, self.args, implementation=requested, global_tokens=global_tokens,
        causal=causal)
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
    return (self.record.from_inputs is not None and self.pos_kind != "rotary"
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

  def __call__(self, x: jax.Array, key_mask: jax.Array | None, *, rng=None) -> jax.Array:
    """x: `[B, L, E]`; key_mask: `[B, L]` bool (True = real token); rng: key or None (eval)."""
    if self._takes_inputs():
      return self._inputs_call(x, key_mask, rng)
    v = jnp.einsum("ble,ehd->blhd", x, self.value[...].astype(x.dtype))  # [B, L, H, Dh]
    if self.pos_kind == "infused":       # positions in the q/k inputs only (Shortformer)
      x = x + jnp.asarray(sinusoidal_table(x.shape[1], x.shape[2]))[None].astype(x.dtype)
    q = jnp.einsum("ble,ehd->blhd", x, self.query[...].astype(x.dtype))  # [B, L, H, Dh]
    proj_k = lambda: jnp.einsum("ble,ehd->blhd", x, self.key[...].astype(x.dtype))
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
    if self.pos_kind == "relative":
      rel = dict(u=self.u[...], v_bias=self.v_bias[...], w_r=self.w_r[...])
      if self.record.relative == "dense" and sequence.devices() == 1:
        out = relative.relative_attention(q, k, v, key_mask=key_mask, **rel, **kwargs)
        return jnp.einsum("blhd,hde->ble", out, self.out[...].astype(out.dtype))
      q, k = relative.factorised_qk(q, k, **rel)                         # [B, L, H, Dh + E]
    if sequence.devices() > 1:                                             # length split
      out = sequence.attend(self.kind, q, k, v, key_mask, kwargs)
      return jnp.einsum("blhd,hde->ble", out, self.out[...].astype(out.dtype))
    fn = backends.function(self.kind, self.implementation)
    if self.shared_qk:
      out = fn(q, v, key_mask=key_mask, **kwargs)                          # [B, L, H, Dh]
    else:
      out = fn(q, k, v, key_mask=key_mask, **kwargs)                       # [B, L, H, Dh]
    return jnp.einsum("blhd,hde->ble", out, self.out[...].astype(out.dtype))  # [B, L, E]
