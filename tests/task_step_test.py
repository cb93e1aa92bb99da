"""`benchmarks/task_step.py`: the step of a task config timed on a random batch of its shapes,
and the profile's operations listed with their shapes."""

from __future__ import annotations

import re

from benchmarks import task_step


def test_a_tiny_mqar_step_is_timed_and_its_operations_listed(capsys):
  assert task_step.main(["mqar", "--arg", "size=small,width=16", "--steps", "2", "--ops", "4",
                         "--config.data.max_length=32", "--config.data.num_kv_pairs=4",
                         "--config.batch_size=8",
                         "--config.eval_batch_size=8"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert re.fullmatch(r"mqar size=small,width=16: [\d.]+ ms/step, [\d.]+ steps/s \(2 steps\), "
                      r"first step [\d.]+ s", lines[0])
  assert len(lines) == 5
  for line in lines[1:]:
    assert re.fullmatch(r" *[\d.]+ ms  \S+  \S+", line), line
  times = [float(line.split()[0]) for line in lines[1:]]
  assert times == sorted(times, reverse=True)


def test_the_random_batch_has_the_specs_shapes_and_answers_inside_the_row():
  import jax
  import jax.numpy as jnp
  spec = {"inputs": jax.ShapeDtypeStruct((3, 16), jnp.int32),
          "mask": jax.ShapeDtypeStruct((3, 16), jnp.int32),
          "answers": jax.ShapeDtypeStruct((3, 4), jnp.int32)}
  batch = task_step.random_batch(spec)
  assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
      k: (s.shape, s.dtype) for k, s in spec.items()}
  assert ((batch["answers"] >= 0) & (batch["answers"] < 16)).all()
  assert (batch["inputs"] >= 1).all()
