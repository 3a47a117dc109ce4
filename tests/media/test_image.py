"""Image geometry, decoding and preprocessing (swaserve.media.image, swaserve.media.pixels): smart_resize against transformers'
qwen2_vl where the two agree and pinned where MiMo's differs, the resize/normalize/patchify pipeline
against an explicit numpy reference, and bad images refused with a message."""

from __future__ import annotations

import io
import math
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from swaserve.media import MediaError
from swaserve.media.image import ImageParams, image_grid, image_num_tokens, image_size, smart_resize
from swaserve.media.pixels import decode_image, preprocess_frames, preprocess_images

P = ImageParams()
SMALL = ImageParams(patch_size=4, merge_size=2, min_pixels=4 * 8 * 8, max_pixels=64 * 8 * 8)
MAX_SRC = 64 * 1024 * 1024
# torch computes bilinear source coordinates in float32 (a ~1e-6 weight error on 0..255 pixel
# steps): measured <= 1.2e-5 after normalization against the float64 reference; a half-pixel
# mistake (align_corners, a missing -0.5) would be ~1
BILINEAR_TOL = 5e-5


def _encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares this size (valid CRCs) and that has no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


# --- (d) smart_resize and token counts ----------------------------------------------------------


def test_smart_resize_equals_transformers_where_they_agree() -> None:
    """Sides >= factor, aspect <= 200, no side clamped: both implementations give the same size
    (transformers' qwen2_vl smart_resize, the pillow image processor's module: no torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize

    rng = np.random.default_rng(0)
    cases = 0
    for min_px, max_px in [
        (P.min_pixels, P.max_pixels),
        (64 * 32 * 32, 256 * 32 * 32),
        (4 * 32 * 32, 16 * 32 * 32),
    ]:
        for _ in range(300):
            h, w = (int(v) for v in rng.integers(32, 6000, 2))
            if math.sqrt(max_px * min(h, w) / max(h, w)) < 32:  # the downscaled short side < factor:
                continue  # transformers clamps it, MiMo refuses (pinned below)
            assert smart_resize(h, w, 32, min_px, max_px) == hf_resize(h, w, 32, min_px, max_px), (h, w)
            cases += 1
    assert cases > 500


@pytest.mark.parametrize(
    ("hw", "want", "hf"),
    [
        ((10, 100), (32, 320), (32, 224)),  # short side scaled up to 32 first, the other truncated
        ((100, 10), (320, 32), (224, 32)),
        ((10, 36), (32, 128), (64, 128)),
        ((10, 2100), (32, 6720), None),  # aspect 210 passes after the upscale; transformers refuses
    ],
)
def test_smart_resize_mimo_branches(
    hw: tuple[int, int], want: tuple[int, int], hf: tuple[int, int] | None
) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize

    assert smart_resize(*hw, 32, P.min_pixels, P.max_pixels) == want
    if hf is None:
        with pytest.raises(ValueError):
            hf_resize(*hw, 32, P.min_pixels, P.max_pixels)
    else:
        assert hf_resize(*hw, 32, P.min_pixels, P.max_pixels) == hf


def test_smart_resize_refusals() -> None:
    with pytest.raises(MediaError, match=r"aspect ratio 203\.1 is over 200"):
        smart_resize(32, 6500, 32, P.min_pixels, P.max_pixels)
    assert smart_resize(32, 6400, 32, P.min_pixels, P.max_pixels) == (32, 6400)  # exactly 200: kept
    # no clamp on downscale: the short side rounds to 0 where transformers would clamp it to 32
    with pytest.raises(MediaError, match="too thin"):
        smart_resize(40, 8000, 32, 4 * 32 * 32, 64 * 32 * 32)
    with pytest.raises(MediaError, match="no pixels"):
        smart_resize(0, 10, 32, P.min_pixels, P.max_pixels)


def test_grids_and_token_counts() -> None:
    assert image_grid(768, 1024, P) == (1, 48, 64) and image_num_tokens(768, 1024, P) == 768
    assert image_num_tokens(10, 10, P) == 4  # min_pixels: 4 merge units
    assert image_num_tokens(1, 1, P) == 4
    big = image_num_tokens(6000, 8000, P)
    assert 4000 < big <= 4096  # max_pixels: at most 4096 tokens
    assert image_num_tokens(64, 64, SMALL) == (64 // 4) ** 2 // 4
    for h, w in [(333, 517), (1080, 1920), (50, 5000)]:
        t, gh, gw = image_grid(h, w, P)
        assert gh % 2 == gw % 2 == 0 and image_num_tokens(h, w, P) == t * gh * gw // 4


def test_params_from_hub_configs() -> None:
    assert ImageParams.from_hf({}, {"patch_size": 16, "spatial_merge_size": 2}) == P
    p = ImageParams.from_hf({"image_min_pixels": 1024, "image_max_pixels": 2048 * 784}, {"patch_size": 14})
    assert (p.patch_size, p.factor, p.min_pixels, p.max_pixels) == (14, 28, 1024, 2048 * 784)
    with pytest.raises(ValueError, match="min_pixels"):
        ImageParams(min_pixels=10, max_pixels=5)


# --- (d) resize + normalize + patchify against numpy ---------------------------------------------


def _np_bilinear(img: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """[C, H, W] float64 -> [C, oh, ow]: half-pixel centers (align_corners=False), no antialias,
    source coordinates below 0 clamped to 0, as torch's upsample_bilinear2d."""
    c, h, w = img.shape
    out = np.zeros((c, oh, ow))
    for y in range(oh):
        sy = max((y + 0.5) * h / oh - 0.5, 0.0)
        y0 = int(sy)
        y1, ly = min(y0 + 1, h - 1), sy - y0
        for x in range(ow):
            sx = max((x + 0.5) * w / ow - 0.5, 0.0)
            x0 = int(sx)
            x1, lx = min(x0 + 1, w - 1), sx - x0
            top = img[:, y0, x0] * (1 - lx) + img[:, y0, x1] * lx
            bottom = img[:, y1, x0] * (1 - lx) + img[:, y1, x1] * lx
            out[:, y, x] = top * (1 - ly) + bottom * ly
    return out


