"""Idiomatic torch implementations of the shipped algorithms, the way a practitioner
writes them with tensor ops (as GRACE does): the baseline of ``bench/kernels.py``.

Each entry is ``(encode, decode)``: ``encode(x) -> tuple of tensors`` (the payload,
bits packed with plain tensor arithmetic where the algorithm packs them) and
``decode(payload, n) -> tensor``. Defaults match ``dsl/*.cll``.
"""

from __future__ import annotations

import torch

__all__ = ["BASELINES"]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    n = codes.numel()
    padded = torch.zeros((n + per - 1) // per * per, dtype=torch.uint8)
    padded[:n] = codes.to(torch.uint8)
    shifts = torch.arange(per, dtype=torch.uint8) * bits
    return (padded.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.uint8) * bits
    return ((packed.view(-1, 1) >> shifts) & ((1 << bits) - 1)).view(-1)[:n]


def onebit_enc(x):
    pos = x >= 0
    return x[pos].mean(), x[~pos].mean(), _pack(pos, 1)


def onebit_dec(p, n):
    mean_pos, mean_neg, bits = p
    return torch.where(_unpack(bits, 1, n).bool(), mean_pos, mean_neg)


def signsgd_enc(x):
    return x.abs().mean(), _pack(x >= 0, 1)


def signsgd_dec(p, n):
    scale, bits = p
    return torch.where(_unpack(bits, 1, n).bool(), scale, -scale)


def tbq_enc(x, tau=0.01):
    codes = (x > tau).to(torch.uint8) * 2 + ((x >= -tau) & (x <= tau)).to(torch.uint8)
    return torch.tensor(tau), _pack(codes, 2)


def tbq_dec(p, n):
    tau, codes = p
    return (_unpack(codes, 2, n).float() - 1) * tau


def terngrad_enc(x):
    scale = x.abs().max()
    keep = torch.rand_like(x) < x.abs() / scale
    return scale, _pack((torch.sign(x) * keep + 1).to(torch.uint8), 2)


def terngrad_dec(p, n):
    scale, codes = p
    return (_unpack(codes, 2, n).float() - 1) * scale


def qsgd_enc(x, s=127):
    norm = x.norm()
    level = torch.floor(x.abs() / norm * s + torch.rand_like(x)).clamp(max=s)
    return norm, (level + 128 * (x < 0)).to(torch.uint8)


def qsgd_dec(p, n, s=127):
    norm, codes = p
    sign = torch.where(codes >= 128, -1.0, 1.0)
    return sign * (codes % 128).float() * norm / s


def minmax8_enc(x):
    lo, hi = x.min(), x.max()
    scale = (hi - lo) / 255
    return lo, scale, torch.round((x - lo) / scale).to(torch.uint8)


def minmax8_dec(p, n):
    lo, scale, q = p
    return lo + q.float() * scale


def fp16_enc(x):
    return (x.half(),)


def fp16_dec(p, n):
    return p[0].float()


def _sampled_threshold(x, count, keep):
    sample = x[torch.randint(x.numel(), (count,))].abs()
    return torch.topk(sample, max(1, keep)).values.min()


def dgc_enc(x, ratio=0.001):
    m = min(x.numel(), max(1024, int(x.numel() * 0.001)))
    thr = _sampled_threshold(x, m, int(m * ratio + 0.999))
    idx = (x.abs() >= thr).nonzero().view(-1)
    return idx.int(), x[idx]


def sparse_dec(p, n):
    idx, vals = p
    return torch.zeros(n).index_add_(0, idx.long(), vals)


def topk_enc(x, ratio=0.001):
    k = max(1, int(x.numel() * ratio))
    idx = torch.topk(x.abs(), k, sorted=False).indices
    return idx.int(), x[idx]


def randomk_enc(x, ratio=0.001):
    n = x.numel()
    k = max(1, int(n * ratio))
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(n, (k,), generator=gen)
    return (x[idx] * (n / k),)


def randomk_dec(p, n, ratio=0.001):
    k = max(1, int(n * ratio))
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(n, (k,), generator=gen)
    return torch.zeros(n).index_add_(0, idx, p[0])


def graddrop_enc(x, drop=0.999):
    m = min(x.numel(), max(1024, int(x.numel() * 0.001)))
    mags = x[:: max(1, x.numel() // m)][:m].abs()
    thr = torch.topk(mags, max(1, int(m * (1 - drop) + 0.999))).values.min()
    idx = (x.abs() >= thr).nonzero().view(-1)
    return idx.int(), x[idx]


def natural_enc(x):
    mant, exp = torch.frexp(x.abs())  # |x| = mant * 2^exp, mant in [0.5, 1)
    up = torch.rand_like(x) < (mant * 2 - 1)
    e = exp - 1 + up.int()
    emax = int(e.max())
    code = torch.where(x == 0, 0, (emax + 2 - e).clamp(1, 127))
    return torch.tensor(emax), (code + 128 * (x < 0)).to(torch.uint8)


def natural_dec(p, n):
    emax, codes = p
    mag = torch.ldexp(torch.ones(n), (int(emax) + 2 - (codes % 128).int()).float())
    mag = torch.where(codes % 128 == 0, 0.0, mag)
    return torch.where(codes >= 128, -mag, mag)


def threshold_enc(x, tau=0.01):
    idx = (x.abs() >= tau).nonzero().view(-1)
    return idx.int(), x[idx]


def _blocks(x, bucket):
    """x cut into rows of ``bucket`` elements (the last padded with its own last value),
    and the element count."""
    n = x.numel()
    rows = (n + bucket - 1) // bucket
    padded = torch.cat([x, x[-1:].expand(rows * bucket - n)]) if rows * bucket > n else x
    return padded.view(rows, bucket), n


def cgx_enc(x, bits=4, bucket=512):
    blocks, n = _blocks(x, bucket)
    lo, hi = blocks.min(dim=1, keepdim=True).values, blocks.max(dim=1, keepdim=True).values
    scale = (hi - lo) / ((1 << bits) - 1)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((blocks - lo) * inv).clamp(max=(1 << bits) - 1).view(-1)[:n]
    return lo.view(-1), scale.view(-1), _pack(q, 4 if bits > 2 else bits)


def cgx_dec(p, n, bits=4, bucket=512):
    lo, scale, packed = p
    q = _unpack(packed, 4 if bits > 2 else bits, n).float()
    return lo.repeat_interleave(bucket)[:n] + q * scale.repeat_interleave(bucket)[:n]


def zeropp_enc(x, bits=4, bucket=512):
    qmax = (1 << (bits - 1)) - 1
    blocks, n = _blocks(x, bucket)
    scale = blocks.abs().max(dim=1, keepdim=True).values / qmax
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(blocks * inv).clamp(-qmax, qmax) + qmax + 1
    return scale.view(-1), _pack(codes.view(-1)[:n], bits)


def zeropp_dec(p, n, bits=4, bucket=512):
    scale, packed = p
    qmax = (1 << (bits - 1)) - 1
    codes = _unpack(packed, bits, n).float()
    return (codes - qmax - 1) * scale.repeat_interleave(bucket)[:n]


BASELINES = {
    "onebit": (onebit_enc, onebit_dec),
    "signsgd": (signsgd_enc, signsgd_dec),
    "tbq": (tbq_enc, tbq_dec),
    "terngrad": (terngrad_enc, terngrad_dec),
    "qsgd": (qsgd_enc, qsgd_dec),
    "minmax8": (minmax8_enc, minmax8_dec),
    "fp16": (fp16_enc, fp16_dec),
    "dgc": (dgc_enc, sparse_dec),
    "topk": (topk_enc, sparse_dec),
    "randomk": (randomk_enc, randomk_dec),
    "graddrop": (graddrop_enc, sparse_dec),
    "natural": (natural_enc, natural_dec),
    "threshold": (threshold_enc, sparse_dec),
    "cgx": (cgx_enc, cgx_dec),
    "zeropp": (zeropp_enc, zeropp_dec),
}
