"""Small models for the parity grid, built the same way on every rank."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.gpt import GPT, GPTConfig

VOCAB = 64
SEQ = 16
FEATURES = 12
HF_MODELS = ("hf_gpt2", "hf_llama", "hf_deepseek_v3")
"""HuggingFace transformers models (tests using them skip when it is not installed)."""
TRANSPOSED_GRADIENT_ACTIVATIONS = {
    "softplus": F.softplus, "elu": F.elu, "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid, "hardtanh": F.hardtanh,
    "logit": lambda t: torch.logit(torch.sigmoid(t), eps=1e-3),
}
REGRESSION_MODELS = ("mlp", "scaled_mlp", "complex_rotation",
                     *(f"transposed_{name}" for name in TRANSPOSED_GRADIENT_ACTIVATIONS))
"""Models of ``FEATURES`` inputs and 7 outputs, trained on a mean squared error."""
BACKEND = "eager"
"""The backend the suite trains with where what a test checks is not the lowering: the step
by regions, as every backend runs it by default, each run of compute as traced
(zero_fx/compiler/lower.py). The same aten ops as aot_eager, without AOTAutograd's second
trace of each body: that trace was about 40 % of a run's compile time, which on the CI's
two cores is most of the suite's. AOTAutograd's and Inductor's lowering of every stage and
world size stay tested: test_parity's aot_eager grid and Inductor parity, the
``inductor``-marked tests, test_memory's peaks under both."""


class MLP(nn.Module):
    # 13 and 7 are odd on purpose: parameters that do not split evenly force padding.
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 13), nn.GELU(), nn.LayerNorm(13), nn.Linear(13, 7))

    def forward(self, x):
        return self.net(x)


TP_HEADS, TP_WIDTH, TP_LAYERS = 4, 32, 2
"""The tensor-parallel tests' GPT (``build("tp_gpt")``)."""


class TensorParallelAttention(nn.Module):
    """Separate q, k, v (a fused qkv does not split by columns into heads) and ``-1`` heads
    in the views, so the same code runs on a rank's local heads."""

    def __init__(self):
        super().__init__()
        self.head_dim = TP_WIDTH // TP_HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(TP_WIDTH, TP_WIDTH, bias=False) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class TensorParallelBlock(nn.Module):
    """No biases, as the parity tests' GPT (examples/gpt.py's GPTConfig.bias says why)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(TP_WIDTH, bias=False), nn.LayerNorm(TP_WIDTH, bias=False)
        self.attn = TensorParallelAttention()
        self.up = nn.Linear(TP_WIDTH, 4 * TP_WIDTH, bias=False)
        self.down = nn.Linear(4 * TP_WIDTH, TP_WIDTH, bias=False)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TensorParallelGPT(nn.Module):
    """A GPT whose attention and MLP split over a "tp" mesh dimension with PyTorch's own
    tensor-parallel API (tests/support/tensor_parallel_models.py parallelizes it)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, TP_WIDTH)
        self.blocks = nn.ModuleList(TensorParallelBlock() for _ in range(TP_LAYERS))
        self.ln_f = nn.LayerNorm(TP_WIDTH, bias=False)
        self.head = nn.Linear(TP_WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ComplexRopeAttention(nn.Module):
    """Attention as Meta's Llama reference code writes it: q and k rotated in complex
    arithmetic (``view_as_complex`` of pairs times ``freqs_cis``, then ``view_as_real``), whose
    backward multiplies by the conjugate of ``freqs_cis``."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x, freqs_cis):
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, self.heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary_emb(q, k, freqs_cis[:T])
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq, xk, freqs_cis):
    """Meta's llama/model.py, as written there."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class ComplexRopeBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attention = ComplexRopeAttention(width, heads)
        self.w1, self.w3 = nn.Linear(width, 2 * width, bias=False), nn.Linear(width, 2 * width, bias=False)
        self.w2 = nn.Linear(2 * width, width, bias=False)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        f = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(f)) * self.w3(f))


