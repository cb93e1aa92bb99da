"""`lra launch slurm` (launch/slurm.py): the batch script it prints, run here as a two-task job.

`--dry_run` prints the script. The test runs that script with bash the way a SLURM node would:
with the job's variables sbatch sets (SLURM_JOB_ID, SLURM_NTASKS=2, SLURM_JOB_NODELIST, ...)
and a stand-in `srun` first on PATH that starts one process per task with the variables srun
sets (SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NODELIST, SLURM_STEP_NUM_NODES), each on 2 CPU
devices standing in for its GPUs. Nothing else is given to jax: `jax.distributed.initialize()`
finds the job through its SlurmCluster (jax/_src/clusters/slurm_cluster.py reads SLURM_JOB_ID,
SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID; the coordinator port comes
from the job id, which is chosen so that the port is free). The two tasks train a tiny ListOps
config as one job, and the final checkpoint holds the parameters of a one-process run. A
stand-in `sbatch` records the `--test-only` check and the submission of the same script.

The same launcher against a real SLURM cluster (CPU-only) is tests/slurm_launch_test.py; the
stand-ins here keep the GPU form of the script (`--gpus_per_node`), `--sbatch` options and the
one-line refusals of bad flags, which need no cluster.
"""

import os
import random
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import configs
from launch import cli
from lra import checkpoint, tasks, train

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file

jax.config.update("jax_disable_most_optimizations", True)  # compiles faster (as the tasks)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {   # tests/distributed_test.py's tiny ListOps config
    "data.num_train": 64, "data.num_val": 20, "data.num_test": 20, "data.max_length": 24,
    "data.gen_min_length": 4, "data.gen_max_length": 25,
    "model.emb_dim": 16, "model.qkv_dim": 16, "model.mlp_dim": 32, "model.classifier_dim": 16,
    "model.num_heads": 2, "model.num_layers": 1, "mesh.data": 4,
    "batch_size": 16, "eval_batch_size": 8, "num_train_steps": 4, "warmup_steps": 1,
    "learning_rate": 0.01, "log_every": 1, "eval_every": 2, "checkpoint_every": 2,
    "progress": False,
}
FLAGS = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]

SRUN = r'''
import os, shlex, subprocess, sys, time
with open(os.environ["STANDIN_RECORD"], "a") as f:
  f.write(shlex.join(["srun", *sys.argv[1:]]) + "\n")
args, opts = sys.argv[1:], {}
while args[0].startswith("--"):
  key, _, value = args.pop(0)[2:].partition("=")
  opts[key] = value
job, procs = os.environ["SLURM_JOB_ID"], []
for t in range(int(os.environ["SLURM_NTASKS"])):
  env = {**os.environ, "SLURM_PROCID": str(t), "SLURM_LOCALID": str(t), "SLURM_STEP_ID": "0",
         "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"],
         "SLURM_STEP_NUM_NODES": os.environ["SLURM_NNODES"],
         "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}   # CPU devices for the GPUs
  log = open(opts["output"].replace("%j", job).replace("%t", str(t)),
             "a" if opts.get("open-mode") == "append" else "w")
  procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT))
while any(p.poll() is None for p in procs):   # --kill-on-bad-exit=1
  if "kill-on-bad-exit" in opts and any(p.poll() not in (None, 0) for p in procs):
    for p in procs:
      if p.poll() is None:
        p.kill()
  time.sleep(0.1)
sys.exit(next((p.returncode for p in procs if p.returncode), 0))
'''

SBATCH = r'''
import os, shlex, sys
with open(os.environ["STANDIN_RECORD"], "a") as f:
  f.write(shlex.join(["sbatch", *sys.argv[1:]]) + "\n")
print("4242")
'''


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
  bin_dir = tmp_path_factory.mktemp("bin")
  for name, text in (("srun", SRUN), ("sbatch", SBATCH)):
    (bin_dir / name).write_text(f"#!{sys.executable}\n{textwrap.dedent(text)}")
    (bin_dir / name).chmod(0o755)
  return bin_dir


def job_id_with_a_free_port() -> int:
  """A job id whose coordinator port (SlurmCluster: id % 4096 + 61440) is free here."""
  for _ in range(100):
    job = random.randrange(1, 4096)
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", job + 61440))
      except OSError:
        continue
    return job
  raise RuntimeError("no free port in 61441..65535")


