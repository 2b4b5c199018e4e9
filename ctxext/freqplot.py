"""The frequency picture: θ'_i/θ_i per pair for each method, i.e. which pairs are extrapolated (ratio 1),
interpolated (ratio 1/s) or somewhere in between."""

from __future__ import annotations

import math

import torch

from .config import MethodConfig
from .methods import compute_inv_freq, get_method, rope_inv_freq
from .outputs import new_figure, save_figure


def frequency_ratios(
    config: MethodConfig, rotary_dim: int, base: float, method_length: int, seq_len: int | None = None
) -> torch.Tensor:
    """θ'_i / θ_i for every pair i (float64); dynamic methods are evaluated at `seq_len` (default L*s)."""
    spec = get_method(config.method)
    params = spec.make_params(factor=config.factor, **config.params)
    length = seq_len if seq_len is not None else int(method_length * config.factor)
    inv_freq, _ = compute_inv_freq(spec, params, rotary_dim, base, method_length, length)
    return inv_freq.double() / rope_inv_freq(rotary_dim, base).double()


def plot_frequency_ratios(
    configs: list[MethodConfig], rotary_dim: int, base: float, method_length: int, path, seq_len: int | None = None
) -> None:
    pairs = torch.arange(rotary_dim // 2)
    wavelengths = 2 * math.pi / rope_inv_freq(rotary_dim, base).double()
    fig = new_figure(figsize=(8, 4.8))
    ax = fig.subplots()
    for config in configs:
        ratio = frequency_ratios(config, rotary_dim, base, method_length, seq_len)
        ax.plot(pairs, ratio, marker=".", label=config.label)
    factors = sorted({c.factor for c in configs if c.factor > 1})
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    for s in factors:
        ax.axhline(1 / s, color="grey", lw=0.8, ls=":")
        ax.text(0, 1 / s, f" interpolated (1/{s:g})", va="bottom", fontsize=8, color="grey")
    ax.text(0, 1.0, " extrapolated (kept)", va="bottom", fontsize=8, color="grey")
    # Pairs whose wavelength exceeds L never complete a turn in pre-training: beyond here, extrapolating is unsafe.
    beyond = (wavelengths > method_length).nonzero()
    if len(beyond):
        ax.axvline(int(beyond[0]), color="tab:red", lw=0.8, alpha=0.6)
        ax.text(int(beyond[0]), 0.5, " wavelength > L", color="tab:red", fontsize=8, rotation=90, va="center")
    ax.set_xlabel("pair index i (high frequency -> low frequency)")
    ax.set_ylabel("theta'_i / theta_i")
    ax.set_yscale("log")
    ax.set_title(f"RoPE frequency scaling, d={rotary_dim}, base={base:g}, L={method_length}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
