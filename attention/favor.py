"""Performer FAVOR+ attention (Choromanski et al. 2020): random-feature softmax attention.

softmax weights exp(q.k / sqrt(d)) are estimated without bias by positive random features

    phi(x)_r = exp(w_r.x' - |x'|^2 / 2) / sqrt(m),   x' = x d^{-1/4},   w_r ~ N(0, I_d),

so that E[phi(q).phi(k)] = exp(q.k / sqrt(d)), and the attention becomes linear in length (see
`attention.linear`). `favor_features` draws the `[m, d]` matrix W, by default with orthogonal
blocks (QR of Gaussian matrices with the sign correction that makes Q Haar-distributed, computed
by Gram-Schmidt, see `orthonormal_columns`; rows rescaled by the norms of independent Gaussian
vectors as in the paper), or i.i.d. Redrawing is the caller's choice: call it again with a new
key.

Numerical stabilisation, and why it is causal-safe. The exponents can be large, so each side is
shifted before `exp`, by amounts that cancel exactly:
  * query i is shifted by the max over features of its own exponents: a per-query factor, which
    cancels between numerator and denominator of that query;
  * key j is shifted by its own max s_j, and the factor exp(s_j) is given back in the sums
    relative to a reference. Bidirectionally the reference is the max of s over the real keys of
    the sequence (one factor per sequence and head, cancels). Causally it is the running max
    M_i = max_{j <= i} s_j: key j enters query i's sums with weight exp(s_j - M_i) <= 1, a
    per-query factor that cancels, and M_i depends on no position after i. (The reference code
    takes the key max over all positions and adds an epsilon after the shift, so future keys
    change past outputs.)
All feature math is float32 whatever the input dtype, and no additive epsilon is used, so the
estimate is exactly the ratio of the feature sums.

Padding: padded keys get zero features (the exponent is masked before `exp`, so gradients stay
finite) and zero values, so they are absent from numerator and denominator; they do not take part
in the key max either. A query with no real key outputs exactly 0; with self-attention lengths,
padded queries output 0.

`kernel="relu"` is the Performer's "generalized" attention: phi(x) = relu(W x') + 1e-3 (no
stabiliser needed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attention import linear, validation
from attention.dot_product import NEG_INF

KERNELS = ("softmax", "relu")
# Added to ReLU features so that every denominator is positive (as in the Performer code).
RELU_EPSILON = 1e-3


def _check_positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}.")
  return int(value)


def favor_features(key, num_features: int, head_dim: int, *, orthogonal: bool = True):
  """Draws the `[num_features, head_dim]` float32 random projection W of FAVOR+.

  Args:
    key: a `jax.random` key (or an int seed). A new key redraws the features.
    num_features: m, the number of random features (e.g. 256; the paper uses m ~ d log d).
    head_dim: d, the per-head dimension of q and k.
    orthogonal: draw ceil(m / d) blocks of d mutually orthogonal rows (the Q of a Gaussian
      matrix's QR with diag(R) > 0, so Q is Haar-distributed), keeping the first m rows,
      and rescale each row by the norm of an independent N(0, I_d) vector so every row has the
      marginal law of a Gaussian vector. False: i.i.d. N(0, I_d) rows.
  """
  m = _check_positive_int("num_features", num_features)
  d = _check_positive_int("head_dim", head_dim)
  if isinstance(key, (int, np.integer)):
    key = jax.random.key(int(key))
  if not orthogonal:
    return jax.random.normal(key, (m, d), jnp.float32)
  key_blocks, key_norms = jax.random.split(key)
  num_blocks = -(-m // d)
  g = jax.random.normal(key_blocks, (num_blocks, d, d), jnp.float32)
  q = orthonormal_columns(g)                                       # [nb, d, d]
  rows = jnp.swapaxes(q, -1, -2).reshape(num_blocks * d, d)[:m]    # orthonormal rows per block
  norms = jnp.linalg.norm(jax.random.normal(key_norms, (m, d), jnp.float32), axis=-1)
  return rows * norms[:, None]


def orthonormal_columns(g):
  """The Q factor of `g = QR` `[..., d, d]` with diag(R) > 0, by Gram-Schmidt without LAPACK.

  This is the QR of a Gaussian matrix with the sign correction (so Q is Haar-distributed), up to
  rounding. It is computed with matmuls only (classical Gram-Schmidt, each column orthogonalised
  twice, which keeps float32 columns orthonormal to ~1e-6), because a jitted program holding
  several `jnp.linalg.qr` calls next to other work can deadlock XLA:CPU's thread pool (seen with
  jax 0.10.2: a model whose layers each draw FAVOR+ features hung in its initialisation).
  """
  d = g.shape[-1]
  hi = jax.lax.Precision.HIGHEST

  def column(j, q):
    done = (jnp.arange(d) < j).astype(g.dtype)                     # columns already built
    basis = q * done                                               # [..., d, d]
    c = jnp.take(g, j, axis=-1)                                    # [..., d]
    for _ in range(2):
      coef = jnp.einsum("...ij,...i->...j", basis, c, precision=hi)
      c = c - jnp.einsum("...ij,...j->...i", basis, coef, precision=hi)
    c = c / jnp.linalg.norm(c, axis=-1, keepdims=True)
    return jax.lax.dynamic_update_index_in_dim(q, c[..., None], j, axis=-1)

  return jax.lax.fori_loop(0, d, column, jnp.zeros_like(g))


def check_features(features, head_dim: int) -> None:
  """Checks that `features` is an `[m, head_dim]` matrix drawn for this head dimension."""
  shape = tuple(np.shape(features))
  if len(shape) != 2 or shape[1] != head_dim or shape[0] < 1:
    raise ValueError(
        f"features must have shape [num_features, head_dim] = [m, {head_dim}] to match q and k, "
        f"got {shape}; draw them with attention.favor_features(key, num_features, "
        f"head_dim={head_dim}).")


def favor_attention(q, k, v, *, features, causal: bool = False, key_mask=None,
                    chunk_size: int | None = None, kernel: str = "softmax"):
  """FAVOR+ attention: linear-time estimate of softmax attention with random features.

  Args:
    q: `[B, Lq, H, D]` queries.
    k: `[B, Lk, H, D]` keys.
    v: `[B, Lk, H, Dv]` values.
    features: `[m, D]` projection from `favor_features` (shared by all heads; the caller owns it
      and redraws it by drawing again).
    causal: query i uses keys j <= i (needs Lq == Lk), by chunked prefix sums.
    key_mask: optional bool `[B, Lk]`, True = real key; padded keys are removed from the
      feature sums. With Lq == Lk, padded queries output 0.
    chunk_size: chunk length of the causal prefix sums (None: `attention.linear`'s default);
      unused when not causal.
    kernel: "softmax" (positive random features, unbiased for softmax) or "relu" (generalized
      attention, phi = relu(W x') + 1e-3).

  Returns:
    `[B, Lq, H, Dv]` in q's dtype. A query with no real key outputs exactly 0.
  """
  b, lq, lk, h, d = validation.check_qkv(q, k, v, same_length=causal)
  check_features(features, d)
  validation.check_token_mask("key_mask", key_mask, b, lk)
  if kernel not in KERNELS:
    raise ValueError(f"unknown FAVOR+ kernel {kernel!r}; valid kernels: {', '.join(KERNELS)}.")
  chunk = linear.check_chunk_size(chunk_size)
  return _favor(q, k, v, jnp.asarray(features), key_mask, causal=bool(causal), chunk=chunk,
                kernel=kernel)


def _softmax_exponents(x, w):
  """w_r.x' - |x'|^2 / 2 for x' = x d^{-1/4}: `[B, H, L, D]` -> float32 `[B, H, L, m]`."""
  x = x.astype(jnp.float32) * (x.shape[-1] ** -0.25)
  proj = jnp.einsum("bhld,md->bhlm", x, w)
  return proj - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)


@functools.partial(jax.jit, static_argnames=("causal", "chunk", "kernel"))
def _favor(q, k, v, features, key_mask, *, causal: bool, chunk: int, kernel: str):
  head_major = lambda x: jnp.swapaxes(x, 1, 2)                     # [B, L, H, .] <-> [B, H, L, .]
  w = features.astype(jnp.float32)                                 # [m, D]
  q, k, v = head_major(q), head_major(k), head_major(v).astype(jnp.float32)  # [B, H, L, D]
  real = None if key_mask is None else key_mask[:, None, :, None]  # [B, 1, Lk, 1]
  log_scale = None
  if kernel == "relu":
    scale = q.shape[-1] ** -0.25
    phi_q = jax.nn.relu(jnp.einsum("bhld,md->bhlm", q.astype(jnp.float32) * scale, w))
    phi_k = jax.nn.relu(jnp.einsum("bhld,md->bhlm", k.astype(jnp.float32) * scale, w))
    phi_q, phi_k = phi_q + RELU_EPSILON, phi_k + RELU_EPSILON
    if real is not None:
      phi_k = jnp.where(real, phi_k, 0.0)
  else:
    eq = _softmax_exponents(q, w)                                  # [B, H, Lq, m]
    phi_q = jnp.exp(eq - jax.lax.stop_gradient(jnp.max(eq, axis=-1, keepdims=True)))
    ek = _softmax_exponents(k, w)                                  # [B, H, Lk, m]
    s = jax.lax.stop_gradient(jnp.max(ek, axis=-1, keepdims=True))  # [B, H, Lk, 1] per key
    if real is not None:
      s = jnp.where(real, s, NEG_INF)
    if causal:
      shifted = ek - s                                             # key j relative to its max
      log_scale = s[..., 0]                                        # [B, H, Lk]
    else:
      ref = jnp.max(s, axis=2, keepdims=True)                      # [B, H, 1, 1] real keys
      shifted = ek - jnp.where(ref > NEG_INF / 2, ref, 0.0)
    if real is not None:
      shifted = jnp.where(real, shifted, NEG_INF)                  # masked before exp
    phi_k = jnp.exp(shifted)
  if real is not None:
    v = jnp.where(real, v, 0.0)
  if causal:
    out = linear.causal_linear_attention(phi_q, phi_k, v, chunk, key_log_scale=log_scale)
  else:
    out = linear.bidirectional_linear_attention(phi_q, phi_k, v)
  if key_mask is not None and q.shape[2] == k.shape[2]:
    out = jnp.where(key_mask[:, None, :, None], out, 0.0)
  return head_major(out).astype(q.dtype)                           # [B, Lq, H, Dv]
