"""attention/compat.py: the one shim between the jax versions we run on (0.10.2 pinned, 0.11.x
on the GPU machine), and that no other module reaches into jax's private or shrinking APIs."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_version_range():
  assert compat.version_tuple("0.11.2") == (0, 11, 2)
  assert compat.version_tuple("0.11.2.dev20260801+cuda13") == (0, 11, 2)
  assert compat.supported((0, 10, 2)) and compat.supported((0, 11, 2))
  assert not compat.supported((0, 10, 1)) and not compat.supported((0, 12, 0))
  assert compat.supported()          # the installed jax


def test_is_tracer():
  seen = []
  jax.jit(lambda x: seen.append(compat.is_tracer(x)) or x)(jnp.ones(3))
  jax.grad(lambda x: seen.append(compat.is_tracer(x)) or x.sum())(jnp.ones(3))
  assert seen == [True, True]
  assert not compat.is_tracer(jnp.ones(3)) and not compat.is_tracer(np.ones(3))


def test_dce_jaxpr_and_jaxpr_types():
  def f(x):
    y = jax.lax.scan(lambda c, _: (c @ c, None), x, None, length=2)[0]
    unused = x @ x.T                     # dead for the first output only
    return y, unused

  closed = jax.make_jaxpr(f)(jnp.ones((4, 4)))
  pruned, used_inputs = compat.dce_jaxpr(closed.jaxpr, [True, False])
  assert used_inputs == [True]
  assert len(pruned.eqns) == len(closed.jaxpr.eqns) - 2   # the transpose and its matmul
  closed_type, open_type = compat.jaxpr_types()
  assert isinstance(closed, closed_type) and isinstance(pruned, open_type)
  scan = next(e for e in pruned.eqns if e.primitive.name == "scan")
  assert isinstance(scan.params["jaxpr"], closed_type)


def test_band_refuses_traced_global_mask_through_compat():
  from attention import band_attention
  q = jnp.ones((1, 8, 1, 4))
  glob = jnp.zeros((1, 8), bool).at[:, 0].set(True)
  with pytest.raises(ValueError, match="pass max_global"):
    jax.jit(lambda g: band_attention(q, q, q, window=2, global_mask=g))(glob)


def test_no_private_or_removed_jax_api_outside_compat():
  pattern = re.compile(r"jax\._src|jax\.core\.|jax\.interpreters|jax\.extend\.core")
  offenders = []
  for folder in ("attention", "models", "lra", "launch", "benchmarks"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
      for name in files:
        path = os.path.join(dirpath, name)
        if not name.endswith(".py") or path.endswith(os.path.join("attention", "compat.py")):
          continue
        with open(path) as f:
          for n, line in enumerate(f, 1):
            if pattern.search(line.split("#")[0]):
              offenders.append(f"{os.path.relpath(path, ROOT)}:{n}")
  assert not offenders, offenders


class _Device:
  def __init__(self, capability):
    self.compute_capability = capability


@pytest.mark.parametrize("reported, expected", [
    ("9.0", (9, 0)), ("8.6", (8, 6)), ("10.0", (10, 0)), ("12", (12, 0)), ("", None),
    (None, None)])
def test_gpu_compute_capability_reads_the_devices_string(monkeypatch, reported, expected):
  monkeypatch.setattr(compat.jax, "devices", lambda platform=None: [_Device(reported)])
  assert compat.gpu_compute_capability() == expected


def test_gpu_compute_capability_is_none_without_a_gpu(monkeypatch):
  def no_gpu(platform=None):
    raise RuntimeError(f"Unknown backend {platform}")
  monkeypatch.setattr(compat.jax, "devices", no_gpu)
  assert compat.gpu_compute_capability() is None
  monkeypatch.setattr(compat.jax, "devices", lambda platform=None: [])
  assert compat.gpu_compute_capability() is None
