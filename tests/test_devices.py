"""The device-generic engine: chunks on a device keep their buffers there and stage only
compressed messages through host memory (``casync.devices``).

No GPU here: CPU tensors stand in for CUDA ones (``ranks._stand_in``), so the engine runs
the device path's code (torch buffers, residuals and scratch, staged messages) with the
CPU kernels, and must give the host path's bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import ranks
import torch

from casync.devices import LENGTH, HostMemory, Link, Message, TorchMemory, link_for, memory_of
from casync.feedback import ErrorFeedback
from casync.staging import stage
from hipress.errors import ConfigError, PayloadError


class _NoTransport:
    rank, size = 0, 2


def _staged() -> Link:
    return link_for(TorchMemory("cpu"), _NoTransport())  # type: ignore[arg-type]


def test_links_are_named_by_memory():
    assert link_for(HostMemory(), _NoTransport()).name == "gloo"  # type: ignore[arg-type]
    assert _staged().name == "staged"
    assert memory_of(np.zeros(3, np.float32)).device == "cpu"
    assert isinstance(memory_of(np.zeros(3, np.float32)), HostMemory)
    assert isinstance(memory_of(torch.zeros(3)), TorchMemory)


def test_a_staged_message_carries_only_the_payloads_through_host_memory():
    link = _staged()
    memory = link.memory
    buf = memory.empty(LENGTH + 16, np.uint8)
    buf[LENGTH:LENGTH + 5] = torch.arange(5, dtype=torch.uint8)
    hosts: list[np.ndarray] = []

    def host(size: int) -> np.ndarray:
        hosts.append(np.empty(size, np.uint8))
        return hosts[-1]

    sent = link.outgoing(buf, 5, host)
    assert isinstance(sent.wire, np.ndarray) and sent.wire.size == LENGTH + 5
    assert int(sent.wire[:LENGTH].view(np.uint64)[0]) == 5
    assert sent.wire[LENGTH:].tolist() == [0, 1, 2, 3, 4]
    assert isinstance(sent.payloads, torch.Tensor)  # the local decode reads the device copy
    received = Message(np.concatenate([sent.wire, np.zeros(11, np.uint8)]))  # a big buffer
    payloads = link.payloads(received, lambda size: memory.empty(size, np.uint8))
    assert isinstance(payloads, torch.Tensor) and payloads.tolist() == [0, 1, 2, 3, 4]
    assert link.payloads(received, lambda size: pytest.fail("copied twice")) is payloads


@pytest.mark.parametrize("wire,error", [(np.zeros(3, np.uint8), "has no length"),
                                        (np.array([9, 0, 0, 0, 0, 0, 0, 0, 1], np.uint8),
                                         "declares 9 bytes")])
def test_a_truncated_staged_message_is_a_payload_error(wire, error):
    link = _staged()
    with pytest.raises(PayloadError, match=error):
        link.payloads(Message(wire), lambda size: link.memory.empty(size, np.uint8))


def test_residuals_live_on_the_device_and_checkpoint_as_host_arrays():
    memory = TorchMemory("cpu")
    ef = ErrorFeedback()
    r = ef.site("a", 4, memory)
    assert isinstance(r, torch.Tensor) and r.tolist() == [0, 0, 0, 0]
    r += 1.5
    assert ef.site("a", 4, memory) is r  # kept while the site stays the same
    state = ef.state_dict()
    assert isinstance(state["a"], np.ndarray) and state["a"].tolist() == [1.5] * 4
    fresh = ErrorFeedback()
    fresh.load_state_dict(state)
    version = fresh.version
    moved = fresh.site("a", 4, memory)
    assert isinstance(moved, torch.Tensor) and moved.tolist() == [1.5] * 4
    assert fresh.version != version  # the engine's cached addresses are looked up again
    assert isinstance(fresh.site("a", 4), np.ndarray)  # and back on the host
    assert fresh.site("a", 4).tolist() == [1.5] * 4


def test_staging_keeps_host_data_in_place_and_refuses_other_devices():
    t = torch.arange(6, dtype=torch.float32)
    buf, write_back, ptr, memory = stage(t)
    assert isinstance(buf, np.ndarray) and not write_back and ptr == t.data_ptr()
    assert memory is None
    with pytest.raises(ConfigError, match="CPU and CUDA tensors, not meta"):
        stage(torch.empty(3, device="meta"))


def _run(tmp_path, scenario, name, args):
    results = ranks.launch(2, scenario, tmp_path / name, args)
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
    return results


@pytest.mark.parallel
@pytest.mark.parametrize("link", ["staged", "nccl"])
def test_the_device_path_gives_the_host_paths_bits(tmp_path, link):
    """Every topology, fp16/bf16/non-contiguous tensors (upcast and written back), small
    tensors through the plain allreduce: the same bits either way."""
    args = {"algos": ["onebit", "dgc", "minmax8", "cgx"]}
    host = _run(tmp_path, "strategies", "host", args)
    device = _run(tmp_path, "strategies", "device", {**args, "device": link})
    assert [r["links"] for r in host] == [["gloo"], ["gloo"]]
    assert [r["links"] for r in device] == [[link], [link]]
    for h, d in zip(host, device, strict=True):
        assert h["arrays"].keys() == d["arrays"].keys()
        for key in h["arrays"]:
            assert h["arrays"][key].tobytes() == d["arrays"][key].tobytes(), key


@pytest.mark.parallel
@pytest.mark.parametrize("link", ["staged", "nccl"])
@pytest.mark.parametrize("topology", ["ps", "ring"])
def test_error_feedback_on_the_device_path_gives_the_host_paths_bits(tmp_path, topology,
                                                                     link):
    args = {"algo": "onebit", "topology": topology, "steps": 20}
    host = _run(tmp_path, "feedback", "host", args)
    device = _run(tmp_path, "feedback", "device", {**args, "device": link})
    for h, d in zip(host, device, strict=True):
        assert sorted(h["arrays"]) == sorted(d["arrays"]) and len(h["arrays"]) > 1
        for key in h["arrays"]:  # the running sums and every residual
            assert h["arrays"][key].tobytes() == d["arrays"][key].tobytes(), key


@pytest.mark.parallel
@pytest.mark.parametrize("link,bf16", [("staged", False), ("staged", True), ("nccl", True)])
def test_the_torch_plugin_on_the_device_path_gives_the_host_paths_bits(tmp_path, link, bf16):
    """The DDP hook (a bucket's gradients are views of one buffer) and DistributedOptimizer;
    bf16 gradients are upcast where they live and written back."""
    args = {"modes": ["hook", "optimizer"], "algos": ["onebit", "none"], "steps": 6,
            "bf16": bf16}
    host = _run(tmp_path, "torch_plugin", "host", args)
    device = _run(tmp_path, "torch_plugin", "device", {**args, "device": link})
    for h, d in zip(host, device, strict=True):
        for key in ("hook/onebit", "hook/none", "optimizer/onebit", "optimizer/none"):
            assert h[key]["digest"] == d[key]["digest"], key
            assert h[key]["losses"] == d[key]["losses"], key


def test_views_of_one_buffer_reduce_in_place():
    from casync.chunks import Entry, Segment
    from casync.graphs import _contiguous

    memory = TorchMemory("cpu")
    bucket = torch.zeros(10)

    def seg(t: torch.Tensor, lo: int = 0) -> Segment:
        return Segment(Entry("t", t, t, ptr=t.data_ptr(), memory=memory), lo,
                       t.numel())

    flat = _contiguous([seg(bucket[:4]), seg(bucket[4:])], memory)
    assert flat is not None and flat.data_ptr() == bucket.data_ptr() and flat.numel() == 10
    flat += 1
    assert bucket.tolist() == [1.0] * 10
    assert _contiguous([seg(bucket[:4]), seg(torch.zeros(6))], memory) is None
    assert _contiguous([seg(bucket[:4]), seg(bucket[5:])], memory) is None


def test_the_sequencer_posts_in_number_order_whatever_order_they_are_ready():
    from casync.transport import Handle, Posted, Sequencer

    seq = Sequencer()
    numbers = [seq.number() for _ in range(4)]
    posted: list[int] = []

    def post(n: int):
        def run():
            posted.append(n)
            if n == 2:
                raise RuntimeError("peer gone")
            return f"work{n}"
        return run

    handles = {n: Handle(None, -1, Posted.EXCHANGE, None) for n in numbers}
    for n in (3, 1):  # ready early: wait for 0
        seq.post(n, post(n), handles[n])
    assert posted == [] and not handles[1].ready.is_set()
    seq.post(0, post(0), handles[0])
    assert posted == [0, 1] and handles[1].work == "work1" and not handles[3].ready.is_set()
    seq.post(2, post(2), handles[2])
    assert posted == [0, 1, 2, 3] and handles[3].ready.is_set()
    assert isinstance(handles[2].error, RuntimeError)  # raised by the waiter, not here


def test_the_nccl_transport_says_what_it_needs():
    from casync.links import cuda_transport_of
    from casync.transport import NcclTransport

    if not torch.distributed.is_nccl_available():
        with pytest.raises(ConfigError, match="needs torch with NCCL and a CUDA device"):
            NcclTransport()
    with pytest.raises(ConfigError, match="give 'auto', 'staged' or 'nccl'"):
        cuda_transport_of("tcp")
    assert cuda_transport_of("auto") == "staged"  # no NCCL default group here
    assert cuda_transport_of("nccl") == "nccl"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _copies(tmp_path, topology, cuda):
    args = {"topology": topology, "device": "staged", "cuda": cuda}
    for rank, r in enumerate(_run(tmp_path, "host_copies", "copies", args)):
        # Only compressed messages leave the device: what is copied to the host is at most
        # what is sent, and onebit's payloads are about 1/32 of the gradients.
        assert 0 < r["copied"] <= r["sent"], (rank, r)
        assert r["copied"] < r["gradients"] / 16, (rank, r)


@pytest.mark.parallel
@pytest.mark.parametrize("topology", ["ps", "ring", "allgather"])
def test_the_staged_link_copies_only_compressed_bytes_to_the_host(tmp_path, topology):
    _copies(tmp_path, topology, cuda=False)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("topology", ["ps", "ring"])
def test_no_full_precision_host_copy_of_a_cuda_gradient(tmp_path, topology):
    _copies(tmp_path, topology, cuda=True)


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensors_give_the_host_paths_bits(tmp_path):
    """Two ranks on one GPU (staged): the CUDA kernels inside the engine, pinned copies,
    residuals on the device — the bits of the same job on host tensors."""
    args = {"algos": ["onebit", "dgc", "minmax8", "cgx"]}
    host = _run(tmp_path, "strategies", "host", args)
    gpu = _run(tmp_path, "strategies", "cuda", {**args, "cuda": True})
    assert [r["links"] for r in gpu] == [["staged"], ["staged"]]
    for h, d in zip(host, gpu, strict=True):
        for key in h["arrays"]:
            assert h["arrays"][key].tobytes() == d["arrays"][key].tobytes(), key


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("topology", ["ps", "ring"])
def test_error_feedback_on_cuda_gives_the_host_paths_bits(tmp_path, topology):
    args = {"algo": "onebit", "topology": topology, "steps": 20}
    host = _run(tmp_path, "feedback", "host", args)
    gpu = _run(tmp_path, "feedback", "cuda", {**args, "cuda": True})
    for h, d in zip(host, gpu, strict=True):
        for key in h["arrays"]:
            assert h["arrays"][key].tobytes() == d["arrays"][key].tobytes(), key
