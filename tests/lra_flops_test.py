"""benchmarks/lra_flops.py: the matrix-multiply count behind docs/efficiency.md's work table."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import lra_flops

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file


def _count(f, *args):
  return lra_flops.matmul_flops(jax.make_jaxpr(f)(*args).jaxpr)


def test_a_scan_counts_its_body_once_per_iteration_and_a_cond_its_largest_branch():
  x = jnp.ones((8, 16))
  w = jnp.ones((16, 16))
  one = 2 * 8 * 16 * 16
  assert _count(lambda x, w: x @ w, x, w) == one

  def scanned(x, w):
    return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=10)[0]
  assert _count(scanned, x, w) == 10 * one

  def branches(p, x, w):
    return jax.lax.cond(p, lambda: (x @ w) @ w, lambda: x @ w)
  assert _count(branches, True, x, w) == 2 * one

  def nested(x, w):                       # a jit inside a scan inside a jit
    inner = jax.jit(lambda c: c @ w @ w)
    return jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=3)[0]
  assert _count(jax.jit(nested), x, w) == 3 * 2 * one


def test_the_dense_step_adds_exactly_the_query_key_and_attention_work_to_identity():
  """The quick model (1 layer, width 32, 2 heads; batch 2, length 128): dense minus identity is
  the query and key projections and the two attention products, each forward matrix multiply
  counted three times (forward, the input's gradient, the other operand's gradient). The Text
  model reads through a CLS token, so a sequence of 128 bytes is 129 tokens."""
  b, length, e = 2, 128, 32
  tokens = length + 1
  out = {kind: lra_flops.count_point(kind, length, b, quick=True)["gflop"] * 1e9
         for kind in ("identity", "dot_product")}
  projections = 2 * (2 * b * tokens * e * e)           # queries and keys
  attention = 2 * (2 * b * tokens * tokens * e)         # scores and values, all heads
  assert round(out["dot_product"] - out["identity"]) == 3 * (projections + attention)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
  for args in (["--kinds", "nope"], ["--length", "0"], ["--times", str(tmp_path / "none")]):
    done = subprocess.run([sys.executable, "benchmarks/lra_flops.py", *args],
                          capture_output=True, text=True)
    assert done.returncode == 2, (args, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
