"""Gradient profiles of well-known models: parameter tensors in backward order.

Derived from the architectures (torchvision ResNet-50 and VGG-19, Hugging Face
BERT-base), so the element counts match ``sum(p.numel() for p in model.parameters())``:
25,557,032 for ResNet-50, 143,667,240 for VGG-19, 109,482,240 for BERT-base.
"""

from __future__ import annotations

from hipress.errors import ConfigError

__all__ = ["PROFILES", "profile", "total"]

Tensors = list[tuple[str, int]]


def _resnet50() -> Tensors:
    out: Tensors = [("conv1.weight", 64 * 3 * 7 * 7), ("bn1.weight", 64), ("bn1.bias", 64)]
    inplanes = 64
    for layer, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3),
                                                strict=True), start=1):
        for block in range(blocks):
            p = f"layer{layer}.{block}"
            out += [(f"{p}.conv1.weight", inplanes * width), (f"{p}.bn1.weight", width),
                    (f"{p}.bn1.bias", width),
                    (f"{p}.conv2.weight", width * width * 9), (f"{p}.bn2.weight", width),
                    (f"{p}.bn2.bias", width),
                    (f"{p}.conv3.weight", width * width * 4), (f"{p}.bn3.weight", width * 4),
                    (f"{p}.bn3.bias", width * 4)]
            if block == 0:
                out += [(f"{p}.downsample.0.weight", inplanes * width * 4),
                        (f"{p}.downsample.1.weight", width * 4),
                        (f"{p}.downsample.1.bias", width * 4)]
            inplanes = width * 4
    out += [("fc.weight", 2048 * 1000), ("fc.bias", 1000)]
    return out[::-1]


def _vgg19() -> Tensors:
    cfg = [64, 64, 128, 128, 256, 256, 256, 256, 512, 512, 512, 512, 512, 512, 512, 512]
    out: Tensors = []
    cin = 3
    for i, cout in enumerate(cfg):
        out += [(f"features.{i}.weight", cin * cout * 9), (f"features.{i}.bias", cout)]
        cin = cout
    for i, (a, b) in enumerate([(25088, 4096), (4096, 4096), (4096, 1000)]):
        out += [(f"classifier.{i}.weight", a * b), (f"classifier.{i}.bias", b)]
    return out[::-1]


def _bert_base() -> Tensors:
    h, ffn = 768, 3072
    out: Tensors = [("embeddings.word_embeddings.weight", 30522 * h),
                    ("embeddings.position_embeddings.weight", 512 * h),
                    ("embeddings.token_type_embeddings.weight", 2 * h),
                    ("embeddings.LayerNorm.weight", h), ("embeddings.LayerNorm.bias", h)]
    for i in range(12):
        p = f"encoder.layer.{i}"
        for proj in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense"):
            out += [(f"{p}.{proj}.weight", h * h), (f"{p}.{proj}.bias", h)]
        out += [(f"{p}.attention.output.LayerNorm.weight", h),
                (f"{p}.attention.output.LayerNorm.bias", h),
                (f"{p}.intermediate.dense.weight", h * ffn), (f"{p}.intermediate.dense.bias", ffn),
                (f"{p}.output.dense.weight", ffn * h), (f"{p}.output.dense.bias", h),
                (f"{p}.output.LayerNorm.weight", h), (f"{p}.output.LayerNorm.bias", h)]
    out += [("pooler.dense.weight", h * h), ("pooler.dense.bias", h)]
    return out[::-1]


PROFILES = {"resnet50": _resnet50, "vgg19": _vgg19, "bert-base": _bert_base}


def profile(name: str) -> Tensors:
    """``(tensor name, elements)`` of a model's gradients, in the order backward yields them.

    Example:
        >>> sum(n for _, n in profile("resnet50"))
        25557032
    """
    if name not in PROFILES:
        raise ConfigError(f"unknown model profile {name!r}; available: {', '.join(PROFILES)}")
    return PROFILES[name]()


def total(name: str) -> int:
    """Elements in all of a model's gradients."""
    return sum(n for _, n in profile(name))
