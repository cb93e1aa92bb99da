"""Runs one task by name: builds its config, applies overrides, trains and prints the result.

  python -m launch.train listops --attention band --size small --workdir runs/x \
      --config.num_train_steps=300 --config.model.attention.window=8

`--config.a.b=V` overrides an existing field (`configs.build_config`; V is converted against the
field's current type by the converter the config arguments use too). Unknown fields raise with
the valid names at that level. The resolved values (and each phase's) are then checked by
`lra.schema`: a bad one ends the command at once with one line naming the field, exit
status 2, before jax is imported. The `lra` console command (launch/cli.py) calls this. Staged
configs (`config.phases`, the character-LM ones) run through `lra.phases`, one workdir per phase;
rerunning the command continues the schedule.

A missing input file (with data.download off) or another live run holding the workdir ends the
command before any compile, with the line `lra data status` or the lock gives. Then, before any
data work, the preflight (`lra.preflight`) compiles the train and eval steps on abstract inputs and stops a run that cannot fit the devices' memory with one line and exit
status 2 (`--no_preflight` skips it). `--dry_run` prints what a run would be (the config's
difference from the task's default, mesh and shardings, parameter count, memory per device,
compile time; `--dry_run=steps:N` adds the time of N steps on random batches) and writes
nothing. It refuses a bad value with the run's own line; what the workdir holds (a finished run,
another run's lock) does not stop it: it says what a real run would do there. Compiled
programs are kept in JAX's persistent cache (`lra.compiling.cache_directory`, off with
`--no_compile_cache`), so the run reuses the preflight's compilation.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import threading
import traceback
from typing import Any, Sequence

import ml_collections

import configs
from launch import run_state
from launch.checks import (_check_names, check_config, check_phase_overrides, check_workdir,
                           dry_run_steps)
from launch.values import flag_spelling, flatten
from lra import identity, schema, signals
from lra import phases  # pure Python: the trainer is imported by its functions only
from lra import host_memory, storage
from lra.rundir import RunDir
from lra import tasks as tasks_lib


def default_workdir(task: str, config: ml_collections.ConfigDict) -> str:
  """`workdirs/TASK-ATTENTION-SIZE`, relative to the folder `lra run` starts in: `_run` resolves
  it there, and every line the run prints names it absolute. A SLURM launch resolves it on the
  launching machine (launch/slurm.py `absolute_argv`), a TPU worker in its `$HOME/lra`."""
  return os.path.join("workdirs", identity.workdir_name(config, task))


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
  """Separates `--config.a.b=v` (or `--config.a.b v`) from the other arguments.

  Raises ValueError when a `--config.a.b` has no value: it ends the command line, or the next
  argument is another flag (`--...`), which is never taken as the value.
  """
  rest, overrides, i = [], [], 0
  argv = list(argv)
  while i < len(argv):
    a = argv[i]
    if a.startswith("--config."):
      key, eq, value = a[len("--config."):].partition("=")
      if not eq:
        if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
          raise ValueError(f"{a} needs a value: {a}=VALUE.")
        value, i = argv[i + 1], i + 1
      overrides.append((key, value))
    else:
      rest.append(a)
    i += 1
  return rest, overrides


RUN_HELP = "Train and evaluate a task by name; rerunning in the same workdir resumes."

RUN_EPILOG = """config overrides:
  --config.FIELD=VALUE  set any field of the task's config, e.g. --config.num_train_steps=300,
                        --config.model.attention.window=8, --config.learning_rate=1e-3;
                        --config.model.attention.NAME sets an argument of the attention kind
                        (`lra list KIND` lists them) and --config.model.attention.implementation
                        its backend (auto, xla, cudnn, tokamax, splash, pallas:
                        docs/accelerators.md).
                        An unknown field fails with the valid names, a bad value in one line.
  --dry_run shows which fields differ from the task's default.

