"""The suite's time guard (tests/conftest.py): with LRA_SUITE_LIMIT_S set, a run that takes
longer fails after its tests and names its slowest; unset, nothing is checked."""

import os
import subprocess
import sys

import pytest

import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_over_the_limit_names_the_ten_slowest_slowest_first():
  durations = {f"t.py::test_{i}": float(i) for i in range(12)}
  report = conftest.over_limit(61.0, 60.0, durations).splitlines()
  assert report[0] == ("error: the suite took 61 s, over its limit of 60 s "
                       "(LRA_SUITE_LIMIT_S); its slowest tests:")
  assert [line.split()[-1] for line in report[1:]] == [f"t.py::test_{i}"
                                                       for i in range(11, 1, -1)]
  assert conftest.over_limit(60.0, 60.0, durations) is None
  assert conftest.over_limit(1e6, None, durations) is None


@pytest.mark.parametrize("value, limit", [("", None), ("900", 900.0), (" 2.5 ", 2.5)])
def test_the_limit_is_read_from_the_environment(monkeypatch, value, limit):
  monkeypatch.setenv("LRA_SUITE_LIMIT_S", value)
  assert conftest.suite_limit() == limit
  monkeypatch.delenv("LRA_SUITE_LIMIT_S")
  assert conftest.suite_limit() is None


@pytest.mark.parametrize("value", ["15m", "0", "-5"])
def test_a_bad_limit_is_one_line_saying_what_to_give(monkeypatch, value):
  monkeypatch.setenv("LRA_SUITE_LIMIT_S", value)
  with pytest.raises(ValueError, match="give the suite's limit in seconds, such as 900"):
    conftest.suite_limit()


def test_a_run_over_the_limit_fails_after_its_tests_and_names_them():
  test = "tests/suite_time_test.py::test_over_the_limit_names_the_ten_slowest_slowest_first"
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                        cwd=ROOT, capture_output=True, text=True, timeout=300,
                        env={**os.environ, "LRA_SUITE_LIMIT_S": "0.001"})
  assert proc.returncode == 1, proc.stdout[-3000:]
  assert "1 passed" in proc.stdout
  lines = proc.stdout.splitlines()
  first = next(i for i, line in enumerate(lines) if line.startswith("error: the suite took"))
  assert "over its limit of 0 s (LRA_SUITE_LIMIT_S)" in lines[first]
  assert lines[first + 1].split()[-1] == test


@pytest.mark.parametrize("markexpr, env, wanted", [
    ("", None, False), ("not slow", "", False), ("", "0", False), ("exhaustive", None, True),
    ("not slow or exhaustive", None, True), ("", "1", True), ("not slow", " yes ", True)])
def test_the_exhaustive_tier_runs_only_when_asked_for(markexpr, env, wanted):
  assert conftest.exhaustive_wanted(markexpr, env) is wanted


def test_an_exhaustive_case_is_skipped_by_default_and_run_on_request(tmp_path):
  (tmp_path / "tier_test.py").write_text(
      "import pytest\n"
      "def test_default():\n  pass\n"
      "@pytest.mark.exhaustive\n"
      "def test_more():\n  pass\n")
  (tmp_path / "conftest.py").write_text(
      "import importlib.util\n"
      f"spec = importlib.util.spec_from_file_location('suite', {os.path.join(ROOT, 'tests', 'conftest.py')!r})\n"
      "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
      "pytest_configure = suite.pytest_configure\n"
      "pytest_collection_modifyitems = suite.pytest_collection_modifyitems\n")

  def run(*args, **env):
    environ = {k: v for k, v in os.environ.items() if k != "LRA_TEST_EXHAUSTIVE"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-p", "no:randomly", *args, "tier_test.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**environ, **env})

  default = run()
  assert "1 passed, 1 skipped" in default.stdout, default.stdout[-2000:]
  assert "exhaustive tier: run with -m exhaustive or LRA_TEST_EXHAUSTIVE=1" in default.stdout
  assert "2 passed" in run(LRA_TEST_EXHAUSTIVE="1").stdout
  only = run("-m", "exhaustive")
  assert "1 passed, 1 deselected" in only.stdout, only.stdout[-2000:]
