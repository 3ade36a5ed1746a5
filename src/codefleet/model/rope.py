"""Rotary position embeddings (Su et al., 2021), rotate-half convention as in Llama/Qwen.

Position p rotates each pair `(x_i, x_{i + d/2})` of a head's `d` dims by the
angle `p * theta^(-2i/d)`:

    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x2, x1)

so that `<rope(q, m), rope(k, n)>` depends on `m - n` only. `rope_cos_sin`
and `apply_rope` are that definition. The model runs the same arithmetic
from a table computed once (`rope_table`: cos and a sin whose first half is
negated) with `apply_rope_signed`, `x * cos + roll(x, d/2) * sin_signed`:
`roll` gives `cat(x2, x1)` and the folded sign makes it `cat(-x2, x1) * sin`,
the same products and sums, so the results are bit-identical.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions_BT: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, T, head_dim] for rotate-half rotary embeddings at the given positions."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions_BT.device, dtype=torch.float32) / head_dim)
    angles_BTd = positions_BT.float()[..., None] * inv_freq
    angles_BTD = torch.cat([angles_BTd, angles_BTd], dim=-1)
    return angles_BTD.cos()[:, None], angles_BTD.sin()[:, None]


def apply_rope(x_BHTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The definition: `x * cos + cat(-x2, x1) * sin`, in fp32, with `rope_cos_sin`'s cos and sin."""
    half = x_BHTD.shape[-1] // 2
    x1, x2 = x_BHTD[..., :half], x_BHTD[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BHTD.float() * cos + rotated.float() * sin).to(x_BHTD.dtype)


def rope_table(n_positions: int, head_dim: int, theta: float, device) -> torch.Tensor:
    """[n_positions, 2, head_dim] fp32: cos and the rotate-half-signed sin (`-sin` on the first half) of
    positions 0..n-1, the same angles as `rope_cos_sin`. With the sign folded in,
    `x * cos + roll(x, half) * sin_signed` equals `x * cos + cat(-x2, x1) * sin` exactly."""
    cos, sin = rope_cos_sin(torch.arange(n_positions, device=device)[None], head_dim, theta)
    sin = sin[0, 0].clone()
    sin[:, : head_dim // 2].neg_()
    return torch.stack([cos[0, 0], sin], dim=1)


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` with the table's signed sin: x * cos + [x2, x1] * [-sin, sin] (fewer ops per call)."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)
    if x.dtype == torch.float32:
        return x * cos + rotated * sin_signed
    return (x.float() * cos + rotated.float() * sin_signed).to(x.dtype)
