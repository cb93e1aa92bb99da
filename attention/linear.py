"""Kernelized (linear) attention and the chunked causal prefix-sum code it shares with FAVOR+.

A kernelized attention replaces softmax weights exp(q.k / sqrt(d)) by a dot product of
non-negative features phi(q).phi(k), so that

    out_i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j)

can be computed as phi(q_i) S / phi(q_i) z with S = sum_j phi(k_j) v_j^T `[M, Dv]` and
z = sum_j phi(k_j) `[M]`: linear in length instead of quadratic.

`linear_attention` is the elu(x) + 1 feature map of Katharopoulos et al. 2020 ("Transformers are
RNNs"). `attention.favor` builds the Performer's random features and calls the kernels here (its
causal softmax kernel has its own, per-feature stabilised, chunked sums).

Causal mode sums only keys j <= i. It is computed by chunked prefix sums: the sequence is cut
into chunks of C positions; inside a chunk a masked `[C, C]` matmul phi(q) phi(k)^T handles the
pairs of the same chunk, and the keys of earlier chunks enter through a carried state (S, z)
summed per chunk. Nothing of size `[L, M, Dv]` is ever formed (only `[L / C, M, Dv]`), and the
loop runs over chunks, never over tokens. The feature-level functions work head-major
(`[B, H, L, ...]`), the layout XLA's dots want; `linear_attention` takes the usual `[B, L, H, D]`.

Keys may carry a log-scale (`key_log_scale`): key j's true feature vector is
phi_k[j] * exp(key_log_scale[j]). The causal code keeps every sum relative to the running
maximum M_i = max_{j <= i} key_log_scale[j] (a cumulative max, so position i depends on no later
position) and rescales per query, which cancels exactly between numerator and denominator.
(FAVOR+'s softmax kernel no longer uses it: one scale per key cannot keep its denominators away
from underflow, so `attention.favor` shifts per feature.)

Precision (`check_precision`): "exact" keeps every feature map and contraction in float32;
"fast" gives the contractions bfloat16 operands with float32 accumulation, forward and backward
(`contract`), so they run on the tensor cores; sums, states and denominators stay float32.
"auto", the default, is "fast" on a GPU or TPU and "exact" elsewhere.

Padding: a key with `key_mask` False has its features zeroed before any sum, so it is absent
from numerator and denominator alike. A query with no real key (or, when causal, none at or
before it) has a zero denominator and outputs exactly 0; padded queries output 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attention import validation
from attention.dot_product import NEG_INF

# Chunk length of the causal prefix sums when the caller gives none.
DEFAULT_CHUNK_SIZE = 128
# Precision settings of the feature maps and contractions (`check_precision`).
PRECISIONS = ("auto", "exact", "fast")
# Operand dtype of the "fast" contractions (accumulation and every statistic stay float32).
FAST_DTYPE = jnp.bfloat16
# Platforms on which "auto" means "fast": those with bfloat16 matrix units.
FAST_PLATFORMS = ("gpu", "tpu")


def check_precision(precision: str) -> str:
  """Resolves a precision setting to "exact" or "fast".

  "exact": float32 operands (FAVOR+'s feature projection at `Precision.HIGHEST`), the path
  every test's float64 reference is checked against. "fast": the feature projection and the
  contractions (key states, readout, causal chunk matmuls) take bfloat16 operands with float32
  accumulation (`preferred_element_type`), in the forward and the backward pass, so they run
  on the tensor cores; feature exponents, maxima, exps, normalisers and carried states stay
  float32. "auto" (the default of the kinds): "fast" when `jax.default_backend()` is a GPU or
  a TPU, else "exact" (so on a CPU the result is what the exact path gives).
  """
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got "
                     f"{precision!r}: 'exact' for float32 feature maps and contractions, 'fast' "
                     f"for bfloat16 operands with float32 accumulation.")
  if precision == "auto":
    return "fast" if jax.default_backend() in FAST_PLATFORMS else "exact"
  return precision


def contract(spec: str, x: jax.Array, y: jax.Array, fast: bool) -> jax.Array:
  """`jnp.einsum(spec, x, y)`; with `fast`, of x and y rounded to `FAST_DTYPE` with float32
  accumulation, and the same in the backward pass (float32 result and gradients)."""
  if not fast:
    return jnp.einsum(spec, x, y)
  return _fast_einsum(spec, x.astype(jnp.float32), y.astype(jnp.float32))


def _fast_dot(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.einsum(spec, x.astype(FAST_DTYPE), y.astype(FAST_DTYPE),
                    preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fast_einsum(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
  return _fast_dot(spec, x, y)


def _fast_einsum_fwd(spec, x, y):
  xb, yb = x.astype(FAST_DTYPE), y.astype(FAST_DTYPE)
  return _fast_dot(spec, xb, yb), (xb, yb)


def _fast_einsum_bwd(spec, res, g):
  """dx = g . y and dy = g . x as einsums of bfloat16 operands (autodiff of a mixed-dtype dot
  would run them in float32)."""
  xb, yb = res
  ins, out = spec.split("->")
  xs, ys = ins.split(",")
  g = g.astype(FAST_DTYPE)
  return _fast_dot(f"{out},{ys}->{xs}", g, yb), _fast_dot(f"{out},{xs}->{ys}", g, xb)


_fast_einsum.defvjp(_fast_einsum_fwd, _fast_einsum_bwd)


def check_chunk_size(chunk_size: int | None) -> int:
  """Checks `chunk_size` (None for the default, else a positive int) and returns it."""
  if chunk_size is None:
    return DEFAULT_CHUNK_SIZE
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
    raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}.")
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int (e.g. 128), got {chunk_size}.")
  return int(chunk_size)


def _normalise(num: jax.Array, den: jax.Array) -> jax.Array:
  """num `[..., L, Dv]` / den `[..., L]`, with exactly 0 where den is 0 (no key)."""
  has = den > 0
  return jnp.where(has[..., None], num / jnp.where(has, den, 1.0)[..., None], 0.0)


def bidirectional_linear_attention(phi_q: jax.Array, phi_k: jax.Array, v: jax.Array,
                                   fast: bool = False) -> jax.Array:
  """Non-causal kernelized attention from features, head-major; float32 `[B, H, Lq, Dv]`.

  Arrays are head-major (`[B, H, L, ...]`, the layout in which every matmul here has its batch
  axes in front; the `[B, L, H, ...]` layout costs 2-3x in XLA:CPU's dots).

  Args:
    phi_q: `[B, H, Lq, M]` non-negative query features (any per-query scale cancels).
    phi_k: `[B, H, Lk, M]` non-negative key features, zero for padded keys.
    v: `[B, H, Lk, Dv]` values, zero for padded keys.
    fast: bfloat16 operands, float32 accumulation (`contract`); the normaliser z rides along
      as a column of ones appended to v, so each of the two contractions is one matmul.
  """
  phi_q, phi_k, v = (x.astype(jnp.float32) for x in (phi_q, phi_k, v))
  if fast:
    ones = jnp.ones(v.shape[:-1] + (1,), jnp.float32)
    s = contract("bhlm,bhld->bhmd", phi_k, jnp.concatenate([v, ones], axis=-1), True)
    num_den = contract("bhlm,bhmd->bhld", phi_q, s, True)             # [B, H, Lq, Dv + 1]
    return _normalise(num_den[..., :-1], num_den[..., -1])
  s = jnp.einsum("bhlm,bhld->bhmd", phi_k, v)                 # [B, H, M, Dv]
  z = jnp.sum(phi_k, axis=2)                                  # [B, H, M]
  num = jnp.einsum("bhlm,bhmd->bhld", phi_q, s)               # [B, H, Lq, Dv]
  den = jnp.einsum("bhlm,bhm->bhl", phi_q, z)                 # [B, H, Lq]
  return _normalise(num, den)


def _exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
  """Sum of the entries strictly before each index along `axis`."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (1, 0)
  summed = jnp.cumsum(x, axis=axis)
  return jax.lax.slice_in_dim(jnp.pad(summed, pad), 0, x.shape[axis], axis=axis)


def causal_linear_attention(phi_q: jax.Array, phi_k: jax.Array, v: jax.Array,
                            chunk_size: int | None = None,
                            key_log_scale: jax.Array | None = None,
                            fast: bool = False) -> jax.Array:
  """Causal kernelized attention by chunked prefix sums, head-major; float32 `[B, H, L, Dv]`.

  Query i uses keys j <= i only. Inside each chunk of `chunk_size` positions a masked
  `[C, C]` matmul covers the pairs of that chunk; earlier chunks enter through per-chunk states
  `[B, H, L / C, M, Dv]` combined by a prefix sum (a scan over chunks when `key_log_scale` is
  given). Padding the length to a multiple of C adds zero keys and queries that are dropped.

  Args:
    phi_q: `[B, H, L, M]` non-negative query features (any per-query scale cancels).
    phi_k: `[B, H, L, M]` non-negative key features, zero for padded keys.
    v: `[B, H, L, Dv]` values, zero for padded keys.
    chunk_size: chunk length C (None: `DEFAULT_CHUNK_SIZE`); results do not depend on it
      beyond rounding.
    key_log_scale: optional `[B, H, L]` float; key j's features are really
      `phi_k[j] * exp(key_log_scale[j])`. Use `NEG_INF` for padded keys. Treated as a constant
      by autodiff (a stabiliser).
    fast: bfloat16 operands, float32 accumulation in every matmul (`contract`).
  """
  chunk = check_chunk_size(chunk_size)
  if phi_q.shape != phi_k.shape or phi_q.shape[:3] != v.shape[:3]:
    raise ValueError(
        f"phi_q and phi_k must be [B, H, L, M] and v [B, H, L, Dv] with equal B, H, L; got "
        f"{tuple(phi_q.shape)}, {tuple(phi_k.shape)}, {tuple(v.shape)}.")
  return _causal_core(phi_q, phi_k, v, key_log_scale, chunk=chunk, fast=bool(fast))


@functools.partial(jax.jit, static_argnames=("chunk", "fast"))
def _causal_core(phi_q: jax.Array, phi_k: jax.Array, v: jax.Array,
                 key_log_scale: jax.Array | None, *, chunk: int,
                 fast: bool = False) -> jax.Array:
  num, den = causal_parts(phi_q, phi_k, v, key_log_scale, chunk=chunk, fast=fast)
  return _normalise(num, den)


def causal_parts(phi_q: jax.Array, phi_k: jax.Array, v: jax.Array,
                 key_log_scale: jax.Array | None = None, *, chunk: int,
                 prefix: tuple[jax.Array, jax.Array] | None = None,
                 fast: bool = False) -> tuple[jax.Array, jax.Array]:
  """The numerator `[B, H, L, Dv]` and denominator `[B, H, L]` of causal kernelized attention
  (`_causal_core` divides them). `prefix` (S `[B, H, M, Dv]`, z `[B, H, M]`, only without
  `key_log_scale`) holds the state of keys before position 0 (another device's), added to every
  query's sums. `fast`: every matmul of bfloat16 operands with float32 accumulation (the
  chunk's masked scores are rounded once more, as the operand of the scores-times-values
  matmul); prefix sums, scales and denominators float32."""
  dot = lambda spec, x, y: contract(spec, x, y, fast)
  b, h, length, m = phi_q.shape
  dv = v.shape[-1]
  chunk = min(chunk, -(-length // 8) * 8)                    # never more than one padded chunk
  n = -(-length // chunk)
  pad = n * chunk - length

  def to_chunks(x, fill=0.0):  # [B, H, L, ...] -> [B, H, N, C, ...]
    x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3),
                constant_values=fill)
    return x.reshape((b, h, n, chunk) + x.shape[3:])

  pq, pk, vc = to_chunks(phi_q), to_chunks(phi_k), to_chunks(v)   # [B, H, N, C, M|Dv]
  tril = np.tril(np.ones((chunk, chunk), bool))                    # [C, C], query >= key

  a = dot("bhncm,bhnsm->bhncs", pq, pk)                            # [B, H, N, C, C]
  if key_log_scale is None:
    a = jnp.where(tril, a, 0.0)
    states = dot("bhnsm,bhnsd->bhnmd", pk, vc)                     # [B, H, N, M, Dv]
    sums = jnp.sum(pk, axis=3)                                     # [B, H, N, M]
    prev_s = _exclusive_cumsum(states, axis=2)                     # keys of earlier chunks
    prev_z = _exclusive_cumsum(sums, axis=2)
    if prefix is not None:
      prev_s = prev_s + prefix[0][:, :, None].astype(jnp.float32)
      prev_z = prev_z + prefix[1][:, :, None].astype(jnp.float32)
    num_inter = dot("bhncm,bhnmd->bhncd", pq, prev_s)
    den_inter = dot("bhncm,bhnm->bhnc", pq, prev_z)
  else:
    ls = jax.lax.stop_gradient(to_chunks(key_log_scale, NEG_INF))  # [B, H, N, C]
    run = jax.lax.cummax(ls, axis=3)                               # running max inside chunk
    chunk_max = run[..., -1]                                       # [B, H, N]
    # Max over all earlier chunks (exclusive), then the running max M_i of every query.
    before = jax.lax.cummax(jnp.concatenate(
        [jnp.full_like(chunk_max[..., :1], NEG_INF), chunk_max[..., :-1]], axis=2), axis=2)
    m_i = jnp.maximum(run, before[..., None])                      # [B, H, N, C]
    # Intra-chunk: key j weighs exp(ls_j - M_i) <= 1 relative to query i's reference.
    rel = ls[..., None, :] - m_i[..., :, None]                     # [B, H, N, C, C]
    a = a * jnp.where(tril, jnp.exp(jnp.minimum(rel, 0.0)), 0.0)
    # Per-chunk states relative to the chunk's own max, carried relative to the running max.
    pkw = pk * jnp.exp(ls - chunk_max[..., None])[..., None]       # [B, H, N, C, M]
    states = dot("bhnsm,bhnsd->bhnmd", pkw, vc)                    # [B, H, N, M, Dv]
    sums = jnp.sum(pkw, axis=3)                                    # [B, H, N, M]

    def step(carry, xs):
      s_acc, z_acc, m_acc = carry
      s_n, z_n, m_n = xs
      m_new = jnp.maximum(m_acc, m_n)
      old, new = jnp.exp(m_acc - m_new), jnp.exp(m_n - m_new)      # [B, H]
      carry = (s_acc * old[..., None, None] + s_n * new[..., None, None],
               z_acc * old[..., None] + z_n * new[..., None], m_new)
      return carry, (s_acc, z_acc)

    init = (jnp.zeros((b, h, m, dv), jnp.float32), jnp.zeros((b, h, m), jnp.float32),
            jnp.full((b, h), NEG_INF, jnp.float32))
    _, (prev_s, prev_z) = jax.lax.scan(
        step, init, (jnp.moveaxis(states, 2, 0), jnp.moveaxis(sums, 2, 0),
                     jnp.moveaxis(chunk_max, 2, 0)))
    prev_s, prev_z = jnp.moveaxis(prev_s, 0, 2), jnp.moveaxis(prev_z, 0, 2)
    carry_w = jnp.exp(before[..., None] - m_i)                     # [B, H, N, C] <= 1
    num_inter = dot("bhncm,bhnmd->bhncd", pq, prev_s) * carry_w[..., None]
    den_inter = dot("bhncm,bhnm->bhnc", pq, prev_z) * carry_w

  num = dot("bhncs,bhnsd->bhncd", a, vc) + num_inter               # [B, H, N, C, Dv]
  den = jnp.sum(a, axis=-1) + den_inter                            # [B, H, N, C]
  return (num.reshape(b, h, n * chunk, dv)[:, :, :length],
          den.reshape(b, h, n * chunk)[:, :, :length])


def elu_features(x: jax.Array) -> jax.Array:
  """The elu(x) + 1 feature map of Katharopoulos et al., in float32 (positive everywhere)."""
  return jax.nn.elu(x.astype(jnp.float32)) + 1.0


def linear_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                     key_mask: jax.Array | None = None,
                     chunk_size: int | None = None, precision: str = "auto") -> jax.Array:
  """Linear attention with the elu(x) + 1 feature map (Katharopoulos et al. 2020).

  Args:
    q: `[B, Lq, H, D]` queries.
    k: `[B, Lk, H, D]` keys.
    v: `[B, Lk, H, Dv]` values.
    causal: query i uses keys j <= i (needs Lq == Lk), computed by chunked prefix sums.
    key_mask: optional bool `[B, Lk]`, True = real key. Padded keys are removed from the
      feature sums; with Lq == Lk padded queries output 0.
    chunk_size: chunk length of the causal prefix sums (None: `DEFAULT_CHUNK_SIZE`); unused
      when not causal.
    precision: "exact" (float32 features and contractions), "fast" (the contractions take
      bfloat16 operands with float32 accumulation: tensor cores) or "auto" ("fast" on a GPU or
      TPU, "exact" elsewhere); see `check_precision`.

  Returns:
    `[B, Lq, H, Dv]` in q's dtype. A query with no real key (at or before it when causal)
    outputs exactly 0.
  """
  b, lq, lk, h, d = validation.check_qkv(q, k, v, same_length=causal)
  validation.check_token_mask("key_mask", key_mask, b, lk)
  chunk = check_chunk_size(chunk_size)
  fast = check_precision(precision) == "fast"
  return _linear_attention(q, k, v, key_mask, causal=bool(causal), chunk=chunk, fast=fast)


@functools.partial(jax.jit, static_argnames=("causal", "chunk", "fast"))
def _linear_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None, *,
                      causal: bool, chunk: int, fast: bool = False) -> jax.Array:
  head_major = lambda x: jnp.swapaxes(x, 1, 2)                     # [B, L, H, .] <-> [B, H, L, .]
  phi_q, phi_k = elu_features(head_major(q)), elu_features(head_major(k))  # [B, H, L, D]
  v = head_major(v).astype(jnp.float32)
  if key_mask is not None:
    real = key_mask[:, None, :, None]                              # [B, 1, Lk, 1]
    phi_k, v = jnp.where(real, phi_k, 0.0), jnp.where(real, v, 0.0)
  if causal:
    out = _causal_core(phi_q, phi_k, v, None, chunk=chunk, fast=fast)
  else:
    out = bidirectional_linear_attention(phi_q, phi_k, v, fast=fast)
  if key_mask is not None and q.shape[1] == k.shape[1]:
    out = jnp.where(key_mask[:, None, :, None], out, 0.0)
  return head_major(out).astype(q.dtype)                           # [B, Lq, H, Dv]
