"""MXFP4 expert weights (GPT-OSS's published checkpoints) dequantized at load.

The OCP microscaling format: each block of 32 values shares one 8-bit power-of-two scale (E8M0,
biased by 127) and stores each value as a 4-bit float (E2M1: sign, 2 exponent bits, 1 mantissa bit),
two per byte, the low nibble first. GPT-OSS stores `<name>_blocks` (E, rows, in / 32, 16) uint8 and
`<name>_scales` (E, rows, in / 32) uint8, `rows` being the matrix's output dimension; transformers holds
the matrix as (E, in, rows), which is what this returns. The values are exact in bfloat16 and float32.
"""
from __future__ import annotations

import torch

# The 16 E2M1 codes, 0..7 positive, 8..15 the same magnitudes negative.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(_E2M1 + tuple(-v for v in _E2M1))


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks (E, rows, G, 16) uint8, scales (E, rows, G) uint8 -> (E, G * 32, rows) in dtype."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype} do not pair")
    table = E2M1_VALUES.to(device=blocks.device, dtype=torch.float32)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # (E, rows, G, 32): low nibble first
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(1, 2).to(dtype).contiguous()
