"""Images for the MiMo-V2.5 vision tower, torch-free (the router counts tokens with it): header
reads, ``smart_resize`` and the token counts. Decoding and preprocessing (resize, normalize,
patchify, as torch ops on the encoder's device) are in ``media.pixels``.

``smart_resize`` follows the MiMo processor (vLLM vllm/transformers_utils/processors/mimo_v2_omni.py,
"ported from SGLang's MiMoVLProcessor", ``_smart_resize``). Errors the client caused are
``MediaError`` (answered with a 400).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


def open_image(data: bytes) -> Image.Image:
    """PIL's lazy image over ``data`` (nothing decoded yet). Raises MediaError as ``image_size``."""
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
    with open_image(data) as img:
        w, h = img.size
    if w <= 0 or h <= 0:
        raise MediaError(f"image has no pixels ({w}x{h})")
    return w, h
