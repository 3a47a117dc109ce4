"""The MiMo audio front end in torch: decoding to a 24 kHz mono waveform, band-limited
resampling and the log-mel spectrogram (the encoder's input). ``media.audio`` (torch-free) has the
parameters, the decoding to samples and the token counts; its docstring gives the sources.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from swaserve.media.audio import (
    DEFAULT_PARAMS,
    SAMPLE_RATE,
    AudioParams,
    check_length,
    decode_channels,
    hz_to_mel,
    mel_to_hz,
    resampled_length,
)


def decode_audio(data: bytes, max_seconds: float) -> torch.Tensor:
    """Decode an audio file to a mono float32 waveform at 24 kHz: ``decode_channels``, channels
    averaged, then ``resample``.

    Returns:
        float32 [samples] at ``SAMPLE_RATE``, on the CPU (``decoded_samples`` of them).

    Raises:
        MediaError: as ``decode_channels``, or too short for one mel frame (< 21 ms).
    """
    channels, rate = decode_channels(data, max_seconds)
    out = resample(torch.from_numpy(channels).mean(dim=0), rate, SAMPLE_RATE)
    check_length(out.shape[0])
    return out


@functools.lru_cache(maxsize=32)
def _sinc_kernel(old: int, new: int, width_zeros: int, rolloff: float) -> tuple[torch.Tensor, int]:
    """Polyphase kernel [new, 1, 2 * pad + old] (float64) and its one-sided padding, in input samples.

    Phase ``j`` produces output sample ``i * new + j``, whose time in input samples is
    ``i * old + j * old / new``; tap ``k`` reads input sample ``i * old + k - pad``. Its weight is
    the band-limited interpolator at the offset ``d = k - pad - j * old / new``:
    ``c * sinc(c * d) * hann(c * d / width_zeros)`` with cutoff ``c = rolloff * min(old, new) / old``
    (cycles per input sample), the window ``cos(pi * x / 2)**2`` on ``|x| <= 1`` and zero beyond.
    """
    cutoff = rolloff * min(old, new) / old
    pad = math.ceil(width_zeros / cutoff)
    taps = torch.arange(-pad, pad + old, dtype=torch.float64)
    phase = torch.arange(new, dtype=torch.float64)[:, None] * (old / new)
    x = cutoff * (taps[None, :] - phase)  # offset in units of the cutoff period
    x = x.clamp(-width_zeros, width_zeros)
    window = torch.cos(x * (math.pi / (2 * width_zeros))) ** 2
    sinc = torch.where(x == 0, torch.ones_like(x), torch.sin(math.pi * x) / (math.pi * x))
    return (cutoff * sinc * window)[:, None, :], pad


def resample(
    wave: torch.Tensor, old: int, new: int, width_zeros: int = 6, rolloff: float = 0.99
) -> torch.Tensor:
    """Band-limited resampling from ``old`` Hz to ``new`` Hz (torchaudio's ``sinc_interp_hann``).

    Args:
        wave: [..., samples], float32 or float64, on any device; zero outside its ends.
        width_zeros: zero crossings of the sinc on each side (torchaudio ``lowpass_filter_width``).
        rolloff: cutoff as a share of the lower Nyquist rate.

    Returns:
        [..., ceil(samples * new / old)] in ``wave``'s dtype; ``wave`` itself when the rates match.
    """
    if old <= 0 or new <= 0:
        raise ValueError(f"sample rates must be positive, got {old}, {new}")
    if old == new:
        return wave
    g = math.gcd(old, new)
    old, new = old // g, new // g
    kernel, pad = _sinc_kernel(old, new, width_zeros, rolloff)
    kernel = kernel.to(device=wave.device, dtype=wave.dtype)
    shape, n = wave.shape[:-1], wave.shape[-1]
    x = torch.nn.functional.pad(wave.reshape(-1, 1, n), (pad, pad + old))
    y = torch.nn.functional.conv1d(x, kernel, stride=old)  # [B, new, frames]
    y = y.transpose(1, 2).reshape(x.shape[0], -1)
    return y[:, : resampled_length(n, old, new)].reshape(*shape, -1)


@functools.lru_cache(maxsize=8)
def mel_bank(p: AudioParams) -> torch.Tensor:
    """HTK triangular mel bank without normalisation, float64 [n_fft // 2 + 1, n_mels].

    Filter m rises linearly in Hz from corner m to corner m + 1 and falls to corner m + 2, the
    ``n_mels + 2`` corners evenly spaced on the HTK mel scale between ``f_min`` and ``f_max``
    (torchaudio ``functional.melscale_fbanks(norm=None, mel_scale="htk")``).
    """
    n_freqs = p.n_fft // 2 + 1
    top = float(p.sample_rate // 2) if p.f_max is None else p.f_max
    freqs = np.linspace(0.0, p.sample_rate // 2, n_freqs)
    corners = mel_to_hz(np.linspace(hz_to_mel(p.f_min), hz_to_mel(top), p.n_mels + 2))
    width = np.diff(corners)
    rise = (freqs[:, None] - corners[None, :-2]) / width[None, :-1]
    fall = (corners[None, 2:] - freqs[:, None]) / width[None, 1:]
    return torch.from_numpy(np.maximum(0.0, np.minimum(rise, fall)))


def log_mel(
    wave: torch.Tensor, p: AudioParams = DEFAULT_PARAMS, device: torch.device | str | None = None
) -> torch.Tensor:
    """The MiMo front end: ``log(clamp(mel(|STFT|**power), log_floor))``.

    Args:
        wave: [samples] at ``p.sample_rate``; at least ``p.min_samples`` samples.
        device: where to compute (default: ``wave``'s device).

    Returns:
        float32 [T, n_mels] on ``device``, T = ``p.num_frames(samples)`` (100 frames/s by default).

    Raises:
        ValueError: not 1-D, or too short for the reflect padding.
    """
    if wave.dim() != 1:
        raise ValueError(f"log_mel takes a 1-D waveform, got shape {tuple(wave.shape)}")
    if wave.shape[0] < p.min_samples:
        raise ValueError(f"waveform of {wave.shape[0]} samples is shorter than {p.min_samples}")
    dev = wave.device if device is None else torch.device(device)
    # float64 where the device has it: float32 STFT error reaches ~4e-5 in the log domain at
    # low-energy bins, float64 leaves only the final rounding (a second of audio is ~1e7 FLOP).
    dtype = torch.float64 if dev.type in ("cpu", "cuda") else torch.float32
    x = wave.to(device=dev, dtype=dtype)
    window = torch.hann_window(p.win_length, periodic=True, dtype=dtype, device=dev)
    spec = torch.stft(
        x,
        n_fft=p.n_fft,
        hop_length=p.hop_length,
        win_length=p.win_length,
        window=window,
        center=p.center,
        pad_mode="reflect",
        normalized=False,
        onesided=True,
        return_complex=True,
    ).abs()  # [n_freqs, T]
    if p.power != 1.0:
        spec = spec.pow(p.power)
    mel = spec.transpose(0, 1) @ mel_bank(p).to(device=dev, dtype=dtype)
    return torch.log(torch.clamp(mel, min=p.log_floor)).float()
