"""``Codec``: encode and decode gradients with a CompLL algorithm (``hipress.codec()``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from hipress_base.errors import ConfigError, PayloadError

from . import compiler
from .buffers import (
    as_float32,
    as_payload,
    byte_buffer,
    check_buffer,
    check_count,
    encode_items,
    float_input,
    is_cuda,
    is_torch,
    numel,
    ptr,
    torch_module,
)
from .constants import MAX_ELEMENTS, SCALE_SUM
from .ir import Program
from .loaders import DECODE_ITEM, load_kernel, payload_size_hint

__all__ = ["Codec", "codec", "algorithms", "TARGETS", "MAX_ELEMENTS"]

#: Backends a codec can run on. ``auto`` runs CUDA tensors on the GPU and everything
#: else on the CPU; ``ref`` is the NumPy reference interpreter, the oracle of the others;
#: ``cuda-emu`` runs the CUDA target's kernels on the CPU (host data, as ``cpu``) under
#: an emulator that checks them, for testing without a GPU.
TARGETS = ("auto", "cpu", "cuda", "ref", "cuda-emu")


def algorithms() -> list[str]:
    """Names of the shipped compression algorithms (the ``dsl/*.cll`` files).

    Example:
        >>> "onebit" in hipress.algorithms()
        True
    """
    return compiler.algorithms()


class Codec:
    """One compression algorithm with fixed parameters, on one target.

    ``encode`` turns a float32 vector into a self-describing uint8 payload; ``decode``
    turns it back. Stochastic algorithms draw from a counter-based RNG keyed by
    ``seed`` and a step that advances with every ``encode``; both travel in the
    payload header, so any rank decodes any payload to the same values.
    """

    def __init__(self, program: Program, target: str, seed: int) -> None:
        self.program = program
        self.target = target
        self.seed = int(seed) & 0xFFFFFFFF
        self.step = 0
        self._kernels: dict[str, Any] = {}
        self._caps: dict[int, int] = {}
        if target != "auto":
            self._kernel(target)  # build now, so a broken toolchain fails at construction

    def _kernel(self, target: str) -> Any:
        if target not in self._kernels:
            self._kernels[target] = load_kernel(self.program, target)
        return self._kernels[target]

    def _backend(self, on_gpu: bool) -> str:
        if on_gpu and self.target in ("cpu", "ref", "cuda-emu"):
            raise ConfigError(f"the data is on the GPU but this codec's target is "
                              f"{self.target!r}; use target='cuda' or 'auto'")
        if not on_gpu and self.target == "cuda":
            raise ConfigError("target='cuda' needs CUDA tensors; move the data with .cuda() "
                              "or use target='auto'")
        if self.target == "auto":
            return "cuda" if on_gpu else "cpu"
        return self.target

    def defers_feedback(self, on_gpu: bool = False) -> bool:
        """Whether batched encodes on this backend defer error feedback's second residual
        update to the site's next encode (``hp::EncItem``'s keep): the CPU target's
        kernels do; the CUDA ones (and so ``cuda-emu``) update at once."""
        return self._backend(on_gpu) == "cpu"

    @property
    def name(self) -> str:
        return self.program.name

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.program.param_values)

    def __repr__(self) -> str:
        params = compiler.describe_params(self.program)
        sep = ", " if params else ""
        return f"Codec({self.name!r}, target={self.target!r}, seed={self.seed}{sep}{params})"

    @property
    def unbiased(self) -> bool:
        """Whether the algorithm declares its decoded values unbiased estimates."""
        return bool(self.program.unbiased)

    def max_payload_bytes(self, n: int) -> int:
        """An upper bound on the payload size for ``n`` elements (exact for fixed layouts).

        Example:
            >>> buf = np.empty(c.max_payload_bytes(len(x)), np.uint8)  # fits any payload
        """
        n = int(n)
        cap = self._caps.get(n)
        if cap is None:
            cap = self._caps[n] = payload_size_hint(self.program, n, n)
        return cap

    def encode(self, x: Any, step: int | None = None, out: Any = None,
               residual: Any = None) -> Any:
        """Compress a gradient.

        Args:
            x: a float array, CPU tensor or (targets ``auto``/``cuda``) CUDA tensor;
                flattened, and upcast when not float32.
            step: the RNG step; by default the codec's own counter, which then advances.
            out: an optional uint8 buffer (array, or CUDA tensor for CUDA input) to write
                the payload into when it fits, so a caller can reuse one buffer per tensor;
                the payload returned is then a view of its first bytes.
            residual: error feedback's residual, a contiguous float32 array (CUDA tensor
                for CUDA input) of x's size: ``x`` is added into it in place
                (``residual += x``, in the kernel) and the payload is that of the sum.

        Returns:
            The payload: a 1-D uint8 array, or a uint8 CUDA tensor for CUDA input.
        """
        check_count(int(x.numel()) if is_torch(x) else np.size(x))
        if step is None:
            step = self.step
            self.step = (self.step + 1) & 0xFFFFFFFF
        step &= 0xFFFFFFFF
        if is_cuda(x):
            self._backend(on_gpu=True)
            flat = x.detach().reshape(-1)
            if flat.dtype != torch_module().float32:
                flat = flat.float()
            flat = flat.contiguous()
            if residual is not None:
                check_buffer(residual, flat.numel(), "residual=", cuda=True)
            return self._kernel("cuda").encode(flat, self.seed, step, out, residual)
        data = as_float32(x, "the gradient")
        backend = self._backend(on_gpu=False)
        res = None if residual is None else check_buffer(residual, data.size, "residual=")
        into = None
        if out is not None:
            into = out.numpy() if is_torch(out) else out
            if not isinstance(into, np.ndarray) or into.dtype != np.uint8 \
                    or not into.flags.c_contiguous:
                raise ConfigError("out= must be a contiguous uint8 array")
            into = into.reshape(-1)
        return self._kernel(backend).encode(data, self.seed, step, into, res)

    def decode(self, payload: Any, n: int, out: Any = None, accumulate: bool = False,
               scale: float = 1.0, feedback: bool = False) -> Any:
        """Decompress a payload of ``n`` elements.

        Args:
            payload: bytes, a uint8 array or tensor from ``encode`` (any codec instance with
                the same algorithm and parameters).
            n: the element count the caller expects; a mismatch is a PayloadError.
            out: an optional contiguous float32 array or tensor of ``n`` elements.
            accumulate: add the decoded values to ``out`` instead of overwriting it.
            scale: multiply the decoded values by this float32 first, in the same pass
                (``1 / world`` averages a sum; ``-1`` with ``accumulate`` subtracts).
            feedback: error feedback's update of its residual ``out``: accumulate, and set
                each non-finite result to 0 (so a NaN gradient does not poison later
                steps). Needs ``out``.

        Returns:
            ``out`` if given, else a new float32 array (a CUDA tensor for CUDA payloads).

        Raises:
            PayloadError: if the payload is malformed, truncated or from another codec;
                ``out`` is left as it was.
        """
        n = int(n)
        check_count(n)
        scale = float(np.float32(scale))
        if (accumulate or feedback) and out is None:
            raise ConfigError("accumulate=True and feedback=True need out= to add into")
        if is_cuda(payload):
            self._backend(on_gpu=True)
            torch = torch_module()
            target = torch.empty(n, dtype=torch.float32, device=payload.device) \
                if out is None else check_buffer(out, n, "out=", cuda=True)
            self._kernel("cuda").decode(payload.reshape(-1), n, target, accumulate, scale,
                                        feedback)
            return target
        buf = as_payload(payload)
        backend = self._backend(on_gpu=False)
        dest = None if out is None else check_buffer(out, n, "out=")
        if dest is None:
            dest = np.empty(n, dtype=np.float32)
            out = dest
        self._kernel(backend).decode(np.ascontiguousarray(buf), n, dest, accumulate, scale,
                                     feedback)
        return out


    def _steps(self, count: int, steps: Any) -> list[int]:
        if steps is None:
            first = self.step
            self.step = (self.step + count) & 0xFFFFFFFF
            return [(first + i) & 0xFFFFFFFF for i in range(count)]
        steps = [int(s) & 0xFFFFFFFF for s in steps]
        if len(steps) != count:
            raise ConfigError(f"{count} segments but {len(steps)} steps")
        return steps

    def encode_batch(self, xs: Sequence[Any], out: Any = None, steps: Sequence[int] | None = None,
                     residuals: Sequence[Any] | None = None, feedback: bool = False,
                     merge: Any = None) -> tuple[Any, list[int]]:
        """Compress several segments in one native call, each into its own payload, the
        payloads laid end to end (what one message of a chunk carries).

        Args:
            xs: contiguous float32 arrays (or, on CUDA, tensors), one per segment.
            out: a uint8 buffer of at least ``sum(max_payload_bytes(len(x)))`` bytes to write
                into; by default a new one.
            steps: each segment's RNG step; by default the codec's counter, advanced by
                ``len(xs)``.
            residuals: per segment, error feedback's residual (or None): ``x`` is added into
                it and the payload is that of the sum, as for ``encode``.
            feedback: also subtract what each payload decodes to from its residual, zeroing
                non-finite results (error feedback's update, in the same call).
            merge: payloads laid end to end, one per segment (a received message): each is
                first added into its segment's ``x``, which must then be a writable
                contiguous float32 array (or CUDA tensor), as ``decode_batch`` with
                ``accumulate=True`` would; then the sums are encoded. An aggregator's last
                merge and its re-encode; with residuals the kernel reads ``x`` once.

        Returns:
            The payloads (a view of ``out``) and each segment's payload size.

        Raises:
            PayloadError: a payload of ``merge`` is malformed; the message names the segment.
                Nothing is merged or encoded when the payloads do not frame.

        Example:
            >>> payload, sizes = c.encode_batch([a, b])
            >>> c.decode_batch(payload, [a.size, b.size])
        """
        count = len(xs)
        steps_ = self._steps(count, steps)
        res = list(residuals) if residuals is not None else [None] * count
        if len(res) != count:
            raise ConfigError(f"{count} segments but {len(res)} residuals")
        cuda = count > 0 and is_cuda(xs[0])
        backend = self._backend(on_gpu=cuda)
        for x in xs:
            check_count(int(x.numel()) if is_torch(x) else np.size(x))
        caps = [self.max_payload_bytes(numel(x)) for x in xs]
        if merge is not None:
            xs = [check_buffer(x, numel(x), "xs= (a merge's target)", cuda) for x in xs]
            if len(xs) == 0 and numel(merge):
                raise PayloadError(f"{numel(merge)} bytes for no segments")
        else:
            # Held here until the kernels have read them: the rows keep only addresses.
            xs = [float_input(x, cuda) for x in xs]
        buf = byte_buffer(out, sum(caps), xs[0] if cuda else None)
        items = encode_items(xs, res, caps, steps_, ptr(buf), feedback, cuda)
        kernel = self._kernel(backend)
        if merge is None:
            total = kernel.encode_batch(items, self.seed, buf)
        else:
            msg = merge.reshape(-1) if cuda else as_payload(merge)
            total = kernel.merge_encode_batch(items, self.seed, msg, buf)
        return buf[:total], [int(v) for v in items["size"]]

    def decode_batch(self, payload: Any, ns: Sequence[int], outs: Sequence[Any] | None = None,
                     accumulate: bool = False, scale: float = 1.0,
                     feedback: bool = False) -> list[Any]:
        """Decompress the payloads of several segments, laid end to end (``encode_batch``'s
        result or a received message), in one native call.

        Args:
            payload: the payloads, end to end; each is found from the header of the one
                before, and no bytes may follow the last.
            ns: each segment's element count.
            outs: each segment's output (contiguous float32 of its count); new ones by
                default. ``accumulate``, ``scale`` and ``feedback`` as for ``decode``.

        Returns:
            The outputs.

        Raises:
            PayloadError: a segment's payload is malformed or truncated, or bytes follow the
                last one; the message names the segment. When the payloads do not frame (a
                truncated message, bytes after the last) no output changes; else that
                segment's output is left as it was, and the kernels decode the others.
        """
        ns = [int(n) for n in ns]
        for n in ns:
            check_count(n)
        scale = float(np.float32(scale))
        count = len(ns)
        if (accumulate or feedback) and outs is None:
            raise ConfigError("accumulate=True and feedback=True need outs= to add into")
        cuda = is_cuda(payload)
        backend = self._backend(on_gpu=cuda)
        if outs is None:
            if cuda:
                torch = torch_module()
                outs = [torch.empty(n, dtype=torch.float32, device=payload.device) for n in ns]
            else:
                outs = [np.empty(n, np.float32) for n in ns]
        outs = list(outs)
        if len(outs) != count:
            raise ConfigError(f"{count} segments but {len(outs)} outputs")
        buf: Any = payload.reshape(-1) if cuda else as_payload(payload)
        nbytes = numel(buf)
        items = np.zeros(count, DECODE_ITEM)
        if count:
            items["p"][0] = ptr(buf) if nbytes else 0
            items["size"][0] = nbytes
            items["n"] = ns
            items["out"] = [ptr(check_buffer(o, n, "outs=", cuda))
                            for o, n in zip(outs, ns, strict=True)]
        elif nbytes:
            raise PayloadError(f"{nbytes} bytes for no segments")
        if cuda:
            self._kernel(backend).decode_batch(items, int(accumulate), scale, feedback,
                                               device=payload.device)
        else:
            self._kernel(backend).decode_batch(items, int(accumulate), scale, feedback)
        return outs

    def encode_items(self, items: np.ndarray, out: Any, merge: Any = None) -> int:
        """``encode_batch``'s native call on prepared rows (for callers that hold the
        addresses, as CaSync's graphs do; they keep the memory alive).

        Args:
            items: a ``compll.loaders.ENCODE_ITEM`` array with every field but ``size``
                set, its ``out`` addresses laid in order inside ``out``.
            out: the buffer the payloads are written to (host array, or CUDA tensor).
            merge: as for ``encode_batch``: payloads end to end, one per row, added into
                each row's ``g`` (then writable memory) before it is encoded.

        Returns:
            The payloads' total bytes, end to end from the first item's ``out``.
        """
        kernel = self._kernel(self._backend(on_gpu=is_cuda(out)))
        if merge is None:
            return int(kernel.encode_batch(items, self.seed, out))
        msg = merge.reshape(-1) if is_cuda(merge) else as_payload(merge)
        return int(kernel.merge_encode_batch(items, self.seed, msg, out))

    def decode_items(self, items: np.ndarray, accumulate: bool = False, scale: float = 1.0,
                     feedback: bool = False, cuda: bool = False,
                     scale_sum: bool = False) -> None:
        """``decode_batch``'s native call on prepared ``compll.loaders.DECODE_ITEM`` rows:
        the first row's ``p`` and ``size`` span the message, every row's ``n`` and ``out``
        are set. ``scale_sum``: add the decoded values, then multiply the sum by
        ``scale`` (an average of a sum). Raises PayloadError naming the bad segment."""
        backend = self._backend(on_gpu=cuda)
        mode = SCALE_SUM if scale_sum else int(accumulate)
        self._kernel(backend).decode_batch(items, mode, float(np.float32(scale)), feedback)


def codec(name_or_path: str | os.PathLike[str], target: str = "auto", seed: int = 0,
          **params: Any) -> Codec:
    """Build a codec for a shipped algorithm or a ``.cll`` file.

    Args:
        name_or_path: an algorithm name from ``algorithms()`` or a path to a ``.cll`` file.
        target: ``"auto"`` (CUDA tensors on the GPU, everything else on the CPU),
            ``"cpu"``, ``"cuda"``, ``"ref"`` for the NumPy reference interpreter, or
            ``"cuda-emu"``: the CUDA kernels run on the CPU by an emulator that checks
            them (host data; see docs/compll.md).
            Kernels are compiled on first use and cached (see ``compll.build``).
        seed: the RNG seed of stochastic algorithms.
        **params: overrides of the algorithm's ``param`` declarations.

    Returns:
        A ``Codec``.

    Raises:
        ConfigError: unknown algorithm, target or parameter, or a failed ``require``.
        CompileError: the DSL file does not parse or check, or a kernel fails to build.

    Example:
        >>> c = hipress.codec("dgc", ratio=0.01)
        >>> y = c.decode(c.encode(x), len(x))
    """
    if target not in TARGETS:
        raise ConfigError(f"unknown target {target!r}; available: {', '.join(TARGETS)}")
    return Codec(compiler.load(name_or_path, **params), target, seed)
