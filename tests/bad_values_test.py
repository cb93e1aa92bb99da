"""Every bad value a user can type ends the command in one line and exit status 2.

`BAD` is the table: command lines of `lra run`, `lra sweep`, `lra results`, `lra data`, `lra
list` and `lra launch` with a bad flag, config value or path. Each goes through the real command
(`launch.cli.main`) and must return 2, print exactly one `error: ` line that contains the
expected text, print nothing else, reach none of the heavy stages (the preflight's compile, the
dry run's, the data step, training: each replaced by a function that fails the test) and create
nothing. Each `lra run` row is also run with `--dry_run`, which must end with the very
same line: a dry run refuses what the run refuses. The table in docs/training.md ("Bad values")
is generated from what the commands print, the dry run's outcome beside the run's: the test
fails when the docs differ, and `LRA_UPDATE_DOCS=1 pytest tests/bad_values_test.py` rewrites
them.
"""

import contextlib
import os
from pathlib import Path
from unittest import mock

import pytest

from launch import cli

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "training.md"
BEGIN, END = "<!-- bad-values: begin -->", "<!-- bad-values: end -->"

# (the command after `lra`, with {w} a fresh folder's path and {file} a file's; text the one
# error line must contain)
BAD = [
    # the command line itself
    ("run", "lra run: the following arguments are required: task"),
    ("run nosuchtask", "unknown task 'nosuchtask'; valid tasks: enwik8"),
    ("run listops --size huge", "unknown size 'huge'; valid sizes: base, small, cpu."),
    ("run listops --size ''", "--size is empty"),
    ("run listops --attention bandd",
     "unknown attention 'bandd'; valid names: adaptive_span, band,"),
    ("run listops --attention ' '", "--attention is empty"),
    ("run listops --arg foo=1", "unknown config argument 'foo' in 'foo=1'"),
    ("run listops --sweep x", "lra run: unrecognized arguments: --sweep x"),
    ("run listops --dry_run=steps:x", "--dry_run takes no value or steps:N"),
    ("run listops --dry_run=steps:-1", "--dry_run takes no value or steps:N"),
    ("run listops --workdir {file}", "is a file, not a folder"),
    ("run listops --workdir {file}/sub", "cannot be written"),
    ("run listops --workdir /proc/lra", "cannot be written"),
    ("run listops --config.seed --size small", "--config.seed needs a value"),
    ("run listops --config.nosuch=1", "unknown config field 'nosuch'"),
    ("run listops --config.model.nosuch=1", "unknown config field 'model.nosuch'"),
    ("run listops --config.batch_size=abc", "--config.batch_size: expected an integer, got 'abc'"),
    ("run listops --config.batch_size=1.5", "--config.batch_size: expected an integer, got '1.5'"),
    ("run listops --config.learning_rate=abc", "--config.learning_rate: expected a number"),
    # training
    ("run listops --config.num_train_steps=-5", "config.num_train_steps = -5"),
    ("run listops --config.num_train_steps=2147483648", "must be at most 2147483647"),
    ("run listops --config.log_every=0", "config.log_every = 0"),
    ("run listops --config.eval_every=0", "config.eval_every = 0"),
    ("run listops --config.checkpoint_every=0", "config.checkpoint_every = 0"),
    ("run listops --config.keep_checkpoints=0", "config.keep_checkpoints = 0"),
    ("run listops --config.seed=-1", "config.seed = -1"),
    ("run listops --config.batch_size=0", "config.batch_size = 0"),
    ("run listops --config.eval_batch_size=0", "config.eval_batch_size = 0"),
    ("run listops --config.learning_rate=-0.1", "config.learning_rate = -0.1"),
    ("run listops --config.learning_rate=1e999", "config.learning_rate = inf"),
    ("run listops --config.warmup_steps=-1", "config.warmup_steps = -1"),
    ("run listops --config.init_from_hf={file}", "afile: not a folder (give a local Hugging Face"),
    ("run listops --config.init_from_hf=/proc", "config.init_from_hf: /proc/config.json: missing"),
    ("run listops --config.init_from=/proc --config.init_from_hf=/proc",
     "give init_from or init_from_hf, not both"),
    ("run listops --config.init_from=/nonexistent",
     "config.init_from = '/nonexistent': does not exist"),
    ("run listops --config.init_from={file}", "afile': is a file"),
    ("run listops --config.task=text",
     "config.task = 'text': configs/listops.py is the config of task 'listops'"),
    ("run listops --config.weight_decay=-1", "config.weight_decay = -1.0"),
    ("run listops --config.grad_clip=-1", "config.grad_clip = -1.0"),
    ("run listops --config.adam_b1=1", "config.adam_b1 = 1.0"),
    ("run listops --config.adam_b2=-0.5", "config.adam_b2 = -0.5"),
    ("run listops --config.adam_eps=0", "config.adam_eps = 0.0"),
    ("run listops --config.schedule=linear", "config.schedule = 'linear'"),
    ("run listops --config.mesh.fsdp=0", "config.mesh.fsdp = 0"),
    ("run listops --config.mesh.data=-1 --config.mesh.fsdp=-1", "at most one axis may be -1"),
    ("run listops --config.mesh.pipe=2", "unknown config field 'mesh.pipe'"),
    # the model
    ("run listops --config.model.num_layers=0", "config.model.num_layers = 0"),
    ("run listops --config.model.emb_dim=0", "config.model.emb_dim = 0"),
    ("run listops --config.model.mlp_dim=-1", "config.model.mlp_dim = -1"),
    ("run listops --config.model.classifier_dim=0", "config.model.classifier_dim = 0"),
    ("run listops --config.model.num_heads=0", "config.model.num_heads = 0"),
    ("run listops --config.model.num_heads=3 --config.model.qkv_dim=64",
     "config.model.qkv_dim = 64"),
    ("run listops --config.model.dropout=1", "config.model.dropout = 1.0"),
    ("run listops --config.model.pos_emb=bogus", "config.model.pos_emb = 'bogus': must be one of"),
    ("run listops --attention favor --config.model.pos_emb=relative",
     "attention 'favor' has no relative positions"),
    ("run listops --config.model.sublayers=sfx", "config.model.sublayers = 'sfx'"),
    ("run listops --config.model.sandwich=9", "config.model.sandwich = 9"),
    ("run listops --config.model.rotary_base=0", "config.model.rotary_base = 0.0"),
    ("run listops --config.model.pool=max", "config.model.pool = 'max'"),
    ("run enwik8 --size small --config.model.same_length=true",
     "config.model.same_length = True: needs config.model.memory_length > 0"),
    ("run enwik8 --size small --config.model.memory_length=-1", "config.model.memory_length"),
    # attention
    ("run listops --config.model.attention.kind=flashy", "config.model.attention.kind = 'flashy'"),
    ("run listops --config.size=huge", "unknown size 'huge'; valid sizes: base, small"),
    ("run listops --config.peer_timeout_s=0", "config.peer_timeout_s = 0: must be"),
    ("run listops --attention band --config.model.attention.window=-3",
     "config.model.attention.window = -3"),
    ("run listops --attention band --config.model.attention.windw=8",
     "band takes no argument 'windw'"),
    ("run listops --config.model.attention.window=8", "dot_product takes no arguments"),
    ("run listops --attention band --config.model.attention.dilation=0",
     "config.model.attention.dilation"),
    ("run listops --attention entmax --config.model.attention.alpha=3",
     "config.model.attention.alpha"),
    ("run listops --attention entmax --config.model.attention.alpha=soft",
     "config.model.attention.alpha"),
    ("run listops --attention bigbird --config.model.attention.block_size=0",
     "config.model.attention.block_size"),
    ("run listops --attention favor --config.model.attention.num_features=0",
     "config.model.attention.num_features"),
    ("run listops --attention linformer --config.model.attention.proj_dim=0",
     "config.model.attention.proj_dim"),
    ("run listops \"--config.model.layer_attention=({'window': 4},)\"",
     "config.model.layer_attention has 1 entry"),
    ("run listops --size small --attention band "
     "\"--config.model.layer_attention=({}, {'kind': 'lsh', 'window': 4})\"",
     "lsh takes no argument 'window'"),
    ("run enwik8 --size small "
     "\"--config.model.layer_attention=({'window': 8}, {'window': -2}, {}, {})\"",
     "config.model.layer_attention[1].window = -2"),
    ("run listops --attention band --config.model.attention.implementation=cuda",
     "config.model.attention.implementation = 'cuda'"),
    ("run listops --attention linear --config.model.attention.implementation=splash",
     "attention 'linear' has no splash implementation"),
    # data
    ("run listops --config.data.max_length=0", "config.data.max_length = 0"),
    ("run listops --config.data.num_train=0", "config.data.num_train = 0"),
    ("run listops --config.data.num_val=0", "config.data.num_val = 0"),
    ("run listops --config.data.num_test=-1", "config.data.num_test = -1"),
    ("run listops --config.data.seed=-1", "config.data.seed = -1"),
    ("run listops --config.data.gen_min_length=10 --config.data.gen_max_length=11",
     "config.data.gen_max_length = 11: must be at least config.data.gen_min_length + 2"),
    ("run listops --config.data.max_depth=0", "config.data.max_depth = 0"),
    ("run listops --config.data.max_depth=1000",
     "config.data.max_depth = 1000: the ListOps generator would find almost no tree"),
    ("run listops --config.data.max_depth=3", "config.data.gen_min_length = 500: must be below "
     "122, the most tokens a ListOps tree of config.data.max_depth = 3"),
    ("run listops --config.data.max_depth=12 --config.data.gen_max_length=2147483647",
     "config.data.gen_max_length = 2147483647: must be at most 195,225,787"),
    ("run listops --config.data.max_args=1", "config.data.max_args = 1"),
    ("run pathfinder --config.data.difficulty=extreme", "config.data.difficulty = 'extreme'"),
    ("run pathfinder --config.data.resolution=0", "config.data.resolution = 0"),
    ("run pathfinder --config.data.num_generated=0", "config.data.num_generated = 0"),
    ("run text --config.data.validation=dev", "config.data.validation = 'dev'"),
    ("run text --config.data.holdout_fraction=1", "config.data.holdout_fraction = 1"),
    ("run retrieval --config.data.doc_bytes=0", "config.data.doc_bytes = 0"),
    ("run sort_marked --size small --config.data.max_marks=20", "max_marks=20 distinct marks"),
    ("run sort_marked --size small --config.model.target_length=3",
     "config.model.target_length = 3"),
    ("run text8 --size small --config.num_train_steps=10",
     "--config.num_train_steps: text8 (attention=band,size=small,window=32) is staged"),
    ("run listops --size cpu --config.learning_rate=0.1", "sets its own learning_rate"),
    ("data prepare", "lra data prepare: the following arguments are required: task"),
    ("data prepare nosuchtask", "unknown task 'nosuchtask'"),
    ("data prepare listops --size huge", "unknown size 'huge'"),
    ("data prepare listops --size small --config.data.max_length=0",
     "config.data.max_length = 0"),
    ("data prepare listops --config.data.num_train=0", "config.data.num_train = 0"),
    ("data prepare listops --bogus 1", "unrecognized arguments: --bogus 1"),
    # sweeps and results
    ("sweep listops", "lra sweep: the following arguments are required: --workdir"),
    ("sweep nosuchtask --workdir {w}", "unknown task 'nosuchtask'"),
    ("sweep listops --workdir {w} --sweep nosuch", "configs/listops.py has no sweep 'nosuch'"),
    ("sweep listops --workdir {w} --parallel 0", "--parallel must be at least 1"),
    ("sweep listops --workdir {w} --runner nosuch", "argument --runner: invalid choice"),
    ("sweep listops --workdir {w} --arg nosuch=1", "unknown config argument 'nosuch'"),
    ("sweep listops --workdir {file}", "is a file, not a folder"),
    ("results {w}", "is not a folder"),
    ("results {file}", "is not a folder"),
    ("results {file} --format xml", "argument --format: invalid choice: 'xml'"),
    ("list nosuchkind", "unknown attention 'nosuchkind'"),
    ("list --config.x=1", "--config.* overrides only apply to `lra run`"),
    ("nosuchcommand", "argument command: invalid choice: 'nosuchcommand'"),
    # launchers
    ("launch", "lra launch needs a launcher"),
    ("launch nosuch", "unknown launcher 'nosuch'; valid launchers: tpu, slurm."),
    ("launch slurm -- run listops", "the SLURM launcher needs --nodes N"),
    ("launch slurm --nodes 1", "nothing after `--`"),
    ("launch slurm --nodes 0 --gpus_per_node 1 -- run listops", "--nodes must be at least 1"),
    ("launch slurm --nodes 1 --gpus_per_node -1 -- run listops",
     "--gpus_per_node must be at least 0"),
    ("launch slurm --nodes 1 --time abc -- run listops", "--time takes SLURM's forms"),
    ("launch slurm --nodes 1 --python /nonexistent -- run listops", "--python /nonexistent"),
    ("launch slurm --nodes 1 -- run nosuchtask",
     "the run command after `--`: unknown task 'nosuchtask'"),
    ("launch slurm --nodes 1 -- run listops --config.batch_size=0",
     "the run command after `--`: config.batch_size = 0"),
    ("launch tpu --zone z -- run listops", "the TPU launcher needs --tpu NAME"),
    ("launch tpu --tpu t --zone z --retries -1 -- run listops", "--retries must be 0 or more"),
    ("launch tpu --tpu t --zone z --create -- run listops", "--create needs --accelerator TYPE"),
    ("launch tpu --tpu t --zone z -- run listops --size huge",
     "the run command after `--`: unknown size 'huge'"),
]


