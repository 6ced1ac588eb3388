"""Run a scenario on N local ranks (one process each, Gloo on loopback) for the tests.

``launch`` starts ``python tests/ranks.py SCENARIO`` once per rank with the environment
torchrun would set; each rank writes ``rank{r}.npz`` (arrays) and ``rank{r}.json``
(anything else) into a scratch folder. The scenarios live at the bottom of this file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from hipress.network import free_port

HERE = Path(__file__).resolve().parent
ALGOS = ["onebit", "terngrad", "dgc", "fp16", "minmax8"]
TOPOLOGIES = ["ps", "ring", "allgather"]
#: (elements, dtype, contiguous) of the tensors every strategy scenario synchronizes
TENSORS = [(0, "float32", True), (1, "float32", True), (7, "float32", True),
           (1000, "float16", True), (3000, "bfloat16", True), (5000, "float32", False),
           (20_001, "float32", True), (70_000, "float32", True)]


def launch(world: int, scenario: str, out: Path, args: dict[str, Any] | None = None,
           timeout: float = 300, env: dict[str, str] | None = None,
           script: Path = HERE / "ranks.py") -> list[dict[str, Any]]:
    """Run ``scenario`` (from ``script``, by default this file) on ``world`` ranks;
    return each rank's exit code, JSON and arrays."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HIPRESS_THREADS="1",
                 OMP_NUM_THREADS="1",
                 # the checkout first; keep what the caller added (the device check's wheels)
                 PYTHONPATH=os.pathsep.join(
                     p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p))
        e.update(env or {})
        procs.append(subprocess.Popen(
            [sys.executable, str(script), scenario, json.dumps(args or {}),
             str(out)], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    results = []
    for rank, proc in enumerate(procs):
        try:
            log, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{scenario}: rank {rank} still running after {timeout} s") \
                from None
        result: dict[str, Any] = {"rc": proc.returncode, "log": log}
        meta = out / f"rank{rank}.json"
        if meta.exists():
            result.update(json.loads(meta.read_text()))
        arrays = out / f"rank{rank}.npz"
        if arrays.exists():
            with np.load(arrays) as z:
                result["arrays"] = {k: z[k] for k in z.files}
        results.append(result)
    return results


def arrays_of(scenario: str, out: Path, args: dict[str, Any],
              world: int = 2) -> list[dict[str, np.ndarray]]:
    """Each rank's arrays from ``scenario`` on ``world`` ranks, every rank exiting 0."""
    results = launch(world, scenario, out, args)
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
    return [r["arrays"] for r in results]


def launch_ok(world: int, scenario: str, out: Path, args: dict[str, Any],
              script: Path) -> list[dict[str, Any]]:
    """``launch``, asserting that every rank exited 0 (its log's tail if not)."""
    results = launch(world, scenario, out, args, script=script)
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
    return results


def resumed_bit_for_bit(scenario: str, out: Path, args: dict[str, Any],
                        script: Path = HERE / "ranks.py", world: int = 2,
                        env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The checkpoint round trip on ``world`` ranks: 12 steps straight, saving a checkpoint
    after the 6th as a training job does, and fresh processes that load it and run the last 6.
    Asserts every run exits 0 and both end on the same parameters to the bit on every rank
    (so saving did not disturb the straight run either); returns the straight run's
    results."""
    def run(name: str, **more: Any) -> list[dict[str, Any]]:
        results = launch(world, scenario, out / name, {**args, **more}, script=script,
                         env=env)
        for r in results:
            assert r["rc"] == 0, r["log"][-3000:]
        return results

    straight = run("straight", start=0, steps=12, save=str(out / "ckpt"), save_at=6)
    second = run("second", start=6, steps=6, load=str(out / "ckpt"))
    for rank in range(world):
        a, b = straight[rank]["arrays"]["params"], second[rank]["arrays"]["params"]
        assert a.tobytes() == b.tobytes(), f"rank {rank}: max diff {np.abs(a - b).max()}"
    return straight


def stall(out: Path, rank: int, limit: float) -> None:
    """Stay alive and silent until every other rank has written its report to ``out`` (the
    survivors have timed out on this rank), or for ``limit`` seconds at most: a stall as
    long as it needs to be and no longer."""
    others = [out / f"rank{r}.json" for r in range(int(os.environ["WORLD_SIZE"])) if r != rank]
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not all(p.exists() for p in others):
        time.sleep(0.1)


def data(rank: int, index: int, n: int, step: int = 0) -> np.ndarray:
    """The gradient rank ``rank`` holds for tensor ``index`` (tests regenerate it)."""
    r = np.random.default_rng([rank, index, step])
    return (r.standard_normal(n) * r.exponential(1.0, n)).astype(np.float32)


# --------------------------------------------------------------------------- scenarios


def _init() -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    return dist


def _torch_tensor(values: np.ndarray, dtype: str, contiguous: bool) -> Any:
    import torch

    t = torch.from_numpy(values.copy()).to(getattr(torch, dtype))
    if not contiguous:  # every other element of a buffer twice as long
        wide = torch.zeros(2 * values.size, dtype=t.dtype)
        wide[::2] = t
        t = wide[::2]
    return t


def _stand_in(args: dict[str, Any]) -> None:
    """With ``device``, CPU tensors take the path CUDA tensors take (torch buffers,
    residuals and scratch), on the CPU kernels (or, with ``target="cuda-emu"``, the CUDA
    ones, emulated), with ``device``'s link: ``staged`` (payloads through host buffers) or
    ``nccl`` (device buffers, batched stages in one order; here over Gloo)."""
    if args.get("device"):
        from casync import settings, staging
        from casync.transport import Transport

        staging.DEVICE_TYPES = {"cuda", "cpu"}
        if args["device"] == "nccl":  # the nccl link's protocol, over Gloo
            settings.cuda_transport_of = lambda choice: Transport()


def _two_gpus(sync: Any, named: list[tuple[str, Any]]) -> str:
    """What ``submit_many`` says of a batch that spans two GPUs (staged here as if the
    first tensor lived on cuda:0 and the second on cuda:1); nothing may be queued."""
    from casync import staging
    from casync.chunks import Entry

    class Gpu:
        cuda = True

        def __init__(self, device: str) -> None:
            self.device = device

        def ready_event(self) -> None:
            return None

    entry, devices = staging.entry, iter(["cuda:0", "cuda:1"])
    staging.entry = lambda name, tensor, completion: Entry(  # type: ignore[assignment]
        name, tensor, tensor, future=completion, memory=Gpu(next(devices)))
    try:
        sync.submit_many(named[:2])
    except Exception as exc:  # noqa: BLE001 - the test compares the message
        return f"{type(exc).__name__}: {exc}"
    finally:
        staging.entry = entry
    raise AssertionError("a batch of two GPUs was accepted")


def strategies(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Every (algorithm, topology) on the TENSORS; returns the synchronized values."""
    import torch

    from casync import StaticPlanner, engine
    from hipress import ConfigError

    _stand_in(args)
    links = set()
    refused: set[str] = set()

    arrays = {}
    for algo in args.get("algos", ALGOS):
        for topo in args.get("topologies", TOPOLOGIES):
            planner = StaticPlanner(algo, topo, min_compress=512, partition_bytes=16 << 10)
            sync = engine(algo, topo, planner=planner, chunk_elems=8192, timeout=60,
                                target=args.get("target", "auto"))
            tensors = [_torch_tensor(data(rank, i, n), dt, c)
                       for i, (n, dt, c) in enumerate(TENSORS)]
            if args.get("cuda"):  # ranks share the GPU (the staged link)
                tensors = [t.cuda() for t in tensors]
            if args.get("batched"):  # one submit_many, one future for every tensor
                named = [(f"t{i}", t) for i, t in enumerate(tensors)]
                try:  # a repeated name is refused before anything is queued
                    sync.submit_many([*named[:2], named[0]])
                    raise AssertionError("a name twice in one batch was accepted")
                except ConfigError as exc:
                    refused.add(str(exc))
                try:  # so is a batch with a tensor it cannot take: t0 is not queued
                    sync.submit_many([named[0], ("ints", torch.zeros(3, dtype=torch.int32))])
                    raise AssertionError("an integer tensor was accepted")
                except ConfigError as exc:
                    refused.add(str(exc))
                refused.add(_two_gpus(sync, named))
                batch = sync.submit_many(named)
                sync.synchronize()
                assert batch.done() and len(batch.value()) == len(tensors)
                assert all(a is b for a, b in zip(batch.value(), tensors, strict=True))
            else:
                futures = [sync.submit(f"t{i}", t) for i, t in enumerate(tensors)]
                sync.synchronize()
                for t, f in zip(tensors, futures, strict=True):
                    assert f.done() and f.value() is t
            for i, t in enumerate(tensors):
                arrays[f"{algo}/{topo}/{i}"] = t.float().cpu().numpy()
            links |= {link.name for link in sync.links.made.values()}
            sync.close()
    np.savez(out / f"rank{rank}.npz", **arrays)
    return {"links": sorted(links), "refused": sorted(refused)}


def feedback(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """50 steps of a fixed gradient stream; returns the synchronized running sums."""
    import torch

    from casync import StaticPlanner, engine

    _stand_in(args)
    n, steps = 20_000, args.get("steps", 50)
    algo, topo = args["algo"], args["topology"]
    planner = StaticPlanner(algo, topo, min_compress=0, partition_bytes=n * 4)
    sync = engine(algo, topo, planner=planner, target=args.get("target", "auto"),
                        error_feedback=args.get("error_feedback"), timeout=60)
    total = np.zeros(n, np.float64)
    for step in range(steps):
        g = torch.from_numpy(data(rank, 0, n, step))
        if args.get("cuda"):
            g = g.cuda()
        sync.submit("g", g)
        sync.synchronize()
        total += g.cpu().numpy()
    residuals = {f"r{i}": r for i, r in enumerate(
        r for ef in sync.state_dict()["residuals"].values() for r in ef.values())}
    np.savez(out / f"rank{rank}.npz", total=total, **residuals)
    return {"residuals": sum(len(ef) for ef in sync.codecs.residuals.values())}


#: (elements, compressed) of the tensors the non-finite scenario synchronizes in one chunk:
#: two compressed ones (the first is poisoned) and one below min_compress (allreduced)
NONFINITE_TENSORS = [(6000, True), (5000, True), (300, False)]


def nonfinite(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """For each algorithm and topology: a step where rank ``victim`` holds a NaN, +inf or
    -inf in one element of tensors 0 and 2, then a clean step. Returns, per case, which
    tensors came back holding a non-finite value in each of the two steps."""
    import torch

    from casync import StaticPlanner, engine

    _stand_in(args)
    victim = args["victim"]
    found: dict[str, list[list[bool]]] = {}
    for algo in args["algos"]:
        for topo in args.get("topologies", TOPOLOGIES):
            # hierarchical: ps across nodes of LOCAL_WORLD_SIZE ranks
            planner = StaticPlanner(algo, "ps" if topo == "hierarchical" else topo,
                                    min_compress=1000, partition_bytes=64 << 10)
            sync = engine(algo, topo, planner=planner, chunk_elems=1 << 16, timeout=60)
            for kind, bad in (("nan", np.nan), ("+inf", np.inf), ("-inf", -np.inf)):
                steps = []
                for step in range(2):
                    tensors = [torch.from_numpy(data(rank, i, n, step))
                               for i, (n, _) in enumerate(NONFINITE_TENSORS)]
                    if step == 0 and rank == victim:
                        tensors[0][1234] = bad
                        tensors[2][17] = bad
                    sync.submit_many([(f"t{i}", t) for i, t in enumerate(tensors)])
                    sync.synchronize()
                    steps.append([not bool(torch.isfinite(t).all()) for t in tensors])
                found[f"{algo}/{topo}/{kind}"] = steps
            sync.close()
    return {"found": found}


def wait_first(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Wait on submit's and submit_many's futures before synchronize(); returns the
    averages and the seconds each wait took."""
    import torch

    from casync import engine

    sync = engine(args["algo"], "ps", min_compress=0, timeout=30)
    waits, arrays = [], {}
    for step in range(2):
        a = torch.from_numpy(data(rank, 0, 5000, step))
        start = time.monotonic()
        sync.submit("a", a).wait()
        waits.append(time.monotonic() - start)
        b, c = (torch.from_numpy(data(rank, i, 3000, step)) for i in (1, 2))
        start = time.monotonic()
        sync.submit_many([("b", b), ("c", c)]).wait()
        waits.append(time.monotonic() - start)
        sync.synchronize()
        arrays.update({f"{k}{step}": t.numpy() for k, t in (("a", a), ("b", b), ("c", c))})
    sync.close()
    np.savez(out / f"rank{rank}.npz", **arrays)
    return {"waits": waits}


def fault(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Rank ``victim`` dies or stalls in step 2; the others report what they raised.
    Mode ``gone``: it dies, and the others start step 2 only once it is gone."""
    import torch

    from casync import engine
    from hipress import SyncError

    sync = engine(args["algo"], args["topology"], timeout=args["timeout"])
    start = 0.0
    try:
        for step in range(4):
            if step == 2 and rank == args["victim"]:
                if args["mode"] in ("die", "gone"):
                    os._exit(17)
                stall(out, rank, args["timeout"] + 15)
            if step == 2 and args["mode"] == "gone":
                time.sleep(2.0)  # posting this step's receives then meets a closed peer
            start = time.monotonic()
            sync.submit("layer1.weight", torch.from_numpy(data(rank, 0, 300_000, step)))
            sync.submit("layer1.bias", torch.from_numpy(data(rank, 1, 100, step)))
            sync.synchronize()
    except SyncError as exc:
        return {"error": str(exc), "type": "SyncError", "after": time.monotonic() - start}
    return {"error": None}


def hierarchical(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """``steps`` steps of the hierarchical topology (nodes of ``LOCAL_WORLD_SIZE`` ranks)
    over tensors of every kind; with ``"none"`` also the world allreduce's average of the
    same data. Saves every step's results."""
    import torch.distributed as dist

    from casync import engine

    world = dist.get_world_size()
    sync = engine(args["algo"], "hierarchical", across=args.get("across", "ps"),
                        intra_dtype=args.get("intra_dtype", "float32"), min_compress=1000,
                        pack_elems=args.get("pack_elems", 50_000), timeout=60)
    results, references = [], []
    for step in range(args["steps"]):
        tensors = [_torch_tensor(data(rank, i, n, step), dtype, contiguous)
                   for i, (n, dtype, contiguous) in enumerate(TENSORS)]
        if args.get("reference"):
            for t in tensors:
                r = t.float().contiguous().clone()
                dist.all_reduce(r)
                references.append((r / world).to(t.dtype).float().numpy().reshape(-1))
        future = sync.submit_many([(f"t{i}", t) for i, t in enumerate(tensors)])
        sync.synchronize()
        assert future.done() and all(a is b for a, b in zip(future.value(), tensors, strict=True))
        results += [t.float().contiguous().numpy().reshape(-1) for t in tensors]
    wide = np.concatenate([np.full(n, dtype == "float32") for n, dtype, _ in TENSORS])
    np.savez(out / f"rank{rank}.npz", results=np.concatenate(results),
             references=np.concatenate(references) if references else np.zeros(0),
             float32=np.tile(wide, args["steps"]))
    state = sync.state_dict()
    sync.close()
    return {"step": state["step"], "layout": state["layout"]}


def mismatch(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Rank 1 starts with a different (or an invalid) setting; every rank reports what it
    raised and how long it took."""
    from casync import engine
    from hipress import ConfigError, SyncError

    settings = dict(args["base"])
    if rank == 1:
        settings.update(args["changed"])
    algo = settings.pop("algorithm")
    start = time.monotonic()
    try:
        engine(algo, **settings).close()
    except (ConfigError, SyncError) as exc:
        return {"error": str(exc), "type": type(exc).__name__,
                "after": time.monotonic() - start}
    return {"error": None}


def pipeline(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """A transport that takes 0.2 s per message; returns the executor's task trace."""
    import torch

    from casync import StaticPlanner, Transport, engine

    class SlowTransport(Transport):
        def wait(self, handle: Any, timeout: float) -> None:
            time.sleep(0.2)
            super().wait(handle, timeout)

    n = 400_000  # four chunks of one tensor
    planner = StaticPlanner("onebit", args["topology"])
    sync = engine("onebit", args["topology"], planner=planner, transport=SlowTransport(),
                        trace=True, timeout=60, chunk_elems=n // 4)
    sync.submit("big", torch.from_numpy(data(rank, 0, n)))
    sync.synchronize()
    trace = sync.take_trace()
    assert trace is not None
    return {"trace": trace}


def messages(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Messages this rank sends per step for the same bytes in 10 or in 200 tensors, and
    how many of the engine's objects its steps left to the cyclic garbage collector."""
    import gc

    import torch

    from casync import StaticPlanner, Transport, engine

    class Counting(Transport):
        def __init__(self) -> None:
            super().__init__()
            self.sends = 0

        def isend(self, payload: Any, dst: int, tag: int) -> Any:
            self.sends += 1
            return super().isend(payload, dst, tag)

        def allreduce(self, data: Any) -> Any:
            self.sends += 1
            return super().allreduce(data)

    counts, sent, cycles = {}, {}, {}
    for topo in args["topologies"]:
        algo = "none" if topo == "none" else args.get("algo", "onebit")
        for count in (10, 200):
            transport = Counting()
            sync = engine(algo, "ps" if topo == "none" else topo, transport=transport,
                                planner=StaticPlanner(algo, topo if topo != "none" else "ps",
                                                      min_compress=0), timeout=60)
            tensors = [torch.from_numpy(data(rank, i, 200_000 // count)) for i in range(count)]
            per_step = []
            gc.collect()
            gc.disable()  # what the steps leave unreachable stays for the count below
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for _ in range(3):
                    before, bytes_before = transport.sends, transport.bytes_sent
                    for i, t in enumerate(tensors):
                        t.copy_(torch.from_numpy(data(rank, i, t.numel())))
                        sync.submit(f"t{i}", t)
                    sync.synchronize()
                    per_step.append(transport.sends - before)
                    sent[f"{topo}/{count}"] = transport.bytes_sent - bytes_before
                gc.collect()
                cycles[f"{topo}/{count}"] = sorted(
                    {type(o).__qualname__ for o in gc.garbage
                     if type(o).__module__.startswith("casync")})
            finally:
                gc.garbage.clear()
                gc.set_debug(0)
                gc.enable()
            if algo != "none":
                codec = sync.codec(sync.planner.plan("t0", tensors[0].numel(), sync.size))
                sent[f"{topo}/{count}/payloads"] = sum(
                    codec.encode(data(rank, i, 200_000 // count)).size for i in range(count))
            sync.close()
            counts[f"{topo}/{count}"] = per_step
    return {"counts": counts, "bytes": sent, "cycles": cycles}


def auto_plan(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """``planner="auto"``: profile once (or load the cache), plan, synchronize twice."""
    from casync import engine

    sizes = [n for n, _, _ in TENSORS] + [300_000, 1_000_000]
    sync = engine(args["algo"], planner="auto", timeout=60)
    arrays = {}
    for step in range(2):
        tensors = [_torch_tensor(data(rank, i, n, step), "float32", True)
                   for i, n in enumerate(sizes)]
        for i, t in enumerate(tensors):
            sync.submit(f"t{i}", t)
        sync.synchronize()
        arrays.update({f"{step}/{i}": t.numpy() for i, t in enumerate(tensors)})
    planner: Any = sync.planner
    # After the first step the planner planned the whole model (CostPlanner.fit).
    plans = {f"t{i}": repr(planner.plan(f"t{i}", n, sync.size)) for i, n in enumerate(sizes)}
    result = {"plans": plans, "choice": planner.choice, "digest": planner.cost.digest,
              "measured": planner.cost.meta["date"], "sizes": sizes}
    sync.close()
    np.savez(out / f"rank{rank}.npz", **arrays)
    return result


def auto_levels(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """``plan="auto"`` on nodes of ``LOCAL_WORLD_SIZE`` ranks: profiled with both links,
    each tensor flat or hierarchical; two steps."""
    from casync import engine

    sizes = [n for n, _, _ in TENSORS] + [300_000, 1_000_000]
    sync = engine(args["algo"], plan="auto", timeout=120)
    measured: Any = getattr(sync, "chooser", None)
    if args.get("split") and measured is not None:  # both ways in one step, by size
        class Split:
            cost = measured.cost

            def hierarchical(self, n: int) -> bool:
                return n > args["split"]

        sync.chooser = Split()
    results = []
    for step in range(2):
        tensors = [_torch_tensor(data(rank, i, n, step), "float32", True)
                   for i, n in enumerate(sizes)]
        sync.submit_many([(f"t{i}", t) for i, t in enumerate(tensors)])
        sync.synchronize()
        results += [t.numpy() for t in tensors]
    chooser: Any = getattr(sync, "chooser", None)
    cost = chooser.cost if chooser is not None else None
    result = {"engine": type(sync).__name__, "sizes": sizes,
              "levels": [chooser.hierarchical(n) for n in sizes] if chooser else None,
              "gpus": cost.gpus if cost else None,
              "intra": cost.intra(4 << 20) if cost else None,
              "digest": cost.digest if cost else None}
    sync.close()
    np.savez(out / f"rank{rank}.npz", results=np.concatenate(results))
    return result


def host_copies(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Every tensor compressed (onebit, min_compress 0) on the device path: the bytes it
    copied from device to host memory, the bytes it sent, and the gradients' own bytes."""
    import torch

    from casync import StaticPlanner, devices, engine

    _stand_in(args)
    copied = [0]
    to_host = devices.TorchMemory.to_host

    def counting(self: Any, dst: np.ndarray, src: Any) -> None:
        copied[0] += dst.nbytes
        to_host(self, dst, src)

    devices.TorchMemory.to_host = counting  # type: ignore[method-assign]
    sizes, steps = [1000, 50_000, 300_000], 3
    topo = args["topology"]
    sync = engine("onebit", topo, planner=StaticPlanner("onebit", topo, min_compress=0),
                        timeout=60)
    for step in range(steps):
        for i, n in enumerate(sizes):
            g = torch.from_numpy(data(rank, i, n, step))
            sync.submit(f"t{i}", g.cuda() if args.get("cuda") else g)
        sync.synchronize()
    sync.close()
    return {"copied": copied[0], "sent": sync.bytes_sent,
            "gradients": 4 * steps * sum(sizes)}


#: rows x width of the embedding-like gradient of the guarded scenario, and the rows each
#: rank's step touches
GUARD_ROWS, GUARD_WIDTH, GUARD_TOUCHED = 1000, 128, 20


def guard_data(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s two gradients in ``step`` of the guarded scenario: an embedding's
    (``GUARD_TOUCHED`` rows of values, the others exactly zero) and a dense layer's."""
    r = np.random.default_rng([rank, step, 99])
    emb = np.zeros((GUARD_ROWS, GUARD_WIDTH), np.float32)
    rows = r.choice(GUARD_ROWS, GUARD_TOUCHED, replace=False)
    emb[rows] = r.standard_normal((GUARD_TOUCHED, GUARD_WIDTH))
    return emb.reshape(-1), data(rank, 1, 100_000, step)


def guarded(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """An engine with the guard on (``casync.guard``) averaging an embedding-like and a
    dense gradient for ``steps`` steps: each step's averages, and what the guard decided."""
    import torch

    from casync import engine

    sync = engine(args["algo"], args.get("topology", "ps"), guard=True, timeout=60)
    arrays = {}
    for step in range(args.get("steps", 5)):
        emb, dense = (torch.from_numpy(a) for a in guard_data(rank, step))
        sync.submit_many([("emb", emb), ("dense", dense)])
        sync.synchronize()
        arrays[f"emb{step}"], arrays[f"dense{step}"] = emb.numpy(), dense.numpy()
    np.savez(out / f"rank{rank}.npz", **arrays)
    state = sync.state_dict()
    sync.close()
    return {"guard": state["guard"], "sent": sync.bytes_sent}


SCENARIOS: dict[str, Any] = {f.__name__: f for f in (strategies, feedback, nonfinite,
                                                     wait_first, fault, hierarchical,
                                                     mismatch, pipeline, messages, auto_plan,
                                                     auto_levels, host_copies, guarded)}


#: scenarios that join the group themselves (through hipress's init, as a user would)
OWN_INIT = {"torch_fault"}


def main(scenarios: dict[str, Any] | None = None) -> None:
    """A rank's entry point: run ``sys.argv[1]`` of ``scenarios`` (default: this file's)."""
    scenario, raw, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    rank = int(os.environ["RANK"])
    if scenario not in OWN_INIT:
        _init()
    result = (scenarios or SCENARIOS)[scenario](json.loads(raw), rank, folder)
    (folder / f"rank{rank}.json").write_text(json.dumps(result))
    # Skip process-group teardown: a dead peer must not turn a report into a hang.
    sys.stdout.flush()
    os._exit(0)



# ------------------------------------------------------------------ torch plugin scenarios


def _digits() -> tuple[Any, Any]:
    import torch

    sys.path.insert(0, str(HERE.parent / "examples"))
    from _digits import load_digits

    x, y = load_digits()
    return torch.from_numpy(x), torch.from_numpy(y)


def _mlp(width: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def _train(model: Any, opt: Any, x: Any, y: Any, rank: int, world: int, steps: int,
           batch: int = 32, accumulate: int = 1, ddp: Any = None) -> list[float]:
    import contextlib

    import torch

    losses = []
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            idx = torch.randint(0, len(x), (batch,), generator=gen)
            quiet = ddp.no_sync() if ddp is not None and micro < accumulate - 1 \
                else contextlib.nullcontext()
            with quiet:
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _digest(model: Any) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def torch_plugin(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """DDP comm hook and DistributedOptimizer, 20 steps per algorithm; digests and losses."""
    import torch
    from torch import nn

    import hipress.torch as hp

    _stand_in(args)
    hp.init()
    world = hp.size()
    x, y = _digits()
    report: dict[str, Any] = {}
    arrays = {}
    for mode in args["modes"]:
        for algo in args["algos"]:
            if mode == "ddp" and algo != "none":
                continue
            model = _mlp(args.get("width", 128))
            if args.get("bf16"):  # before DDP builds its buckets
                model = model.to(torch.bfloat16)
                x = x.to(torch.bfloat16)
            opt: Any = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            ddp = None
            if mode == "hook":
                ddp = nn.parallel.DistributedDataParallel(model)
                ddp.register_comm_hook(hp.HookState(algorithm=algo, min_compress=1024),
                                       hp.comm_hook)
                net = ddp
            elif mode == "ddp":  # torch's own allreduce: the reference for "none"
                ddp = nn.parallel.DistributedDataParallel(model)
                net = ddp
            else:
                opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                              algorithm=algo, min_compress=1024,
                                              backward_passes_per_step=args.get("passes", 1))
                net = model
            losses = _train(net, opt, x, y, rank, world, args.get("steps", 20),
                            accumulate=args.get("passes", 1), ddp=ddp)
            key = f"{mode}/{algo}"
            report[key] = {"digest": _digest(model.float()), "losses": losses}
            flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
            arrays[key] = flat.numpy()
    np.savez(out / f"rank{rank}.npz", **arrays)
    return report


def slow_wire(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """DDP with the comm hook over a transport that delays every message by ``delay`` s,
    beside the same training over the plain one. Returns backward's seconds in the last
    step, the chunks that step ran, and both models' digests."""
    import torch
    from torch import nn

    import hipress.torch as hp
    from casync import Synchronizer, Transport
    from hipress import distributed as core

    class Slow(Transport):  # every message arrives ``delay`` seconds late
        def wait(self, handle: Any, timeout: float) -> None:
            if handle.kind != "send":
                time.sleep(args["delay"])
            super().wait(handle, timeout)

    hp.init()
    real = core.synchronizer

    def slow_engine(algorithm: str, **options: Any) -> Any:
        engine = Synchronizer(algorithm, transport=Slow(core.gloo_group()), **options)
        core._engines.add(engine)
        return engine

    x, y = _digits()
    report: dict[str, Any] = {}
    for wire in ("slow", "plain"):
        core.synchronizer = slow_engine if wire == "slow" else real
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), *(nn.Linear(256, 256) for _ in range(7)),
                              nn.Linear(256, 10))
        # a bucket per layer (256 KB each): the step runs a chunk per bucket
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)
        state = hp.HookState(algorithm="onebit", min_compress=0, trace=True)
        ddp.register_comm_hook(state, hp.comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x[32 * step:32 * step + 32]),
                                               y[32 * step:32 * step + 32])
            state.take_trace()
            start = time.monotonic()
            loss.backward()
            seconds = time.monotonic() - start
            opt.step()
        trace = state.take_trace()
        assert trace is not None
        report[wire] = {"backward_s": seconds, "digest": _digest(model),
                        "chunks": len({graph for _, _, graph, _, _ in trace.tasks}),
                        "waits": sum(lane == "comm" for lane, *_ in trace.tasks)}
    core.synchronizer = real
    return report


def amp(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """fp16 autocast with a real GradScaler through plain DDP, the comm hook or
    DistributedOptimizer; in step ``overflow`` rank 1's loss is scaled to inf. Returns
    the scale after every step and the parameters' digest."""
    import torch
    from torch import nn

    import hipress.torch as hp

    hp.init()
    x, y = _digits()
    report: dict[str, Any] = {}
    for mode, algo in args["cases"]:
        model = _mlp(64)
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        net: Any = model
        if mode in ("ddp", "hook"):
            net = nn.parallel.DistributedDataParallel(model)
            if mode == "hook":
                net.register_comm_hook(hp.HookState(algorithm=algo, min_compress=512),
                                       hp.comm_hook)
        else:
            opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                          algorithm=algo, min_compress=512)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
        gen = torch.Generator().manual_seed(100 + rank)
        scales = []
        for step in range(args["steps"]):
            opt.zero_grad()
            idx = torch.randint(0, len(x), (32,), generator=gen)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            if step == args["overflow"] and rank == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            if mode == "optimizer" and step % 2:  # the explicit form, every other step
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        report[f"{mode}/{algo}"] = {"scales": scales, "digest": _digest(model),
                                    "finite": all(bool(torch.isfinite(p).all())
                                                  for p in model.parameters())}
    hp.shutdown()
    return report


def invalid_rank(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Rank 1 passes an invalid codec parameter to the hook's state or the optimizer;
    every rank reports what it raised and how long it took."""
    import torch
    from torch import nn

    import hipress.torch as hp
    from hipress import ConfigError, SyncError

    hp.init()
    x, y = _digits()
    model = _mlp(16)
    params = {"ratio": 0} if rank == 1 else {}
    start = time.monotonic()
    try:
        if args["mode"] == "hook":
            net = nn.parallel.DistributedDataParallel(model)
            net.register_comm_hook(hp.HookState(algorithm="dgc", min_compress=0, **params),
                                   hp.comm_hook)
            nn.functional.cross_entropy(net(x[:8]), y[:8]).backward()
        else:
            opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(),
                                          algorithm="dgc", min_compress=0, **params)
            nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
            opt.step()
    except (ConfigError, SyncError) as exc:
        return {"type": type(exc).__name__, "error": str(exc),
                "after": time.monotonic() - start}
    finally:
        hp.shutdown()
    return {"error": None}


def misuse(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """What DistributedOptimizer says of a second backward before step(); zero_grad()
    after backward is fine (the gradients are averaged when backward returns)."""
    import torch

    import hipress.torch as hp

    hp.init()
    x, y = _digits()
    model = _mlp(16)
    opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), algorithm="onebit")
    messages = {}
    torch.nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
    try:
        torch.nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
    except Exception as exc:  # noqa: BLE001
        messages["backward"] = f"{type(exc).__name__}: {exc}"
    try:
        opt.zero_grad()
    except Exception as exc:  # noqa: BLE001
        messages["zero_grad"] = f"{type(exc).__name__}: {exc}"
    torch.nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
    opt.step()
    # without its hooks, backward leaves each rank's own gradient (another batch a rank)
    opt.remove_hooks()
    opt.zero_grad()
    batch = slice(8 * rank + 8, 8 * rank + 16)
    torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
    opt.step()
    messages["local grad"] = float(next(model.parameters()).grad.double().sum())
    return messages


def torch_fault(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """A 2-rank training loop (DDP + comm hook, or DistributedOptimizer) whose rank 1 dies
    or stalls in step 3; the survivor catches ``hipress.SyncError`` around the step, shuts
    HiPress down and exits the way a user's script would (``sys.exit(7)``)."""
    import torch
    from torch import nn

    import hipress
    import hipress.torch as hp

    hp.init(timeout=60)
    if args["mode"] == "engine":
        return _engine_fault(args, rank, out)
    x, y = _digits()
    model = _mlp(2048)  # large enough to be compressed
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.05)
    net: Any = model
    if args["mode"] == "hook":
        net = nn.parallel.DistributedDataParallel(model)
        net.register_comm_hook(hp.HookState(algorithm="onebit"), hp.comm_hook)
    else:
        opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      algorithm="onebit")
    report: dict[str, Any] = {"error": None}
    start = time.monotonic()
    try:
        for step in range(6):
            start = time.monotonic()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x[:64]), y[:64])
            if step == 3 and rank == 1:
                # mid-step: the survivor has posted this step's messages and waits on them
                time.sleep(1.0)
                if args["fault"] == "die":
                    os._exit(17)
                stall(out, rank, float(os.environ["HIPRESS_TIMEOUT"]) + 5)
            loss.backward()
            opt.step()
    except hipress.SyncError as exc:
        report = {"error": str(exc), "type": type(exc).__name__,
                  "after": time.monotonic() - start}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if args.get("shutdown", True):
        hp.shutdown()
    sys.exit(7)


def _engine_fault(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """torch_fault on the engine itself: many tensors, so that many messages are in
    flight when the last rank dies mid-step."""
    import torch

    import hipress
    from hipress import distributed as core

    world = core.size()
    sync = core.synchronizer("onebit", topology=args.get("topology", "ps"), timeout=5)
    report: dict[str, Any] = {"error": None}
    try:
        for step in range(4):
            tensors = [torch.from_numpy(data(rank, i, 300_000, step)) for i in range(20)]
            if step == 2 and rank == world - 1:
                time.sleep(0.5)
                os._exit(17)
            for i, t in enumerate(tensors):
                sync.submit(f"t{i}", t)
            sync.synchronize()
    except hipress.SyncError as exc:
        report = {"error": str(exc), "type": type(exc).__name__}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if args.get("shutdown", True):
        core.shutdown()
    sys.exit(7)


def torch_checkpoint(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Train ``steps`` steps from ``start`` (DDP + hook, or DistributedOptimizer), loading
    the checkpoint in ``load`` first and saving one to ``save`` after step ``save_at``: the
    straight run and the saved-and-resumed one must end with the same bits."""
    import torch
    from torch import nn

    import hipress.torch as hp

    hp.init()
    model = _mlp(1024)  # two layers large enough to be compressed
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    algo, mode = args["algo"], args["mode"]
    state = None
    net: Any = model
    topology = args.get("topology", "ps")
    if mode == "hook":
        state = hp.HookState(algorithm=algo, topology=topology)
        net = nn.parallel.DistributedDataParallel(model)
        net.register_comm_hook(state, hp.comm_hook)
    else:
        opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      algorithm=algo, topology=topology)
    # one_file: rank 0 writes one checkpoint with every rank's HiPress state, as
    # Lightning, Accelerate and Trainer do; every rank reads it
    one_file = args.get("one_file")
    hipress_obj: Any = hp.AllRanksState(state if state is not None else opt)
    if args.get("load"):
        name = "all.pt" if one_file else f"rank{rank}.pt"
        saved = torch.load(Path(args["load"]) / name, weights_only=True)
        model.load_state_dict(saved["model"])
        if one_file:
            hipress_obj.load_state_dict(saved["hipress"])
            if state is None:  # the optimizer's whole state came with its HiPress part
                saved["opt"] = None
        if args.get("reset"):  # the optimizer and model only, as before HiPress had state
            saved["opt"].pop("hipress", None)
        if saved["opt"] is not None:
            opt.load_state_dict(saved["opt"])
        if state is not None and not args.get("reset") and not one_file:
            state.load_state_dict(saved["hook"])
    x, y = _digits()
    for step in range(args["start"], args["start"] + args["steps"]):
        idx = torch.from_numpy(np.random.default_rng([rank, step]).integers(0, len(x), 32))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
        if args.get("save") and step + 1 == args["save_at"]:
            folder = Path(args["save"])
            folder.mkdir(parents=True, exist_ok=True)
            if one_file:
                gathered = hipress_obj.state_dict()  # every rank takes part
                if rank == 0:
                    torch.save({"model": model.state_dict(), "hipress": gathered,
                                "opt": opt.state_dict() if state is not None else None},
                               folder / "all.pt")
            else:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "hook": state.state_dict() if state is not None else None},
                           folder / f"rank{rank}.pt")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    np.savez(out / f"rank{rank}.npz", params=flat.numpy())
    return {}


def torch_embedding(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """A bag-of-tokens model (an untied embedding, 2048 x 64, and a dense output layer)
    under DDP with ``HookState()`` as a user leaves it, or ``args["hook"]``: every step's
    averaged embedding gradient, and plain DDP's for the same steps alongside."""
    import torch
    from torch import nn

    import hipress.torch as hp

    hp.init()
    grads: dict[str, list[Any]] = {"hipress": [], "ddp": []}
    for kind in grads:
        torch.manual_seed(0)
        model = nn.Sequential(nn.EmbeddingBag(2048, 64), nn.Linear(64, 2048))
        ddp = nn.parallel.DistributedDataParallel(model)
        if kind == "hipress":
            ddp.register_comm_hook(hp.HookState(**args.get("hook", {})), hp.comm_hook)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(args.get("steps", 5)):
            r = np.random.default_rng([rank, step])
            tokens = torch.from_numpy(r.integers(0, 2048, (8, 16)))
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(tokens), tokens[:, 0]).backward()
            grads[kind].append(model[0].weight.grad.clone().numpy())
            opt.step()
    np.savez(out / f"rank{rank}.npz", **{f"{k}{i}": g for k, gs in grads.items()
                                         for i, g in enumerate(gs)})
    return {}


SCENARIOS.update({f.__name__: f for f in (torch_plugin, amp, slow_wire, invalid_rank, misuse,
                                          torch_fault, torch_embedding,
                                          torch_checkpoint)})


if __name__ == "__main__":
    main()
