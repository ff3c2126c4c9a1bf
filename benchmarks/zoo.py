"""A zoo of small but real training setups used to measure memguard's accuracy.

Every case builds a model from a config (no weights are downloaded), a deterministic example
batch and, where the model does not compute its own loss, a ``loss_fn(model, batch)``. Cases are
sized so that the real CPU peak of one training step lies roughly between 20 and 300 MB (large
enough that allocator noise is negligible) and two real CPU steps take a few seconds on one core.

``case.build("meta")`` builds the same model on the meta device (no memory, nearly free) with
the same batch on the CPU; ``case.build()`` builds it with real, seeded CPU weights.

Example:
    >>> from benchmarks.zoo import CASES
    >>> model, batch, loss_fn = CASES["gpt2"].build("meta")
    >>> optimizer = CASES["gpt2"].optimizer(model.parameters())  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ZooCase", "CASES", "Batch", "LossFn", "seeded_generator"]

#: An example micro-batch: a tensor, or a tuple/list/dict of tensors with the batch on dim 0.
Batch = Any
#: ``loss_fn(model, batch) -> scalar loss``; ``None`` means "call the model and use its loss".
LossFn = Callable[[nn.Module, Batch], torch.Tensor]

#: The seed of every model's weights and every batch, so that runs are reproducible.
SEED = 0


@dataclass(frozen=True)
class ZooCase:
    """One benchmark case: a model, its example batch, its loss and its optimizer.

    Attributes:
        name: short unique identifier (the key in :data:`CASES`).
        kind: task family, e.g. ``"causal-lm"``, ``"masked-lm"``, ``"seq2seq"``,
            ``"image-classification"``, ``"regression"``.
        build: ``build(device="cpu") -> (model, batch, loss_fn or None)``. The model is built on
            ``device`` (``"meta"`` works and allocates nothing); the batch is always on the CPU.
            Weights and batch are seeded, so two builds are identical.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``; receives
            ``model.parameters()`` and selects the trainable ones itself where needed.
        notes: what the case exercises.
        precision: the Lightning precision the step runs in (see :func:`real_step`).
    """

    name: str
    kind: str
    build: Callable[..., tuple[nn.Module, Batch, LossFn | None]]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    notes: str = ""
    precision: str = "32-true"


def real_step(model: nn.Module, batch: Batch, loss_fn: LossFn | None, precision: str):
    """The model, batch and loss of a real CPU step in ``precision``, as memguard models it:
    ``*-true`` casts the floating weights, buffers and inputs; ``*-mixed`` runs the loss under CPU
    autocast (the model and batch stay fp32)."""
    from memguard.batch import compute_loss, map_tensors

    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else None
    if dtype is None:
        return model, batch, loss_fn
    if precision.endswith("-true"):
        cast = map_tensors(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)
        return model.to(dtype), cast, loss_fn

    def mixed(m: nn.Module, b: Batch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return compute_loss(m, b, loss_fn)

    return model, batch, mixed


def seeded_generator(seed: int = SEED) -> torch.Generator:
    """A CPU random generator with a fixed seed, for reproducible batches."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


@contextlib.contextmanager
def _building_on(device: str) -> Iterator[None]:
    """Seed the global RNG (weight init) and make ``device`` the default for new tensors."""
    torch.manual_seed(SEED)
    with torch.device(device):
        yield


def _tokens(batch: int, seq: int, vocab: int, low: int = 0, seed: int = SEED) -> torch.Tensor:
    return torch.randint(low, vocab, (batch, seq), generator=seeded_generator(seed), dtype=torch.long)


def _trainable(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if p.requires_grad]


def _quiet_hf() -> None:
    """Silence transformers' info/warning chatter (config sanity notes, deprecations)."""
    import transformers

    transformers.logging.set_verbosity_error()


# --------------------------------------------------------------------------------------------
# transformers models (their forward computes the loss from ``labels``; loss_fn is None)
# --------------------------------------------------------------------------------------------

_VOCAB = 8192  # small vocabulary so the LM head does not dwarf the blocks


def _gpt2_config():
    import transformers

    return transformers.GPT2Config(
        vocab_size=_VOCAB, n_positions=256, n_embd=256, n_layer=4, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )


