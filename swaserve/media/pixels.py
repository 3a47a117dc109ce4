"""Image and video-frame pixels for the MiMo-V2.5 vision tower: guarded decoding of images to
uint8 tensors, and preprocessing (resize, normalize, patchify) as torch ops on the encoder's device.

Follows the MiMo processor (vLLM vllm/transformers_utils/processors/mimo_v2_omni.py, "ported from
SGLang's MiMoVLProcessor": ``_smart_resize``, ``_transform_single``, ``_flatten_visual``)::

    uint8 [3, H, W] -> float -> bilinear resize to smart_resize(H, W) (align_corners=False, no
    antialias) -> (x - mean) / std (ImageNet values on the 0..255 scale, not CLIP's)
    -> repeated to temporal_patch_size frames -> rows [t * gh * gw, C * T * P * P] in merge-unit
    order (t, gh/m, gw/m, m, m), each row (C, T, P, P) = the Conv3d kernel's layout

Sizes and token counts are ``media.image``'s (torch-free). Errors the client caused are
``MediaError`` (answered with a 400); a caller's bug (a tensor of the wrong dtype or shape) is a
``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from swaserve.media import MediaError
from swaserve.media.image import ImageParams, open_image, smart_resize


def decode_image(data: bytes, max_source_pixels: int) -> torch.Tensor:
    """Decode to RGB uint8 [3, H, W] (the first frame of an animation).

    The declared size is checked before any pixel is decoded. Alpha (RGBA, LA, PA, palette with
    transparency) is composited over white, as the MiMo processor does for RGBA; other modes go
    through PIL's ``convert("RGB")``, except 16-bit grayscale, scaled to 8 bits (PIL would clip it).

    Raises:
        MediaError: as ``image_size``; more than ``max_source_pixels`` pixels; corrupt or truncated
            data (PIL's truncated-image tolerance stays off).
    """
    with open_image(data) as img:
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
