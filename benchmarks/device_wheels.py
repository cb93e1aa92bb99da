"""Stages the wheels that the GPU machine lacks, for `benchmarks/device_check.py`.

The GPU machine we measure on has no network. Its Python (3.12) already has jax, jaxlib with the
CUDA plugin, flax, optax, orbax-checkpoint, chex, etils, numpy, Pillow, tqdm, pytest and
pytest-xdist, but not the data, config and kernel libraries below (`MISSING`, with their small
dependencies). This script downloads them from the package registry into
`device-wheels/cp<tag>/` (git-ignored), one wheel per package, exactly the versions that
`setup.py` pins (the other versions are the ones our pinned stack resolves to), and writes
`manifest.json` beside them: name, version, file, sha256 and size of each wheel, and the total.

On the device the wheels are installed with `pip install --no-index --no-deps --target DIR` into
a temporary folder put on `PYTHONPATH` (device_check.py does this), so nothing may be missing:
every `Requires-Dist` of every staged wheel (markers evaluated for the target Python, extras
ignored) must be staged too or be one of `TARGET_HAS`, the packages the GPU machine's image is
known to hold. The script checks this after downloading and fails naming the package to add.

  .venv/bin/python benchmarks/device_wheels.py                    # cp312, for the GPU machine
  .venv/bin/python benchmarks/device_wheels.py --python-tag 311   # this machine (rehearsal)

Idempotent: a wheel already in the folder (same name and version, hash unchanged since the
manifest) is not downloaded again. `promise` has no wheel on the registry; it is built once with
`pip wheel --no-deps` (pure Python, any tag).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_DEST = os.path.join(ROOT, "device-wheels")

# Packages the GPU machine lacks -> version. setup.py pins tensorflow-datasets, grain,
# ml-collections, tensorboardX and tokamax (keep these equal to it; tests/device_check_test.py
# checks); the rest are their dependencies at the versions our pinned stack resolves to.
MISSING = {
    "tensorflow-datasets": "4.9.10",
    "grain": "0.2.18",
    "ml-collections": "1.1.0",
    "tensorboardX": "2.6.5",
    "tokamax": "0.0.12",
    "annotated-types": "0.8.0",
    "array-record": "0.8.6",
    "dm-tree": "0.1.10",
    "docstring-parser": "0.18.0",
    "einshape": "1.0",
    "googleapis-common-protos": "1.76.0",
    "immutabledict": "4.3.1",
    "portpicker": "1.6.0",
    "promise": "2.3",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "qwix": "0.1.8",
    "simple-parsing": "0.1.9",
    "tensorflow-metadata": "1.21.0",
    "termcolor": "3.3.0",
    "toml": "0.10.2",
    "typeguard": "2.13.3",
    "typing-inspection": "0.4.5",
}
# Built locally: no wheel of these is on the registry.
BUILD_FROM_SOURCE = {"promise"}

# What the GPU machine's image holds that the staged wheels (or our code) need. The rehearsal
# installs exactly these from the registry into its fresh environment, so a dependency missing
# from both lists fails there as it would on the device.
TARGET_HAS = (
    "absl-py", "attrs", "chex", "cloudpickle", "etils", "flax", "fsspec", "humanize",
    "importlib-resources", "jax", "jaxlib", "jaxtyping", "msgpack", "numpy", "opt-einsum",
    "optax", "orbax-checkpoint", "packaging", "pillow", "protobuf", "psutil", "pyarrow",
    "pytest", "pytest-xdist", "pyyaml", "requests", "rich", "scipy", "six", "tensorboard",
    "tensorstore", "tqdm", "treescope", "typing-extensions", "wrapt", "zipp",
)

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def canonical(name: str) -> str:
  """PEP 503 normalised project name."""
  return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(filename: str) -> tuple[str, str]:
  """(canonical name, version) of a wheel file name."""
  parts = os.path.basename(filename).split("-")
  return canonical(parts[0]), parts[1]


def sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _tag_matches(filename: str, python_tag: str) -> bool:
  """Whether a wheel installs on CPython `python_tag` (e.g. "312") on x86_64 Linux."""
  stem = os.path.basename(filename)[:-len(".whl")]
  py, abi, plat = stem.split("-")[-3:]
  pure = plat == "any"
  return ((pure and ("py3" in py.split(".") or f"cp{python_tag}" in py.split(".")))
          or (f"cp{python_tag}" in py.split(".") and "x86_64" in plat))


def staged(dest: str, python_tag: str) -> dict[str, str]:
  """Canonical name -> wheel path already in `dest` for `python_tag`."""
  out = {}
  if os.path.isdir(dest):
    for f in sorted(os.listdir(dest)):
      if f.endswith(".whl") and _tag_matches(f, python_tag):
        out[wheel_name_version(f)[0]] = os.path.join(dest, f)
  return out


def download(dest: str, python_tag: str, quiet: bool = True) -> list[str]:
  """Downloads (or builds) every wheel of `MISSING` not yet in `dest`; returns the new names."""
  os.makedirs(dest, exist_ok=True)
  have = staged(dest, python_tag)
  todo = [(n, v) for n, v in MISSING.items()
          if canonical(n) not in have or wheel_name_version(have[canonical(n)])[1] != v]
  for name, _ in todo:   # a stale version of a package would make two wheels of one name
    if canonical(name) in have:
      os.remove(have[canonical(name)])
  pip = [sys.executable, "-m", "pip"]
  q = ["-q"] if quiet else []
  fetch = [f"{n}=={v}" for n, v in todo if canonical(n) not in BUILD_FROM_SOURCE]
  if fetch:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(pip + ["download", *q, "--no-deps", "--only-binary=:all:", "--python-version",
                          python_tag[0] + "." + python_tag[1:], "--implementation", "cp",
                          *platforms, "-d", dest, *fetch], check=True)
  for n, v in todo:
    if canonical(n) in BUILD_FROM_SOURCE:
      subprocess.run(pip + ["wheel", *q, "--no-deps", "-w", dest, f"{n}=={v}"], check=True)
  return [n for n, _ in todo]


def requirements(wheel: str, python_tag: str) -> list[str]:
  """Canonical names a wheel requires on CPython `python_tag`, Linux x86_64, no extras."""
  from packaging.requirements import Requirement

  env = dict(python_version=python_tag[0] + "." + python_tag[1:],
             python_full_version=python_tag[0] + "." + python_tag[1:] + ".0",
             sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
             os_name="posix", implementation_name="cpython",
             platform_python_implementation="CPython", extra="")
  with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode("utf-8", "replace").splitlines()
  out = []
  for line in lines:
    if not line.startswith("Requires-Dist:"):
      continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is None or req.marker.evaluate(env):
      out.append(canonical(req.name))
  return out


def check_complete(dest: str, python_tag: str) -> None:
  """Raises ValueError naming any package a staged wheel needs that is neither staged nor in
  `TARGET_HAS`, and any package of `MISSING` without a wheel."""
  have = staged(dest, python_tag)
  absent = sorted(canonical(n) for n in MISSING if canonical(n) not in have)
  if absent:
    raise ValueError(f"no wheel in {dest} for {', '.join(absent)}: run `make device-wheels`.")
  known = set(have) | {canonical(n) for n in TARGET_HAS}
  for name, path in sorted(have.items()):
    gaps = sorted(set(requirements(path, python_tag)) - known)
    if gaps:
      raise ValueError(f"{os.path.basename(path)} needs {', '.join(gaps)}, which the GPU machine "
                       f"lacks: add it to MISSING in benchmarks/device_wheels.py.")


def write_manifest(dest: str, python_tag: str) -> dict:
  """Writes `dest/manifest.json` (name, version, file, sha256, bytes per wheel; total)."""
  rows = []
  for name, path in sorted(staged(dest, python_tag).items()):
    rows.append(dict(name=name, version=wheel_name_version(path)[1],
                     file=os.path.basename(path), sha256=sha256(path),
                     bytes=os.path.getsize(path)))
  manifest = dict(python_tag=f"cp{python_tag}", wheels=rows,
                  total_bytes=sum(r["bytes"] for r in rows))
  with open(os.path.join(dest, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
    f.write("\n")
  return manifest


def wheels_dir(root: str, python_tag: str) -> str:
  """The folder of one Python's wheels under `root`."""
  return os.path.join(root, f"cp{python_tag}")


def stage(root: str = DEFAULT_DEST, python_tag: str = "312", quiet: bool = True) -> dict:
  """Downloads, checks and lists the wheels for `python_tag`; returns the manifest."""
  dest = wheels_dir(root, python_tag)
  download(dest, python_tag, quiet=quiet)
  check_complete(dest, python_tag)
  return write_manifest(dest, python_tag)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dest", default=DEFAULT_DEST,
                 help="root folder; wheels go to DEST/cp<tag>/ (default device-wheels)")
  p.add_argument("--python-tag", default="312",
                 help="CPython version without the dot: 312 for the GPU machine (default), "
                      "311 for this machine's rehearsal")
  args = p.parse_args(argv)
  if not re.fullmatch(r"3\d{1,2}", args.python_tag):
    p.error(f"--python-tag must look like 312, got {args.python_tag!r}")
  try:
    manifest = stage(args.dest, args.python_tag, quiet=True)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  dest = wheels_dir(args.dest, args.python_tag)
  print(f"{len(manifest['wheels'])} wheels for {manifest['python_tag']} in {dest}: "
        f"{manifest['total_bytes'] / 2**20:.1f} MiB (manifest.json)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
