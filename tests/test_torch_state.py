"""The torch plugin's checkpoint state: tensors and plain values only, so
``torch.load(weights_only=True)`` (torch's default) reads it; the NumPy form written
before still loads. The resumes themselves are tested per path (test_torch_plugin,
test_fsdp, test_diloco), every one through a ``weights_only=True`` load."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from casync.feedback import ErrorFeedback  # noqa: E402
from hipress.torch.state import plain  # noqa: E402


def _engine_like_state() -> dict:
    """The shapes an engine's ``state_dict`` has: residuals by tuple site keys, owners by
    tuple keys, NumPy scalars among the settings."""
    rng = np.random.default_rng(3)
    feedback = ErrorFeedback()
    feedback.load_state_dict({("w", 0): rng.standard_normal(10).astype(np.float32),
                              ("b", 1): rng.standard_normal(3).astype(np.float32)})
    return {"format": 1, "step": np.int64(7), "owners": {("w", 0): 1},
            "config": {"algorithm": "cgx", "algorithm parameters": {"bits": np.uint32(2)}},
            "residuals": {"grads": feedback.state_dict()}, "plan": None}


def test_plain_makes_arrays_tensors_and_scalars_python_values():
    state = _engine_like_state()
    out = plain(state)
    residual = out["residuals"]["grads"][("w", 0)]
    assert isinstance(residual, torch.Tensor) and residual.dtype == torch.float32
    # no copy: the tensor is the array's memory
    assert residual.numpy().ctypes.data == state["residuals"]["grads"][("w", 0)].ctypes.data
    assert out["step"] == 7 and type(out["step"]) is int
    assert type(out["config"]["algorithm parameters"]["bits"]) is int
    assert out["owners"] == {("w", 0): 1} and out["plan"] is None


def test_the_state_loads_under_torchs_defaults_and_the_old_form_still_does():
    state = _engine_like_state()
    buffer = io.BytesIO()
    torch.save(plain(state), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True: torch's default
    old = io.BytesIO()
    torch.save(state, old)  # the NumPy form of earlier releases
    old.seek(0)
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        torch.load(old)
    old.seek(0)
    before = torch.load(old, weights_only=False)
    for saved in (loaded, before):
        feedback = ErrorFeedback()
        feedback.load_state_dict(saved["residuals"]["grads"])
        restored = feedback.state_dict()
        for key, residual in state["residuals"]["grads"].items():
            assert restored[key].dtype == np.float32
            assert restored[key].tobytes() == residual.tobytes(), key