class ComplexRopeLlama(nn.Module):
    """A small Llama with complex rotary embeddings (``freqs_cis`` a complex buffer, as in
    torchtitan's llama3)."""

    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(ComplexRopeBlock(width, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.output = nn.Linear(width, VOCAB, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(width // heads, SEQ), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class ComplexRotation(nn.Module):
    """The smallest complex-arithmetic model: a linear layer's output taken as complex pairs,
    rotated by a complex buffer, taken back as real numbers."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(FEATURES, FEATURES)
        angles = torch.arange(FEATURES // 2, dtype=torch.float32)
        self.register_buffer("rotation", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x):
        h = self.lin(x)
        rotated = torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2)) * self.rotation
        return torch.view_as_real(rotated).flatten(-2)[..., :7]


class TransposedGradient(nn.Module):
    """A pointwise activation whose gradient comes back transposed, after a reshape of a linear
    layer's output: Qwen3-Next's ``softplus(a + dt_bias)`` in miniature ([Note: a gradient's
    layout as traced and as run] in zero_fx/capture/layout_decompositions.py)."""

    def __init__(self, activation: str):
        super().__init__()
        self.activation = TRANSPOSED_GRADIENT_ACTIVATIONS[activation]
        self.lin = nn.Linear(FEATURES, FEATURES)
        self.mix = nn.Parameter(torch.randn(3, 2))
        self.head = nn.Linear(8, 7)

    def forward(self, x):
        gated = self.activation(self.lin(x).view(-1, 3, 4))   # (N, 3, 4), contiguous
        mixed = gated.transpose(1, 2) @ self.mix                # its gradient: (N, 3, 4) transposed
        return self.head(mixed.flatten(1))


class ScaledMLP(nn.Module):
    """The MLP with a learnt 0-dim temperature (CLIP's ``logit_scale``)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.logit_scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.mlp(x) * self.logit_scale.exp()


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP()
    if name == "gpt4":  # the optimizers' tests: four blocks, many matrices to own
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=32,
                             bias=False))
    if name in ("gpt", "gpt_dropout"):
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32,
                             bias=False, dropout=0.1 if name == "gpt_dropout" else 0.0))
    if name == "tp_gpt":
        return TensorParallelGPT()
    if name == "complex_llama":
        return ComplexRopeLlama()
    if name == "scaled_mlp":
        return ScaledMLP()
    if name == "complex_rotation":
        return ComplexRotation()
    if name.startswith("transposed_"):
        return TransposedGradient(name.removeprefix("transposed_"))
    if name in HF_MODELS:
        from examples import hf_models
        return {"hf_gpt2": hf_models.tiny_gpt2, "hf_llama": hf_models.tiny_llama,
                "hf_deepseek_v3": hf_models.tiny_deepseek_v3}[name](VOCAB, SEQ)
    raise ValueError(name)


def global_batch(name: str, step: int, size: int = 8):
    """The global batch of one step: the same on every rank (each takes its slice)."""
    g = torch.Generator().manual_seed(1000 + step)
    if name in REGRESSION_MODELS:
        return torch.randn(size, FEATURES, generator=g), torch.randn(size, 7, generator=g)
    x = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def loss_fn(name: str, model: nn.Module, x, y):
    if name in HF_MODELS:  # the model shifts the labels itself
        return model(input_ids=x, labels=x).loss
    out = model(x)
    if name in REGRESSION_MODELS:
        return F.mse_loss(out, y)
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def make_optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    # AdamW is nearly blind to the scale of the gradient (m / sqrt(v)), so a
    # gradient that is N times too large passes an AdamW parity test; SGD is not.
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def save_matmuls(node) -> str:
    """A selective recompute policy: keep what matrix products and attention computed,
    recompute the rest (norms, activations, residual adds)."""
    name = str(node.target)
    return "save" if "mm" in name or "scaled_dot_product" in name else "recompute"


def training_step(name: str):
    """The plain training step the tests compile: forward, backward, optimizer step, zero_grad."""
    def train_step(model, opt, x, y):
        loss = loss_fn(name, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


def language_model_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor):
    """A step on a HuggingFace causal LM's own loss (for a mixture of experts, cross-entropy
    plus the router's load-balancing loss)."""
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def mixtral_after_one_step(layers: int = 2, width: int = 64, ffn: int = 512, experts: int = 4,
                           **options):
    """A ``@zero_compile(stage=3, backend=BACKEND, **options)`` step of a small HF Mixtral
    (router loss on; experts of ``width`` x ``ffn`` above the residency threshold by default)
    after one call, and its model."""
    from examples.hf_models import causal_lm, mixtral_config
    from zero_fx import zero_compile

    torch.manual_seed(0)
    model = causal_lm(mixtral_config(VOCAB, SEQ, layers=layers, width=width, heads=4, kv_heads=2,
                                     ffn=ffn, experts=experts))
    step = zero_compile(language_model_step, **{"stage": 3, "backend": BACKEND, **options})
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), global_batch("hf_llama", 0)[0])
    return step, model
