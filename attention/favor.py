"""Performer FAVOR+ attention (Choromanski et al. 2020): random-feature softmax attention.

softmax weights exp(q.k / sqrt(d)) are estimated without bias by positive random features

    phi(x)_r = exp(w_r.x' - |x'|^2 / 2) / sqrt(m),   x' = x d^{-1/4},   w_r ~ N(0, I_d),

so that E[phi(q).phi(k)] = exp(q.k / sqrt(d)), and the attention becomes linear in length (see
`attention.linear`). `favor_features` draws the `[m, d]` matrix W, by default with orthogonal
blocks (QR of Gaussian matrices with the sign correction that makes Q Haar-distributed, computed
by Gram-Schmidt, see `orthonormal_columns`; rows rescaled by the norms of independent Gaussian
vectors as in the paper), or i.i.d. Redrawing is the caller's choice: call it again with a new
key.

Numerical stabilisation, and why it is causal-safe. With a_ir = w_r.q_i' and
b_jr = w_r.k_j' - |k_j'|^2 / 2 (q_i's own -|q_i'|^2 / 2 is a factor of query i alone and cancels,
so it is left out), the estimate is

    out_i = sum_j sum_r exp(a_ir + b_jr) v_j / sum_j sum_r exp(a_ir + b_jr).

The exponents span far more than float32's range at large norms, and a query's largest a_ir and
a key's largest b_jr rarely fall on the same feature r, so every sum is taken relative to
per-feature references y_r of its keys: keys enter as exp(b_jr - y_r) with y_r the max of b_r over
the keys of the sum (<= 1, and 1 for that key), queries as exp(a_ir + y_r - x_i) with
x_i = max_r (a_ir + y_r) (<= 1, and 1 at that feature). y cancels in the product and x_i between
numerator and denominator, so both are constants for autodiff (`stop_gradient`, exact), and a
denominator is >= 1 whenever the query has a real key: nothing the backward divides by can
underflow. (Shifting each query and each key by its own max, as before, left denominators in
(0, 1e-19) or at 0 at 10x standard-normal inputs: NaN gradients, rows silently 0.)
Bidirectionally y is the per-feature max over the sequence's real keys. Causally the keys of
every sum lie at or before all of its queries, so no position depends on a later one, bit for
bit: query i with key i; inside a chunk (a power of two), for s = C/2, ..., 2, 1, the right half
of every block of 2 s positions with the left half's keys (each pair j < i of a chunk falls in
exactly one such block); earlier chunks through per-chunk states carried relative to the running
per-feature max of the chunks before. A query's parts are added relative to the largest of their
log-scales x. This costs one `exp` per query and feature per level (log2(C) levels) where the
earlier scheme had one in all. (The reference code takes the key max over all positions and adds
an epsilon after the shift, so future keys change past outputs.)
With `precision="exact"` all feature math is float32 whatever the input dtype (the projection
at `Precision.HIGHEST`), and no additive epsilon is used, so the estimate is exactly the ratio of
the feature sums. With `precision="fast"` (the default on a GPU or TPU, see
`linear.check_precision`) the projection and every contraction take bfloat16 operands with
float32 accumulation, forward and backward, so they run on the tensor cores: x is used as given
(bfloat16 inputs are exact) and d^{-1/4} is folded into W before W is rounded; the exponents,
|x'|^2 / 2, both max subtractions, the exps and every sum, state and denominator stay float32,
and the features (<= 1 after the shifts) are rounded to bfloat16 only as matmul operands. Each
exponent then errs by at most u sum_j |W_rj x'_j| (u = 2^-9, bfloat16's unit roundoff), each
feature, state and value operand by u relative; `tests/favor_test.py` checks outputs and
gradients against the exact path and a float64 transcription of the paper within that bound.

Padding: padded keys get zero features (the exponent is masked before `exp`, so gradients stay
finite) and zero values, so they are absent from numerator and denominator; they do not take part
in the key maxima either. A query with no real key outputs exactly 0; with self-attention lengths,
padded queries output 0.

`kernel="relu"` is the Performer's "generalized" attention: phi(x) = relu(W x') + 1e-3 (no
stabiliser needed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from attention import linear, validation
from attention.dot_product import NEG_INF

KERNELS = ("softmax", "relu")
# Partial sums of queries (numerator, denominator, log-scale) or a key state (S, z, t).
ThreeArrays = tuple[jax.Array, jax.Array, jax.Array]
# Added to ReLU features so that every denominator is positive (as in the Performer code).
RELU_EPSILON = 1e-3


def _check_positive_int(name: str, value: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}.")
  return int(value)


def favor_features(key: jax.Array | int, num_features: int, head_dim: int, *,
                   orthogonal: bool = True) -> jax.Array:
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


def orthonormal_columns(g: jax.Array) -> jax.Array:
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


def check_features(features: ArrayLike, head_dim: int) -> None:
  """Checks that `features` is an `[m, head_dim]` matrix drawn for this head dimension."""
  shape = tuple(np.shape(features))
  if len(shape) != 2 or shape[1] != head_dim or shape[0] < 1:
    raise ValueError(
        f"features must have shape [num_features, head_dim] = [m, {head_dim}] to match q and k, "
        f"got {shape}; draw them with attention.favor_features(key, num_features, "
        f"head_dim={head_dim}).")


def favor_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, features: ArrayLike,
                    causal: bool = False, key_mask: jax.Array | None = None,
                    chunk_size: int | None = None, kernel: str = "softmax",
                    precision: str = "auto") -> jax.Array:
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
      the softmax kernel takes the largest power of two <= chunk_size (and no longer than the
      sequence needs). Unused when not causal.
    kernel: "softmax" (positive random features, unbiased for softmax) or "relu" (generalized
      attention, phi = relu(W x') + 1e-3).
    precision: "exact" (float32 feature maps, the projection at `Precision.HIGHEST`), "fast"
      (bfloat16 operands with float32 accumulation in the projection and the contractions;
      stabilisers and statistics float32) or "auto" ("fast" on a GPU or TPU, else "exact").

  Returns:
    `[B, Lq, H, Dv]` in q's dtype. A query with no real key outputs exactly 0.
  """
  b, lq, lk, h, d = validation.check_qkv(q, k, v, same_length=causal)
  check_features(features, d)
  validation.check_token_mask("key_mask", key_mask, b, lk)
  if kernel not in KERNELS:
    raise ValueError(f"unknown FAVOR+ kernel {kernel!r}; valid kernels: {', '.join(KERNELS)}.")
  chunk = linear.check_chunk_size(chunk_size)
  fast = linear.check_precision(precision) == "fast"
  return _favor(q, k, v, jnp.asarray(features), key_mask, causal=bool(causal), chunk=chunk,
                kernel=kernel, fast=fast)


