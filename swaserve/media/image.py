"""Images for the MiMo-V2.5 vision tower: header reads for the router's token counts, guarded
decoding, and preprocessing (resize, normalize, patchify) as torch ops on the encoder's device.

Follows the MiMo processor (vLLM vllm/transformers_utils/processors/mimo_v2_omni.py, "ported from
SGLang's MiMoVLProcessor": ``_smart_resize``, ``_transform_single``, ``_flatten_visual``)::

    uint8 [3, H, W] -> float -> bilinear resize to smart_resize(H, W) (align_corners=False, no
    antialias) -> (x - mean) / std (ImageNet values on the 0..255 scale, not CLIP's)
    -> repeated to temporal_patch_size frames -> rows [t * gh * gw, C * T * P * P] in merge-unit
    order (t, gh/m, gw/m, m, m), each row (C, T, P, P) = the Conv3d kernel's layout

Errors the client caused are ``MediaError`` (answered with a 400); a caller's bug (a tensor of the
wrong dtype or shape) is a ``ValueError``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from swaserve.media import MediaError

# formats we let PIL parse (PIL has many more decoders; fewer is less attack surface). JPEG covers
# MPO, the multi-picture JPEG of many phone cameras (PIL opens those through the JPEG plugin).
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
MAX_ASPECT = 200


@dataclass(frozen=True)
class ImageParams:
    """Preprocessing parameters (part of an image's cache key).

    Attributes:
        patch_size, temporal_patch_size, merge_size: the ViT's (``vision_config``).
        min_pixels, max_pixels: bounds of the resized area (``processor_config.image_{min,max}_pixels``).
        mean, std: per RGB channel on the 0..255 scale.
    """

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 4 * 32 * 32
    max_pixels: int = 4096 * 32 * 32
    mean: tuple[float, float, float] = (123.675, 116.28, 103.53)
    std: tuple[float, float, float] = (58.395, 57.12, 57.375)

    def __post_init__(self) -> None:
        if min(self.patch_size, self.temporal_patch_size, self.merge_size, self.min_pixels) <= 0:
            raise ValueError(f"image params must be positive: {self}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError(f"mean and std need 3 channels (std > 0): {self.mean}, {self.std}")

    @property
    def factor(self) -> int:
        """Sides of a resized image are multiples of this: patch_size * merge_size."""
        return self.patch_size * self.merge_size

    @staticmethod
    def from_hf(processor_config: Mapping[str, Any], vision: Mapping[str, Any]) -> ImageParams:
        """From the hub config's ``processor_config`` and ``vision_config`` dicts; absent pixel bounds
        default to 4 and 4096 merge units, as the MiMo processor's ``from_hf_config``."""
        patch = int(vision.get("patch_size") or 16)
        merge = int(vision.get("spatial_merge_size") or 2)
        unit = patch * merge
        return ImageParams(
            patch_size=patch,
            temporal_patch_size=int(vision.get("temporal_patch_size") or 2),
            merge_size=merge,
            min_pixels=int(processor_config.get("image_min_pixels") or 4 * unit * unit),
            max_pixels=int(processor_config.get("image_max_pixels") or 4096 * unit * unit),
        )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area within [min_pixels, max_pixels] where the
    rounding allows, aspect ratio kept as well as it can be.

    The MiMo processor's version, which differs from transformers' qwen2_vl ``smart_resize``: a side
    under ``factor`` is first scaled up to ``factor`` (the other side in proportion, truncated), and
    only then is the aspect ratio checked, so a thin image (say 10 x 2100) passes; and the downscale
    branch does not clamp sides to >= factor.

    Raises:
        MediaError: an empty image, an aspect ratio over 200 (sides both >= factor), or one whose
            downscaled side would be 0 (where the MiMo processor would fail).
    """
    if height <= 0 or width <= 0:
        raise MediaError(f"image has no pixels ({width}x{height})")
    h, w = height, width
    if min(h, w) < factor:
        if h < w:
            h, w = factor, int(w * factor / h)
        else:
            h, w = int(h * factor / w), factor
    elif max(h, w) / min(h, w) > MAX_ASPECT:
        raise MediaError(
            f"image aspect ratio {max(h, w) / min(h, w):.1f} is over {MAX_ASPECT} ({width}x{height})"
        )
    h_bar, w_bar = round(h / factor) * factor, round(w / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        h_bar, w_bar = math.floor(h / beta / factor) * factor, math.floor(w / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        h_bar, w_bar = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    if h_bar < factor or w_bar < factor:
        most = max(1, max_pixels // (factor * factor))
        raise MediaError(
            f"image {width}x{height} is too thin for this model: its sides must stay >= {factor} pixels "
            f"within {max_pixels} pixels, so at most {most}:1; crop or pad it"
        )
    return h_bar, w_bar


def image_grid(height: int, width: int, p: ImageParams) -> tuple[int, int, int]:
    """(t, gh, gw) patches of an image of this size (t = 1: one temporal patch). MediaError as smart_resize."""
    h, w = smart_resize(height, width, p.factor, p.min_pixels, p.max_pixels)
    return 1, h // p.patch_size, w // p.patch_size


def image_num_tokens(height: int, width: int, p: ImageParams) -> int:
    """Placeholder tokens (= ViT output rows) of an image of this size."""
    t, gh, gw = image_grid(height, width, p)
    return t * gh * gw // p.merge_size**2


def _open(data: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except Image.DecompressionBombError:
        raise MediaError("the image is too large (its header declares over 179 million pixels)") from None
    except Image.UnidentifiedImageError:
        raise MediaError(f"not an image in a supported format ({', '.join(SUPPORTED_FORMATS)})") from None
    except Exception as e:  # PIL raises many kinds on malformed input
        raise MediaError(f"not a readable image ({', '.join(SUPPORTED_FORMATS)}): {e}") from None


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the header alone, nothing decoded.

    Raises:
        MediaError: not an image, an unsupported format, a corrupt header, or a size past PIL's
            decompression-bomb limit.
    """
    with _open(data) as img:
        w, h = img.size
    if w <= 0 or h <= 0:
        raise MediaError(f"image has no pixels ({w}x{h})")
    return w, h


def decode_image(data: bytes, max_source_pixels: int) -> torch.Tensor:
    """Decode to RGB uint8 [3, H, W] (the first frame of an animation).

    The declared size is checked before any pixel is decoded. Alpha (RGBA, LA, PA, palette with
    transparency) is composited over white, as the MiMo processor does for RGBA; other modes go
    through PIL's ``convert("RGB")``, except 16-bit grayscale, scaled to 8 bits (PIL would clip it).

    Raises:
        MediaError: as ``image_size``; more than ``max_source_pixels`` pixels; corrupt or truncated
            data (PIL's truncated-image tolerance stays off).
    """
    with _open(data) as img:
        w, h = img.size
        if w <= 0 or h <= 0:
            raise MediaError(f"image has no pixels ({w}x{h})")
        if w * h > max_source_pixels:
            raise MediaError(f"image is {w}x{h} = {w * h} pixels, over the limit of {max_source_pixels}")
        try:
            img.load()
            arr = np.array(_to_rgb(img), dtype=np.uint8)
        except Exception as e:
            raise MediaError(f"corrupt or truncated {img.format} image: {type(e).__name__}: {e}") from None
    if arr.shape != (h, w, 3):
        raise MediaError(f"decoded {img.format} image has shape {arr.shape}, expected ({h}, {w}, 3)")
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode.startswith("I;16"):
        return Image.fromarray((np.asarray(img, dtype=np.uint32) >> 8).astype(np.uint8), "L").convert("RGB")
    if img.mode in ("LA", "PA", "La", "RGBa") or (img.mode == "P" and "transparency" in img.info):
        img = img.convert("RGBA")
    if img.mode == "RGBA":
        white = Image.new("RGB", img.size, (255, 255, 255))
        white.paste(img, mask=img.getchannel("A"))
        return white
    return img.convert("RGB")


def _check_frames(x: torch.Tensor, dims: int) -> None:
    if x.dtype != torch.uint8 or x.dim() != dims or x.shape[-3] != 3 or min(x.shape) == 0:
        want = "[3, H, W]" if dims == 3 else "[n, 3, H, W]"
        raise ValueError(f"expected uint8 {want} RGB, got {x.dtype} {tuple(x.shape)}")


def _resize_normalize(
    frames: torch.Tensor, size: tuple[int, int], p: ImageParams, device: Any
) -> torch.Tensor:
    """uint8 [n, 3, H, W] -> float32 [n, 3, h, w] on ``device``, resized and normalized."""
    x = frames.to(device).float()
    if tuple(x.shape[-2:]) != size:  # bilinear to the same size is the identity: skip it
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=False)
    mean = torch.tensor(p.mean, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(p.std, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def patchify(x: torch.Tensor, p: ImageParams) -> torch.Tensor:
    """[n, C, H, W] (n a multiple of T, H and W of patch * merge) -> [n/T * gh * gw, C * T * P * P],
    rows in merge-unit order (t, gh/m, gw/m, m, m), each row (C, T, P, P)."""
    n, c, h, w = x.shape
    t, pp, m = p.temporal_patch_size, p.patch_size, p.merge_size
    gt, gh, gw = n // t, h // pp, w // pp
    x = x.reshape(gt, t, c, gh // m, m, pp, gw // m, m, pp).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * t * pp * pp)


def preprocess_images(
    images: Sequence[torch.Tensor],
    p: ImageParams,
    device: torch.device | str | None = None,
    sizes: Sequence[tuple[int, int] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (uint8 [3, H, W] RGB each) -> the ViT's fused input; ``sizes[i]`` (h, w, multiples
    of the factor) replaces image i's ``smart_resize`` target (a request's ``detail: low``).

    Returns:
        (patches float32 [sum of t*gh*gw, 3*T*P*P] on ``device``, grid_thw int64 [items, 3] on
        ``device``), items in order.

    Raises:
        MediaError: an image smart_resize refuses. ValueError: not uint8 [3, H, W].
    """
    if not images:
        raise ValueError("no images")
    dev = torch.device(device) if device is not None else images[0].device
    rows, grids = [], []
    for i, img in enumerate(images):
        _check_frames(img, 3)
        size = sizes[i] if sizes is not None else None
        if size is None:
            h, w = smart_resize(img.shape[1], img.shape[2], p.factor, p.min_pixels, p.max_pixels)
        elif size[0] > 0 and size[1] > 0 and not size[0] % p.factor and not size[1] % p.factor:
            h, w = size
        else:
            raise ValueError(f"image size {size} must be positive multiples of {p.factor}")
        x = _resize_normalize(img[None], (h, w), p, dev)
        rows.append(patchify(x.expand(p.temporal_patch_size, -1, -1, -1), p))
        grids.append((1, h // p.patch_size, w // p.patch_size))
    return torch.cat(rows), torch.tensor(grids, dtype=torch.int64, device=dev)


def preprocess_frames(
    frames: torch.Tensor, size: tuple[int, int], p: ImageParams, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Video frames (uint8 [n, 3, H, W], n a multiple of temporal_patch_size) resized to ``size``
    (h, w: multiples of patch * merge, chosen by the caller's per-frame pixel budget); frames
    2k and 2k + 1 form temporal patch k, attended as one sequence by the ViT.

    Returns:
        (patches float32 [n/T * h/P * w/P, 3*T*P*P], grid_thw int64 [[n/T, h/P, w/P]]) on ``device``.

    Raises:
        ValueError: bad dtype/shape, n not a multiple of T, or a size not a multiple of the factor.
    """
    _check_frames(frames, 4)
    n = frames.shape[0]
    if n % p.temporal_patch_size:
        raise ValueError(f"{n} frames: need a multiple of {p.temporal_patch_size} (pad with the last frame)")
    h, w = size
    if h <= 0 or w <= 0 or h % p.factor or w % p.factor:
        raise ValueError(f"frame size {size} must be positive multiples of {p.factor}")
    dev = torch.device(device) if device is not None else frames.device
    x = _resize_normalize(frames, (h, w), p, dev)
    grid = torch.tensor([[n // p.temporal_patch_size, h // p.patch_size, w // p.patch_size]], device=dev)
    return patchify(x, p), grid
