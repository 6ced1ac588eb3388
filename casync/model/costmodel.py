"""The cost model: each primitive costs t(x) = a + b·x, fitted from measurements.

A ``CostModel`` holds one ``Linear`` per primitive, keyed by ``Cost.KIND.key(...)``
(the strings below, as profiles are cached), the world it was measured on and where.
The profiler (``casync.model.profiler``) fills it on a real group; ``CostModel.cluster``
builds one for a hypothetical cluster from stated hardware figures. The planner and
the simulator read nothing else.

Keys: ``send`` (seconds per message of x bytes between two ranks while every rank
sends), ``allreduce`` (seconds for x float32 elements over the measured world),
``exchange`` (seconds for a compress-and-all-gather baseline's exchange of x payload
bytes per rank: an all-gather of the payload sizes, then one of the payloads),
``merge`` (x elements added in place), ``encode/ALGO`` (x elements, with error feedback
where the engine keeps it), ``decode/ALGO`` (into a buffer, scaled: a rank's final
values), ``accumulate/ALGO`` (decode-and-merge: an aggregator's or a hop's merge),
``fuse/ALGO`` (an aggregator's or a hop's last merge and its re-encode in one call, as
the CPU kernels run them; without it they cost ``accumulate`` plus ``encode``),
``bytes/ALGO`` (payload bytes for x elements), ``graph/TOPOLOGY`` and ``tensor/TOPOLOGY``
(the engine's own cost per chunk graph and per segment in it, beyond its primitives:
building the graph, dispatching its tasks, submitting the tensors) and, for several
GPUs per node, ``intra`` (seconds per byte moved within a node); the engine's own cost
per element of big steps, ``bulk/ALGO/TOPOLOGY``; the naive baseline's per tensor,
``naive``; and in cluster models, ``flops`` (PowerSGD's GEMMs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from compll.codec import codec as make_codec
from hipress_base.errors import ConfigError

__all__ = ["Cost", "Linear", "CostModel", "payload_bytes"]


@dataclass(frozen=True)
class Linear:
    """t(x) = max(a + b·x, floor), with the R² of the fit that produced it and the
    measured points ``(x, t)`` it was fitted to (kept in profiles, to inspect or refit).

    Example:
        >>> Linear.fit([1, 2, 3], [2.0, 3.0, 4.0])(10)
        11.0
    """

    a: float
    b: float
    r2: float = 1.0
    floor: float = 0.0
    points: tuple[tuple[float, float], ...] = ()

    def __call__(self, x: float) -> float:
        return max(self.a + self.b * x, self.floor)

    @classmethod
    def fit(cls, xs: Any, ts: Any, fixed: str = "min") -> Linear:
        """Fit ``ts ≈ a + b·xs`` in its two regimes (Hockney's latency-bandwidth model):
        ``b`` by least squares over the larger half of the sizes, ``a`` as the smallest
        ``t - b·x`` over the smaller half (noise only ever adds time, and a spike in one
        small collective made plain ps look slow enough for a worse plan to win), or with
        ``fixed="mean"`` as their mean (for a cost a strictly serial chain pays at every
        call, spikes included); a negative value is clamped to 0 and the smallest
        measured time becomes the floor.

        One line through every size lets the largest set the intercept too: a send's
        fixed cost came out at 5x the measured time of a 1 KiB message, and a step pays it
        for every message. And sizes that stay in a cache or inside a link's burst run
        faster per unit than the bulk does, so the small sizes must not set the slope.
        """
        if fixed not in ("min", "mean"):
            raise ConfigError(f"fixed must be 'min' or 'mean', not {fixed!r}")
        x = np.asarray(xs, np.float64)
        t = np.asarray(ts, np.float64)
        if x.size < 2 or np.ptp(x) == 0:
            raise ConfigError("fitting a line needs at least two distinct sizes")
        order = np.argsort(x, kind="stable")
        x, t = x[order], t[order]
        half = x.size // 2
        big, small = slice(half if np.ptp(x[half:]) > 0 else 0, None), slice(0, max(half, 1))
        (b, _), *_ = np.linalg.lstsq(np.stack([x[big], np.ones_like(x[big])], 1), t[big],
                                     rcond=None)
        b = max(float(b), 0.0)
        reduce = np.min if fixed == "min" else np.mean
        a = max(float(reduce(t[small] - b * x[small])), 0.0)
        resid = t - (a + b * x)
        spread = float(np.sum((t - t.mean()) ** 2))
        r2 = 1.0 - float(np.sum(resid ** 2)) / spread if spread > 0 else 1.0
        points = tuple((float(u), float(v)) for u, v in zip(x, t, strict=True))
        return cls(a, b, r2, float(t.min()), points)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"a": self.a, "b": self.b, "r2": self.r2, "floor": self.floor}
        if self.points:
            out["points"] = [list(p) for p in self.points]
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Linear:
        points = tuple((float(u), float(v)) for u, v in d.get("points", ()))
        return cls(float(d["a"]), float(d["b"]), float(d.get("r2", 1.0)),
                   float(d.get("floor", 0.0)), points)


class Cost(StrEnum):
    """What an entry of a cost profile prices. ``key`` names the entry as profiles are
    cached: the kind, then the algorithm and/or topology it is for (``encode/onebit``,
    ``graph/ring``, ``bulk/dgc/ps``, ``send``)."""

    ENCODE = "encode"  # per algorithm: with error feedback's residual
    PLAIN = "plain"  # per algorithm: without one (the naive baseline's)
    DECODE = "decode"
    ACCUMULATE = "accumulate"  # decode into a sum
    FUSE = "fuse"  # an aggregator's last merge and its re-encode, in one call
    BYTES = "bytes"  # payload bytes per element count
    MERGE = "merge"  # an uncompressed add
    SEND = "send"  # a point-to-point message, by bytes
    INTRA = "intra"  # bytes moved inside a node of several GPUs
    PCIE = "pcie"  # bytes copied between a GPU and host memory
    LAUNCH = "launch"  # a small GPU kernel's fixed cost
    CPU = "cpu"  # per algorithm: host-side compression per element (BytePS's)
    FLOPS = "flops"  # fp32 GEMM work (PowerSGD's), by floating-point operations
    EXCHANGE = "exchange"  # the all-gather of payload sizes, then of payloads
    ALLREDUCE = "allreduce"  # Gloo's, by elements
    NAIVE = "naive"  # the naive baseline's own cost per tensor
    GRAPH = "graph"  # per topology: the engine's own cost per chunk graph
    TENSOR = "tensor"  # per topology: per segment
    BULK = "bulk"  # per algorithm and topology (or ``none``): per element of big steps

    def key(self, *parts: object) -> str:
        return "/".join((self.value, *map(str, parts)))


@dataclass
class CostModel:
    """Fitted primitive costs for one kind of host and network.

    Attributes:
        world: nodes (ranks, with one per node) the collectives were measured on.
        gpus: workers per node; above 1, ``intra`` prices the traffic inside a node,
            ``send`` is the node's link, and the job's own collectives are those of
            ``flat()``.
        costs: ``Linear`` per key (see the module docstring).
        meta: where and how it was measured (host, devices, link, date, sizes).
    """

    world: int
    costs: dict[str, Linear]
    gpus: int = 1
    meta: dict[str, Any] = field(default_factory=dict)
    #: how much of a send's time the CPU stays free for compute (1: a separate link,
    #: 0 or less: the same cores, as with several ranks on few cores over loopback)
    overlap: float = 1.0
    #: the compute lane is the processor backward runs on (a cluster's GPUs): the
    #: simulator runs backward's layers on it too, so kernels delay backward
    shares_compute: bool = False

    # -- lookups -------------------------------------------------------------------------

    def _get(self, key: str) -> Linear:
        try:
            return self.costs[key]
        except KeyError:
            have = self.algorithms
            raise ConfigError(f"the cost model has no {key!r}; it was profiled for "
                              f"{', '.join(have) or 'no algorithms'} — profile again "
                              "with that algorithm (hipress profile --algorithms ...)") from None

    @property
    def algorithms(self) -> list[str]:
        return sorted(k.split("/", 1)[1] for k in self.costs
                      if k.startswith(Cost.ENCODE.key("")))

    def encode(self, algo: str, n: float) -> float:
        return self._get(Cost.ENCODE.key(algo))(n)

    def plain_encode(self, algo: str, n: float) -> float:
        """An encode without error feedback (the naive baseline's); a profile that timed
        ``encode/ALGO`` without residuals, or has no ``plain/ALGO``, prices it so."""
        key = Cost.PLAIN.key(algo) if Cost.PLAIN.key(algo) in self.costs else Cost.ENCODE.key(algo)
        return self._get(key)(n)

    def decode(self, algo: str, n: float) -> float:
        return self._get(Cost.DECODE.key(algo))(n)

    def accumulate(self, algo: str, n: float) -> float:
        """Decode-and-merge; a profile without it prices it as a decode."""
        key = Cost.ACCUMULATE.key(algo)
        if key not in self.costs:
            key = Cost.DECODE.key(algo)
        return self._get(key)(n)

    def nbytes(self, algo: str, n: float) -> float:
        return self._get(Cost.BYTES.key(algo))(n)

    def send(self, nbytes: float) -> float:
        return self._get(Cost.SEND.key())(nbytes)

    def wire(self, nbytes: float) -> tuple[float, float]:
        """A message's ``send`` time split into the link's time for its bytes (b·x) and
        the fixed rest (latency, per-message work), which overlaps other messages."""
        total = self.send(nbytes)
        busy = min(self._get(Cost.SEND.key()).b * nbytes, total)
        return busy, total - busy

    def merge(self, n: float) -> float:
        return self._get(Cost.MERGE.key())(n)

    def allreduce(self, n: float, world: int, fixed: bool = True) -> float:
        """Uncompressed allreduce of n floats: measured when the world matches, else a
        ring of 2(N-1) steps priced by ``send``. Without ``fixed``, only what its size
        adds (what one more tensor adds to a chunk)."""
        if world <= 1:
            return 0.0
        if world == self.world and self.gpus == 1 and Cost.ALLREDUCE.key() in self.costs:
            fit = self.costs[Cost.ALLREDUCE.key()]  # measured over every rank
            return fit(n) if fixed else fit.b * n
        send, merge = self._get(Cost.SEND.key()), self._get(Cost.MERGE.key())
        if not fixed:
            return 2 * (world - 1) * send.b * 4 * n / world + (world - 1) * merge.b * n / world
        return 2 * (world - 1) * (send.a + send.b * 4 * n / world) \
            + (world - 1) * self.merge(n / world)

    def exchange(self, nbytes: float, world: int) -> float:
        """A compress-and-all-gather exchange among ``world`` ranks: an all-gather of
        every rank's payload size, then one of ``nbytes`` from each. Measured when the
        world matches, else two tiny allreduces' latency plus the bytes of every peer."""
        if world <= 1:
            return 0.0
        if world == self.world and self.gpus == 1 and Cost.EXCHANGE.key() in self.costs:
            return self.costs[Cost.EXCHANGE.key()](nbytes)
        return 2 * self.allreduce(1, world) + (world - 1) * self.wire(nbytes)[0]

    def intra(self, nbytes: float) -> float:
        """Moving ``nbytes`` in a reduce-scatter or allgather inside a node of ``gpus``."""
        if self.gpus <= 1:
            return 0.0
        return self._get(Cost.INTRA.key())((self.gpus - 1) / self.gpus * nbytes)

    def flat(self) -> CostModel:
        """The same nodes seen as ``world × gpus`` ranks on one network, as a flat
        topology runs on them: no intra-node level, and a node's ``gpus`` ranks share its
        link for the messages that leave the node ((N-1)·g of a rank's N·g - 1 peers;
        the others' bytes stay inside it)."""
        if self.gpus <= 1:
            return self
        costs = dict(self.costs)
        send, ranks = costs[Cost.SEND.key()], self.world * self.gpus
        share = self.gpus * (self.world - 1) * self.gpus / max(ranks - 1, 1)
        costs[Cost.SEND.key()] = Linear(send.a, send.b * share, send.r2, send.floor)
        return CostModel(ranks, costs, 1, {**self.meta, "flat": True}, self.overlap,
                         self.shares_compute)

    def cross(self, nodes: int) -> CostModel:
        """What one cross-node group of the hierarchical topology runs on: ``nodes``
        ranks, one per node, each on its share of the node's link (all ``gpus`` such
        groups send at once). The whole job's measured collectives do not apply."""
        flat = self.flat()
        costs = {k: v for k, v in flat.costs.items()
                 if k not in (Cost.ALLREDUCE.key(), Cost.EXCHANGE.key())}
        return CostModel(nodes, costs, 1, {**self.meta, "cross": nodes}, self.overlap,
                         self.shares_compute)

    @property
    def digest(self) -> str:
        """A short hash of the fitted costs: equal models plan alike."""
        import hashlib

        body = json.dumps({k: v.to_json() for k, v in sorted(self.costs.items())},
                          sort_keys=True)
        head = f"{self.world}/{self.gpus}/{self.overlap}/{self.shares_compute}"
        return hashlib.sha256(f"{head}/{body}".encode()).hexdigest()[:12]

    # -- persistence ---------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"world": self.world, "gpus": self.gpus, "overlap": self.overlap,
                "shares_compute": self.shares_compute, "meta": self.meta,
                "costs": {k: v.to_json() for k, v in sorted(self.costs.items())}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CostModel:
        try:
            return cls(int(d["world"]), {k: Linear.from_json(v) for k, v in d["costs"].items()},
                       int(d.get("gpus", 1)), dict(d.get("meta", {})),
                       float(d.get("overlap", 1.0)), bool(d.get("shares_compute", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a HiPress cost profile ({exc!r}); create one with "
                              "`hipress profile`") from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the profile {path}: {exc.strerror}; create it "
                              "with `hipress profile -o FILE`") from None
        try:
            return cls.from_json(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not JSON ({exc}); create it with "
                              "`hipress profile -o FILE`") from None

    # -- a cluster on paper --------------------------------------------------------------

    @classmethod
    def cluster(cls, nodes: int, gpus: int, bandwidth_bps: float,
                algorithms: tuple[str, ...] = ("onebit", "dgc"),
                intra_Bps: float | None = None) -> CostModel:
        """A cost model for ``nodes`` × ``gpus`` V100-class GPUs on a ``bandwidth_bps``
        network, from the stated figures of ``casync.model.cluster`` (``ASSUMPTIONS``: each
        with its source; none measured here). Payload sizes are the real codecs'
        (``payload_bytes``). Its compute lane is the GPU that backward runs on."""
        from .cluster import value

        codec = value("gpu-codec") / 4   # elements per second
        select = value("gpu-select") / 4
        launch = value("launch")
        costs = {
            Cost.SEND.key(): Linear(value("net-fixed"),
                                    1.0 / (value("net-rate") * bandwidth_bps / 8)),
            Cost.MERGE.key(): Linear(launch, 12 / value("hbm")),  # read two, write one
            Cost.INTRA.key(): Linear(10e-6, 1.0 / (intra_Bps or value("nvlink"))),
            Cost.PCIE.key(): Linear(10e-6, 1.0 / value("pcie")),
            Cost.LAUNCH.key(): Linear(launch, 0.0),
            Cost.FLOPS.key(): Linear(launch, 1.0 / value("gemm")),
        }
        for algo in algorithms:
            slow = algo in ("dgc", "graddrop", "topk")
            costs[Cost.ENCODE.key(algo)] = Linear(launch, 1.0 / (select if slow else codec))
            costs[Cost.DECODE.key(algo)] = Linear(launch, 1.0 / codec)
            costs[Cost.ACCUMULATE.key(algo)] = Linear(launch, 1.0 / codec)
            costs[Cost.CPU.key(algo)] = Linear(10e-6, 4.0 / value("cpu-codec"))
            costs[Cost.BYTES.key(algo)] = payload_bytes(algo)
        return cls(nodes, costs, gpus, {"kind": "cluster", "nodes": nodes, "gpus": gpus,
                                        "bandwidth_bps": bandwidth_bps},
                   shares_compute=True)


def payload_bytes(algo: str, sizes: tuple[int, ...] = (16384, 262144, 1 << 20),
                  **params: Any) -> Linear:
    """Payload bytes per element count of ``algo``, fitted from real encodes (the
    reference codec, so no build is needed)."""
    codec = make_codec(algo, target="ref", **params)
    rng = np.random.default_rng(0)
    counts = [codec.encode(rng.standard_normal(n).astype(np.float32)).nbytes for n in sizes]
    fit = Linear.fit(sizes, counts)
    return Linear(fit.a, fit.b, fit.r2)
