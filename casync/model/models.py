"""Gradient profiles of well-known models: parameter tensors in backward order.

Derived from the architectures, so the element counts match
``sum(p.numel() for p in model.parameters())`` of the usual implementations:
25,557,032 for torchvision's ResNet-50, 143,667,240 for VGG-19, 109,482,240 for
Hugging Face's BERT-base and 335,141,888 for BERT-large. The LSTM, Transformer and
UGATIT profiles follow the configurations named in their builders.

Each tensor also carries a *work weight*, its share of the backward pass: a
convolution's weight counts its parameters times its output positions (the FLOPs of
its two backward GEMMs scale with that), a dense layer its parameters (times tokens,
the same for every layer of a model), biases and norms almost nothing. The simulator
spreads a model's measured backward time over its tensors by these weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from hipress_base.errors import ConfigError

__all__ = ["PROFILES", "Layer", "layers", "profile", "total", "TIMINGS", "Timing"]


@dataclass(frozen=True)
class Layer:
    """One gradient tensor: its name, element count and share of the backward work."""

    name: str
    numel: int
    work: float


def _norm(name: str, n: int) -> list[Layer]:
    return [Layer(f"{name}.weight", n, 0.0), Layer(f"{name}.bias", n, 0.0)]


def _resnet50() -> list[Layer]:
    out = [Layer("conv1.weight", 64 * 3 * 7 * 7, 64 * 3 * 49 * 112 * 112), *_norm("bn1", 64)]
    inplanes, side = 64, 56
    for layer, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3),
                                                strict=True), start=1):
        for block in range(blocks):
            p = f"layer{layer}.{block}"
            stride = 2 if block == 0 and layer > 1 else 1
            out_side = side // stride
            area = out_side * out_side
            out += [Layer(f"{p}.conv1.weight", inplanes * width, inplanes * width * side * side),
                    *_norm(f"{p}.bn1", width),
                    Layer(f"{p}.conv2.weight", width * width * 9, width * width * 9 * area),
                    *_norm(f"{p}.bn2", width),
                    Layer(f"{p}.conv3.weight", width * width * 4, width * width * 4 * area),
                    *_norm(f"{p}.bn3", width * 4)]
            if block == 0:
                out += [Layer(f"{p}.downsample.0.weight", inplanes * width * 4,
                              inplanes * width * 4 * area),
                        *_norm(f"{p}.downsample.1", width * 4)]
            inplanes, side = width * 4, out_side
    out += [Layer("fc.weight", 2048 * 1000, 2048 * 1000), Layer("fc.bias", 1000, 0)]
    return out[::-1]


def _vgg19() -> list[Layer]:
    cfg: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
                            512, 512, 512, 512, "M", 512, 512, 512, 512]
    out: list[Layer] = []
    cin, side, i = 3, 224, 0
    for item in cfg:
        if item == "M":
            side //= 2
            continue
        cout = int(item)  # an int here: "M" was handled above
        out += [Layer(f"features.{i}.weight", cin * cout * 9, cin * cout * 9 * side * side),
                Layer(f"features.{i}.bias", cout, 0)]
        cin, i = cout, i + 1
    for j, (a, b) in enumerate([(25088, 4096), (4096, 4096), (4096, 1000)]):
        out += [Layer(f"classifier.{j}.weight", a * b, a * b), Layer(f"classifier.{j}.bias", b, 0)]
    return out[::-1]


def _bert(layers_: int, h: int) -> list[Layer]:
    ffn = 4 * h

    def dense(name: str, a: int, b: int) -> list[Layer]:
        return [Layer(f"{name}.weight", a * b, a * b), Layer(f"{name}.bias", b, 0)]

    # Embedding lookups have sparse-like backward work: count them as one position each.
    out = [Layer("embeddings.word_embeddings.weight", 30522 * h, h),
           Layer("embeddings.position_embeddings.weight", 512 * h, h),
           Layer("embeddings.token_type_embeddings.weight", 2 * h, h),
           *_norm("embeddings.LayerNorm", h)]
    for i in range(layers_):
        p = f"encoder.layer.{i}"
        for proj in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense"):
            out += dense(f"{p}.{proj}", h, h)
        out += [*_norm(f"{p}.attention.output.LayerNorm", h),
                *dense(f"{p}.intermediate.dense", h, ffn), *dense(f"{p}.output.dense", ffn, h),
                *_norm(f"{p}.output.LayerNorm", h)]
    out += dense("pooler.dense", h, h)
    return out[::-1]


def _lstm() -> list[Layer]:
    """PyTorch's word_language_model, large setting: 2 layers of 1500, WikiText-2 vocabulary."""
    vocab, h = 33278, 1500
    out = [Layer("encoder.weight", vocab * h, h)]
    for i in range(2):
        out += [Layer(f"rnn.weight_ih_l{i}", 4 * h * h, 4 * h * h),
                Layer(f"rnn.weight_hh_l{i}", 4 * h * h, 4 * h * h),
                Layer(f"rnn.bias_ih_l{i}", 4 * h, 0), Layer(f"rnn.bias_hh_l{i}", 4 * h, 0)]
    out += [Layer("decoder.weight", vocab * h, vocab * h), Layer("decoder.bias", vocab, 0)]
    return out[::-1]