def _lm_batch(batch: int, seq: int, vocab: int = _VOCAB, mask: bool = False) -> dict[str, torch.Tensor]:
    ids = _tokens(batch, seq, vocab)
    out = {"input_ids": ids, "labels": ids.clone()}
    if mask:
        out["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
    return out


def _build_gpt2(device: str = "cpu"):
    import transformers

    _quiet_hf()
    with _building_on(device):
        model = transformers.GPT2LMHeadModel(_gpt2_config())
    model.train()
    return model, _lm_batch(8, 128), None


def _build_gpt2_hf_ckpt(device: str = "cpu"):
    import transformers

    _quiet_hf()
    with _building_on(device):
        model = transformers.GPT2LMHeadModel(_gpt2_config())
    # transformers >= 5 renamed gradient_checkpointing_enable (kept as a deprecated alias)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    return model, _lm_batch(8, 128), None


def _build_llama_sdpa(device: str = "cpu"):
    import transformers

    _quiet_hf()
    config = transformers.LlamaConfig(
        vocab_size=_VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa",
    )
    with _building_on(device):
        model = transformers.LlamaForCausalLM(config)
    model.train()
    return model, _lm_batch(8, 128, mask=True), None


def _build_qwen2_eager(device: str = "cpu"):
    import transformers

    _quiet_hf()
    config = transformers.Qwen2Config(
        vocab_size=_VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
        attn_implementation="eager",
    )
    with _building_on(device):
        model = transformers.Qwen2ForCausalLM(config)
    model.train()
    return model, _lm_batch(8, 128, mask=True), None


def _build_bert_mlm(device: str = "cpu"):
    import transformers

    _quiet_hf()
    config = transformers.BertConfig(
        vocab_size=_VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=256, pad_token_id=0,
    )
    with _building_on(device):
        model = transformers.BertForMaskedLM(config)
    model.train()
    ids = _tokens(8, 128, _VOCAB, low=5)
    g = seeded_generator(SEED + 1)
    masked = torch.rand(ids.shape, generator=g) < 0.15  # BERT masks 15% of tokens (Devlin et al. 2018)
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    inputs = torch.where(masked, torch.full_like(ids, 4), ids)  # 4 stands in for [MASK]
    batch = {
        "input_ids": inputs,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "labels": labels,
    }
    return model, batch, None


def _build_t5(device: str = "cpu"):
    import transformers

    _quiet_hf()
    config = transformers.T5Config(
        vocab_size=_VOCAB, d_model=256, d_kv=32, d_ff=1024, num_layers=3, num_decoder_layers=3,
        num_heads=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    with _building_on(device):
        model = transformers.T5ForConditionalGeneration(config)
    model.train()
    batch = {
        "input_ids": _tokens(8, 128, _VOCAB, low=2),
        "attention_mask": torch.ones(8, 128, dtype=torch.long),
        "labels": _tokens(8, 64, _VOCAB, low=2, seed=SEED + 1),
    }
    return model, batch, None


def _build_bart(device: str = "cpu"):
    import transformers

    _quiet_hf()
    config = transformers.BartConfig(
        vocab_size=_VOCAB, d_model=256, encoder_layers=3, decoder_layers=3,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=1024,
        decoder_ffn_dim=1024, max_position_embeddings=256,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    with _building_on(device):
        model = transformers.BartForConditionalGeneration(config)
    model.train()
    batch = {
        "input_ids": _tokens(8, 128, _VOCAB, low=3),
        "attention_mask": torch.ones(8, 128, dtype=torch.long),
        "labels": _tokens(8, 96, _VOCAB, low=3, seed=SEED + 1),
    }
    return model, batch, None


def _build_vit(device: str = "cpu"):
    import transformers

    _quiet_hf()
    config = transformers.ViTConfig(
        image_size=64, patch_size=8, num_channels=3, hidden_size=256, num_hidden_layers=4,
        num_attention_heads=4, intermediate_size=1024, num_labels=10,
    )
    with _building_on(device):
        model = transformers.ViTForImageClassification(config)
    model.train()
    g = seeded_generator()
    batch = {
        "pixel_values": torch.randn(32, 3, 64, 64, generator=g),
        "labels": torch.randint(0, 10, (32,), generator=g),
    }
    return model, batch, None


def _build_hf_convnext(device: str = "cpu"):
    import transformers

    _quiet_hf()
    # transformers' ConvNeXt (depthwise 7x7 convolutions, LayerNorm over channels through permutes,
    # layer scale), shrunk: 4 stages of 1/1/2/1 blocks, widths 32-256
    config = transformers.AutoConfig.for_model(
        "convnext", depths=[1, 1, 2, 1], hidden_sizes=[32, 64, 128, 256], image_size=64, num_labels=10)
    with _building_on(device):
        model = transformers.ConvNextForImageClassification(config)
    model.train()
    g = seeded_generator()
    batch = {
        "pixel_values": torch.randn(8, 3, 64, 64, generator=g),
        "labels": torch.randint(0, 10, (8,), generator=g),
    }
    return model, batch, None


def _build_hf_resnet(device: str = "cpu"):
    import transformers

    _quiet_hf()
    # transformers' ResNet (7x7 stem, max pool, basic blocks of two 3x3 convolutions with BatchNorm),
    # shrunk: one block per stage, widths 32-256; the last stage's 3x3 kernels are wider than its
    # 2x2 maps, which oneDNN's AVX2 kernel rejects for the weight gradient (im2col + GEMM instead)
    config = transformers.AutoConfig.for_model(
        "resnet", embedding_size=32, depths=[1, 1, 1, 1], hidden_sizes=[32, 64, 128, 256], layer_type="basic",
        num_labels=10)
    with _building_on(device):
        model = transformers.ResNetForImageClassification(config)
    model.train()
    g = seeded_generator()
    batch = {
        "pixel_values": torch.randn(8, 3, 64, 64, generator=g),
        "labels": torch.randint(0, 10, (8,), generator=g),
    }
    return model, batch, None


# --------------------------------------------------------------------------------------------
# torch.nn models
# --------------------------------------------------------------------------------------------


class LSTMLanguageModel(nn.Module):
    """Embedding -> 2-layer LSTM -> linear head over the vocabulary."""

    def __init__(self, vocab: int = 8000, embed: int = 256, hidden: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True, dropout=0.1)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


def _token_ce_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of per-token logits ``model(tokens)`` against ``targets``."""
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _build_lstm(device: str = "cpu"):
    with _building_on(device):
        model = LSTMLanguageModel()
    model.train()
    ids = _tokens(16, 65, 8000)
    return model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), _token_ce_loss


class BasicBlock(nn.Module):
    """ResNet basic block (He et al. 2015): two 3x3 conv + BatchNorm, identity or 1x1 shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet-like classifier: strided stem, three stages of two basic blocks, global pool."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128), classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 2, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks: list[nn.Module] = []
        cin = widths[0]
        for i, w in enumerate(widths):
            blocks += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of ``model(inputs)`` against integer ``labels``."""
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def _build_resnet(device: str = "cpu"):
    with _building_on(device):
        model = SmallResNet()
    model.train()
    g = seeded_generator()
    images, labels = torch.randn(32, 3, 64, 64, generator=g), torch.randint(0, 100, (32,), generator=g)
    return model, (images, labels), _classification_loss


class ConvNeXtBlock(nn.Module):
    """ConvNeXt block (Liu et al. 2022, arXiv 2201.03545): depthwise 7x7 convolution, LayerNorm over
    channels, pointwise MLP as Linear layers on channels-last activations, residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pw1, self.pw2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        return x + self.pw2(F.gelu(self.pw1(y))).permute(0, 3, 1, 2)


class SmallConvNeXt(nn.Module):
    """A ConvNeXt-style classifier: 4x4 stride-4 stem, two stages (downsampled by a 2x2 stride-2
    convolution), global pool, linear head."""

    def __init__(self, widths: tuple[int, int] = (64, 128), depth: int = 2, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, widths[0], 4, stride=4)
        self.stage1 = nn.Sequential(*(ConvNeXtBlock(widths[0]) for _ in range(depth)))
        self.down = nn.Conv2d(widths[0], widths[1], 2, stride=2)
        self.stage2 = nn.Sequential(*(ConvNeXtBlock(widths[1]) for _ in range(depth)))
        self.head = nn.Linear(widths[1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(x.mean((2, 3)))


def _build_convnext(device: str = "cpu"):
    with _building_on(device):
        model = SmallConvNeXt()
    model.train()
    g = seeded_generator()
    images, labels = torch.randn(16, 3, 128, 128, generator=g), torch.randint(0, 100, (16,), generator=g)
    return model, (images, labels), _classification_loss


class MLPRegressor(nn.Module):
    """A GELU MLP whose forward takes ``(x, target)`` and returns the MSE loss itself."""

    def __init__(self, dims: tuple[int, ...] = (512, 2048, 2048, 2048, 512)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in zip(dims[:-2], dims[1:-1]):
            layers += [nn.Linear(a, b), nn.GELU()]
        layers.append(nn.Linear(dims[-2], dims[-1]))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), target)


def _build_mlp(device: str = "cpu"):
    with _building_on(device):
        model = MLPRegressor()
    model.train()
    g = seeded_generator()
    return model, (torch.randn(256, 512, generator=g), torch.randn(256, 512, generator=g)), None


class TiedMLPLanguageModel(nn.Module):
    """Token embedding, pre-LN residual MLP blocks, output projection tied to the embedding.

    ``forward(tokens)`` returns the next-token cross-entropy, so the batch is a single tensor.
    """

    def __init__(self, vocab: int = 16384, dim: int = 256, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # the tie: one Parameter, two modules

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens[:, :-1])
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _build_tied(device: str = "cpu"):
    with _building_on(device):
        model = TiedMLPLanguageModel()
    model.train()
    return model, _tokens(8, 129, 16384), None


class FrozenEncoderClassifier(nn.Module):
    """``nn.TransformerEncoder`` classifier whose embedding and lower layers are frozen."""

    def __init__(self, vocab: int = 8192, dim: int = 256, layers: int = 4, frozen_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 10)
        self.embed.requires_grad_(False)
        for block in self.encoder.layers[:frozen_layers]:
            block.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def _build_frozen(device: str = "cpu"):
    with _building_on(device):
        model = FrozenEncoderClassifier()
    model.train()
    g = seeded_generator(SEED + 1)
    return model, (_tokens(16, 128, 8192), torch.randint(0, 10, (16,), generator=g)), _classification_loss


class CheckpointedResidualMLP(nn.Module):
    """Residual MLP blocks, each run under non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, dim: int = 256, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(blocks)
        )
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.out(x)


def _regression_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of ``model(inputs)`` against ``targets``."""
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


def _build_ckpt(device: str = "cpu"):
    with _building_on(device):
        model = CheckpointedResidualMLP()
    model.train()
    g = seeded_generator()
    return model, (torch.randn(16, 128, 256, generator=g), torch.randn(16, 128, 256, generator=g)), _regression_loss


# --------------------------------------------------------------------------------------------
# optimizers (learning rates are small and irrelevant to memory; they keep the steps finite)
# --------------------------------------------------------------------------------------------


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _adamw_trainable(params):
    return torch.optim.AdamW(_trainable(params), lr=1e-4)


def _adamw_amsgrad(params):
    return torch.optim.AdamW(params, lr=1e-4, amsgrad=True)


def _adam(params):
    return torch.optim.Adam(params, lr=1e-4)


def _adam_foreach(params):
    return torch.optim.Adam(params, lr=1e-4, foreach=True)


def _sgd_momentum(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _sgd_nesterov_wd(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=5e-4)


def _rmsprop(params):
    return torch.optim.RMSprop(params, lr=1e-4)


def _rmsprop_momentum(params):
    return torch.optim.RMSprop(params, lr=1e-4, momentum=0.9)


def _rmsprop_centered(params):
    return torch.optim.RMSprop(params, lr=1e-4, centered=True)


def _adagrad(params):
    return torch.optim.Adagrad(params, lr=1e-3)


_ALL = [
    ZooCase("gpt2", "causal-lm", _build_gpt2, _adamw,
            "GPT-2 (4x256, vocab 8192, tied LM head), SDPA attention, seq 128 x 8, AdamW"),
    ZooCase("gpt2-hf-ckpt", "causal-lm", _build_gpt2_hf_ckpt, _adamw,
            "same GPT-2 with transformers' activation checkpointing (non-reentrant), AdamW"),
    ZooCase("llama-sdpa", "causal-lm", _build_llama_sdpa, _adam_foreach,
            "Llama (4x256, GQA 4/2 heads, RoPE, SwiGLU), SDPA, attention_mask, Adam foreach=True"),
    ZooCase("qwen2-eager", "causal-lm", _build_qwen2_eager, _sgd_momentum,
            "Qwen2 (3x256, GQA 8/2 heads, untied head), eager attention, SGD momentum"),
    ZooCase("bert-mlm", "masked-lm", _build_bert_mlm, _rmsprop_momentum,
            "BERT (4x256) masked LM, 15% masked labels, seq 128 x 8, RMSprop momentum"),
    ZooCase("t5", "seq2seq", _build_t5, _adagrad,
            "T5 (3+3 layers, d_model 256), src 128 / tgt 64 x 8, Adagrad (state built eagerly)"),
    ZooCase("bart", "seq2seq", _build_bart, _adamw_amsgrad,
            "BART (3+3 layers, d_model 256, tied embeddings), src 128 / tgt 96 x 8, AdamW amsgrad"),
    ZooCase("vit", "image-classification", _build_vit, _sgd_nesterov_wd,
            "ViT (4x256, 64px images, 8px patches) x 32, SGD nesterov + weight decay"),
    ZooCase("lstm-lm", "causal-lm", _build_lstm, _adam,
            "torch.nn 2-layer LSTM LM (vocab 8000, hidden 512), tuple batch, loss_fn, Adam"),
    ZooCase("resnet-bn", "image-classification", _build_resnet, _sgd_nesterov_wd,
            "ResNet-like conv net with BatchNorm (3 stages x 2 blocks), 32 x 64px, SGD nesterov + wd"),
    ZooCase("mlp", "regression", _build_mlp, _rmsprop,
            "GELU MLP 512-2048-2048-2048-512 whose forward(x, y) returns the loss; tuple batch, RMSprop"),
    ZooCase("tied-lm", "causal-lm", _build_tied, _adamw,
            "torch.nn MLP LM with output weight tied to the embedding; tensor batch; forward returns loss"),
    ZooCase("frozen-encoder", "classification", _build_frozen, _adamw_trainable,
            "nn.TransformerEncoder classifier, embedding + 2 of 4 layers frozen; AdamW on trainable only"),
    ZooCase("ckpt-mlp", "regression", _build_ckpt, _rmsprop_centered,
            "residual MLP blocks under torch.utils.checkpoint(use_reentrant=False), RMSprop centered"),
    ZooCase("convnext", "image-classification", _build_convnext, _adamw,
            "ConvNeXt-style net (depthwise 7x7 + Linear MLP blocks, 2 stages), 16 x 128px, AdamW"),
    # 16-bit steps: oneDNN takes bf16 (and, where the CPU has AVX-512-FP16, fp16) matmuls and
    # convolutions, so these follow the host's instruction set (memguard.estimator._cpu_kernels)
    ZooCase("gpt2-bf16-true", "causal-lm", _build_gpt2, _adamw, "GPT-2 as above, weights and step in bf16",
            precision="bf16-true"),
    ZooCase("llama-bf16-mixed", "causal-lm", _build_llama_sdpa, _adam_foreach,
            "Llama as above under CPU bf16 autocast", precision="bf16-mixed"),
    ZooCase("vit-bf16-mixed", "image-classification", _build_vit, _sgd_nesterov_wd,
            "ViT as above under CPU bf16 autocast", precision="bf16-mixed"),
    ZooCase("resnet-bn-bf16-mixed", "image-classification", _build_resnet, _sgd_nesterov_wd,
            "ResNet-like conv net as above under CPU bf16 autocast (NCHW convolutions)", precision="bf16-mixed"),
    ZooCase("convnext-bf16-true", "image-classification", _build_convnext, _adamw,
            "ConvNeXt-style net as above, weights and step in bf16", precision="bf16-true"),
    ZooCase("convnext-bf16-mixed", "image-classification", _build_convnext, _adamw,
            "ConvNeXt-style net as above under CPU bf16 autocast", precision="bf16-mixed"),
    ZooCase("mlp-bf16-true", "regression", _build_mlp, _rmsprop, "GELU MLP as above in bf16",
            precision="bf16-true"),
    ZooCase("mlp-16-true", "regression", _build_mlp, _rmsprop, "GELU MLP as above in fp16",
            precision="16-true"),
    # transformers' vision models on oneDNN's kernels (depthwise and bf16 convolutions, BatchNorm)
    ZooCase("hf-convnext-bf16-mixed", "image-classification", _build_hf_convnext, _adamw,
            "transformers ConvNextForImageClassification (depths 1/1/2/1, widths 32-256), 8 x 64px, CPU bf16 "
            "autocast, AdamW", precision="bf16-mixed"),
    ZooCase("hf-resnet", "image-classification", _build_hf_resnet, _sgd_momentum,
            "transformers ResNetForImageClassification (basic blocks, 1 a stage, widths 32-256), 8 x 64px, fp32, "
            "SGD momentum"),
]

#: Every case, by name.
CASES: dict[str, ZooCase] = {case.name: case for case in _ALL}
