"""The numbers the reference, the payload format and the kernels must agree on.

Defined once here; the build renders them into ``hp_constants.h``
(``templates/constants.h.j2``), which every runtime header includes, so the C++ and
CUDA code never carries its own copy.
"""

from __future__ import annotations

__all__ = ["SUM_CHUNK", "SUM_BLOCK", "SUM_LANES", "MAX_ELEMENTS", "HEADER_SIZE", "MAGIC",
           "VERSION", "ALIGN", "MAX_STAGED", "GRAIN", "GROUP_LIMIT", "BATCH_SMALL", "FEEDBACK",
           "SCALE_SUM", "NONFINITE", "TOO_MANY", "header_text"]

#: A float sum's defined order (``compll.interpreter._sum_f32``): chunks of SUM_CHUNK
#: elements, each cut into blocks of SUM_BLOCK, each block summed in SUM_LANES lanes.
SUM_CHUNK = 8192
SUM_BLOCK = 512
SUM_LANES = 32
#: Elements one codec call takes: CompLL counts and indexes in u32.
MAX_ELEMENTS = 2**32 - 1
#: The payload header: magic "HP", format version, section count, algorithm id, n (u32),
#: flags (u32), seed and step (24 bytes), then a u64 size per section; sections are
#: 8-byte aligned.
HEADER_SIZE = 24
MAGIC = b"HP"
VERSION = 2
#: A payload header's flag: the encoded values held a NaN or an infinity. Every decoder
#: then writes NaN, whatever the sections hold, so the signal survives any codec.
NONFINITE = 1
ALIGN = 8
#: Packed arrays one fused pass unpacks into L1 chunk by chunk.
MAX_STAGED = 4
#: Elements per parallel block of the CPU's scans (filter, keys).
GRAIN = 1 << 16
#: Group loops run ``for (; i + 64 <= lim; i += 64)`` in 32 bits with ``lim`` at most
#: this, so ``i + 64`` cannot wrap.
GROUP_LIMIT = 0xFFFFFF80
#: A batched call's segments below this many elements run one per thread.
BATCH_SMALL = 1 << 16
#: An encode item's flag: update the residual with what the payload decodes to.
FEEDBACK = 1
#: A batched decode's ``accumulate`` that adds, then scales the sum.
SCALE_SUM = 2
TOO_MANY = f"a codec call holds at most {MAX_ELEMENTS} elements; split the tensor"


def header_text() -> str:
    """``hp_constants.h``: the constants above as C++ for the runtimes."""
    from pathlib import Path

    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent
                                                                / "templates")),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.get_template("constants.h.j2").render(
        SUM_CHUNK=SUM_CHUNK, SUM_BLOCK=SUM_BLOCK, SUM_LANES=SUM_LANES,
        MAX_ELEMENTS=MAX_ELEMENTS, HEADER_SIZE=HEADER_SIZE, VERSION=VERSION,
        MAX_STAGED=MAX_STAGED, GRAIN=GRAIN, GROUP_LIMIT=GROUP_LIMIT, BATCH_SMALL=BATCH_SMALL,
        FEEDBACK=FEEDBACK, SCALE_SUM=SCALE_SUM, NONFINITE=NONFINITE, TOO_MANY=TOO_MANY)
