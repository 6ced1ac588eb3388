import importlib
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import hipress

ROOT = Path(__file__).resolve().parent.parent

ALGORITHMS = hipress.algorithms()
SIZES = [0, 1, 7, 8, 9, 1000, 2**20 + 3]


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def gradient(n: int, seed: int = 0) -> np.ndarray:
    """A heavy-tailed synthetic gradient with some exact zeros."""
    r = np.random.default_rng(seed)
    g = r.standard_normal(n) * r.exponential(1.0, n)
    g[r.random(n) < 0.01] = 0.0
    return g.astype(np.float32)


def bench_module(name: str) -> ModuleType:
    """A module of bench/ (in the source tree, not the installed package), imported with
    the repository root on sys.path only while it loads."""
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module(f"bench.{name}")
    finally:
        sys.path.remove(str(ROOT))


@pytest.fixture(scope="session", autouse=True)
def _private_kernel_cache(tmp_path_factory):
    """Build kernels into a cache private to this test session."""
    import os

    old = os.environ.get("HIPRESS_CACHE_DIR")
    os.environ["HIPRESS_CACHE_DIR"] = str(tmp_path_factory.mktemp("hipress-cache"))
    yield
    if old is None:
        os.environ.pop("HIPRESS_CACHE_DIR", None)
    else:
        os.environ["HIPRESS_CACHE_DIR"] = old