def _fill(command: str, folder: Path) -> str:
  return command.replace("{w}", str(folder / "w")).replace("{file}", str(folder / "afile"))


def _argv(command: str, folder: Path) -> list[str]:
  import shlex
  (folder / "afile").write_text("x")
  text = _fill(command, folder)
  argv = shlex.split(text)
  if argv[0] == "run" and "--workdir" not in argv and len(argv) > 1:
    argv += ["--workdir", str(folder / "w")]
  return argv


def _shown(text: str, folder: Path) -> str:
  """A command or error line as the docs show it: the test's folders as DIR and FILE."""
  return text.replace(str(folder / "afile"), "FILE").replace(str(folder / "w"), "DIR")


# The stages a bad value must never reach (the checks come first), as `module:attribute`.
HEAVY = ("launch.train:run_preflight", "launch.train:dry_run", "lra.phases:run",
         "lra.data.builders:TaskData.build")


def _reached(stage: str):
  def heavy(*args, **kwargs):
    raise AssertionError(f"a bad value reached {stage}")
  return heavy


def _error_line(command: str, folder: Path, capsys) -> str:
  """Runs `lra COMMAND` with the heavy stages replaced (HEAVY); checks exit 2, one line,
  nothing else, nothing made; the line."""
  capsys.readouterr()
  with contextlib.ExitStack() as stack:
    for stage in HEAVY:
      module, attribute = stage.split(":")
      owner = __import__(module, fromlist=["_"])
      for part in attribute.split(".")[:-1]:
        owner = getattr(owner, part)
      stack.enter_context(mock.patch.object(owner, attribute.split(".")[-1], _reached(stage)))
    try:
      status = cli.main(_argv(command, folder))
    except AssertionError as e:
      raise AssertionError(f"{command}: {e}") from None
  out, err = capsys.readouterr()
  assert status == 2, (command, status, out, err)
  assert out == "", (command, out)
  assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), (command, err)
  assert "Traceback" not in err
  assert not (folder / "w").exists(), command
  return err.rstrip("\n")


