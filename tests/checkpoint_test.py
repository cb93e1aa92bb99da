"""Tests for lra/checkpoint.py: round trip with shardings, fallback past a corrupt or damaged step
(checksums of the arrays), unfinished saves removed, and a clear error (never a silent fresh
start) when no checkpoint restores."""

import json
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
  assert "WARNING" in out and "step 2" in out and "trying the previous step" in out


@pytest.mark.parametrize("edit", [
    ("train_iterator", "next_index", 3),          # the data position
    ("train_sums", "loss_sum", 1.5),              # the open window's metric sums
    ("best", "accuracy", 0.99),                   # a best checkpoint's validation record
])
def test_an_edited_data_value_is_refused_like_a_damaged_array(tmp_path, mesh, capsys, edit):
  """The `data` item's JSON is checksummed: one changed value makes the step unusable (one
  warning line) and the previous step is restored."""
  group, key, value = edit
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
  for step in (1, 2):
    data = {"train_iterator": {"next_index": 4 * step}, "train_sums": {"loss_sum": 0.5 * step},
            "best": {"accuracy": 0.25 * step, "step": step}}
    ckpt.save(step, make_state(step, mesh), data)
  (path,) = [p for p in (tmp_path / "2" / "data").iterdir() if p.name == "metadata"]
  saved = json.loads(path.read_text())
  assert saved[group][key] != value
  saved[group][key] = value
  path.write_text(json.dumps(saved))
  _, data, step = ckpt.restore_latest(checkpoint.abstract_like(make_state(0, mesh)))
  out = capsys.readouterr().out
  assert step == 1 and data["train_iterator"] == {"next_index": 4}
  assert out.count("\n") == 1 and "WARNING: checkpoint step 2" in out
  assert "data/metadata values" in out and "do not match the checksum" in out


def test_the_data_checksum_follows_the_json_values():
  a = {"train_iterator": {"next_index": 4}, "train_sums": {"loss": 0.1, "n": np.float32(2)}}
  assert checkpoint.data_digest(a) == checkpoint.data_digest(json.loads(json.dumps(
      {**a, "train_sums": {"loss": 0.1, "n": 2.0}})))
  assert checkpoint.data_digest(a) != checkpoint.data_digest(
      {**a, "train_iterator": {"next_index": 5}})
  assert checkpoint.data_digest({"x": 1, "y": 2}) == checkpoint.data_digest({"y": 2, "x": 1})


def test_no_restorable_checkpoint_is_an_error_not_a_fresh_start(tmp_path, mesh):
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
  ckpt.save(1, make_state(1, mesh), {"pos": 1})
  other_shape = {"params": {"w": jax.ShapeDtypeStruct((3, 3), jnp.float32,
                                                      sharding=NamedSharding(mesh, P()))},
                 "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}
  with pytest.raises(checkpoint.CheckpointError, match="could be restored"):
    ckpt.restore_latest(other_shape)


def test_unfinished_saves_are_removed_and_never_counted(tmp_path, mesh, capsys):
  # A save killed (or out of disk) before orbax renamed its temporary folder.
  os.makedirs(tmp_path / "5.orbax-checkpoint-tmp-123" / "state")
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
  assert "Removed unfinished checkpoint saves" in capsys.readouterr().out
  assert not (tmp_path / "5.orbax-checkpoint-tmp-123").exists()
  assert ckpt.restore_latest(checkpoint.abstract_like(make_state(0, mesh))) is None
  ckpt.save(3, make_state(3, mesh), {"pos": 3})
  os.makedirs(tmp_path / "4.orbax-checkpoint-tmp-9" / "state")
  again = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
  _, data, step = again.restore_latest(checkpoint.abstract_like(make_state(0, mesh)))
  assert (step, data) == (3, {"pos": 3}) and os.listdir(tmp_path) == ["3"]


def _largest_array_file(step_dir):
  files = [os.path.join(d, f) for d, _, names in os.walk(step_dir / "state") for f in names
           if os.sep + "d" + os.sep in os.path.join(d, f) + os.sep or d.endswith(os.sep + "d")]
  return max(files, key=os.path.getsize)


def test_a_flipped_byte_in_the_array_data_is_never_loaded(tmp_path, mesh, capsys):
  # Whichever byte of the array file is flipped, the restore either refuses step 2 (and uses
  # step 1) or, when the byte is not read at all, gives step 2's exact values: never changed
  # values. Some of the flips must be caught.
  big = lambda v: {"w": jax.device_put(jnp.arange(4096, dtype=jnp.float32) * v,
                                       NamedSharding(mesh, P("data")))}
  caught = 0
  for i, fraction in enumerate((0.1, 0.3, 0.5, 0.7, 0.9, 0.99)):
    folder = tmp_path / str(i)
    ckpt = checkpoint.Checkpointer(str(folder), every=1, keep=3)
    for step in (1, 2):
      ckpt.save(step, big(step), {"pos": step})
    path = _largest_array_file(folder / "2")
    data = bytearray(open(path, "rb").read())
    data[int(len(data) * fraction)] ^= 0x10
    open(path, "wb").write(bytes(data))
    state, _, step = ckpt.restore_latest(checkpoint.abstract_like(big(0)))
    ckpt.close()
    np.testing.assert_array_equal(state["w"], np.arange(4096, dtype=np.float32) * step)
    if step == 1:
      caught += 1
      assert "checkpoint step 2" in capsys.readouterr().out
  assert caught >= 3


def test_arrays_that_do_not_match_their_checksums_are_refused(tmp_path, mesh, monkeypatch,
                                                               capsys):
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
  ckpt.save(1, make_state(1, mesh), {"pos": 1})
  real = checkpoint.checksums
  monkeypatch.setattr(checkpoint, "checksums",
                      lambda state: {**real(state), "state": "0" * 32})  # as if damaged later
  ckpt.save(2, make_state(2, mesh), {"pos": 2})
  _, data, step = ckpt.restore_latest(checkpoint.abstract_like(make_state(0, mesh)))
  assert (step, data) == (1, {"pos": 1})
  out = capsys.readouterr().out
  assert "step 2" in out and "do not match the checksums" in out and out.count("\n") == 1


def test_checkpoints_without_checksums_still_restore(tmp_path, mesh, monkeypatch):
  monkeypatch.setattr(checkpoint, "CHECKSUMS", "unused")  # written as by earlier versions
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
  ckpt.save(1, make_state(1, mesh), {"pos": 1})
  monkeypatch.undo()
  _, data, step = ckpt.restore_latest(checkpoint.abstract_like(make_state(0, mesh)))
  assert step == 1 and data["pos"] == 1


def test_fingerprint_ignores_sharding_and_sees_one_bit(mesh):
  x = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
  tree = {"a": jnp.asarray(x), "b": jnp.arange(5, dtype=jnp.int32),
          "c": jnp.ones((3,), jnp.bfloat16)}
  sharded = {**tree, "a": jax.device_put(tree["a"], NamedSharding(mesh, P("data", None)))}
  assert checkpoint.fingerprint(tree) == checkpoint.fingerprint(sharded)
  flipped = x.copy()
  flipped.view(np.uint32)[3, 2] ^= 1 << 7
  assert checkpoint.fingerprint({**tree, "a": jnp.asarray(flipped)}) != \
      checkpoint.fingerprint(tree)
  swapped = x.copy()
  swapped[[0, 1]] = swapped[[1, 0]]                       # same values, other places
  assert checkpoint.fingerprint({**tree, "a": jnp.asarray(swapped)}) != \
      checkpoint.fingerprint(tree)


def test_load_params_refuses_damaged_parameters(tmp_path, mesh, monkeypatch):
  real = checkpoint.checksums
  monkeypatch.setattr(checkpoint, "checksums",
                      lambda state: {**real(state), "params": "0" * 32})
  ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), every=1, keep=3)
  ckpt.save(1, make_state(1, mesh), {"pos": 1})
  ckpt.close()
  with pytest.raises(checkpoint.CheckpointError, match="do not match the checksums"):
    checkpoint.load_params(str(tmp_path), checkpoint.abstract_like(make_state(0, mesh)["params"]))