def _transformer() -> list[Layer]:
    """Transformer-base (Vaswani et al.): 6+6 layers, d=512, FFN 2048, shared 37k vocabulary."""
    d, ffn, vocab = 512, 2048, 37000

    def dense(name: str, a: int, b: int) -> list[Layer]:
        return [Layer(f"{name}.weight", a * b, a * b), Layer(f"{name}.bias", b, 0)]

    def attention(name: str) -> list[Layer]:
        return [*dense(f"{name}.in_proj", d, 3 * d), *dense(f"{name}.out_proj", d, d)]

    out = [Layer("embed_tokens.weight", vocab * d, vocab * d)]  # tied with the output layer
    for i in range(6):
        p = f"encoder.layers.{i}"
        out += [*attention(f"{p}.self_attn"), *_norm(f"{p}.norm1", d),
                *dense(f"{p}.fc1", d, ffn), *dense(f"{p}.fc2", ffn, d), *_norm(f"{p}.norm2", d)]
    for i in range(6):
        p = f"decoder.layers.{i}"
        out += [*attention(f"{p}.self_attn"), *_norm(f"{p}.norm1", d),
                *attention(f"{p}.cross_attn"), *_norm(f"{p}.norm2", d),
                *dense(f"{p}.fc1", d, ffn), *dense(f"{p}.fc2", ffn, d), *_norm(f"{p}.norm3", d)]
    return out[::-1]