def dry_command(command: str) -> str | None:
  """The `lra run` command as a dry run (`--dry_run` added, unless it has one); None for the
  other commands."""
  if command.split(" ", 1)[0] != "run":
    return None
  return command if "--dry_run" in command else f"{command} --dry_run"


def _dry_line(command: str, folder: Path, capsys) -> str | None:
  """The dry run's one error line (the checks of `_error_line`), None for another command."""
  dry = dry_command(command)
  return None if dry is None else _error_line(dry, folder, capsys)


@pytest.mark.parametrize("command, message", BAD, ids=[c for c, _ in BAD])
def test_each_bad_value_is_one_line_and_exit_2(command, message, tmp_path, capsys):
  line = _error_line(command, tmp_path, capsys)
  assert message in line
  dry = _dry_line(command, tmp_path, capsys)
  assert dry in (None, line), f"{command} --dry_run ends otherwise: {dry}"


SAME = "the same line, exit status 2"


def table(lines: list[tuple[str, str, str | None]]) -> str:
  """The docs' markdown table of (command, error line, the dry run's error line or None)."""
  cut = lambda s: s if len(s) <= 170 else s[:167] + "..."  # noqa: E731
  code = lambda s: "`` " + s.replace("|", "\\|") + " ``"  # noqa: E731  (backticks inside)
  dry = lambda e, d: ("-" if d is None else SAME if d == e else code(cut(d)))  # noqa: E731
  rows = ["| Command | What it prints (exit status 2) | With `--dry_run` |", "|---|---|---|"]
  rows += [f"| {code('lra ' + c)} | {code(cut(e))} | {dry(e, d)} |" for c, e, d in lines]
  return "\n".join(rows)