def _log_features(x: jax.Array, w: jax.Array, *, with_norm: bool,
                  fast: bool = False) -> jax.Array:
  """Exponents w_r.x' (- |x'|^2 / 2 if `with_norm`), x' = x d^{-1/4}: `[B, H, L, D]` -> float32
  `[B, H, L, m]`. Exact: the projection runs at full float32 precision: an error in an exponent
  is a relative error of the feature, and default-precision matmuls (TF32 on GPUs, bfloat16
  passes on TPUs) would err by ~1e-3 of |w| |x'|, units of the exponent at large norms. Fast:
  x and W d^{-1/4} rounded to bfloat16, float32 accumulation (the norm term stays float32)."""
  scale = x.shape[-1] ** -0.25
  if fast:
    proj = linear.contract("bhld,md->bhlm", x, w.astype(jnp.float32) * scale, True)
    if not with_norm:
      return proj
    x = x.astype(jnp.float32) * scale
    return proj - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)
  x = x.astype(jnp.float32) * scale
  proj = jnp.einsum("bhld,md->bhlm", x, w, precision=jax.lax.Precision.HIGHEST)
  return proj - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True) if with_norm else proj


@functools.partial(jax.jit, static_argnames=("causal", "chunk", "kernel", "fast"))
def _favor(q: jax.Array, k: jax.Array, v: jax.Array, features: jax.Array,
           key_mask: jax.Array | None, *, causal: bool, chunk: int, kernel: str,
           fast: bool = False) -> jax.Array:
  head_major = lambda x: jnp.swapaxes(x, 1, 2)                     # [B, L, H, .] <-> [B, H, L, .]
  w = features.astype(jnp.float32)                                 # [m, D]
  q, k, v = head_major(q), head_major(k), head_major(v).astype(jnp.float32)  # [B, H, L, D]
  real = None if key_mask is None else key_mask[:, None, :, None]  # [B, 1, Lk, 1]
  if real is not None:
    v = jnp.where(real, v, 0.0)
  if kernel == "relu":
    scale = q.shape[-1] ** -0.25
    if fast:
      phi_q = jax.nn.relu(linear.contract("bhld,md->bhlm", q, w * scale, True))
      phi_k = jax.nn.relu(linear.contract("bhld,md->bhlm", k, w * scale, True))
    else:
      phi_q = jax.nn.relu(jnp.einsum("bhld,md->bhlm", q.astype(jnp.float32) * scale, w))
      phi_k = jax.nn.relu(jnp.einsum("bhld,md->bhlm", k.astype(jnp.float32) * scale, w))
    phi_q, phi_k = phi_q + RELU_EPSILON, phi_k + RELU_EPSILON
    if real is not None:
      phi_k = jnp.where(real, phi_k, 0.0)
    if causal:
      out = linear.causal_linear_attention(phi_q, phi_k, v, chunk, fast=fast)
    else:
      out = linear.bidirectional_linear_attention(phi_q, phi_k, v, fast=fast)
  else:
    # |q'|^2 / 2 is a factor of query i alone: it cancels, and is left out.
    a = _log_features(q, w, with_norm=False, fast=fast)            # [B, H, Lq, m]
    b = _log_features(k, w, with_norm=True, fast=fast)             # [B, H, Lk, m]
    if real is not None:
      b = jnp.where(real, b, NEG_INF)                              # masked before any exp
    if causal:
      if real is None:
        real = jnp.ones((1, 1, k.shape[2], 1), bool)
      out = _causal_softmax(a, b, v, real[..., 0], _power_of_two_chunk(chunk, k.shape[2]),
                            fast)
    else:
      out = _bidirectional_softmax(a, b, v, real, fast)
  if key_mask is not None and q.shape[2] == k.shape[2]:
    out = jnp.where(key_mask[:, None, :, None], out, 0.0)
  return head_major(out).astype(q.dtype)                           # [B, Lq, H, Dv]


