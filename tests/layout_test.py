"""Tests of the codebase's layout rules (the Layout table of README.md): which room may import which, configs
that load neither jax nor tensorflow_datasets, no per-family branches in the trainer, file sizes,
no import cycle anywhere, and attention, models and lra never importing configs or launch.

Imports are read from the source with `ast` (every `import` and `from ... import`, including those
inside functions), so a rule breaks the moment someone writes the import, not when it runs.
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("attention", "models", "lra", "configs", "launch", "benchmarks")
TRAINER_MODULES = {"lra.train", "lra.loop", "lra.phases", "lra.checkpoint", "lra.mesh",
                   "lra.metrics", "lra.progress", "lra.optim", "lra.preflight", "lra.compiling"}
MAX_LINES = 520


def python_files(*folders: str) -> list[str]:
  out = []
  for folder in folders:
    for base, _, names in os.walk(os.path.join(ROOT, folder)):
      out += [os.path.relpath(os.path.join(base, n), ROOT) for n in names if n.endswith(".py")]
  return sorted(out)


def module_name(path: str) -> str:
  name = path[:-3].replace(os.sep, ".")
  return name[:-len(".__init__")] if name.endswith(".__init__") else name


def imports(path: str) -> set[str]:
  """Every module `path` imports, absolute (`from lra import tasks` gives lra and lra.tasks)."""
  with open(os.path.join(ROOT, path)) as f:
    tree = ast.parse(f.read(), path)
  package = module_name(path).rsplit(".", 1)[0] if not path.endswith("__init__.py") else \
      module_name(path)
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
      out.add(base)
      out.update(f"{base}.{alias.name}" for alias in node.names)
  return out


def within(module: str, *roots: str) -> bool:
  return any(module == r or module.startswith(r + ".") for r in roots)


def violations(files, forbidden) -> list[str]:
  return [f"{path} imports {m}" for path in files for m in sorted(imports(path))
          if forbidden(m)]


def test_the_data_room_imports_no_models_attention_or_trainer():
  bad = violations(python_files("lra/data"),
                   lambda m: within(m, "models", "attention", "launch", "configs")
                   or m in TRAINER_MODULES or within(m, "lra.tasks"))
  assert not bad, "\n".join(bad)


def test_nothing_outside_launch_imports_launch():
  files = [p for p in python_files(*PACKAGES) if not p.startswith("launch" + os.sep)]
  bad = violations(files, lambda m: within(m, "launch"))
  assert not bad, "\n".join(bad)


def test_attention_imports_only_jax_numpy_its_kernels_and_itself():
  # tokamax: the GPU kernels of the tokamax backend; absl: the flags holding tokamax's options.
  stdlib = set(sys.stdlib_module_names) | {"__future__"}
  allowed = lambda m: m.split(".")[0] in stdlib | {"jax", "numpy", "attention", "tokamax", "absl"}
  bad = violations(python_files("attention"), lambda m: not allowed(m))
  assert not bad, "\n".join(bad)


def test_the_rules_catch_a_forbidden_import(tmp_path, monkeypatch):
  # The checks above must be able to fail: a data-room file importing the models is reported.
  folder = tmp_path / "lra" / "data"
  folder.mkdir(parents=True)
  (folder / "bad.py").write_text("from models import encoder\nimport launch.cli\n")
  monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
  bad = violations(python_files("lra/data"), lambda m: within(m, "models", "launch"))
  assert bad == [f"lra{os.sep}data{os.sep}bad.py imports launch.cli",
                 f"lra{os.sep}data{os.sep}bad.py imports models",
                 f"lra{os.sep}data{os.sep}bad.py imports models.encoder"]


def test_attention_models_and_lra_never_import_configs_or_launch():
  bad = violations(python_files("attention", "models", "lra"),
                   lambda m: within(m, "configs", "launch"))
  assert not bad, "\n".join(bad)


def import_graph(*folders: str) -> dict[str, set[str]]:
  """Module -> the modules of the repository it imports (a `from package import name` counts
  as importing `package.name` when that is a module of the repository)."""
  files = python_files(*folders)
  modules = {module_name(p) for p in files}
  return {module_name(p): {m for m in imports(p) if m in modules and m != module_name(p)}
          for p in files}


def cycle(graph: dict[str, set[str]]) -> list[str]:
  """One import cycle of `graph` as [a, b, ..., a], or [] when there is none. A package's
  `__init__` importing its own submodules is not an arrow back up."""
  def arrows(module):
    return sorted(m for m in graph.get(module, ())
                  if not module.startswith(m + ".") and not m.startswith(module + "."))
  state, path = {}, []

  def visit(module):
    state[module] = "open"
    path.append(module)
    for target in arrows(module):
      if state.get(target) == "open":
        return path[path.index(target):] + [target]
      if target not in state:
        found = visit(target)
        if found:
          return found
    state[module] = "done"
    path.pop()
    return []

  for module in sorted(graph):
    if module not in state:
      found = visit(module)
      if found:
        return found
  return []


def test_no_import_cycle_anywhere():
  found = cycle(import_graph(*PACKAGES))
  assert not found, " -> ".join(found)


def test_the_layer_rules_catch_a_planted_import(tmp_path, monkeypatch):
  # A model importing the config files, and a cycle between two launch modules, are reported.
  for folder, name, text in (("models", "bad.py", "from configs import common\n"),
                             ("launch", "a.py", "from launch import b\n"),
                             ("launch", "b.py", "def f():\n  from launch import a\n")):
    (tmp_path / folder).mkdir(exist_ok=True)
    (tmp_path / folder / name).write_text(text)
  monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
  assert violations(python_files("models"), lambda m: within(m, "configs", "launch")) == [
      f"models{os.sep}bad.py imports configs", f"models{os.sep}bad.py imports configs.common"]
  assert cycle(import_graph("launch")) == ["launch.a", "launch.b", "launch.a"]
  (tmp_path / "launch" / "b.py").write_text("import os\n")
  assert cycle(import_graph("launch")) == []


def test_configs_load_neither_jax_nor_tensorflow_datasets():
  names = sorted(module_name(p) for p in python_files("configs"))
  code = ("import importlib, sys\n"
          f"for name in {names!r}:\n"
          "  module = importlib.import_module(name)\n"
          "  if hasattr(module, 'get_config') and name != 'configs.charlm':\n"
          "    module.get_config('size=small')\n"
          "import configs\n"
          "configs.build_config('enwik8', size='base', overrides=[('seed', '3')])\n"
          "heavy = sorted(m for m in ('jax', 'jaxlib', 'tensorflow_datasets', 'tensorflow', "
          "'flax', 'grain', 'orbax') if m in sys.modules)\n"
          "print('HEAVY', heavy)\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr
  assert "HEAVY []" in out.stdout, out.stdout


def test_the_trainer_never_asks_which_family_it_runs():
  for path in python_files("lra", "launch"):
    with open(os.path.join(ROOT, path)) as f:
      text = f.read()
    for pattern in ("MODEL ==", "MODEL !=", '"lm"', "test_bpc\" in", "'test_bpc' in"):
      if path.startswith(os.path.join("lra", "tasks")):
        continue
      assert pattern not in text, f"{path} contains {pattern!r}"


@pytest.mark.parametrize("folder", PACKAGES)
def test_files_stay_small(folder):
  big = []
  for path in python_files(folder):
    with open(os.path.join(ROOT, path)) as f:
      n = sum(1 for _ in f)
    if n > MAX_LINES:
      big.append(f"{path}: {n} lines")
  assert not big, f"split these by topic (at most {MAX_LINES} lines): {big}"
