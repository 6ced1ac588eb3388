"""A cluster on paper: the figures the simulator prices a GPU cluster with, each stated
once with where it comes from, and which of them each strategy's prediction rests on.

``CostModel.cluster`` turns them into a cost model; ``hipress bench simulate`` prints
them and, beside each prediction, the ones it rests on. None is measured on this host:
they describe V100-class nodes (8 GPUs on NVLink, PCIe 3.0 to the host) on Ethernet, the
HiPress paper's cluster, so read every simulated figure as a consequence of this list.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Assumption", "ASSUMPTIONS", "RESTS_ON", "value", "rests_on"]


@dataclass(frozen=True)
class Assumption:
    """One stated figure: its key, value and unit, what it prices, and its source."""

    key: str
    value: float
    unit: str
    what: str
    source: str


ASSUMPTIONS: dict[str, Assumption] = {a.key: a for a in (
    Assumption("net-rate", 0.38, "x line rate", "bytes of a message between nodes",
               "fits of measured 16-node clusters: ~38 Gbit/s effective on 100 Gbit/s "
               "links; with it, allreduce of VGG on 2 x 8 V100 at 25 Gbit/s comes out "
               "near a public measurement of VGG16 there (0.31 scaling efficiency: "
               "1149 img/s on 16 GPUs, 230 on one)"),
    Assumption("net-fixed", 100e-6, "s", "fixed cost of a message between nodes",
               "the same fits: several times a bare round trip (25 us)"),
    Assumption("nvlink", 130e9, "B/s", "reduce-scatter and all-gather inside a node",
               "NCCL bus bandwidth on 8 V100 with NVLink (DGX-1 class)"),
    Assumption("pcie", 12e9, "B/s", "a GPU's copies to and from host memory",
               "PCIe 3.0 x16, per direction, as BytePS's CPU path copies"),
    Assumption("gpu-codec", 150e9, "B/s", "GPU codec kernels (input streamed)",
               "a sixth of the V100's 900 GB/s HBM2: what memory-bound CompLL-style "
               "kernels reach"),
    Assumption("gpu-select", 30e9, "B/s", "top-k selection kernels (dgc)",
               "a fifth of gpu-codec: sampling, threshold and compaction passes"),
    Assumption("launch", 8e-6, "s", "a small GPU kernel (a codec call, one step of "
               "PowerSGD's orthogonalization)", "CUDA launch latency of 5-10 us"),
    Assumption("hbm", 800e9, "B/s", "elementwise passes (merges, error feedback, copies)",
               "~90 % of the V100's 900 GB/s HBM2, what a streaming add reaches"),
    Assumption("gemm", 10e12, "FLOP/s", "fp32 GEMMs (PowerSGD's)",
               "10 of the V100's 15.7 peak TFLOP/s"),
    Assumption("cpu-codec", 2e9, "B/s", "BytePS's CPU compression per GPU, and a node's "
               "server (decode, sum, re-encode)", "BytePS's defaults: 4 OpenMP threads per "
               "GPU (BYTEPS_OMP_THREAD_PER_GPU), 4 engine threads per server "
               "(BYTEPS_SERVER_ENGINE_THREAD); 0.5 GB/s per thread assumed, between "
               "GRACE's onebit in framework ops (0.15 GB/s per thread) and CompLL's CPU "
               "kernel (~5 GB/s on one core of this host)"),
    Assumption("gpu-share", 1.0, "", "codec kernels share the GPU with backward: the GPU "
               "does both (work-conserving time sharing), the engine's kernels first",
               "kernels of two streams interleave on the SMs; memory-bound kernels gain "
               "nothing from running side by side"),
)}

#: What each simulated strategy's prediction rests on (the keys above).
RESTS_ON: dict[str, tuple[str, ...]] = {
    "allreduce": ("net-rate", "net-fixed", "nvlink", "hbm"),
    "byteps-onebit": ("net-rate", "net-fixed", "nvlink", "pcie", "cpu-codec"),
    "ring-dgc": ("net-rate", "net-fixed", "nvlink", "gpu-select", "gpu-codec", "launch",
                 "gpu-share"),
    "naive": ("net-rate", "net-fixed", "gpu-codec", "launch", "gpu-share"),
    "powersgd": ("net-rate", "net-fixed", "nvlink", "gemm", "launch", "hbm", "gpu-share"),
    "casync": ("net-rate", "net-fixed", "nvlink", "gpu-codec", "gpu-select", "launch",
               "hbm", "gpu-share"),
}


def value(key: str) -> float:
    """The value of the assumption ``key``."""
    return ASSUMPTIONS[key].value


def rests_on(strategy: str) -> tuple[str, ...]:
    """The assumptions a strategy's prediction rests on (``casync-*`` share one list)."""
    return RESTS_ON["casync" if strategy.startswith("casync") else strategy]
