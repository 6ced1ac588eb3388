"""The profiler: measure each primitive on the real host and group, fit t(x) = a + b·x.

Every rank runs every measurement at the same time (so the timings carry the CPU and
link contention of a real step), and the slowest rank's mean per size is fitted;
all ranks therefore hold the same ``CostModel``. ``cached`` runs it once per host,
world and settings and keeps the result under the HiPress cache directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from compll import codec as make_codec
from compll.build import cache_dir
from compll.parallelism import threads
from hipress_base.version import __version__

from .. import primitives as P
from ..feedback import ErrorFeedback
from ..plan import StepTimer
from ..transport import Transport
from .costmodel import Cost, CostModel, Linear, payload_bytes
from .engine_costs import engine_costs

__all__ = ["measure", "cached", "ELEMENTS", "BYTES"]

#: element counts swept for the compute primitives and the allreduce
ELEMENTS = tuple(4 ** k for k in range(5, 12))       # 1,024 .. 4,194,304
#: message sizes swept for point-to-point sends: up to the engine's largest (a 4 MiB
#: partition); on shaped links a 16 MiB burst overflows the queue and runs at half rate
BYTES = tuple(4 ** k for k in range(5, 12))          # 1 KiB .. 4 MiB


#: each timed repetition of a small size runs back to back for about this long
BATCH_SECONDS = 0.01
#: at most this many calls per timed repetition
MAX_BATCH = 64
#: each size is timed for at least about this long in all, so slow calls get more
#: repetitions and one stall cannot decide their mean
SAMPLE_SECONDS = 0.1
#: repetitions slower than this many times their median are freezes of the host, not
#: the cost of the call, and are left out of the mean (see ``_typical_mean``)
FREEZE = 4.0


def _typical_mean(times: list[float]) -> float:
    """The mean of ``times`` without freezes (over ``FREEZE`` x the median).

    Bursts of stalls a step pays on shared cores stay in, since a step pays them too. A
    freeze does not: it would inflate a whole fit from one repetition, and the bench that
    the profile predicts reports the median step, which leaves such a step out too.
    """
    limit = FREEZE * statistics.median(times)
    return statistics.fmean([t for t in times if t <= limit])


def _sweep(transport: Transport, sizes: tuple[int, ...], reps: int,
           run: Callable[[int], None], seconds: float = BATCH_SECONDS,
           fixed: str = "min") -> Linear:
    """Time ``run(size)`` on every rank at once; fit the slowest rank's means.

    A repetition of a fast call runs it back to back for about ``seconds`` (at most
    ``MAX_BATCH`` calls per ``BATCH_SECONDS``); there are ``reps`` repetitions, more
    for slow calls (``SAMPLE_SECONDS``), and the fit takes the mean over all of them:
    a step pays the mean of its many small calls, and with several ranks sharing few
    cores that mean sits well above the median (bursts of stalls). Every rank
    runs the same count, as collectives require. Freezes of the host are left out
    (``_typical_mean``). ``fixed`` is ``Linear.fit``'s rule for the fixed cost.
    """
    most = max(1, round(MAX_BATCH * seconds / BATCH_SECONDS))
    means = []
    for size in sizes:
        # Warm caches, pages, connections and residuals: first calls are slower.
        run(size)
        t0 = time.perf_counter()
        run(size)
        first = transport.max_over_ranks([time.perf_counter() - t0])[0]
        batch = int(min(max(seconds // max(first, 1e-9), 1), most))
        count = max(reps, min(4 * reps, math.ceil(SAMPLE_SECONDS / max(batch * first, 1e-9))))
        times = []
        for _ in range(count):
            if transport.size > 1:
                transport.dist.barrier(group=transport.group)
            t0 = time.perf_counter()
            for _ in range(batch):
                run(size)
            times.append((time.perf_counter() - t0) / batch)
        means.append(_typical_mean(times))
    return Linear.fit(sizes, transport.max_over_ranks(means), fixed)


#: the primitives a profile holds; a cached profile of another format is measured again
#: (4: ``fuse/ALGO``, without which a cached profile would price the fused call as two;
#: 5: ``plain/ALGO``, without which the naive baseline paid error feedback's encode)
PROFILE_FORMAT = 5

#: elements in each rotating pool: 64 MiB of float32, more than any last-level cache
_POOL = 16 << 20


class _Cold:
    """Successive slices of a large array, so each timed call reads memory a real step
    would find outside the caches (every gradient is a different buffer)."""

    def __init__(self, pool: np.ndarray) -> None:
        self.pool = pool
        self.offset = 0

    def __call__(self, n: int) -> np.ndarray:
        if self.offset + n > self.pool.size:
            self.offset = 0
        view = self.pool[self.offset:self.offset + n]
        self.offset += n
        return view


def _codec_costs(transport: Transport, algo: str, x: _Cold, acc: _Cold,
                 elements: tuple[int, ...], reps: int, target: str,
                 error_feedback: bool | None) -> dict[str, Linear]:
    """Encode (with residuals where the engine keeps them), decode (into a buffer,
    scaled, as a rank's final values are), decode-and-merge, an aggregator's last merge
    fused into its re-encode (CPU kernels), bytes; with residuals, an encode without
    them too (``plain/ALGO``, the naive baseline's)."""
    codec = make_codec(algo, target=target)
    on = (not codec.unbiased) if error_feedback is None else error_feedback
    feedback = ErrorFeedback() if on else None
    out = np.empty(codec.max_payload_bytes(max(elements)), np.uint8)
    payloads = {n: codec.encode(x(n)).copy() for n in elements}
    mean = 1.0 / max(transport.size, 2)

    def encode(n: int) -> None:
        P.encode(codec, x(n), 0, feedback, n, out)

    def decode(n: int) -> None:
        P.decode(codec, payloads[n], acc(n), scale=mean)

    def accumulate(n: int) -> None:
        P.decode(codec, payloads[n], acc(n), accumulate=True)

    costs = {Cost.ENCODE.key(algo): _sweep(transport, elements, reps, encode),
             Cost.DECODE.key(algo): _sweep(transport, elements, reps, decode),
             Cost.ACCUMULATE.key(algo): _sweep(transport, elements, reps, accumulate),
             Cost.BYTES.key(algo): payload_bytes(algo, **codec.params)}
    if feedback is not None:  # the naive baseline encodes without residuals
        def plain(n: int) -> None:
            codec.encode(x(n), out=out)

        costs[Cost.PLAIN.key(algo)] = _sweep(transport, elements, reps, plain)
    if codec.target in ("cpu", "auto"):  # the kernels fuse; elsewhere it is acc + enc
        residual = np.zeros(max(elements), np.float32) if on else None

        def fuse(n: int) -> None:
            res = None if residual is None else [residual[:n]]
            codec.encode_batch([acc(n)], out=out, steps=[0], residuals=res, feedback=on,
                               merge=payloads[n])

        costs[Cost.FUSE.key(algo)] = _sweep(transport, elements, reps, fuse)
    return costs


#: floats merged before each timed exchange (see ``_exchange``)
_GATHER_WORK = 16384
#: each timed repetition of an exchange runs for about this long (see ``measure``)
_GATHER_SECONDS = 0.06
#: untimed exchanges before the sweep: right after bulk transfers the first hundred or so
#: run faster than a long chain of them does
_GATHER_SETTLE = 100


def _exchange(transport: Transport, largest: int) -> Callable[[int], None]:
    """A compress-and-all-gather baseline's exchange of ``nbytes`` per rank
    (``casync.model.simulate``'s naive): an all-gather of every rank's payload size (8 bytes),
    then one of the payloads.

    Timed as the pair the baselines run, since an all-gather alternating with the sizes'
    one costs more per call than one repeated alone. Each exchange follows a little
    codec-sized work (a merge of ``_GATHER_WORK`` floats), as the baselines call it:
    between collectives each rank computes, and the next collective then waits for the
    later rank and for Gloo's threads to wake, which back-to-back calls never pay.
    """
    import torch

    mine = torch.zeros(largest, dtype=torch.uint8)
    outs = [torch.empty(largest, dtype=torch.uint8) for _ in range(transport.size)]
    size = torch.zeros(1, dtype=torch.int64)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(transport.size)]
    acc, x = np.zeros(_GATHER_WORK, np.float32), np.ones(_GATHER_WORK, np.float32)

    def run(nbytes: int) -> None:
        P.merge(acc, x)
        size[0] = nbytes
        transport.dist.all_gather(sizes, size, group=transport.group)
        transport.dist.all_gather([o[:nbytes] for o in outs], mine[:nbytes],
                                  group=transport.group)

    return run


def _overlap(transport: Transport, costs: dict[str, Linear], x: np.ndarray, reps: int,
             send: Callable[[int], None], largest: int, seconds: float = 0.04) -> float:
    """How much of its sends' time a rank can spend computing: time merges alone, sends
    alone (each about ``seconds`` long: shorter runs drown in thread start-up and barrier
    skew) and both at once, and compare; 1 means fully parallel, 0 fully serial.

    Each round times the three back to back, in an order that rotates from round to
    round, and yields one estimate from the slowest rank's times; the result is the
    median over ``2 * reps`` rounds after a warm-up one. Timing all of one kind, then
    all of the next, let a burst of stalls land on one kind only: on 4 shaped ranks
    sharing 2 cores it came out anywhere from 0 to 1.0.
    """
    import threading

    work = np.zeros_like(x)
    merges = max(1, round(seconds / max(costs[Cost.MERGE.key()](x.size), 1e-6)))
    fit = costs[Cost.SEND.key()]
    nbytes = int(min(max((seconds - fit.a) / max(fit.b, 1e-15), 64 << 10), largest))
    sends = max(1, round(seconds / max(fit(nbytes), 1e-6)))

    def compute() -> None:
        for _ in range(merges):
            P.merge(work, x)

    def communicate() -> None:
        for _ in range(sends):
            send(nbytes)

    def both() -> None:
        thread = threading.Thread(target=communicate)
        thread.start()
        compute()
        thread.join()

    kinds = (compute, communicate, both)
    times = []
    for r in range(2 * reps + 1):
        row = [0.0] * 3
        for k in ((r + j) % 3 for j in range(3)):  # rotated: no kind always follows the same one
            transport.dist.barrier(group=transport.group)
            t0 = time.perf_counter()
            kinds[k]()
            row[k] = time.perf_counter() - t0
        times += row
    slowest = transport.max_over_ranks(times)
    estimates = [(m + s - b) / max(min(m, s), 1e-9)
                 for m, s, b in zip(slowest[3::3], slowest[4::3], slowest[5::3], strict=True)]
    return max(0.0, min(1.0, statistics.median(estimates)))


def measure(transport: Transport, algorithms: tuple[str, ...] = ("onebit",), *,
            steps: StepTimer, elements: tuple[int, ...] = ELEMENTS,
            message_bytes: tuple[int, ...] = BYTES,
            reps: int = 5, target: str = "auto", error_feedback: bool | None = None,
            per_node: int = 1, say: Callable[[str], Any] = lambda _: None) -> CostModel:
    """Profile the primitives on ``transport``'s group (a collective: call on every rank).

    On a job of several nodes of ``per_node`` ranks (numbered node by node) it also
    fits the two links apart: ``send`` between nodes, every rank sending to its peer on
    the next node at once (stored as the node's link: ``gpus`` = ``per_node`` ranks
    share it), and ``intra``, the node's reduce-scatter and all-gather.

    Args:
        transport: the engine's transport (pacing via ``HIPRESS_BANDWIDTH`` applies).
        algorithms: codecs to time encode and decode for.
        steps: how the engine times its own steps (``Synchronizer.time_steps``), for
            its costs beyond the primitives (``casync.model.engine_costs``).
        elements, message_bytes: the size sweeps.
        reps: timed repetitions per size, at least (their mean is kept).
        target: codec target, as for ``hipress.codec``.
        error_feedback: time encodes with residuals (``None``: as the engine does,
            on for biased codecs).
        per_node: ranks per node (1, or the whole group: one level).
        say: progress callback.

    Returns:
        The fitted ``CostModel``, identical on every rank.

    Example:
        >>> cost = measure(Transport(), ("onebit", "dgc"), steps=Synchronizer.time_steps)
        >>> cost.encode("onebit", 1 << 20)
    """
    rng = np.random.default_rng(transport.rank)
    x = _Cold((rng.standard_normal(_POOL) * 1e-3).astype(np.float32))
    acc = _Cold(np.zeros(_POOL, np.float32))
    costs: dict[str, Linear] = {}

    def merge(n: int) -> None:
        P.merge(acc(n), x(n))

    costs[Cost.MERGE.key()] = _sweep(transport, elements, reps, merge)
    say(f"merge: {costs[Cost.MERGE.key()]}")
    for algo in algorithms:
        costs.update(_codec_costs(transport, algo, x, acc, elements, reps, target,
                                  error_feedback))
        say(f"{algo}: encode {costs[Cost.ENCODE.key(algo)]}, "
            f"decode {costs[Cost.DECODE.key(algo)]}")
    overlap = 1.0
    if transport.size > 1:
        overlap = _wire_costs(transport, costs, x, acc, elements, message_bytes, reps, say)
        engine_costs(transport, steps, costs, overlap, algorithms, reps, say)
    nodes = per_node > 1 and transport.size > per_node and transport.size % per_node == 0
    if nodes:
        _level_costs(transport, costs, per_node, elements, message_bytes, reps, say)
    meta = {"host": platform.node(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "threads": str(threads()),
            "bandwidth": os.environ.get("HIPRESS_BANDWIDTH"), "target": target,
            "hipress": __version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "elements": list(elements), "message_bytes": list(message_bytes), "reps": reps}
    if nodes:  # as a cluster model: its world the nodes, its collectives the flat view's
        return CostModel(transport.size // per_node, costs, per_node, meta, overlap)
    return CostModel(transport.size, costs, 1, meta, overlap)


def _level_costs(transport: Transport, costs: dict[str, Linear], per_node: int,
                 elements: tuple[int, ...], message_bytes: tuple[int, ...], reps: int,
                 say: Callable[[str], Any]) -> None:
    """A job of nodes: ``send`` between nodes as the node's link, and ``intra``."""
    import torch

    dist, rank, size = transport.dist, transport.rank, transport.size
    local, node = rank % per_node, rank // per_node
    members = [int(dist.get_global_rank(transport.group, r)) if transport.group is not None
               else r for r in range(size)]
    group = None
    for first in range(0, size, per_node):  # every rank makes every node's group
        made = dist.new_group(members[first:first + per_node], backend="gloo")
        if first == node * per_node:
            group = made
    # to the same local rank on the next node, from the one on the previous
    send = _hop(transport, ((node + 1) * per_node + local) % size,
                ((node - 1) * per_node + local) % size, 2, max(message_bytes))
    across = _sweep(transport, message_bytes, reps, send)
    # The node's ranks sent at once: its link moved per_node messages in that time.
    costs[Cost.SEND.key()] = Linear(across.a, across.b / per_node, across.r2, across.floor,
                                    across.points)
    say(f"send between nodes (per rank, {per_node} at once): {across}")
    flat = torch.zeros(per_node * max(elements))
    part = torch.empty(max(elements))

    def level(n: int) -> None:  # one reduce-scatter and one all-gather of n per rank
        dist.reduce_scatter_single(part[:n], flat[:per_node * n], group=group)
        dist.all_gather_single(flat[:per_node * n], part[:n], group=group)

    both = _sweep(transport, elements, reps, level)
    # ``CostModel.intra`` prices one level by the bytes each rank moves, (L-1)/L of it
    moved = 4 * (per_node - 1)
    costs[Cost.INTRA.key()] = Linear(both.a / 2, both.b / 2 / moved, both.r2, both.floor / 2)
    say(f"intra-node level (reduce-scatter or all-gather): {costs[Cost.INTRA.key()]}")


def _hop(transport: Transport, right: int, left: int, tag: int,
         largest: int) -> Callable[[int], None]:
    """A timed message: send ``nbytes`` to ``right`` while receiving as many from
    ``left`` (every rank at once, so a link carries a message each way)."""
    send_buf = np.zeros(largest, np.uint8)
    recv_buf = np.empty_like(send_buf)

    def send(nbytes: int) -> None:
        handles = [transport.isend(send_buf[:nbytes], right, tag),
                   transport.irecv(nbytes, left, tag, recv_buf[:nbytes])]
        for handle in handles:
            transport.wait(handle, 600)

    return send


def _wire_costs(transport: Transport, costs: dict[str, Linear], x: _Cold, acc: _Cold,
                elements: tuple[int, ...], message_bytes: tuple[int, ...], reps: int,
                say: Callable[[str], Any]) -> float:
    """Fit the messages' costs into ``costs`` (a ring hop's send, the naive baseline's
    exchange, the allreduce); returns how much of a send's time the cores stay free."""
    # Every rank sends to its right and receives from its left, as a ring hop.
    send = _hop(transport, (transport.rank + 1) % transport.size,
                (transport.rank - 1) % transport.size, 1, max(message_bytes))

    def allreduce(n: int) -> None:
        transport.wait(transport.allreduce(acc(n)), 600)

    costs[Cost.SEND.key()] = _sweep(transport, message_bytes, reps, send)
    say(f"send: {costs[Cost.SEND.key()]}")
    # The naive baseline pays an exchange's fixed cost per tensor, serially, spikes
    # included: fit its mean, over a sample long enough to hold the spikes.
    exchange = _exchange(transport, max(message_bytes))
    for _ in range(_GATHER_SETTLE):
        exchange(min(message_bytes))
    costs[Cost.EXCHANGE.key()] = _sweep(transport, message_bytes, reps, exchange,
                               seconds=_GATHER_SECONDS, fixed="mean")
    say(f"exchange (all-gather of sizes, then of payloads): {costs[Cost.EXCHANGE.key()]}")
    # DDP-sized buckets reach 6.5M floats: sweep the allreduce that far and beyond.
    costs[Cost.ALLREDUCE.key()] = _sweep(transport, (*elements, 4 * max(elements)), reps,
                                         allreduce)
    say(f"allreduce: {costs[Cost.ALLREDUCE.key()]}")
    overlap = _overlap(transport, costs, x(max(elements)), reps, send, max(message_bytes))
    say(f"compute/communication overlap: {overlap:.2f}")
    return overlap


def _cache_path(transport: Transport, algorithms: tuple[str, ...], target: str,
                per_node: int) -> Path:
    key = json.dumps([PROFILE_FORMAT, platform.node(), transport.size, sorted(algorithms), target,
                      __version__, os.environ.get("HIPRESS_BANDWIDTH"),
                      threads().count, per_node])
    return cache_dir() / "profiles" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def cached(transport: Transport, algorithms: tuple[str, ...], target: str = "auto", *,
           steps: StepTimer, per_node: int = 1,
           say: Callable[[str], Any] = lambda _: None) -> CostModel:
    """Rank 0's cached profile for this host, world, layout and settings, measured (on
    every rank) when rank 0 has none; every rank returns the same model."""
    path = _cache_path(transport, algorithms, target, per_node)
    text = [path.read_text() if transport.rank == 0 and path.exists() else None]
    if transport.size > 1:
        transport.dist.broadcast_object_list(text, src=transport.dist.get_global_rank(
            transport.group, 0) if transport.group is not None else 0, group=transport.group)
    if text[0] is not None:
        return CostModel.from_json(json.loads(text[0]))
    say("profiling the primitives once for plan='auto' (cached afterwards)")
    cost = measure(transport, algorithms, steps=steps, target=target, per_node=per_node,
                   say=say)
    if transport.rank == 0:
        cost.save(path)
    return cost
