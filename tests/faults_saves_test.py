"""Faults around the saves of `lra run` (issue 36): a damaged `best/` checkpoint (F7) and a
diverged train state (F10), each through the real command in a child process, then the rerun.

F7: a run stopped at step 8 (SIGTERM) whose `best/` is then damaged must resume (the training
checkpoint is intact), warn in one line, move the damaged copy aside, and finish identical to
an uninterrupted run (final checkpoint checksums, every metrics record, results.json).
F10: parameters turned NaN after step 10 (a save step that is neither a log nor an evaluation
step) must not be checkpointed: the run ends in one line naming the step a rerun resumes from,
and the rerun without the fault (the suggested fix) finishes identical to the reference.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.soak_kill import final_checksums, records, results  # noqa: E402

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file

STEPS = 12
TINY = ["--config.data.num_train=96", "--config.data.num_val=32", "--config.data.num_test=32",
        "--config.data.max_length=24", "--config.data.gen_min_length=4",
        "--config.data.gen_max_length=25", "--config.model.emb_dim=16",
        "--config.model.qkv_dim=16", "--config.model.mlp_dim=32",
        "--config.model.classifier_dim=16", "--config.model.num_layers=1",
        "--config.batch_size=16", "--config.eval_batch_size=16",
        f"--config.num_train_steps={STEPS}", "--config.warmup_steps=2", "--config.log_every=3",
        "--config.eval_every=4", "--config.checkpoint_every=2", "--config.progress=false"]

# argv: fault, step, then the `lra` command line. Faults: none, sigterm (after train step
# `step`), nan (the parameters become NaN from train step `step` on).
DRIVER = textwrap.dedent("""
    import os, signal, sys
    fault, at = sys.argv[1], int(sys.argv[2])
    import jax, jax.numpy as jnp
    from lra import train
    init = train.Trainer.__init__
    def faulty_init(self, config, plan=None):
      init(self, config, plan)
      step_fn = self.train_step
      def step(state, batch, rest):
        state, sums = step_fn(state, batch, rest)
        if fault == "nan" and int(state["step"]) >= at:
          state = {**state, "params": jax.tree.map(lambda x: x * jnp.nan, state["params"])}
        if fault == "sigterm" and int(state["step"]) == at:
          os.kill(os.getpid(), signal.SIGTERM)
        return state, sums
      self.train_step = step
    train.Trainer.__init__ = faulty_init
    from launch import cli
    sys.exit(cli.main(sys.argv[3:]))
    """)


def run(workdir, data_dir, fault="none", at=0):
  env = {**os.environ, "LRA_DATA": data_dir, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  args = ["run", "listops", "--size", "small", "--workdir", workdir, *TINY]
  return subprocess.run([sys.executable, "-c", DRIVER, fault, str(at), *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("data"))
  workdir = str(tmp_path_factory.mktemp("reference") / "run")
  done = run(workdir, data_dir)
  assert done.returncode == 0, done.stderr[-3000:]
  return workdir, data_dir


def assert_same_as_reference(workdir, reference):
  ref = reference[0]
  assert final_checksums(workdir, STEPS) == final_checksums(ref, STEPS)
  assert records(workdir) == records(ref)
  assert results(workdir) == results(ref)


def damage(step_dir):
  """Truncates every data file of a checkpoint step's arrays to half its size."""
  for folder, _, names in os.walk(os.path.join(step_dir, "state")):
    if os.path.basename(folder) == "d":
      for name in names:
        path = os.path.join(folder, name)
        with open(path, "r+b") as f:
          f.truncate(os.path.getsize(path) // 2)


def test_damaged_best_falls_back_and_finishes_identical(reference, tmp_path):
  workdir = str(tmp_path / "run")
  stopped = run(workdir, reference[1], "sigterm", 8)
  assert stopped.returncode == 130, stopped.stderr[-3000:]
  best_dir = os.path.join(workdir, "best")
  (best_step,) = [n for n in os.listdir(best_dir) if n.isdigit()]
  damage(os.path.join(best_dir, best_step))
  again = run(workdir, reference[1])
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  warnings = [x for x in again.stdout.splitlines() if "best checkpoint" in x]
  assert len(warnings) == 1 and f"rebuilt from step {best_step}" in warnings[0], again.stdout
  assert "Traceback" not in again.stdout + again.stderr
  assert os.path.isdir(os.path.join(workdir, "best.damaged", best_step))   # kept, aside
  assert_same_as_reference(workdir, reference)


def test_diverged_state_is_never_saved_and_a_rerun_recovers(reference, tmp_path):
  workdir = str(tmp_path / "run")
  diverged = run(workdir, reference[1], "nan", 10)
  assert diverged.returncode == 2, diverged.stdout[-3000:] + diverged.stderr[-3000:]
  err = diverged.stderr.strip().splitlines()
  assert len(err) == 1 and "diverged" in err[0] and "step 8" in err[0], diverged.stderr
  steps = sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints"))
                 if n.isdigit())
  assert steps[-1] == 8                                  # step 10 (NaN) was not saved
  again = run(workdir, reference[1])                     # the fix: rerun without the fault
  assert again.returncode == 0, again.stderr[-3000:]
  assert "at step 8" in again.stdout
  assert_same_as_reference(workdir, reference)


def test_a_sigterm_stop_of_a_diverged_state_saves_nothing(reference, tmp_path):
  """The save at a stop is checked too (it is forced, off the saving period)."""
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  driver = DRIVER.replace('if fault == "sigterm" and', 'if fault == "nan" and')
  env = {**os.environ, "LRA_DATA": reference[1], "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  done = subprocess.run([sys.executable, "-c", driver, "nan", "5", "run", "listops", "--size",
                         "small", "--workdir", workdir, *TINY], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
  assert "diverged" in done.stderr and "step 4" in done.stderr
  steps = sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints"))
                 if n.isdigit())
  assert steps == [2, 4]                                 # the stop at step 5 saved nothing
