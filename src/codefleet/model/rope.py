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

Llama 3's long-context frequency scaling (`scaling={"rope_type": "llama3",
"factor": s, "low_freq_factor": l, "high_freq_factor": h,
"original_max_position_embeddings": L}`, `inv_freq`): frequencies whose
wavelength is shorter than L/h are kept, those longer than L/l are divided by
s, and those in between are interpolated linearly in L/wavelength.
"""

from __future__ import annotations

import math

import torch


def inv_freq(head_dim: int, theta: float, device=None, scaling: dict | None = None) -> torch.Tensor:
    """The rotation frequency of each pair, `theta^(-2i/d)` [head_dim / 2] fp32, with Llama 3's scaling if given."""
    freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None:
        return freq
    if scaling.get("rope_type") != "llama3":
        raise ValueError(f"rope scaling {scaling.get('rope_type')!r} is not supported (only 'llama3')")
    factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / freq
    scaled = torch.where(wavelength > context / low, freq / factor, freq)
    ramp = (context / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at the short end
    blended = (1 - ramp) * scaled / factor + ramp * scaled
    in_band = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(in_band, blended, scaled)


def rope_cos_sin(
    positions_BT: torch.Tensor, head_dim: int, theta: float, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, T, head_dim] for rotate-half rotary embeddings at the given positions."""
    angles_BTd = positions_BT.float()[..., None] * inv_freq(head_dim, theta, positions_BT.device, scaling)
    angles_BTD = torch.cat([angles_BTd, angles_BTd], dim=-1)
    return angles_BTD.cos()[:, None], angles_BTD.sin()[:, None]


def apply_rope(x_BHTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The definition: `x * cos + cat(-x2, x1) * sin`, in fp32, with `rope_cos_sin`'s cos and sin."""
    half = x_BHTD.shape[-1] // 2
    x1, x2 = x_BHTD[..., :half], x_BHTD[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BHTD.float() * cos + rotated.float() * sin).to(x_BHTD.dtype)


def rope_table(n_positions: int, head_dim: int, theta: float, device, scaling: dict | None = None) -> torch.Tensor:
    """[n_positions, 2, head_dim] fp32: cos and the rotate-half-signed sin (`-sin` on the first half) of
    positions 0..n-1, the same angles as `rope_cos_sin`. With the sign folded in,
    `x * cos + roll(x, half) * sin_signed` equals `x * cos + cat(-x2, x1) * sin` exactly."""
    cos, sin = rope_cos_sin(torch.arange(n_positions, device=device)[None], head_dim, theta, scaling)
    sin = sin[0, 0].clone()
    sin[:, : head_dim // 2].neg_()
    return torch.stack([cos[0, 0], sin], dim=1)


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` with the table's signed sin: x * cos + [x2, x1] * [-sin, sin] (fewer ops per call)."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)
    if x.dtype == torch.float32:
        return x * cos + rotated * sin_signed
    return (x.float() * cos + rotated.float() * sin_signed).to(x.dtype)
