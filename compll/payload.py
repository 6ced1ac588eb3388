"""The self-describing payload format shared by every backend.

Layout (all integers little-endian)::

    offset  size  field
    0       2     magic b"HP"
    2       1     format version (2)
    3       1     number of sections S
    4       4     algorithm id (CRC-32 of the program name, source and parameters)
    8       4     element count n
    12      4     flags: NONFINITE (1) when the encoded values held a NaN or an infinity
    16      4     seed of the counter-based RNG
    20      4     step of the counter-based RNG
    24      8*S   byte size of each section
    ...           the sections, each starting at a multiple of 8 bytes

``parse`` validates every field against the buffer length and the program's layout
before any section is read, and raises ``PayloadError`` on a mismatch.

The NONFINITE flag is how a NaN or an infinity crosses any codec: encoders set it from
the values they read (the gradient, or with error feedback the residual's sum), and a
payload that carries it decodes to NaN in every element, whatever its sections say. A
sparse or quantizing codec would otherwise drop the non-finite element (top-k ranks NaN
below every number; a max ignores NaN), and AMP's loss scaler would never see it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hipress_base.errors import PayloadError

from .constants import ALIGN, HEADER_SIZE, MAGIC, NONFINITE, VERSION
from .ir import Length, LengthKind, Program, Section, Type, TypeKind
from .typing_rules import ITEMSIZE

__all__ = ["MAGIC", "VERSION", "HEADER_SIZE", "NONFINITE", "Header", "SizeRule", "algorithm_id",
           "build", "nonfinite", "parse", "header_size", "section_count", "framed_size",
           "fixed_count", "size_rule", "frame_all"]

_HEAD = struct.Struct("<2sBBIIIII")


@dataclass(frozen=True)
class Header:
    algorithm_id: int
    n: int
    seed: int
    step: int
    sizes: tuple[int, ...]
    flags: int = 0

    @property
    def nonfinite(self) -> bool:
        """The encoded values held a NaN or an infinity: the payload decodes to NaN."""
        return bool(self.flags & NONFINITE)


@dataclass(frozen=True)
class SizeRule:
    """A section's bytes from its element count: ``ceil(count * bits / 8)``. The one
    definition: Python sizes and checks payloads with ``bytes``, the kernels with the C
    expression ``c`` renders."""

    bits: int

    def bytes(self, count: int) -> int:
        return (count * self.bits + 7) // 8

    def c(self, count: str) -> str:
        if self.bits % 8 == 0:
            return f"({count}) * {self.bits // 8}"
        return f"(({count}) * {self.bits} + 7) / 8"


def size_rule(ty: Type) -> SizeRule:
    """The size rule of a section of type ``ty`` (a scalar holds one element)."""
    return SizeRule(ty.bits if ty.kind is TypeKind.PACKED else 8 * ITEMSIZE[ty.elem])


def fixed_count(length: Length, n: int) -> int | None:
    """Elements of a section of ``length`` for a tensor of ``n``; None when the count is
    known only at run time (the renderer's ``fixed_count`` is the same rule in C)."""
    if length.kind is LengthKind.N:
        return n
    if length.kind is LengthKind.CONST:
        return length.value
    if length.kind is LengthKind.BLOCKS:
        assert length.base is not None
        base = fixed_count(length.base, n)
        if base is None:
            return None
        return -(-base // length.value) if length.value else 1
    return None


def algorithm_id(program: Program) -> int:
    """A 32-bit id that differs when the name, the source or a parameter differs."""
    text = f"{program.name}\0{program.source}\0{sorted(program.param_values)!r}"
    return zlib.crc32(text.encode())


def _pad(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


def header_size(sections: int) -> int:
    return HEADER_SIZE + 8 * sections


def build(program: Program, n: int, seed: int, step: int,
          sections: Sequence[np.ndarray], flags: int = 0) -> np.ndarray:
    """Assemble header and section bytes into one uint8 payload."""
    sizes = [s.nbytes for s in sections]
    total = header_size(len(sections)) + sum(_pad(s) for s in sizes)
    out = np.zeros(total, dtype=np.uint8)
    view = out.data
    _HEAD.pack_into(view, 0, MAGIC, VERSION, len(sections), algorithm_id(program), n, flags,
                    seed & 0xFFFFFFFF, step & 0xFFFFFFFF)
    struct.pack_into(f"<{len(sizes)}Q", view, HEADER_SIZE, *sizes)
    offset = header_size(len(sections))
    for sec in sections:
        out[offset:offset + sec.nbytes] = np.frombuffer(sec.tobytes(), dtype=np.uint8)
        offset += _pad(sec.nbytes)
    return out


def framed_size(buf: np.ndarray) -> int:
    """The byte length a payload's header declares, read from the front of ``buf``.

    Lets a receiver that posted a worst-case buffer find where the payload ends.

    Raises:
        PayloadError: if the header is not a HiPress header or declares more bytes than
            ``buf`` holds.
    """
    if buf.size < HEADER_SIZE:
        raise PayloadError(f"{buf.size} bytes cannot hold a {HEADER_SIZE}-byte header")
    raw = buf[:HEADER_SIZE].tobytes()
    magic, version, nsec = raw[:2], raw[2], raw[3]
    if magic != MAGIC or version != VERSION:
        raise PayloadError("not a HiPress payload (bad magic or version)")
    head = header_size(nsec)
    if buf.size < head:
        raise PayloadError(f"{buf.size} bytes cannot hold a {head}-byte header")
    sizes = struct.unpack(f"<{nsec}Q", buf[HEADER_SIZE:head].tobytes())
    total = head + sum(_pad(s) for s in sizes)
    if total > buf.size:
        raise PayloadError(f"the header declares {total} bytes but only {buf.size} arrived")
    return total


def nonfinite(buf: np.ndarray) -> bool:
    """Whether a payload (already validated) carries the NONFINITE flag."""
    return bool(struct.unpack_from("<I", np.ascontiguousarray(buf[12:16]).data)[0] & NONFINITE)


def section_count(section: Section, size: int, n: int) -> int:
    """Elements in a section of ``size`` bytes, or PayloadError if the size is wrong."""
    ty = section.ty
    rule = size_rule(ty)
    if ty.kind is TypeKind.SCALAR:
        want = rule.bytes(1)
        if size != want:
            raise PayloadError(f"a {ty.elem} section must be {want} bytes, not {size}")
        return 1
    assert ty.length is not None
    fixed = fixed_count(ty.length, n)
    if fixed is not None:
        what = f"u{ty.bits}" if ty.kind is TypeKind.PACKED else ty.elem
        if size != rule.bytes(fixed):
            raise PayloadError(
                f"a {what}[{fixed}] section must be {rule.bytes(fixed)} bytes, not {size}"
            )
        return fixed
    assert ty.kind is not TypeKind.PACKED  # the checker allows only fixed-length packed sections
    item = ITEMSIZE[ty.elem]
    if size % item:
        raise PayloadError(f"a {ty.elem} array section of {size} bytes is not whole elements")
    return size // item


def parse(program: Program, payload: np.ndarray, n: int) -> tuple[Header, list[np.ndarray],
                                                                   list[int]]:
    """Validate a payload against ``program`` and ``n``; return header, sections, counts.

    Raises:
        PayloadError: if anything in the header disagrees with the buffer or the program.
    """
    buf = np.asarray(payload)
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise PayloadError(f"a payload is a 1-D uint8 array, not {buf.dtype}[{buf.shape}]")
    if buf.size < HEADER_SIZE:
        raise PayloadError(f"payload of {buf.size} bytes is shorter than the "
                           f"{HEADER_SIZE}-byte header")
    raw = np.ascontiguousarray(buf).data
    magic, version, nsec, algo, count, flags, seed, step = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC:
        raise PayloadError("not a HiPress payload (bad magic)")
    if version != VERSION:
        raise PayloadError(f"payload format version {version} is not supported "
                           f"(this HiPress reads version {VERSION})")
    if algo != algorithm_id(program):
        raise PayloadError(f"payload was written by another algorithm or parameter set, not "
                           f"{program.name} with {dict(program.param_values)}")
    if count != n:
        raise PayloadError(f"payload holds {count} elements but {n} were requested")
    if flags & ~NONFINITE:
        raise PayloadError(f"payload flags {flags:#x} are not ones this HiPress writes")
    if nsec != len(program.layout):
        raise PayloadError(f"payload has {nsec} sections; {program.name} writes "
                           f"{len(program.layout)}")
    head = header_size(nsec)
    if buf.size < head:
        raise PayloadError(f"payload of {buf.size} bytes is shorter than its {head}-byte header")
    sizes = struct.unpack_from(f"<{nsec}Q", raw, HEADER_SIZE)
    counts = [section_count(sec, size, n) for sec, size in zip(program.layout, sizes,
                                                                strict=True)]
    groups: dict[str, int] = {}
    for sec, cnt in zip(program.layout, counts, strict=True):
        if sec.group:
            if groups.setdefault(sec.group, cnt) != cnt:
                raise PayloadError(f"sections of one group hold {groups[sec.group]} and {cnt} "
                                   "elements")
    total = head + sum(_pad(s) for s in sizes)
    if total != buf.size:
        raise PayloadError(f"payload is {buf.size} bytes but its header describes {total}")
    sections = []
    offset = head
    for size in sizes:
        sections.append(buf[offset:offset + size])
        offset += _pad(size)
    return Header(algo, count, seed, step, tuple(sizes), flags), sections, counts


def frame_all(buf: np.ndarray, count: int) -> list[int]:
    """The sizes of the ``count`` payloads ``buf`` holds end to end, found from their
    headers before anything is decoded (as the kernels do); a PayloadError names the
    segment that does not frame, or says that bytes follow the last."""
    sizes = []
    pos = 0
    for i in range(count):
        try:
            sizes.append(framed_size(buf[pos:]))
        except PayloadError as exc:
            raise PayloadError(f"segment {i} of {count}: {exc}") from None
        pos += sizes[-1]
    if pos != buf.size:
        raise PayloadError(f"segment {max(count - 1, 0)} of {count}: {buf.size - pos} bytes "
                           "follow the last segment's payload")
    return sizes