def test_only_event_loop_closed_errors_are_dropped_and_from_before_a_restore(monkeypatch, capsys):
  """tensorstore reports a read that a failed restore abandoned through `sys.excepthook` from its
  own thread, possibly before the failure reaches the caller: the filter is in place as soon as
  a restore or save starts, and passes every other error on."""
  import sys
  import threading
  seen = []
  monkeypatch.setattr(sys, "excepthook", lambda kind, error, tb: seen.append(str(error)))
  monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(str(args.exc_value)))
  with checkpoint._quiet_orbax():
    sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
    sys.excepthook(RuntimeError, RuntimeError("something else"), None)

    def fail(message):
      raise RuntimeError(message)
    for message in ("Event loop is closed", "a thread's own error"):
      thread = threading.Thread(target=fail, args=(message,))
      thread.start()
      thread.join()
  assert seen == ["something else", "a thread's own error"]


def test_after_a_failed_restore_unawaited_coroutine_warnings_are_dropped(recwarn):
  """A failed restore abandons orbax's reads; their coroutines, collected unawaited, warned on
  stderr after the command's one error line. Other warnings still show."""
  import warnings
  with warnings.catch_warnings():
    with pytest.raises(ValueError):
      with checkpoint._quiet_orbax():
        raise ValueError("restore failed")
    warnings.warn("coroutine 'read' was never awaited", RuntimeWarning)
    warnings.warn("something else", RuntimeWarning)
  assert [str(w.message) for w in recwarn] == ["something else"]


def test_asyncio_reports_of_abandoned_reads_are_dropped_from_the_start_of_a_restore(caplog):
  """orbax's loop may collect a failed read's task, and asyncio report "Task exception was never
  retrieved", before the failure reaches the caller: CI once saw that report above the command's
  one error line. Inside the block asyncio's errors are dropped; after a success they show again;
  after a failure they stay dropped (the abandoned reads may still be collected)."""
  import logging
  asyncio_logger = logging.getLogger("asyncio")
  level = asyncio_logger.level
  try:
    with caplog.at_level(logging.DEBUG):
      asyncio_logger.setLevel(logging.NOTSET)
      with checkpoint._quiet_orbax():
        asyncio_logger.error("Task exception was never retrieved (inside)")
      asyncio_logger.error("an asyncio error after a successful restore")
      with pytest.raises(ValueError):
        with checkpoint._quiet_orbax():
          raise ValueError("restore failed")
      asyncio_logger.error("Task exception was never retrieved (after the failure)")
    messages = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert messages == ["an asyncio error after a successful restore"]
  finally:
    asyncio_logger.setLevel(level)