def _np_patches(frames: np.ndarray, p: ImageParams) -> np.ndarray:
    """[n, C, h, w] normalized frames -> rows by explicit loops: for t, block row, block col, mh, mw
    one row of frames[2t + tt, c, y * P + py, x * P + px] for c, tt, py, px."""
    n, _, h, w = frames.shape
    pp, m, tp = p.patch_size, p.merge_size, p.temporal_patch_size
    rows = []
    for t in range(n // tp):
        for bh in range(h // pp // m):
            for bw in range(w // pp // m):
                for mh in range(m):
                    for mw in range(m):
                        y, x = bh * m + mh, bw * m + mw
                        cell = frames[t * tp : (t + 1) * tp, :, y * pp : (y + 1) * pp, x * pp : (x + 1) * pp]
                        rows.append(cell.transpose(1, 0, 2, 3).reshape(-1))  # (c, tt, py, px)
    return np.stack(rows)


def _np_normalize(x: np.ndarray, p: ImageParams) -> np.ndarray:
    return (x - np.array(p.mean)[:, None, None]) / np.array(p.std)[:, None, None]


@pytest.mark.parametrize(("p", "hw"), [(SMALL, (37, 53)), (SMALL, (90, 70)), (P, (70, 50)), (P, (64, 96))])
def test_preprocess_equals_numpy_reference(p: ImageParams, hw: tuple[int, int]) -> None:
    src = _rgb(*hw).transpose(2, 0, 1)
    patches, grid = preprocess_images([torch.from_numpy(src.copy())], p, device="cpu")
    oh, ow = smart_resize(*hw, p.factor, p.min_pixels, p.max_pixels)
    assert grid.tolist() == [[1, oh // p.patch_size, ow // p.patch_size]] and grid.dtype == torch.int64
    frame = _np_normalize(_np_bilinear(src.astype(np.float64), oh, ow), p)
    want = _np_patches(np.stack([frame] * p.temporal_patch_size), p)
    assert patches.dtype == torch.float32 and patches.shape == want.shape
    assert np.abs(patches.numpy() - want).max() <= BILINEAR_TOL
    if (oh, ow) == hw:  # no resize: exactly the normalized pixels
        exact = (torch.from_numpy(src).float() - torch.tensor(p.mean).view(3, 1, 1)) / torch.tensor(
            p.std
        ).view(3, 1, 1)
        assert torch.equal(patches, torch.from_numpy(_np_patches(np.stack([exact.numpy()] * 2), p)))


def test_two_images_fuse_in_order() -> None:
    a, b = (
        torch.from_numpy(_rgb(*hw, seed=i).transpose(2, 0, 1).copy())
        for i, hw in enumerate([(40, 56), (90, 70)])
    )
    fused, grid = preprocess_images([a, b], SMALL)
    pa, ga = preprocess_images([a], SMALL)
    pb, gb = preprocess_images([b], SMALL)
    assert torch.equal(fused, torch.cat([pa, pb])) and torch.equal(grid, torch.cat([ga, gb]))
    assert fused.shape[0] == int(grid.prod(-1).sum())


def test_video_frames_pair_into_temporal_patches() -> None:
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (4, 3, 30, 44), dtype=np.uint8)
    patches, grid = preprocess_frames(torch.from_numpy(frames), (32, 48), SMALL)
    assert grid.tolist() == [[2, 8, 12]]
    resized = np.stack([_np_normalize(_np_bilinear(f.astype(np.float64), 32, 48), SMALL) for f in frames])
    assert np.abs(patches.numpy() - _np_patches(resized, SMALL)).max() <= BILINEAR_TOL
    with pytest.raises(ValueError, match="multiple of 2"):
        preprocess_frames(torch.from_numpy(frames[:3]), (32, 48), SMALL)
    with pytest.raises(ValueError, match="multiples of 8"):
        preprocess_frames(torch.from_numpy(frames), (30, 48), SMALL)


def test_preprocess_rejects_wrong_tensors() -> None:
    with pytest.raises(ValueError, match="uint8"):
        preprocess_images([torch.zeros(3, 8, 8)], SMALL)
    with pytest.raises(ValueError, match="uint8"):
        preprocess_images([torch.zeros(8, 8, 3, dtype=torch.uint8)], SMALL)
    with pytest.raises(MediaError, match="aspect"):
        preprocess_images([torch.zeros(3, 8, 2000, dtype=torch.uint8)], SMALL)


# --- decoding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "WEBP", "TIFF"])
def test_lossless_formats_decode_exactly(fmt: str) -> None:
    arr = _rgb(21, 34)
    data = _encode(Image.fromarray(arr), fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    assert image_size(data) == (34, 21)
    out = decode_image(data, MAX_SRC)
    assert out.dtype == torch.uint8 and torch.equal(out, torch.from_numpy(arr).permute(2, 0, 1))


def test_jpeg_decodes_close() -> None:
    arr = np.full((16, 24, 3), (200, 40, 90), dtype=np.uint8)
    data = _encode(Image.fromarray(arr), "JPEG", quality=95)
    assert image_size(data) == (24, 16)
    out = decode_image(data, MAX_SRC)
    assert (
        out.shape == (3, 16, 24) and (out.int() - torch.tensor([200, 40, 90]).view(3, 1, 1)).abs().max() <= 4
    )


def test_modes_convert_to_rgb() -> None:
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)  # opaque: kept; the rest transparent: white
    out = decode_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG"), MAX_SRC)
    assert out[:, 0, 0].tolist() == [10, 20, 30] and out[:, 1, 1].tolist() == [255, 255, 255]
    gray = decode_image(_encode(Image.new("L", (3, 2), 100), "PNG"), MAX_SRC)
    assert gray.shape == (3, 2, 3) and gray.unique().tolist() == [100]
    pal = Image.new("P", (2, 2), 1)
    pal.putpalette([0, 0, 0, 7, 8, 9] + [0] * 762)
    assert decode_image(_encode(pal, "PNG"), MAX_SRC)[:, 0, 0].tolist() == [7, 8, 9]
    pal.info["transparency"] = 1
    assert decode_image(_encode(pal, "PNG", transparency=1), MAX_SRC)[:, 0, 0].tolist() == [255, 255, 255]
    la = Image.new("LA", (2, 2), (50, 0))
    assert decode_image(_encode(la, "PNG"), MAX_SRC)[:, 0, 0].tolist() == [255, 255, 255]
    cmyk = decode_image(_encode(Image.new("CMYK", (2, 2), (0, 0, 0, 0)), "JPEG"), MAX_SRC)
    assert cmyk.shape == (3, 2, 2) and cmyk.min() >= 250  # no ink: white
    deep = Image.fromarray(np.full((2, 2), 0x8000, dtype=np.uint16))
    assert decode_image(_encode(deep, "PNG"), MAX_SRC).unique().tolist() == [128]  # scaled, not clipped


# --- (e) bad images ------------------------------------------------------------------------------


def test_corrupt_png_is_refused_on_decode() -> None:
    data = bytearray(_encode(Image.fromarray(_rgb(40, 56)), "PNG"))
    at = data.index(b"IDAT") + 10
    data[at : at + 30] = bytes(b ^ 0xFF for b in data[at : at + 30])
    assert image_size(bytes(data)) == (56, 40)  # the header is intact: the cheap read cannot tell
    with pytest.raises(MediaError, match="corrupt or truncated PNG image"):
        decode_image(bytes(data), MAX_SRC)


def test_truncated_jpeg_is_refused() -> None:
    data = _encode(Image.fromarray(_rgb(40, 56)), "JPEG", quality=90)
    with pytest.raises(MediaError, match="truncated"):
        decode_image(data[: len(data) // 2], MAX_SRC)


@pytest.mark.parametrize(
    "data", [b"hello, not an image", b"", b"\x89PNG\r\n\x1a\n\x00\x00"], ids=["text", "empty", "png-magic"]
)
def test_non_images_are_refused(data: bytes) -> None:
    with pytest.raises(MediaError, match="not an image in a supported format"):
        image_size(data)
    with pytest.raises(MediaError, match="not an image in a supported format"):
        decode_image(data, MAX_SRC)


def test_unsupported_format_is_refused() -> None:
    data = _encode(Image.fromarray(_rgb(8, 8)), "PCX")  # PIL reads PCX; we do not let it
    with pytest.raises(MediaError, match=r"not an image in a supported format \(PNG, JPEG"):
        image_size(data)


def test_huge_declared_sizes_are_refused_before_decoding() -> None:
    data = _png_header_only(5000, 5000)
    assert image_size(data) == (5000, 5000)  # the router may still count it (and refuse by its limit)
    with pytest.raises(MediaError, match="5000x5000 = 25000000 pixels, over the limit of 16777216"):
        decode_image(data, 4096 * 4096)
    bomb = _png_header_only(100_000, 100_000)
    with pytest.raises(MediaError, match="too large"):
        image_size(bomb)
    with pytest.raises(MediaError, match="too large"):
        decode_image(bomb, 10**12)