def _bidirectional_softmax(a: jax.Array, b: jax.Array, v: jax.Array,
                           real: jax.Array | None, fast: bool = False) -> jax.Array:
  """Positive-feature attention from exponents a `[B, H, Lq, m]`, b `[B, H, Lk, m]`."""
  y = jax.lax.stop_gradient(jnp.max(b, axis=2, keepdims=True))     # [B, H, 1, m] per feature
  phi_k = jnp.exp(b - y)                                           # <= 1, max 1 in every column
  if real is not None:
    phi_k = jnp.where(real, phi_k, 0.0)
  x = jax.lax.stop_gradient(jnp.max(a + y, axis=-1, keepdims=True))  # [B, H, Lq, 1] per query
  phi_q = jnp.exp(a + y - x)                                       # <= 1, max 1 in every row
  return linear.bidirectional_linear_attention(phi_q, phi_k, v, fast=fast)


def _power_of_two_chunk(chunk: int, length: int) -> int:
  """The largest power of two <= chunk, and no larger than the power of two >= length."""
  return min(1 << (chunk.bit_length() - 1), 1 << max(0, (length - 1).bit_length()))


def _merge(acc: ThreeArrays, part: ThreeArrays) -> ThreeArrays:
  """Adds two partial sums (num `[..., Dv]`, den `[...]`, log-scale x `[...]`) of one query."""
  (num0, den0, x0), (num1, den1, x1) = acc, part
  x = jnp.maximum(x0, x1)
  w0, w1 = jnp.exp(x0 - x), jnp.exp(x1 - x)
  return num0 * w0[..., None] + num1 * w1[..., None], den0 * w0 + den1 * w1, x


