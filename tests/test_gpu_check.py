"""The prepared device check: its report's shape, here where no GPU is."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, bench_module

pytestmark = pytest.mark.pure


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="with a GPU the check runs for real: make gpu-check")
def test_without_a_gpu_every_check_is_skipped_and_reported(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["checks"]) == {"tests", "kernels", "nan payloads", "train hook x1",
                                     "train hook x2", "train optimizer x2"}
    assert {c["status"] for c in report["checks"].values()} == {"skipped"}
    assert "| tests | skipped | no CUDA device |" in (tmp_path / "report.md").read_text()


def test_the_markdown_report_lists_every_kernel_row():
    gpu_check = bench_module("gpu_check")
    row = {"algorithm": "dgc", "payload_bytes": 1, "encode_ms": 1.0, "decode_ms": 2.0,
           "copy_GBps": 3000.0, "encode_vs_copy": 0.7, "decode_vs_copy": 0.9,
           "encode_vs_topk": 6.5}
    report = {"device": "H200", "torch": "2.11", "nvcc": "nvcc", "when": "now",
              "checks": {"kernels": {"status": "passed", "elements": 10, "rows": [row]},
                         "train hook x2": {"status": "passed", "replicas_identical": True,
                                           "samples_per_s": 1234.0}}}
    text = gpu_check.markdown(report)
    assert "| dgc | 1.00 | 2.00 | 0.70 | 0.90 | 6.5x |" in text
    assert "| train hook x2 | passed | replicas identical: True, 1234 samples/s |" in text


def test_payloads_that_differ_in_nan_words_only_are_told_apart():
    """A GPU writes the canonical NaN (0x7FFFFFFF) where x86 keeps the input's payload:
    such a payload is reported apart, and any other difference is still one."""
    import numpy as np

    gpu_check = bench_module("gpu_check")
    want = np.array([1.5, np.nan, -2.0, 0.25], np.float32)
    want.view(np.uint32)[1] = 0xFFC00123  # a negative NaN with a payload, as x86 passes it
    got = want.copy()
    got.view(np.uint32)[1] = 0x7FFFFFFF
    assert gpu_check.nan_only(got.tobytes(), want.tobytes())
    halves = np.array([0x3C00, 0x7E01, 0xC000, 0], np.uint16)  # f16: 1, NaN, -2, 0
    other = halves.copy()
    other[1] = 0x7FFF
    assert gpu_check.nan_only(other.tobytes(), halves.tobytes())
    got.view(np.uint32)[2] ^= 1  # a float that is not a NaN changed too
    assert not gpu_check.nan_only(got.tobytes(), want.tobytes())
    assert not gpu_check.nan_only(b"\x00" * 8, b"\x00" * 12)
    assert not gpu_check.nan_only(np.float32([np.nan, 1]).tobytes(),
                                  np.float32([2, 1]).tobytes())
