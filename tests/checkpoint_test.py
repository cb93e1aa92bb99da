"""Tests for lra/checkpoint.py: round trip with shardings, fallback past a corrupt step, and a
clear error (never a silent fresh start) when no checkpoint restores."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from lra import checkpoint, mesh as mesh_lib


def make_state(value: float, mesh):
  w = jax.device_put(jnp.full((8, 4), value), NamedSharding(mesh, P("data", None)))
  return {"params": {"w": w}, "step": jax.device_put(jnp.int32(value), NamedSharding(mesh, P()))}


@pytest.fixture
def mesh():
  return mesh_lib.make_mesh({"data": -1})


def test_round_trip_keeps_values_shardings_and_data_state(tmp_path, mesh):
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=2, keep=2)
  assert ckpt.restore_latest(checkpoint.abstract_like(make_state(0, mesh))) is None
  for step in (1, 2, 3, 4, 6):
    ckpt.save(step, make_state(step, mesh), {"pos": step})
  assert ckpt.steps() == [4, 6]                      # period 2, keep 2
  state, data, step = ckpt.restore_latest(checkpoint.abstract_like(make_state(0, mesh)))
  assert step == 6 and data == {"pos": 6}
  np.testing.assert_array_equal(state["params"]["w"], np.full((8, 4), 6.0))
  assert state["params"]["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
  ckpt.close()


def test_corrupt_latest_step_falls_back_to_the_previous_one(tmp_path, mesh):
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
  for step in (1, 2):
    ckpt.save(step, make_state(step, mesh), {"pos": step})
  shutil.rmtree(tmp_path / "2" / "state")
  state, data, step = ckpt.restore_latest(checkpoint.abstract_like(make_state(0, mesh)))
  assert step == 1 and data == {"pos": 1}
  np.testing.assert_array_equal(state["params"]["w"], np.ones((8, 4)))


def test_fallback_warning_is_loud(tmp_path, mesh, capsys):
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
  for step in (1, 2):
    ckpt.save(step, make_state(step, mesh), {"pos": step})
  data_files = list((tmp_path / "2" / "data").iterdir())
  assert data_files
  for path in data_files:
    path.write_text("{not json")
  _, _, step = ckpt.restore_latest(checkpoint.abstract_like(make_state(0, mesh)))
  out = capsys.readouterr().out
  assert step == 1
  assert "WARNING" in out and "step 2" in out and "falling back" in out


def test_no_restorable_checkpoint_is_an_error_not_a_fresh_start(tmp_path, mesh):
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
  ckpt.save(1, make_state(1, mesh), {"pos": 1})
  other_shape = {"params": {"w": jax.ShapeDtypeStruct((3, 3), jnp.float32,
                                                      sharding=NamedSharding(mesh, P()))},
                 "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}
  with pytest.raises(checkpoint.CheckpointError, match="could be restored"):
    ckpt.restore_latest(other_shape)


def test_partial_step_directory_is_an_error(tmp_path, mesh):
  os.makedirs(tmp_path / "5.orbax-checkpoint-tmp-123" / "state")
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
  with pytest.raises(checkpoint.CheckpointError, match="none is a finished checkpoint"):
    ckpt.restore_latest(checkpoint.abstract_like(make_state(0, mesh)))