def _causal_softmax(a: jax.Array, b: jax.Array, v: jax.Array, real: jax.Array,
                    chunk: int, fast: bool = False) -> jax.Array:
  num, den, _ = causal_softmax_parts(a, b, v, real, chunk, fast=fast)
  has = den > 0                                                    # >= 1 when any real key
  return jnp.where(has[..., None], num / jnp.where(has, den, 1.0)[..., None], 0.0)


def causal_softmax_parts(a: jax.Array, b: jax.Array, v: jax.Array, real: jax.Array, chunk: int,
                         prefix: ThreeArrays | None = None,
                         fast: bool = False) -> ThreeArrays:
  """Causal positive-feature attention from exponents a, b `[B, H, L, m]` (b = NEG_INF at
  padded keys), v `[B, H, L, Dv]` (0 at padded keys), real `[B, 1, L]`; chunk a power of two.

  Every feature sum is taken relative to the per-feature max of its keys, and all those keys lie
  at or before every query of the sum: query i with key i (`_diagonal`); inside each dyadic block
  of 2 s positions of a chunk, the right half's queries with the left half's keys, for
  s = 1, 2, ..., C / 2; earlier chunks through states carried relative to their running
  per-feature max. The parts are added per query relative to their largest log-scale.

  Returns the numerator `[B, H, L, Dv]`, denominator `[B, H, L]` and log-scale `[B, H, L]` of
  every query (out = num / den). `prefix` (S `[B, H, m, Dv]`, z `[B, H, m]` relative to the
  per-feature reference t `[B, H, m]`) is a state of keys before position 0 (other devices'),
  added to every query relative to its own reference. `fast`: the matmuls take bfloat16
  operands with float32 accumulation (`linear.contract`).
  """
  bsz, h, length, _ = a.shape
  n = -(-length // chunk)
  pad = n * chunk - length

  def to_chunks(x, fill):  # [B, H, L, ...] -> [B, H, N, C, ...]
    x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3), constant_values=fill)
    return x.reshape(x.shape[:2] + (n, chunk) + x.shape[3:])

  a, b, v = to_chunks(a, 0.0), to_chunks(b, NEG_INF), to_chunks(v, 0.0)   # [B, H, N, C, .]
  real = to_chunks(real, False)                                    # [B, 1, N, C]
  acc = _diagonal(a, b, v, real)
  # Blocks of `size` keys, bottom-up: y [B, H, N, C / size, m] the max of each block's real keys;
  # phi_k [B, H, N, C, m] every key relative to its block's max (<= 1). Size 1: exp(b - b) = 1,
  # written 1 + (b - b) to keep the derivative of exp at 0 without computing an exp.
  y = jax.lax.stop_gradient(b)
  phi_k = jnp.where(real[..., None], 1.0 + (b - y), 0.0)
  size = 1
  while size < chunk:
    acc = _merge(acc, _left_to_right(a, phi_k, y, v, size, fast))
    # Up one level: a key's feature relative to its block of 2 * size. Only terms below 1e-38
    # of the block's largest (which the same queries see) can underflow.
    pairs = y.reshape(y.shape[:3] + (-1, 2) + y.shape[4:])         # [B, H, N, G, 2, m]
    y = jnp.max(pairs, axis=4)                                     # [B, H, N, G, m]
    scale = jnp.exp(pairs - y[:, :, :, :, None])                   # <= 1, no gradient
    phi_k = (phi_k.reshape(pairs.shape[:5] + (size, -1)) * scale[:, :, :, :, :, None]).reshape(
        phi_k.shape)
    size *= 2
  if n > 1 or prefix is not None:
    acc = _merge(acc, _earlier_chunks(a, phi_k, y[:, :, :, 0], v, prefix, fast))
  num, den, x = acc
  cut = lambda t: t.reshape((bsz, h, n * chunk) + t.shape[4:])[:, :, :length]
  return cut(num), cut(den), cut(x)