def launch_args(workdir, launch_dir, *extra) -> list[str]:
  return ["launch", "slurm", "--nodes", "1", "--gpus-per-node", "2", "--partition", "gpu",
          "--time", "30", "--launch_dir", str(launch_dir), "--sbatch", "mem=1G",
          "--sbatch", "exclusive",
          "--env", f"LRA_DATA={os.environ['LRA_DATA']}", "--env",
          "JAX_DISABLE_MOST_OPTIMIZATIONS=1", "--env", "JAX_DEFAULT_MATMUL_PRECISION=highest",
          *extra, "--", "run", "listops", "--size", "small", "--workdir", str(workdir), *FLAGS]


@pytest.fixture(scope="module")
def config():
  c = configs.build_config("listops", size="small",
                           overrides=[(k, str(v)) for k, v in OVERRIDES.items()])
  tasks.get_task("listops").prepare(c.data)  # once, before the tasks start: they share it
  return c


def test_the_dry_run_script_trains_two_tasks_as_one_job(standin, config, tmp_path, capsys):
  workdir, launch_dir = tmp_path / "workdir", tmp_path / "launch"
  assert cli.main(launch_args(workdir, launch_dir, "--dry_run")) == 0
  script, note = capsys.readouterr()
  lines = script.splitlines()
  assert lines[0] == "#!/bin/bash"
  for directive in ("--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--partition=gpu",
                    "--time=30", "--signal=B:USR1@120", f"--output={launch_dir}/slurm-%j.out",
                    "--open-mode=append", "--no-requeue", "--mem=1G", "--exclusive"):
    assert f"#SBATCH {directive}" in lines
  assert "export LRA_DISTRIBUTED=1" in lines and f"cd {REPO}" in lines
  srun = next(x for x in lines if x.startswith("srun "))
  assert srun.startswith(f"srun --kill-on-bad-exit=1 --open-mode=append "
                         f"--output={launch_dir}/job%j-task%t.log bash -c ")
  assert f" lra-task {sys.executable} -c " in srun and srun.endswith(" &")
  # The workdir is absolute in the script (tests/slurm_launch_test.py gives a relative one).
  assert f"run listops --size small --workdir {workdir} " in srun
  assert not launch_dir.exists()   # a dry run writes nothing
  assert note == (f"(dry run: {launch_dir}/job.sbatch would hold this script, checked with "
                  f"`sbatch --test-only` and submitted with `sbatch --parsable "
                  f"{launch_dir}/job.sbatch`)\n")

  # Run it as SLURM would on one node with two tasks.
  launch_dir.mkdir()
  (tmp_path / "job.sbatch").write_text(script)
  job = job_id_with_a_free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # conftest's 8 devices
  env.update(PATH=f"{standin}:{os.environ['PATH']}", STANDIN_RECORD=str(tmp_path / "calls"),
             SLURM_JOB_ID=str(job), SLURM_NTASKS="2", SLURM_NNODES="1",
             SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=str(tmp_path))
  proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  logs = [launch_dir / f"job{job}-task{t}.log" for t in (0, 1)]
  tails = "\n".join(f"--- {p.name}:\n{p.read_text()[-2000:]}" for p in logs if p.exists())
  assert proc.returncode == 0, proc.stdout + proc.stderr + tails
  calls = (tmp_path / "calls").read_text().splitlines()
  assert len(calls) == 1 and calls[0].startswith("srun --kill-on-bad-exit=1 --open-mode=append")
  assert f"=== job {job} attempt 1 on localhost" in proc.stdout
  assert f"=== job {job} attempt 1 task 0 on " in logs[0].read_text()
  assert "test accuracy" in logs[0].read_text()

  # One job of two processes: the parameters of the same config in one process on 4 devices.
  reference = train.train_and_evaluate(config, str(tmp_path / "one"))["state"]["params"]
  params, step = checkpoint.load_params(str(workdir), checkpoint.abstract_like(reference))
  assert step == OVERRIDES["num_train_steps"]
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_submission_writes_the_script_and_calls_sbatch(standin, tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("PATH", f"{standin}:{os.environ['PATH']}")
  monkeypatch.setenv("STANDIN_RECORD", str(tmp_path / "calls"))
  workdir, launch_dir = tmp_path / "workdir", tmp_path / "launch"
  assert cli.main(launch_args(workdir, launch_dir, "--dry_run")) == 0
  script = capsys.readouterr().out
  assert cli.main(launch_args(workdir, launch_dir)) == 0
  out, err = capsys.readouterr()
  assert (launch_dir / "job.sbatch").read_text() == script
  assert (tmp_path / "calls").read_text() == (f"sbatch --test-only {launch_dir}/job.sbatch\n"
                                              f"sbatch --parsable {launch_dir}/job.sbatch\n")
  assert out.startswith(f"submitted job 4242: `lra run listops --size small --workdir {workdir}")
  assert f"task logs {launch_dir}/job4242-task*.log" in out and err == ""


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "0", "--gpus-per-node", "2"], "error: --nodes must be at least 1, got 0."),
    (["--gpus-per-node", "2"], "error: the SLURM launcher needs --nodes N (and --gpus_per_node "
                               "G on a cluster with GPUs)."),
    (["--nodes", "1", "--gpus-per-node", "-1"], "error: --gpus_per_node must be at least 0, "
                                                "got -1."),
    (["--nodes", "1", "--cpus-per-task", "0"], "error: --cpus_per_task must be at least 1, "
                                               "got 0."),
    (["--nodes", "1", "--sbatch", "mem"], None),   # a bare key is a flag: fine here
    (["--nodes", "1", "--sbatch", "mem="], "error: --sbatch takes KEY=VALUE or KEY"),
    (["--nodes", "1", "--sbatch", "Bad Key=1"], "error: --sbatch takes KEY=VALUE or KEY"),
    (["--nodes", "1", "--sbatch", "ntasks_per_node=4"],
     "error: --sbatch ntasks-per-node: the launcher writes that option itself; use its own "
     "flag"),
    (["--nodes", "1", "--requeue"], "error: --requeue requeues the job at its time limit: give "
                                    "--time too."),
    (["--nodes", "1", "--python", "/nonexistent/python3"],
     "error: --python /nonexistent/python3: no executable there"),
    (["--nodes", "1", "--gpus-per-node", "2", "--gpus", "2"],
     "error: lra launch slurm: unrecognized arguments: --gpus 2"),
    (["--nodes", "x", "--gpus-per-node", "2"],
     "error: lra launch slurm: argument --nodes: invalid int value: 'x'"),
    (["--nodes", "1", "--gpus-per-node", "2", "--time", "soon"],
     "error: --time takes SLURM's forms"),
    (["--nodes", "1", "--gpus-per-node", "2", "--partition", "a b"],
     "error: --partition takes one name, got 'a b'."),
])
def test_bad_flags_are_one_line_and_call_nothing(argv, message, standin, tmp_path, capsys,
                                                 monkeypatch):
  monkeypatch.setenv("PATH", f"{standin}:{os.environ['PATH']}")
  monkeypatch.setenv("STANDIN_RECORD", str(tmp_path / "calls"))
  if message is None:   # valid: a dry run prints the script
    assert cli.main(["launch", "slurm", *argv, "--dry_run", "--", "run", "listops"]) == 0
    assert "#SBATCH --mem\n" in capsys.readouterr().out
    return
  assert cli.main(["launch", "slurm", *argv, "--launch_dir", str(tmp_path / "l"), "--", "run",
                   "listops"]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.startswith(message) and err.count("\n") == 1, err
  assert not (tmp_path / "calls").exists() and not (tmp_path / "l").exists()


@pytest.mark.parametrize("command, message", [
    ([], "error: nothing after `--`: "),
    (None, "error: nothing after `--`: "),
    (["listops"], "error: the command after `--` must be `run TASK ...`"),
    (["run", "listops", "--attention", "flashy"], "error: the run command after `--`: "),
    (["run", "listops", "--config.num_train_steps=many"], "error: the run command after `--`: "),
    (["run", "listops", "--config.seed"], "error: the run command after `--`: --config.seed "
                                          "needs a value"),
])
def test_bad_run_commands_are_one_line_and_call_nothing(command, message, standin, tmp_path,
                                                        capsys, monkeypatch):
  monkeypatch.setenv("PATH", f"{standin}:{os.environ['PATH']}")
  monkeypatch.setenv("STANDIN_RECORD", str(tmp_path / "calls"))
  argv = ["launch", "slurm", "--nodes", "1"]
  assert cli.main(argv + ([] if command is None else ["--", *command])) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.startswith(message) and err.count("\n") == 1, err
  assert not (tmp_path / "calls").exists()


def test_without_sbatch_on_path_nothing_is_written(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))
  argv = ["launch", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--launch_dir",
          str(tmp_path / "l"), "--", "run", "listops"]
  assert cli.main(argv) == 2
  out, err = capsys.readouterr()
  assert out == "" and err == ("error: `sbatch` is not on PATH; run this on a SLURM login node "
                               "(or use --dry_run to see the commands).\n")
  assert not (tmp_path / "l").exists()
  assert cli.main(["launch", "nomad", "--", "run", "listops"]) == 2
  assert capsys.readouterr().err == ("error: unknown launcher 'nomad'; valid launchers: tpu, "
                                     "slurm.\n")
