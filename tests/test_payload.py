"""Malformed, truncated or foreign payloads raise PayloadError and never crash."""

import shutil
import struct
import subprocess

import numpy as np
import pytest
from conftest import ALGORITHMS, gradient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hipress
from compll import payload
from hipress import PayloadError

pytestmark = pytest.mark.pure

CODECS = {name: hipress.codec(name) for name in ALGORITHMS}
N = 1000
GOOD = {name: c.encode(gradient(N)) for name, c in CODECS.items()}


def decode_or_payload_error(name, data, n=N):
    try:
        out = CODECS[name].decode(data, n)
    except PayloadError:
        return None
    assert out.shape == (n,) and out.dtype == np.float32
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ALGORITHMS), st.binary(max_size=400))
def test_random_bytes(name, blob):
    decode_or_payload_error(name, blob)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ALGORITHMS), st.data())
def test_truncations_are_rejected(name, data):
    good = GOOD[name]
    cut = data.draw(st.integers(0, good.size - 1))
    with pytest.raises(PayloadError):
        CODECS[name].decode(good[:cut], N)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ALGORITHMS), st.data())
def test_bit_flips_never_crash(name, data):
    bad = GOOD[name].copy()
    pos = data.draw(st.integers(0, bad.size - 1))
    bad[pos] ^= np.uint8(1 << data.draw(st.integers(0, 7)))
    decode_or_payload_error(name, bad)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_header_fields_are_checked(name):
    good = GOOD[name]
    c = CODECS[name]

    def with_field(offset, fmt, value):
        bad = good.copy()
        struct.pack_into(fmt, bad, offset, value)
        return bad

    cases = {
        "bad magic": with_field(0, "<2s", b"XX"),
        "version": with_field(2, "<B", 9),
        "another algorithm": with_field(4, "<I", 12345),
        "elements": with_field(8, "<Q", N + 1),
        "sections": with_field(3, "<B", 7),
        "section size": with_field(payload.HEADER_SIZE, "<Q", 2**40),
    }
    for bad in cases.values():
        with pytest.raises(PayloadError):
            c.decode(bad, N)
    with pytest.raises(PayloadError, match="1000 elements but 999"):
        c.decode(good, N - 1)
    with pytest.raises(PayloadError):
        c.decode(np.concatenate([good, np.zeros(8, np.uint8)]), N)


def test_payload_from_other_parameters_is_rejected():
    a = hipress.codec("topk", ratio=0.01)
    b = hipress.codec("topk", ratio=0.02)
    with pytest.raises(PayloadError, match="another algorithm or parameter set"):
        b.decode(a.encode(gradient(N)), N)


def test_sparse_indices_out_of_range_are_rejected():
    c = hipress.codec("threshold", tau=0.0)
    good = c.encode(np.ones(16, np.float32))
    bad = good.copy()
    head = payload.header_size(2)
    struct.pack_into("<I", bad, head, 16)  # first index now points past the end
    with pytest.raises(PayloadError, match="outside the tensor"):
        c.decode(bad, 16)


def test_index_and_value_counts_must_agree():
    c = hipress.codec("threshold", tau=0.0)
    good = c.encode(np.ones(16, np.float32))
    bad = good.copy()
    struct.pack_into("<Q", bad, payload.HEADER_SIZE, 60)  # 15 indices, 16 values
    with pytest.raises(PayloadError):
        c.decode(bad, 16)


def test_non_uint8_payloads_are_rejected():
    with pytest.raises(PayloadError, match="uint8"):
        CODECS["onebit"].decode(np.zeros(10, np.float32), 10)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_kernels_read_the_constants_python_defines(tmp_path):
    # hp_constants.h is rendered from compll/constants.py; a C++ program that prints it
    # must print back what Python holds
    from compll import constants

    (tmp_path / "hp_constants.h").write_text(constants.header_text())
    (tmp_path / "main.cpp").write_text(
        '#include <cstdio>\n#include "hp_constants.h"\n'
        "int main() { std::printf(\"%llu %llu %llu %llu %llu %d %d %s\", "
        "(unsigned long long)hp::SUM_CHUNK, (unsigned long long)hp::SUB_BLOCK, "
        "(unsigned long long)hp::MAX_ELEMENTS, (unsigned long long)hp::HEADER, "
        "(unsigned long long)hp::FORMAT_VERSION, (int)hp::FEEDBACK, hp::SCALE_SUM, "
        "hp::TOO_MANY); }\n")
    subprocess.run(["g++", "-std=c++17", str(tmp_path / "main.cpp"), "-o",
                    str(tmp_path / "main")], check=True)
    out = subprocess.run([str(tmp_path / "main")], capture_output=True, text=True,
                         check=True).stdout
    c = constants
    assert out == (f"{c.SUM_CHUNK} {c.SUM_BLOCK} {c.MAX_ELEMENTS} {c.HEADER_SIZE} {c.VERSION} "
                   f"{c.FEEDBACK} {c.SCALE_SUM} {c.TOO_MANY}")