Flags are spelled with underscores; the hyphen spelling (--dry-run) works too.
Examples:
  lra run listops --size small
  lra run listops --size small --attention performer --config.num_train_steps=5
  lra run enwik8 --size xl-small --dry_run"""


def _size_help() -> str:
  import configs
  listed = "; ".join(f"{task}: {', '.join(configs.sizes(task))}"
                     for task in sorted(tasks_lib.TASKS))
  return (f"the task's size, default the first listed (base: the LRA settings; small and cpu fit "
          f"a laptop CPU). {listed}")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("task", help=f"one of: {', '.join(sorted(tasks_lib.TASKS))}")
  parser.add_argument("--attention", default=None,
                      help="an attention kind or a paper's name for one (see `lra list`); "
                           "default: the task's")
  parser.add_argument("--size", default=None, help=_size_help())
  parser.add_argument("--arg", default="",
                      help="the task config's argument, key=value pairs joined by commas: "
                           "attention=NAME, size=S, window=W (the band window the kind's "
                           "defaults are sized for), e.g. --arg window=8")
  parser.add_argument("--workdir", default=None,
                      help="run directory (default workdirs/TASK-ATTENTION-SIZE); rerunning in "
                           "it resumes")
  parser.add_argument("--dry_run", nargs="?", const="steps:0", default=None, metavar="steps:N",
                      help="print the config's changes, mesh, shardings, parameter count, "
                           "memory per device and compile time (steps:N: and the time of N "
                           "steps on random batches) without training or writing anything")
  parser.add_argument("--no_preflight", action="store_true",
                      help="skip the memory and time check before the run")
  parser.add_argument("--yes", action="store_true",
                      help="run even when the preflight expects more than an hour of training "
                           "on a CPU")
  parser.add_argument("--no_compile_cache", action="store_true",
                      help="compile every program afresh instead of using the persistent "
                           "compile cache")


def config_changes(config: ml_collections.ConfigDict) -> tuple[str, list[str]]:
  """(the default it is compared with, `field: default -> value` for every field that differs
  from the task's config of the same attention kind and size without overrides)."""
  default = configs.build_config(config.task, arg=identity.arg(config))
  before, after = flatten(default.to_dict()), flatten(config.to_dict())
  missing = "(absent)"
  lines = [f"  {key}: {before.get(key, missing)!r} -> {after.get(key, missing)!r}"
           for key in sorted(set(before) | set(after))
           if before.get(key, missing) != after.get(key, missing)]
  return identity.label(default), lines


def _startup_message(signum: int) -> str:
  if os.environ.get("LRA_DISTRIBUTED", "0") == "1":
    return (f"\n{signals.signal_label(signum)} during start-up: every process stops after the "
            f"first training step and saves it.")
  return (f"\n{signals.signal_label(signum)}: stopping before training starts, once the current "
          f"start-up step ends (imports, compiling, the data); a second signal stops at once.")


_STARTUP_ABORT = ("error: interrupted twice before training started; nothing was trained: "
                  "rerun the same command to start.")


def run(args: argparse.Namespace, overrides: Sequence[tuple[str, str]]) -> int:
  """Trains; returns the process exit status (130 when interrupted by Ctrl-C or SIGTERM).

  From its first line to the training loop a first Ctrl-C or SIGTERM is held
  (`signals.StartUp`): one process stops at its next start-up stage with one line, nothing
  trained or written; the processes of a multi-process run leave it to the loop, which stops
  them all at one step."""
  with signals.StartUp(_startup_message, _STARTUP_ABORT) as startup:
    return _run(args, overrides, startup)


def _interrupted(startup: signals.StartUp, config: Any = None) -> bool:
  """Whether a signal held at start-up ends the command here (one process: after one line)."""
  if not startup.requested:
    return False
  if os.environ.get("LRA_DISTRIBUTED", "0") == "1" or (
      config is not None and bool(config.get("distributed", False))):
    return False   # every process stops at the loop's agreed step
  print(f"error: interrupted by {signals.signal_label(startup.signum)} before training "
        f"started; nothing was trained: rerun the same command to start.", file=sys.stderr)
  return True


def _run(args: argparse.Namespace, overrides: Sequence[tuple[str, str]],
         startup: signals.StartUp) -> int:
  try:  # a bad name, override or value: say which in one line, before any heavy import
    _check_names(args)
    config = configs.build_config(args.task, attention=args.attention, size=args.size,
                                  arg=args.arg, overrides=overrides)
    schema.check_task(config, tasks_lib.check_name(args.task))
    check_config(config)
    check_phase_overrides(config, overrides)
    dry_steps = dry_run_steps(getattr(args, "dry_run", None))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  # A relative workdir is the current folder's, and every line the run prints names it in
  # full: a run started from another folder says where it writes.
  workdir = storage.resolve(args.workdir or default_workdir(args.task, config))
  try:  # a finished run is shown, continued to more steps, or refused: never rewritten
    rerun, stored = _rerun(config, workdir)
  except ValueError as e:
    if dry_steps is None:
      print(f"error: {e}", file=sys.stderr)
      return 2
    rerun, stored = "refused", f"{e}"   # a dry run says so and goes on
  if rerun == "same" and dry_steps is None:
    print(tasks_lib.get_task(config.task).result_line(
        stored, RunDir(storage.resolve(workdir)).results), flush=True)
    return 0
  try:   # where the run writes (a finished run above may be shown from a read-only one)
    if rerun in ("new", "more"):
      check_workdir(workdir)
      storage.check_remote(workdir)   # a bucket: gcsfs installed, the bucket there, credentials
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  # Another run holding the workdir: said before the preflight's compile (the lock itself is
  # taken after it). One process only: a job's processes start together and share one lock.
  from lra import lock
  busy = lock.run_refusal(workdir) if dry_steps is None and rerun in ("new", "more") and \
      os.environ.get("LRA_DISTRIBUTED", "0") != "1" else None
  if busy:
    print(f"error: {busy}", file=sys.stderr)
    return 2
  if rerun == "more" and dry_steps is None:
    print(f"Continuing the finished run in {workdir} from step {stored['steps']} to "
          f"{config.num_train_steps} (num_train_steps: {stored['steps']} -> "
          f"{config.num_train_steps}).", flush=True)
  if _interrupted(startup, config):
    return 130
  from lra import compiling, train  # heavy imports only once the arguments are valid
  from lra.data import archives
  task = tasks_lib.get_task(config.task)
  try:  # names, combinations and input files; then the preflight; then the data
    train.check_layers(phases.phase_config(config, 0) if config.get("phases") else config, task)
    data = task.status(config.data) if dry_steps is None else None   # before any compile
    if data is not None and data.missing and not config.data.get("download", False):
      task.prepare(config.data)   # stops at once on the missing file with the task's own line
  except (ValueError, archives.DataMissingError, archives.CorruptArchiveError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if _interrupted(startup, config):
    return 130
  with compiling.compile_cache(not getattr(args, "no_compile_cache", False)):
    if dry_steps is not None:
      status = dry_run(config, workdir, dry_steps, workdir_lines(config, workdir, rerun, stored))
      return 130 if _interrupted(startup) else status
    if not getattr(args, "no_preflight", False):
      status, plans = run_preflight(config, workdir, yes=getattr(args, "yes", False))
      if status:
        return 130 if _interrupted(startup) else status
    else:
      plans = []
    if _interrupted(startup, config):
      return 130
    try:
      task.prepare(config.data)
    except (ValueError, archives.DataMissingError, archives.CorruptArchiveError) as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    if _interrupted(startup, config):
      return 130
    print(f"Training {args.task} ({identity.label(config)}) in {workdir}", flush=True)
    try:
      results = phases.run(config, workdir, plans=plans)
    except KeyboardInterrupt:
      print("error: interrupted (Ctrl-C twice); rerun the same command to resume from the last "
            "checkpoint.", file=sys.stderr)
      return 130
    except Exception as e:  # noqa: BLE001 - one line naming the cause; the traceback to a file
      from lra import checkpoint
      line = failure_line(e, workdir)
      if line.startswith("no space left"):   # orbax's abandoned writes report as they end
        checkpoint.stderr_to(RunDir(workdir).error_log)
      checkpoint.report(f"error: {line}")
      return 2
  if results["interrupted"]:
    return 130
  RunDir(storage.resolve(workdir)).retire_error_log()
  print(task.result_line(results, phases.results_path(workdir, results)), flush=True)
  return 0


def _rerun(config: ml_collections.ConfigDict, workdir: str) -> tuple[str, Any]:
  """`run_state.rerun_of_finished` for an unstaged run (a staged one skips its finished
  phases); ("new", None) for a staged one."""
  if config.get("phases"):
    return "new", None
  return run_state.rerun_of_finished(config.to_json_best_effort(indent=2, sort_keys=True),
                                     storage.resolve(workdir))


def _configs_to_check(config: ml_collections.ConfigDict, workdir: str
                      ) -> list[tuple[str, ml_collections.ConfigDict]]:
  """(label, config) of the run, or of each phase a staged run has not finished yet."""
  if not config.get("phases"):
    return [("", config)]
  count = len(config.phases)
  return [(f" phase {k + 1}/{count}", phases.phase_config(config, k)) for k in range(count)
          if phases.finished_results(RunDir(workdir).phase(k + 1).path) is None]


def _steps_left(config: ml_collections.ConfigDict, workdir: str, label: str) -> int:
  """Train steps the run (or phase, by its `label`) still has: its total minus its newest
  checkpoint's step in a local workdir (a resumed run is not charged again)."""
  total = int(config.num_train_steps)
  folder = RunDir(workdir)
  if label:   # " phase K/N"
    folder = folder.phase(int(label.split()[1].split("/")[0]))
  done = max(folder.steps(), default=0)
  return max(0, total - done)


def _preflight(config: ml_collections.ConfigDict, initialisers: bool = False):
  """`lra.preflight.check(config)`, or the one line saying why it could not be done."""
  from lra import mesh, preflight
  try:
    return preflight.check(config, initialisers=initialisers)
  except (ValueError, mesh.PeerTimeout) as e:   # a batch the mesh cannot split, a late peer
    return f"{e}"
  except KeyboardInterrupt:
    return "interrupted during the preflight; nothing was started."
  except Exception as e:  # noqa: BLE001 - whatever stops the compilation stops the run too
    first = str(e).splitlines()[0][:300] if str(e) else ""
    return (f"the preflight could not compile the steps: {type(e).__name__}: {first} "
            f"(--no_preflight skips it).")


COMPILE_NOTE_SECONDS = 10.0   # a preflight compile taking longer says what it compiles


def run_preflight(config: ml_collections.ConfigDict, workdir: str, *,
                  yes: bool = False) -> tuple[int, list[Any]]:
  """Checks that the run (each unfinished phase) fits: (0, the planned trainers, which the run
  reuses with their compiled steps), or (2, []) after one `error:` line. On a CPU, a run whose
  training steps are expected to take more than `preflight.LONG_RUN_SECONDS` also stops with
  one line (the estimate, the task's sizes) unless `yes`."""
  from lra import preflight
  plans, seconds, cpu = [], 0.0, False
  for label, c in _configs_to_check(config, workdir):
    # A compile that takes a while names what it compiles (a large --size, num_layers).
    note = threading.Timer(COMPILE_NOTE_SECONDS, print, args=(
        f"Preflight{label}: compiling the steps of {c.task} ({identity.label(c)}), "
        f"{int(c.model.num_layers)} layers, to measure their memory and time "
        f"(--no_preflight skips this)...",), kwargs={"flush": True})
    note.daemon = True
    note.start()
    try:
      report = _preflight(c, initialisers=True)   # the run allocates with what it compiles
    finally:
      note.cancel()
    if isinstance(report, str):
      print(f"error: {report}", file=sys.stderr)
      return (130 if report.startswith("interrupted") else 2), []
    if not report.fits:
      print(f"error: {report.refusal()}", file=sys.stderr)
      return 2, []
    plans.append(report.trainer)   # the run's trainer reuses the compiled steps
    cpu = report.trainer.mesh.devices.flat[0].platform == "cpu"
    if cpu and not yes:
      seconds += report.step_seconds() * _steps_left(c, workdir, label)
    free = "" if report.available is None else f" of {report.available / 1e9:.1f} GB available"
    print(f"Preflight{label}: about {report.peak / 1e9:.2f} GB per device{free}; steps "
          f"{'loaded' if report.train.cache_hit else 'compiled'} in "
          f"{report.compile_seconds:.1f} s.", flush=True)
  if cpu and not yes and seconds > preflight.LONG_RUN_SECONDS:
    sizes = ", ".join(s for s in configs.sizes(config.task)
                      if s != identity.size(config))
    print(f"error: {config.task} ({identity.label(config)}) would train for about "
          f"{preflight.duration_text(seconds)} on this CPU (an estimate from the compiled "
          f"steps; --dry_run=steps:2 times real ones): pass --yes to run it anyway, or a "
          f"smaller --size ({sizes}) or --config.num_train_steps.", file=sys.stderr)
    return 2, []
  return 0, plans


def workdir_lines(config: ml_collections.ConfigDict, workdir: str, rerun: str,
                  stored: Any) -> list[str]:
  """What a real run would do with what `workdir` holds, for the dry run: `rerun` and `stored`
  are `_rerun`'s answer ("refused" and the refusal when it raised). Nothing for a folder a run
  would simply start or resume in. A run holding the workdir's lock (or a phase's) is named too:
  a real run would stop when it takes the lock, after its preflight."""
  lines = []
  where = RunDir(workdir).results
  if rerun == "same":
    line = tasks_lib.get_task(config.task).result_line(stored, where)
    lines.append(f"workdir: holds this run finished ({where}); a real run would change nothing "
                 f"and print its result: {line}")
  elif rerun == "more":
    lines.append(f"workdir: holds this run finished at step {stored['steps']} ({where}); a real "
                 f"run would continue it from its last checkpoint to step "
                 f"{config.num_train_steps}.")
  elif rerun == "refused":
    lines.append(f"workdir: holds a finished run; a real run would stop with: error: {stored}")
  if config.get("phases"):
    for k in range(len(config.phases)):
      phase = RunDir(workdir).phase(k + 1)
      if phases.finished_results(phase.path) is not None:
        lines.append(f"workdir: phase {k + 1}/{len(config.phases)} finished earlier "
                     f"({phase.results}); a real run skips it.")
  from lra import lock
  busy = lock.run_refusal(workdir) if rerun in ("new", "more") else None   # as a run would
  if busy:
    lines.append(f"workdir: another run holds it; a real run started now would stop before "
                 f"its preflight with: error: {busy}")
  return lines


def dry_run(config: ml_collections.ConfigDict, workdir: str, steps: int,
            notes: Sequence[str] = ()) -> int:
  """Prints what the run would be (see the module docstring), after `notes` (what a real run
  would do with what the workdir holds); 2 when it cannot fit."""
  from lra import preflight, preflight_lines
  print(f"dry run: {config.task} ({identity.label(config)}); nothing is written to {workdir}")
  for line in notes:
    print(line)
  default, changes = config_changes(config)
  n = len(changes)
  differ = "differs" if n == 1 else "differ"
  print(f"config: {n} field{'s' * (n != 1)} {differ} from the default {config.task} ({default})")
  for line in changes:
    print(line)
  status = 0
  for label, c in _configs_to_check(config, workdir):
    report = _preflight(c, initialisers=bool(steps))   # timed steps allocate the state
    if isinstance(report, str):
      print(f"error: {report}", file=sys.stderr)
      return 2
    mesh = report.trainer.mesh
    devices = list(mesh.devices.flat)
    print(f"mesh{label}: " + " x ".join(f"{k} {v}" for k, v in mesh.shape.items()) +
          f" = {len(devices)} {devices[0].platform} device{'s' * (len(devices) > 1)}")
    print("\n".join(preflight_lines.sharding_table(report)))
    print(f"attention{label}:")
    print("\n".join(preflight_lines.attention_lines(c, devices[0].platform)))
    print(f"parameters{label}: {report.param_count:,}")
    print(f"memory{label}:")
    print("\n".join(preflight_lines.memory_lines(report)))
    source = lambda p: "loaded from the cache" if p.cache_hit else "compiled"  # noqa: E731
    print(f"compile{label}: {report.compile_seconds:.2f} s, programs side by side (train step "
          f"{report.train.compile_seconds:.2f} s {source(report.train)}, eval step "
          f"{report.eval.compile_seconds:.2f} s {source(report.eval)})")
    if not report.fits:
      print(f"verdict{label}: {report.refusal()}")
      status = 2
    elif not steps:
      print(f"time{label}: about {preflight.duration_text(report.step_seconds())} per step, "
            f"{int(c.num_train_steps):,} steps in about "
            f"{preflight.duration_text(report.step_seconds() * int(c.num_train_steps))} (an "
            f"estimate from the compiled step's {report.step_flops / 1e9:,.1f} GFLOP; "
            f"--dry_run=steps:N times real steps)")
    else:
      times = sorted(preflight_lines.time_steps(report, steps))
      median = times[len(times) // 2]
      total = median * int(c.num_train_steps)
      span = f"{total / 60:.1f} min" if total < 7200 else f"{total / 3600:.1f} h"
      print(f"time{label}: {steps} steps on random batches, median {median:.4f} s per step: "
            f"{int(c.num_train_steps):,} steps in about {span} (evaluation and checkpoints "
            f"not included)")
  return status


def _chain(e: BaseException) -> list[BaseException]:
  out = []
  while e is not None and e not in out:
    out.append(e)
    e = e.__cause__ or e.__context__
  return out


def failure_line(e: Exception, workdir: str) -> str:
  """The one line a failed run ends with: the cause and what to do (the known failures), or
  the exception with its traceback written to `<workdir>/error.log`."""
  from lra import checkpoint, lock, mesh
  chain = _chain(e)
  if any(isinstance(x, OSError) and x.errno == errno.ENOSPC for x in chain) or any(
      "No space left on device" in str(x) for x in chain):
    return (f"no space left on device while writing in {workdir} ({type(e).__name__}); free "
            f"some space and rerun the same command: it resumes from the last finished "
            f"checkpoint, and an unfinished save is discarded.")
  if isinstance(e, (lock.WorkdirBusy, checkpoint.CheckpointError, FloatingPointError,
                    mesh.PeerTimeout)):
    return str(e).splitlines()[0] if str(e) else type(e).__name__
  log = RunDir(workdir).error_log
  try:
    storage.makedirs(workdir)
    storage.append_text(log, "".join(traceback.format_exception(e)))
    where = f"the traceback is in {log}"
  except OSError:
    where = "no traceback could be written"
  first = str(e).splitlines()[0][:300] if str(e) else ""
  if isinstance(e, ValueError):   # a setting the checks before the run could not see
    return f"{first} ({where})."
  return f"{type(e).__name__}: {first} ({where}; rerun the same command to resume)."


def main(argv: Sequence[str] | None = None) -> int:
  if (code := host_memory.command_start()) is not None:   # before JAX starts its threads
    return code
  argv = sys.argv[1:] if argv is None else argv
  try:
    rest, overrides = split_overrides(flag_spelling(argv))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  add_run_arguments(parser)
  return run(parser.parse_args(rest), overrides)


if __name__ == "__main__":
  sys.exit(main())