def test_the_docs_table_is_what_the_commands_print(tmp_path, capsys):
  assert len(BAD) >= 80
  assert len({c for c, _ in BAD}) == len(BAD), "a command is in the table twice"
  lines = []
  for i, (command, _) in enumerate(BAD):
    folder = tmp_path / str(i)
    folder.mkdir()
    line, dry = _error_line(command, folder, capsys), _dry_line(command, folder, capsys)
    lines.append((_shown(_fill(command, folder), folder), _shown(line, folder),
                  None if dry is None else _shown(dry, folder)))
  want = table(lines)
  text = DOC.read_text()
  assert BEGIN in text and END in text, f"docs/training.md lacks the {BEGIN} ... {END} markers"
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  new = f"{head}{BEGIN}\n{want}\n{END}{tail}"
  if os.environ.get("LRA_UPDATE_DOCS") == "1" and new != text:
    DOC.write_text(new)
    text = new
  assert new == text, ("docs/training.md's bad-value table differs from what the commands "
                       "print: rerun with LRA_UPDATE_DOCS=1 to rewrite it")
  assert "| `` lra run listops --config.log_every=0 `` | `` error: config.log_every = 0: " in want
  assert all(d in (None, e) for _, e, d in lines), "a dry run ends otherwise than its run"
  assert f" | {SAME} |" in want and "| `` lra list nosuchkind `` |" in want
