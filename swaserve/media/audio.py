"""Audio inputs, torch-free (the router counts tokens with it): metadata, decoding to samples,
the token counts. The front end in torch (``decode_audio`` to 24 kHz mono, ``resample``,
``log_mel``) is ``media.audio_features``.

The MiMo-V2.5 processor (vLLM vllm/transformers_utils/processors/mimo_v2_omni.py
``MiMoVLProcessor.preprocess_audio``, ported from the Xiaomi-authored SGLang fork Abatom/sglang)
decodes the audio, resamples it to 24 kHz with ``torchaudio.transforms.Resample``, averages the
channels, and takes ``log(clip(MelSpectrogram(...), 1e-7))`` transposed to ``[T, 128]`` (100
frames/s). torchaudio cannot be installed here (no wheel for our torch), so both pieces are
re-implemented in plain torch from their definitions (``media.audio_features``):

* ``resample``: the windowed-sinc (Hann) band-limited interpolation that torchaudio's
  ``sinc_interp_hann`` method computes (low-pass width 6 zero crossings, roll-off 0.99), applied
  as a polyphase convolution. Output length ``ceil(n * new / old)``.
* ``log_mel``: ``torch.stft`` (periodic Hann, centred, reflect padding), magnitude (power 1), a
  triangular HTK mel bank without normalisation whose triangles are linear in Hz between
  mel-spaced corners (torchaudio ``melscale_fbanks``; transformers' ``audio_utils.mel_filter_bank``
  with ``triangularize_in_mel_space=False`` builds the same bank), then ``log(clamp(x, 1e-7))``.

Two details differ from the processor, both only in float rounding: channels are averaged before
resampling, not after (both steps are linear), and the mel is computed in float64 (torchaudio:
float32, ~4e-5 off in the log domain at low-energy bins), then returned as float32.

Token count (``audio_num_tokens``, the processor's formula): the tokenizer's conv stack gives
``(T + 2 - 3) // 2 + 1`` frames at 50 Hz, its pooler halves that (rounding up) to 25 Hz codes, and
the LLM takes one embedding per group of 4 codes (rounding up): 6.25 tokens per second.
Errors from untrusted bytes are ``MediaError``. PyAV is imported by the functions that use it (the
engine loads ``AudioParams`` without FFmpeg).
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from swaserve.media import MediaError

SAMPLE_RATE = 24000  # Hz, what the MiMo audio tokenizer consumes

# Sanity limits on what a container may claim (the API applies its own, tighter, per-request limits).
MAX_CHANNELS = 64
MAX_SOURCE_RATE = 768_000  # Hz

# A decode that yields less than this share of the duration the container declares is truncated.
_TRUNCATED_SHARE = 0.9
_TRUNCATED_SLACK_S = 0.25

# The tokenizer's conv front (kernel 3, stride 2, padding 1), pooler (2) and LLM group size (4), as
# fixed in the MiMo processor (``audio_kernel_size``, ``audio_stride_size``, ``audio_avg_pooler``,
# ``audio_group_size``).
_KERNEL, _STRIDE, _POOLER, _GROUP = 3, 2, 2, 4


@dataclass(frozen=True)
class AudioParams:
    """The log-mel front end (MiMo processor defaults; vLLM processors/mimo_v2_omni.py
    ``MiMoVLProcessor.__init__`` and its ``MelSpectrogram`` call).

    Attributes:
        sample_rate: Hz the waveform is resampled to (``audio_sampling_rate``).
        n_fft / win_length / hop_length: STFT size, Hann window length and hop, in samples
            (``audio_nfft``, ``audio_window_size``, ``audio_hop_length``): 40 ms / 40 ms / 10 ms.
        n_mels: mel bands (``audio_n_mels``).
        f_min / f_max: mel bank edges in Hz (``audio_fmin``, ``audio_fmax``; None: Nyquist).
        power: magnitude exponent (1: magnitude, the processor's ``power=1.0``).
        center: frames centred on ``t * hop`` with reflect padding (the processor's ``center=True``).
        log_floor: clamp before the natural log (the processor's ``clip(min=1e-7)``).
    """

    sample_rate: int = SAMPLE_RATE
    n_fft: int = 960
    win_length: int = 960
    hop_length: int = 240
    n_mels: int = 128
    f_min: float = 0.0
    f_max: float | None = None
    power: float = 1.0
    center: bool = True
    log_floor: float = 1e-7

    def __post_init__(self) -> None:
        if self.sample_rate <= 0 or self.hop_length <= 0 or self.n_mels <= 0:
            raise ValueError(f"sample_rate, hop_length and n_mels must be positive: {self}")
        if not 0 < self.win_length <= self.n_fft:
            raise ValueError(f"need 0 < win_length <= n_fft, got {self.win_length}, {self.n_fft}")
        top = self.sample_rate / 2 if self.f_max is None else self.f_max
        if not 0 <= self.f_min < top <= self.sample_rate / 2:
            raise ValueError(f"need 0 <= f_min < f_max <= sample_rate / 2, got {self.f_min}, {top}")
        if self.power <= 0 or self.log_floor <= 0:
            raise ValueError("power and log_floor must be positive")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> AudioParams:
        """From a ``processor_config`` mapping (``audio_sampling_rate``, ``audio_nfft``,
        ``audio_window_size``, ``audio_hop_length``, ``audio_n_mels``, ``audio_fmin``,
        ``audio_fmax``); absent keys keep the defaults, other keys are ignored. power, center and
        the log floor are fixed in the processor's code, not in the config."""
        f_max = d.get("audio_fmax")
        return cls(
            sample_rate=int(d.get("audio_sampling_rate", SAMPLE_RATE)),
            n_fft=int(d.get("audio_nfft", 960)),
            win_length=int(d.get("audio_window_size", 960)),
            hop_length=int(d.get("audio_hop_length", 240)),
            n_mels=int(d.get("audio_n_mels", 128)),
            f_min=float(d.get("audio_fmin", 0.0)),
            f_max=None if f_max is None else float(f_max),
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``processor_config`` keys ``from_hf`` reads."""
        return {
            "audio_sampling_rate": self.sample_rate,
            "audio_nfft": self.n_fft,
            "audio_window_size": self.win_length,
            "audio_hop_length": self.hop_length,
            "audio_n_mels": self.n_mels,
            "audio_fmin": self.f_min,
            "audio_fmax": self.f_max,
        }

    def num_frames(self, num_samples: int) -> int:
        """Mel frames of a waveform of ``num_samples`` samples (at ``sample_rate``)."""
        if self.center:
            return 1 + num_samples // self.hop_length
        return 0 if num_samples < self.n_fft else 1 + (num_samples - self.n_fft) // self.hop_length

    @property
    def min_samples(self) -> int:
        """Shortest waveform ``log_mel`` takes: reflect padding needs more than ``n_fft // 2``."""
        return self.n_fft // 2 + 1 if self.center else self.n_fft


DEFAULT_PARAMS = AudioParams()


class AudioMeta(NamedTuple):
    """Container metadata of an audio item: what the router needs to count tokens.

    ``duration_s`` comes from the container (or the packet timestamps when it declares none); for
    compressed formats the decoded length can differ by an encoder delay (AAC: ~1024 samples).
    """

    sample_rate: int  # Hz of the audio stream
    channels: int
    duration_s: float
    codec: str  # FFmpeg decoder name (pcm_s16le, aac, opus, mp3float, flac, ...)


def _open(data: bytes) -> Any:
    import av

    if not data:
        raise MediaError("audio: empty data")
    try:
        return av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError) as e:
        raise MediaError(f"audio: not a readable audio file ({e})") from e


def _audio_stream(container: Any) -> Any:
    if not container.streams.audio:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise MediaError(f"audio: the file has no audio stream (streams: {', '.join(kinds)})")
    stream = container.streams.audio[0]
    rate, channels = int(stream.sample_rate or 0), int(stream.codec_context.channels or 0)
    if not 0 < rate <= MAX_SOURCE_RATE:
        raise MediaError(f"audio: unsupported sample rate {rate} Hz")
    if not 0 < channels <= MAX_CHANNELS:
        raise MediaError(f"audio: unsupported channel count {channels}")
    return stream


def _declared_seconds(container: Any, stream: Any) -> float | None:
    import av

    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def probe_audio(data: bytes) -> AudioMeta:
    """Read an audio file's metadata without decoding samples.

    The duration comes from the container; when it declares none the packets are demuxed (not
    decoded) and their durations summed.

    Raises:
        MediaError: not a media file, no audio stream, or an unsupported rate or channel count.
    """
    import av

    with _open(data) as container:
        stream = _audio_stream(container)
        seconds = _declared_seconds(container, stream)
        if seconds is None:
            try:
                ticks = sum(p.duration or 0 for p in container.demux(stream))
            except av.FFmpegError as e:
                raise MediaError(f"audio: corrupt data ({e})") from e
            seconds = float(ticks * stream.time_base)
        return AudioMeta(
            sample_rate=int(stream.sample_rate),
            channels=int(stream.codec_context.channels),
            duration_s=seconds,
            codec=str(stream.codec_context.name),
        )


# FFmpeg's integer sample formats map to [-1, 1) by these divisors (u8 is offset binary).
_SCALE = {"u8": 128.0, "s16": 32768.0, "s32": 2147483648.0, "s64": 9223372036854775808.0}


def _frame_to_float(frame: Any, channels: int) -> np.ndarray:
    """One decoded frame -> float32 [channels, samples]."""
    name = frame.format.packed.name
    raw = frame.to_ndarray()
    raw = raw.reshape(channels, -1) if frame.format.is_planar else raw.reshape(-1, channels).T
    if name in ("flt", "dbl"):
        return raw.astype(np.float32, copy=False)
    if name not in _SCALE:
        raise MediaError(f"audio: unsupported sample format {frame.format.name}")
    x = raw.astype(np.float64)
    if name == "u8":
        x = x - 128.0
    return (x / _SCALE[name]).astype(np.float32)


def _wav_truncated(data: bytes) -> bool:
    """True when a RIFF/WAVE file's ``data`` chunk declares more bytes than the file holds
    (FFmpeg silently decodes the rest). 0 and 0xFFFFFFFF mean "unknown" (streamed WAV)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return False
    pos = 12
    while pos + 8 <= len(data):
        tag, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        if tag == b"data":
            return size not in (0, 0xFFFFFFFF) and pos + 8 + size > len(data)
        pos += 8 + size + (size & 1)
    return False


def decode_channels(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    """Decode the first audio stream to float32 [channels, samples] at its own rate (integer
    formats scaled to [-1, 1)); video streams are ignored.

    Args:
        data: the file's bytes (any container/codec the bundled FFmpeg reads: WAV, FLAC, MP3,
            AAC/MP4, Opus/Ogg, ...).
        max_seconds: longest accepted audio, checked on the declared duration before decoding and
            on the decoded samples while decoding.

    Returns:
        (samples float32 [channels, n], the stream's rate in Hz).

    Raises:
        MediaError: not audio, corrupt, truncated (shorter than the container declares, or a WAV
            data chunk past the end of the file), an unsupported format, or longer than
            ``max_seconds``.
    """
    import av

    if _wav_truncated(data):
        raise MediaError("audio: truncated WAV file (data chunk runs past the end)")
    with _open(data) as container:
        stream = _audio_stream(container)
        rate, channels = int(stream.sample_rate), int(stream.codec_context.channels)
        declared = _declared_seconds(container, stream)
        if declared is not None and declared > max_seconds:
            raise MediaError(f"audio: {declared:.2f} s is longer than the {max_seconds:g} s limit")
        limit = math.floor(max_seconds * rate)
        chunks: list[np.ndarray] = []
        total = 0
        try:
            for frame in container.decode(stream):
                if frame.sample_rate != rate or len(frame.layout.channels) != channels:
                    raise MediaError("audio: sample rate or channel count changes mid-stream")
                chunk = _frame_to_float(frame, channels)
                total += chunk.shape[1]
                if total > limit:
                    raise MediaError(f"audio: longer than the {max_seconds:g} s limit")
                chunks.append(chunk)
        except av.FFmpegError as e:
            raise MediaError(f"audio: corrupt data ({e})") from e
    if total == 0:
        raise MediaError("audio: the stream has no samples")
    decoded = total / rate
    if declared is not None and decoded < _TRUNCATED_SHARE * declared - _TRUNCATED_SLACK_S:
        raise MediaError(f"audio: truncated file ({decoded:.2f} s decoded of {declared:.2f} s declared)")
    return np.concatenate(chunks, axis=1), rate


def check_length(num_samples: int) -> None:
    """Raise MediaError when a waveform of ``num_samples`` samples at ``SAMPLE_RATE`` is too short
    for one mel frame (< 21 ms)."""
    if num_samples < DEFAULT_PARAMS.min_samples:
        need = DEFAULT_PARAMS.min_samples
        raise MediaError(
            f"too short: {num_samples} samples at {SAMPLE_RATE} Hz, at least {need} "
            f"({1000 * need / SAMPLE_RATE:.0f} ms) needed"
        )


def decoded_samples(data: bytes, max_seconds: float) -> int:
    """Samples at ``SAMPLE_RATE`` of the mono waveform ``media.audio_features.decode_audio``
    returns for ``data`` (the router decodes to count tokens: declared durations can be wrong).

    Raises:
        MediaError: as ``decode_channels`` and ``check_length``.
    """
    channels, rate = decode_channels(data, max_seconds)
    n = resampled_length(channels.shape[1], rate, SAMPLE_RATE)
    check_length(n)
    return n


def resampled_length(num_samples: int, old: int, new: int) -> int:
    """Samples ``resample`` returns: ``ceil(num_samples * new / old)``."""
    g = math.gcd(old, new)
    return -(-num_samples * (new // g) // (old // g))


def hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    """The HTK mel scale: ``2595 log10(1 + hz / 700)``."""
    return 2595.0 * np.log10(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    """The inverse of ``hz_to_mel``."""
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def audio_num_tokens(num_mel_frames: int) -> int:
    """LLM tokens (``<|audio_pad|>`` count) of an item with ``num_mel_frames`` mel frames.

    ``n = (T + 2 - 3) // 2 + 1`` (conv, 50 Hz); ``n = ceil(n / 2)`` (pooler, 25 Hz codes);
    ``ceil(n / 4)`` (groups of 4 codes). Source: vLLM processors/mimo_v2_omni.py
    ``preprocess_audio``; 0 frames give 0 tokens.
    """
    if num_mel_frames < 0:
        raise ValueError(f"num_mel_frames must be >= 0, got {num_mel_frames}")
    if num_mel_frames == 0:
        return 0
    n = (num_mel_frames + 2 - _KERNEL) // _STRIDE + 1
    n = -(-n // _POOLER)
    return -(-n // _GROUP)


def audio_tokens_for_samples(
    num_samples: int, sample_rate: int = SAMPLE_RATE, p: AudioParams = DEFAULT_PARAMS
) -> int:
    """Tokens of a mono waveform of ``num_samples`` samples at ``sample_rate`` Hz: exact for what
    ``decode_audio`` + ``log_mel`` produce from that many decoded samples."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    n = resampled_length(num_samples, sample_rate, p.sample_rate)
    return audio_num_tokens(p.num_frames(n)) if n > 0 else 0


def audio_tokens_for_seconds(
    seconds: float, sample_rate: int = SAMPLE_RATE, p: AudioParams = DEFAULT_PARAMS
) -> int:
    """Tokens of ``seconds`` of audio at ``sample_rate`` Hz (``round(seconds * sample_rate)``
    samples). From ``AudioMeta`` this is exact for PCM; compressed formats may decode a few ms
    longer (encoder delay), which moves the count only when it crosses a 0.16 s token boundary."""
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
    return audio_tokens_for_samples(round(seconds * sample_rate), sample_rate, p)