def _ugatit() -> list[Layer]:
    """U-GAT-IT at 256x256 (ngf=ndf=64, 4 resblocks, full model): two generators, four
    discriminators. The generators' gamma/beta MLPs on the flattened 64x64x256 map
    dominate (268M weights each)."""
    out: list[Layer] = []

    def conv(name: str, cin: int, cout: int, k: int, side: int, bias: bool = True) -> None:
        out.append(Layer(f"{name}.weight", cin * cout * k * k, cin * cout * k * k * side * side))
        if bias:
            out.append(Layer(f"{name}.bias", cout, 0))

    def fc(name: str, a: int, b: int, bias: bool = True) -> None:
        out.append(Layer(f"{name}.weight", a * b, a * b))
        if bias:
            out.append(Layer(f"{name}.bias", b, 0))

    for g in ("genA2B", "genB2A"):
        conv(f"{g}.down.0", 3, 64, 7, 256, bias=False)
        conv(f"{g}.down.1", 64, 128, 3, 128, bias=False)
        conv(f"{g}.down.2", 128, 256, 3, 64, bias=False)
        for i in range(4):
            conv(f"{g}.res{i}.conv1", 256, 256, 3, 64, bias=False)
            conv(f"{g}.res{i}.conv2", 256, 256, 3, 64, bias=False)
        fc(f"{g}.gap_fc", 256, 1, bias=False)
        fc(f"{g}.gmp_fc", 256, 1, bias=False)
        conv(f"{g}.conv1x1", 512, 256, 1, 64)
        fc(f"{g}.FC.0", 64 * 64 * 256, 256, bias=False)
        fc(f"{g}.FC.1", 256, 256, bias=False)
        fc(f"{g}.gamma", 256, 256, bias=False)
        fc(f"{g}.beta", 256, 256, bias=False)
        for i in range(4):
            conv(f"{g}.up_res{i}.conv1", 256, 256, 3, 64, bias=False)
            conv(f"{g}.up_res{i}.conv2", 256, 256, 3, 64, bias=False)
        conv(f"{g}.up.0", 256, 128, 3, 128, bias=False)
        conv(f"{g}.up.1", 128, 64, 3, 256, bias=False)
        conv(f"{g}.up.2", 64, 3, 7, 256, bias=False)
    for d, depth in (("disGA", 7), ("disLA", 5), ("disGB", 7), ("disLB", 5)):
        ch, side = 64, 128
        conv(f"{d}.conv0", 3, ch, 4, side)
        for i in range(1, depth - 2):
            conv(f"{d}.conv{i}", ch, ch * 2, 4, side // 2)
            ch, side = ch * 2, side // 2
        conv(f"{d}.conv_last", ch, ch * 2, 4, side)
        fc(f"{d}.gap_fc", ch * 2, 1, bias=False)
        fc(f"{d}.gmp_fc", ch * 2, 1, bias=False)
        conv(f"{d}.conv1x1", ch * 4, ch * 2, 1, side)
        conv(f"{d}.out", ch * 2, 1, 4, side, bias=False)
    return out[::-1]


PROFILES = {
    "resnet50": _resnet50, "vgg19": _vgg19,
    "bert-base": lambda: _bert(12, 768), "bert-large": lambda: _bert(24, 1024),
    "lstm": _lstm, "transformer": _transformer, "ugatit": _ugatit,
}


@dataclass(frozen=True)
class Timing:
    """One training iteration of a model on one V100-class GPU (fp32): what it runs on,
    forward and backward milliseconds, and where the figure comes from."""

    batch: str
    forward_ms: float
    backward_ms: float
    source: str


# Approximate public figures for one V100 (16 GB, fp32), rounded; backward taken as
# twice the forward, the usual ratio for these models. They set the simulator's
# compute lane, so only their rough size matters to the conclusions.
TIMINGS = {
    "resnet50": Timing("64 images", 58, 116, "NVIDIA DeepLearningExamples, ResNet-50 v1.5 "
                       "PyTorch, V100 16G FP32: ~360 img/s at batch 64"),
    "vgg19": Timing("32 images", 50, 100, "DAWNBench-era V100 figures: VGG-19 ~210 img/s "
                    "FP32 at batch 32"),
    "bert-base": Timing("32 x 128 tokens", 47, 94, "NVIDIA DeepLearningExamples, BERT-base "
                        "fine-tuning, V100 FP32: ~230 sequences/s at batch 32"),
    "bert-large": Timing("16 x 128 tokens", 75, 150, "NVIDIA DeepLearningExamples, BERT-large "
                         "fine-tuning, V100 FP32: ~70 sequences/s at batch 16"),
    "lstm": Timing("20 x 35 tokens", 25, 50, "PyTorch word_language_model large on V100 "
                   "(~13k tokens/s)"),
    "transformer": Timing("4096 tokens", 130, 260, "fairseq Transformer-base, V100 FP32: "
                          "~10k tokens/s"),
    "ugatit": Timing("1 image 256x256", 150, 300, "U-GAT-IT official code, ~0.45 s per "
                     "iteration on one V100"),
}


def layers(name: str) -> list[Layer]:
    """The gradient tensors of a named model in the order backward yields them.

    Example:
        >>> layers("resnet50")[0]
        Layer(name='fc.bias', numel=1000, work=0)
    """
    if name not in PROFILES:
        raise ConfigError(f"unknown model profile {name!r}; available: {', '.join(PROFILES)}")
    return PROFILES[name]()


def profile(name: str) -> list[tuple[str, int]]:
    """``(tensor name, elements)`` of a model's gradients, in the order backward yields them.

    Example:
        >>> sum(n for _, n in profile("resnet50"))
        25557032
    """
    return [(layer.name, layer.numel) for layer in layers(name)]


def total(name: str) -> int:
    """Elements in all of a model's gradients."""
    return sum(layer.numel for layer in layers(name))
