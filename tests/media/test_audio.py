"""Audio front end: decoding (WAV/AAC/Opus/MP3 made here), resampling vs a dense sinc sum, the
log-mel vs transformers' audio_utils, the MiMo token count, and bad audio."""

from __future__ import annotations

import io
import math
import wave

import av
import numpy as np
import pytest
import torch
from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

from swaserve.media import MediaError
from swaserve.media.audio import (
    DEFAULT_PARAMS,
    SAMPLE_RATE,
    AudioParams,
    audio_num_tokens,
    audio_tokens_for_samples,
    audio_tokens_for_seconds,
    decoded_samples,
    probe_audio,
    resampled_length,
)
from swaserve.media.audio_features import decode_audio, log_mel, mel_bank, resample


def _tone(rate: int, seconds: float, freq: float = 440.0, amp: float = 0.3) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    return amp * np.sin(2 * np.pi * freq * t)


def _wav(channels: list[np.ndarray], rate: int) -> bytes:
    pcm = np.stack([np.round(c * 32767).astype(np.int16) for c in channels], axis=1)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(len(channels))
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _encoded(fmt: str, codec: str, rate: int, x: np.ndarray) -> bytes:
    """Mono float samples at ``rate`` -> a file written by PyAV's bundled FFmpeg encoders."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(x.astype(np.float32)[None], format="fltp", layout="mono")
        frame.sample_rate = rate
        fmt_name = stream.codec_context.format.name
        resampler = av.AudioResampler(format=fmt_name, layout="mono", rate=rate)
        for f in [*resampler.resample(frame), *resampler.resample(None)]:
            out.mux(stream.encode(f))
        out.mux(stream.encode(None))
    return buf.getvalue()


def _video_only() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream("mpeg4", rate=10)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
        for _ in range(3):
            out.mux(s.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")))
        out.mux(s.encode(None))
    return buf.getvalue()


def _peak_hz(x: torch.Tensor, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x.numpy() * np.hanning(len(x))))
    return float(np.argmax(spec) * rate / len(x))


# --- the mel front end ---


def test_log_mel_equals_transformers_audio_utils() -> None:
    x = _tone(SAMPLE_RATE, 1.3) + 0.05 * np.random.default_rng(0).standard_normal(round(SAMPLE_RATE * 1.3))
    x = x.astype(np.float32).astype(np.float64)  # both sides see the same float32 waveform
    bank = mel_filter_bank(481, 128, 0.0, 12000.0, SAMPLE_RATE, norm=None, mel_scale="htk")
    ref = spectrogram(
        x,
        window_function(960, "hann", periodic=True),
        frame_length=960,
        hop_length=240,
        fft_length=960,
        power=1.0,
        center=True,
        pad_mode="reflect",
        mel_filters=bank,
        mel_floor=1e-7,
        log_mel="log",
    ).T  # float64 [T, 128]
    ours = log_mel(torch.from_numpy(x).float())
    assert ours.shape == ref.shape == (DEFAULT_PARAMS.num_frames(len(x)), 128) == (131, 128)
    assert np.abs(ours.double().numpy() - ref).max() <= 1e-5  # measured 4.8e-7 (float64 inside, float32 out)
    assert np.abs(mel_bank(DEFAULT_PARAMS).numpy() - bank).max() <= 1e-12


def test_mel_bank_is_torchaudios_hz_triangles_not_mel_space_ones() -> None:
    """torchaudio's ``melscale_fbanks`` (what the MiMo processor uses) draws the triangles linearly
    in Hz; transformers' ``triangularize_in_mel_space=True`` is a different bank."""
    mel_space = mel_filter_bank(
        481, 128, 0.0, 12000.0, SAMPLE_RATE, None, "htk", triangularize_in_mel_space=True
    )
    assert np.abs(mel_bank(DEFAULT_PARAMS).numpy() - mel_space).max() > 1e-3  # measured 2.8e-3