def _diagonal(a: jax.Array, b: jax.Array, v: jax.Array, real: jax.Array) -> ThreeArrays:
  """Query i with key i, exactly: the largest term of the feature sum is 1."""
  e = a + b                                                        # [B, H, N, C, m]
  x = jax.lax.stop_gradient(jnp.max(e, axis=-1))                   # [B, H, N, C]
  den = jnp.where(real, jnp.sum(jnp.exp(e - x[..., None]), axis=-1), 0.0)
  return den[..., None] * v, den, x


def _left_to_right(a: jax.Array, phi_k: jax.Array, y: jax.Array, v: jax.Array,
                   size: int, fast: bool = False) -> ThreeArrays:
  """In blocks of 2 * size positions, right-half queries with left-half keys: phi_k relative to
  y, the per-feature max of the left half (whose keys all come before the queries)."""
  bsz, h, n, chunk, _ = a.shape
  blocks = chunk // (2 * size)
  split = lambda x: x.reshape(x.shape[:3] + (blocks, 2, size) + x.shape[4:])
  aq, kl, vk = split(a)[:, :, :, :, 1], split(phi_k)[:, :, :, :, 0], split(v)[:, :, :, :, 0]
  ref = y.reshape(y.shape[:3] + (blocks, 2, 1) + y.shape[4:])[:, :, :, :, 0]  # [B, H, N, G, 1, m]
  x = jax.lax.stop_gradient(jnp.max(aq + ref, axis=-1))           # [B, H, N, G, S]
  phi_q = jnp.exp(aq + ref - x[..., None])                         # <= 1, max 1 in every row
  p = linear.contract("bhngim,bhngjm->bhngij", phi_q, kl, fast)   # [B, H, N, G, S, S]
  num, den = linear.contract("bhngij,bhngjd->bhngid", p, vk, fast), jnp.sum(p, axis=-1)
  right = lambda x, fill: jnp.stack([jnp.full_like(x, fill), x], axis=4).reshape(
      (bsz, h, n, chunk) + x.shape[5:])                            # left halves get nothing
  return right(num, 0.0), right(den, 0.0), right(x, NEG_INF)


def _earlier_chunks(a: jax.Array, phi_k: jax.Array, t: jax.Array, v: jax.Array,
                    prefix: ThreeArrays | None = None, fast: bool = False) -> ThreeArrays:
  """Queries of chunk n with the keys of chunks < n: per-chunk states (S, z) of phi_k (relative
  to the chunk's per-feature max t `[B, H, N, m]`), carried relative to their running max,
  starting from `prefix` (S, z, t) when given (else nothing)."""
  states = linear.contract("bhncm,bhncd->bhnmd", phi_k, v, fast)   # [B, H, N, m, Dv]
  sums = jnp.sum(phi_k, axis=3)                                    # [B, H, N, m]

  def step(carry, xs):
    s_acc, z_acc, t_acc = carry
    s_n, z_n, t_n = xs
    t_new = jnp.maximum(t_acc, t_n)
    old, new = jnp.exp(t_acc - t_new), jnp.exp(t_n - t_new)        # [B, H, m] <= 1
    carry = (s_acc * old[..., None] + s_n * new[..., None], z_acc * old + z_n * new, t_new)
    return carry, (s_acc, z_acc, t_acc)

  init = (jnp.zeros_like(states[:, :, 0]), jnp.zeros_like(sums[:, :, 0]),
          jnp.full_like(t[:, :, 0], NEG_INF)) if prefix is None else \
      tuple(x.astype(jnp.float32) for x in prefix)
  _, prev = jax.lax.scan(step, init, tuple(jnp.moveaxis(x, 2, 0) for x in (states, sums, t)))
  prev_s, prev_z, prev_t = (jnp.moveaxis(x, 0, 2) for x in prev)
  ref = prev_t[:, :, :, None]                                      # [B, H, N, 1, m]
  x = jax.lax.stop_gradient(jnp.max(a + ref, axis=-1))            # [B, H, N, C]
  phi_q = jnp.exp(a + ref - x[..., None])
  num = linear.contract("bhncm,bhnmd->bhncd", phi_q, prev_s, fast)
  den = linear.contract("bhncm,bhnm->bhnc", phi_q, prev_z, fast)
  return num, den, x
