"""Hyper-parameters of the Llama-style decoder, plus the derived sizes."""

from dataclasses import dataclass


@dataclass
class LlamaConfig:
    vocab_size: int = 512
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None -> n_heads (plain multi-head attention)
    ffn_hidden: int | None = None  # None -> Llama rule from dim and multiple_of
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1/3.2 long-context rotary scaling: wavelengths above original/low_freq_factor
    # are stretched by rope_scale_factor, those below original/high_freq_factor kept, and
    # the band between blended. rope_scale_factor 1: no scaling.
    rope_scale_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02
    loss_chunk_tokens: int = 4096  # tokens per logits chunk in the fused LM-head loss
    fused: bool = False  # DecoderConfig.fused: the elementwise work between the matmuls compiled

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden is None:
            # Llama: 2/3 of the classic 4*dim (SwiGLU has three matrices), rounded up.
            hidden = int(2 * 4 * self.dim / 3)
            self.ffn_hidden = self.multiple_of * -(-hidden // self.multiple_of)
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.rope_scale_factor < 1:
            raise ValueError(f"rope_scale_factor {self.rope_scale_factor} must be >= 1 (1: no scaling)")
        if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError("rope scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor")
        if self.rope_original_max_seq_len < 1:
            raise ValueError("rope_original_max_seq_len must be positive")
        if self.loss_chunk_tokens < 1:
            raise ValueError("loss_chunk_tokens must be positive")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rope_scaling(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_seq_len), or None."""
        if self.rope_scale_factor == 1:
            return None
        return (self.rope_scale_factor, self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_max_seq_len)