def test_log_mel_rejects_short_or_bad_input() -> None:
    with pytest.raises(ValueError, match="shorter"):
        log_mel(torch.zeros(480))
    with pytest.raises(ValueError, match="1-D"):
        log_mel(torch.zeros(2, 1000))
    assert log_mel(torch.zeros(481)).shape == (3, 128)


def test_params_from_hf() -> None:
    p = AudioParams.from_hf({"audio_sampling_rate": 16000, "audio_n_mels": 80, "audio_fmax": 7600, "x": 1})
    assert (p.sample_rate, p.n_mels, p.f_max, p.n_fft) == (16000, 80, 7600.0, 960)
    assert AudioParams.from_hf(DEFAULT_PARAMS.to_hf()) == DEFAULT_PARAMS
    with pytest.raises(ValueError):
        AudioParams(f_max=20000.0)


# --- resampling ---


def _dense_sinc(x: np.ndarray, old: int, new: int, zeros: int = 6, rolloff: float = 0.99) -> np.ndarray:
    """y[m] = sum_n x[n] h(n - m * old / new): the windowed-sinc interpolator, written out densely."""
    cutoff = rolloff * min(old, new) / old
    m = np.arange(resampled_length(len(x), old, new))[:, None]
    u = cutoff * (np.arange(len(x))[None, :] - m * old / new)
    h = cutoff * np.sinc(u) * np.where(np.abs(u) <= zeros, np.cos(np.pi * u / (2 * zeros)) ** 2, 0.0)
    return h @ x


