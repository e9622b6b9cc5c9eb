"""The proxy GPT: a small decoder-only transformer in the nanoGPT tradition, one knob per hypothesis.

    cfg = GPTConfig(n_layer=4)               # d_model 256, 4 heads: width derives from depth
    model = GPT(cfg)
    loss = model(idx, targets)               # idx, targets: (B, T) int64

Every architectural option a hypothesis changes is a field of GPTConfig, named as the run's
config names it (runner/options.py): positional scheme, norm type and position, activation,
QK-norm, grouped-query attention, tied embeddings, dropout. Attention is
F.scaled_dot_product_attention, which dispatches to the fused (flash) kernels on a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

HEAD_DIM = 64            # width per head; d_model = 64 x depth keeps one head per layer of depth


@dataclass
class GPTConfig:
    n_layer: int = 4
    d_model: int = 0           # 0: 64 x n_layer
    n_head: int = 0            # 0: d_model / 64 (at least 1)
    n_kv_head: int = 0         # 0: n_head (plain multi-head attention)
    vocab_size: int = 256
    seq_len: int = 256
    pos: str = "learned"       # learned | rope
    norm: str = "layernorm"    # layernorm | rmsnorm
    norm_position: str = "pre"  # pre | post
    activation: str = "gelu"   # gelu | swiglu | relu2
    qk_norm: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0

    def __post_init__(self):
        self.d_model = self.d_model or HEAD_DIM * self.n_layer
        self.n_head = self.n_head or max(1, self.d_model // HEAD_DIM)
        self.n_kv_head = self.n_kv_head or self.n_head
        problems = []
        if self.d_model % self.n_head:
            problems.append(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            problems.append(f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
        if self.pos == "rope" and (self.d_model // self.n_head) % 2:
            problems.append(f"rope needs an even head width, not {self.d_model // self.n_head}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def make_norm(cfg: GPTConfig, dim: int) -> nn.Module:
    # no bias: it buys nothing at this scale and keeps LayerNorm and RMSNorm parameter-equal
    return nn.RMSNorm(dim) if cfg.norm == "rmsnorm" else nn.LayerNorm(dim, bias=False)


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angle per pair of channels, shaped (T, head_dim/2)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) queries or keys: channel i pairs with channel i + D/2 (GPT-NeoX layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        kv_dim = cfg.n_kv_head * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * kv_dim, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj.residual_out = True
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        cfg = self.cfg
        B, T, C = x.shape
        kv_dim = cfg.n_kv_head * cfg.head_dim
        q, k, v = self.qkv(x).split((C, kv_dim, kv_dim), dim=-1)
        q = q.view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)
        k = k.view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)
        v = v.view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)
        if cfg.qk_norm:
            # bounds attention logits, the usual fix for their growth at high lr; without a gain,
            # as nanochat has it (and a gain in fp32 would take bf16 q off the fused kernel)
            q, k = F.rms_norm(q, (cfg.head_dim,)), F.rms_norm(k, (cfg.head_dim,))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=cfg.dropout if self.training else 0.0,
            enable_gqa=cfg.n_kv_head != cfg.n_head)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.activation = cfg.activation
        if cfg.activation == "swiglu":
            # 2/3 of the usual 4x hidden width so the three matrices cost what two 4x ones do
            hidden = 64 * math.ceil(8 * cfg.d_model / 3 / 64)
            self.fc = nn.Linear(cfg.d_model, 2 * hidden, bias=False)
        else:
            hidden = 4 * cfg.d_model
            self.fc = nn.Linear(cfg.d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=False)
        self.proj.residual_out = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.activation == "relu2":
            h = F.relu(h).square()
        else:
            h = F.gelu(h)
        return self.drop(self.proj(h))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.post = cfg.norm_position == "post"
        self.norm1 = make_norm(cfg, cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = make_norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        if self.post:          # the original Transformer: normalise the residual stream itself
            x = self.norm1(x + self.attn(x, rope))
            return self.norm2(x + self.mlp(x))
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos == "learned" else None
        if cfg.pos == "rope":
            cos, sin = rope_tables(cfg.seq_len, cfg.head_dim)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        # post-norm blocks already end normalised; pre-norm needs a final norm before the head
        self.norm_f = make_norm(cfg, cfg.d_model) if cfg.norm_position == "pre" else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    def _init(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if getattr(module, "residual_out", False):
                std /= math.sqrt(2 * self.cfg.n_layer)     # GPT-2: residual sums grow with depth
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def num_params(self, embeddings: bool = True) -> int:
        """Parameters (a tied matrix once); without the position table when embeddings=False,
        the N of FLOPs-per-token estimates (a lookup does no multiply)."""
        n = sum(p.numel() for p in self.parameters())
        if not embeddings and self.wpe is not None:
            n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the matrices plus the attention scores and mixing
        (12 L d T), the estimate nanoGPT and PaLM use for MFU."""
        c = self.cfg
        return 6 * self.num_params(embeddings=False) + 12 * c.n_layer * c.d_model * c.seq_len

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len {self.cfg.seq_len}")
        x = self.wte(idx)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        else:
            rope = (self.rope_cos[:T], self.rope_sin[:T])
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope)
        logits = self.lm_head(self.norm_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