@pytest.mark.parametrize("old", [8000, 16000, 22050, 44100, 48000])
def test_resample_equals_dense_sinc_sum(old: int) -> None:
    x = np.random.default_rng(old).standard_normal(old // 20)  # 50 ms of noise
    ours = resample(torch.from_numpy(x).float(), old, SAMPLE_RATE)
    ref = _dense_sinc(x, old, SAMPLE_RATE)
    assert ours.shape == (math.ceil(len(x) * SAMPLE_RATE / old),) == ref.shape
    assert np.abs(ours.double().numpy() - ref).max() <= 5e-6  # measured <= 5e-7 (fp32 conv)


def test_resample_identity_and_band_limited_tone() -> None:
    x = torch.randn(1000)
    assert resample(x, SAMPLE_RATE, SAMPLE_RATE) is x
    y = resample(torch.from_numpy(_tone(16000, 0.5)).float(), 16000, SAMPLE_RATE)
    interior = slice(200, -200)  # away from the zero-padded ends
    want = _tone(SAMPLE_RATE, 0.5)[interior]
    assert np.abs(y[interior].numpy() - want).max() < 2e-3
    batched = resample(torch.randn(2, 3, 500, dtype=torch.float64), 44100, SAMPLE_RATE)
    assert (
        batched.shape == (2, 3, resampled_length(500, 44100, SAMPLE_RATE)) and batched.dtype == torch.float64
    )


# --- the token count ---


@pytest.mark.parametrize(
    ("frames", "tokens"),
    [
        (0, 0),
        (1, 1),
        (2, 1),
        (16, 1),
        (17, 2),
        (32, 2),
        (33, 3),
        (100, 7),
        (101, 7),
        (1000, 63),
        (6000, 375),
        (6001, 376),
    ],
)
def test_audio_num_tokens_pinned(frames: int, tokens: int) -> None:
    assert audio_num_tokens(frames) == tokens


def test_token_count_from_samples_and_seconds() -> None:
    assert audio_tokens_for_seconds(1.0) == 7  # 101 frames
    assert audio_tokens_for_seconds(60.0) == 376  # 6001 frames
    assert audio_tokens_for_seconds(1.0, 16000) == 7
    for n in (481, 3839, 3840, 3841, 10_000, 24_000):
        assert audio_tokens_for_samples(n) == audio_num_tokens(log_mel(torch.zeros(n)).shape[0])
    wav = _wav([_tone(16000, 2.5)], 16000)
    meta = probe_audio(wav)
    frames = log_mel(decode_audio(wav, 10.0)).shape[0]
    assert audio_tokens_for_seconds(meta.duration_s, meta.sample_rate) == audio_num_tokens(frames) == 16


# --- decoding ---


def test_wav_decodes_to_24k_mono() -> None:
    left, right = _tone(16000, 1.0, 440.0), _tone(16000, 1.0, 1000.0, amp=0.2)
    data = _wav([left, right], 16000)
    assert probe_audio(data) == (16000, 2, 1.0, "pcm_s16le")
    out = decode_audio(data, max_seconds=5.0)
    assert out.dtype == torch.float32 and out.shape == (SAMPLE_RATE,)
    pcm = [np.round(c * 32767) / 32768 for c in (left, right)]
    want = resample(torch.from_numpy((pcm[0] + pcm[1]) / 2).float(), 16000, SAMPLE_RATE)
    assert (out - want).abs().max().item() <= 1e-6
    native = _wav([_tone(SAMPLE_RATE, 0.5)], SAMPLE_RATE)  # already 24 kHz: samples pass untouched
    exact = torch.from_numpy(np.round(_tone(SAMPLE_RATE, 0.5) * 32767) / 32768).float()
    assert torch.equal(decode_audio(native, 5.0), exact)
    assert decoded_samples(data, 5.0) == SAMPLE_RATE and decoded_samples(native, 5.0) == exact.shape[0]


@pytest.mark.parametrize(
    ("fmt", "codec", "rate", "name"),
    [
        ("mp4", "aac", 16000, "aac"),
        ("ogg", "libopus", 48000, "opus"),
        ("mp3", "libmp3lame", 22050, "mp3float"),
    ],
)
def test_compressed_audio_decodes_to_the_right_length(fmt: str, codec: str, rate: int, name: str) -> None:
    data = _encoded(fmt, codec, rate, _tone(rate, 1.0))
    meta = probe_audio(data)
    assert (meta.sample_rate, meta.channels, meta.codec) == (rate, 1, name)
    assert abs(meta.duration_s - 1.0) < 0.1
    out = decode_audio(data, max_seconds=5.0)
    assert abs(out.shape[0] - SAMPLE_RATE) <= 0.1 * SAMPLE_RATE  # AAC adds its 1024-sample priming
    assert decoded_samples(data, 5.0) == out.shape[0]  # the router's count, without torch
    assert abs(_peak_hz(out, SAMPLE_RATE) - 440.0) < 5.0


# --- bad audio ---


def test_bad_audio_is_a_media_error() -> None:
    wav = _wav([_tone(16000, 1.0)], 16000)
    mp3 = _encoded("mp3", "libmp3lame", 16000, _tone(16000, 1.0))
    aac = _encoded("mp4", "aac", 16000, _tone(16000, 1.0))
    cases = [
        (b"", "empty"),
        (b"\x00garbage bytes" * 50, "not a readable audio file"),
        (wav[:30], "not a readable audio file"),
        (wav[: len(wav) // 2], "truncated WAV"),
        (mp3[: len(mp3) // 2], "truncated file"),
        (aac[: len(aac) // 2], "not a readable audio file"),  # the index (moov) is at the end
        (_video_only(), "no audio stream"),
        (_wav([_tone(16000, 0.01)], 16000), "too short"),
    ]
    for data, msg in cases:
        with pytest.raises(MediaError, match=msg):
            decode_audio(data, max_seconds=5.0)
        with pytest.raises(MediaError, match=msg):
            decoded_samples(data, max_seconds=5.0)
    with pytest.raises(MediaError, match=r"longer than the 0\.5 s limit"):
        decode_audio(wav, max_seconds=0.5)
    with pytest.raises(MediaError, match="no audio stream"):
        probe_audio(_video_only())
    with pytest.raises(MediaError, match="not a readable"):
        probe_audio(b"\x89PNG not really")
