"""The MiMo-V2.5 audio encoder: tokenizer vs an independent per-segment reference, the local
transformer vs transformers' Qwen2Model, token counts, batching invariance, hub weights."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2Model

from swaserve.config import ConfigError
from swaserve.media.audio import audio_num_tokens
from swaserve.model.audio import (
    AudioConfig,
    AudioEncoder,
    AudioWeightsError,
    audio_state_dict_from_hub,
    load_audio_encoder,
    random_audio_weights,
)
from swaserve.model.audio_tokenizer import AudioTokenizerConfig, TokenizerEncoder, _Plan

TOK = AudioTokenizerConfig(
    n_mels=128,
    d_model=32,
    avg_pooler=2,
    encoder_layers=4,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    encoder_skip_layer_id=2,
    encoder_attn_window_size=(3, 2),
    hybrid_attention=True,
    swa_per_block=2,
    num_quantizers=5,
    codebook_size=(16, 16, 8, 8, 8),
)
CFG = AudioConfig(
    speech_vocab_size=(17, 17, 9, 9),
    speech_zeroemb_idx=(16, 16, 8, 8),
    audio_channels=4,
    input_local_layers=2,
    input_local_dim=32,
    input_local_attn_heads=4,
    input_local_head_dim=8,
    input_local_intermediate_size=64,
    out_hidden_size=48,
    partial_rotary_factor=1.0,
    projection_layers=2,
    add_post_norm=True,
    audio_segment_size=64,  # small, so items cross segment boundaries
    tokenizer=TOK,
)


def _model(cfg: AudioConfig = CFG, seed: int = 0) -> AudioEncoder:
    main, tok = random_audio_weights(cfg, seed)
    model = AudioEncoder(cfg)
    model.load_state_dict(audio_state_dict_from_hub(main, tok, cfg), strict=True)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def model() -> AudioEncoder:
    return _model()


def _mels(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 128, generator=g) for n in lengths]


# --- an independent reference of the tokenizer: one segment at a time, the ports' structure ---


def _ref_attention(
    x: torch.Tensor, layer: torch.nn.Module, heads: int, window: tuple[int, int], theta: float
) -> torch.Tensor:
    a = layer.self_attn
    n, d = x.shape
    hd = d // heads
    q = (x @ a.q_proj.weight.T + a.q_proj.bias).view(n, heads, hd)
    k = (x @ a.k_proj.weight.T).view(n, heads, hd)
    v = (x @ a.v_proj.weight.T + a.v_proj.bias).view(n, heads, hd)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang).to(x.dtype)[:, None, :], torch.sin(ang).to(x.dtype)[:, None, :]

    def rot(t: torch.Tensor) -> torch.Tensor:  # NeoX halves: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
        x1, x2 = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    q, k = rot(q), rot(k)
    logits = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(hd)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    left, right = window
    allowed = ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = torch.einsum("hij,jhd->ihd", probs, v).reshape(n, d)
    return out @ a.out_proj.weight.T + a.out_proj.bias


def _ref_codes(tok: TokenizerEncoder, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment [L, n_mels] -> (features [L3, d], codes [L3, n_q])."""
    cfg = tok.cfg
    x = F.gelu(F.conv1d(mel.T[None], tok.conv1.weight, tok.conv1.bias, padding=1))
    x = F.gelu(F.conv1d(x, tok.conv2.weight, tok.conv2.bias, stride=cfg.stride_size, padding=1))[0].T
    skip = None
    for idx, layer in enumerate(tok.layers):
        full = cfg.hybrid_attention and idx % cfg.swa_per_block == cfg.swa_per_block - 1
        window = (-1, -1) if full else cfg.encoder_attn_window_size
        x = x + _ref_attention(
            layer.self_attn_layer_norm(x), layer, cfg.encoder_attention_heads, window, cfg.rope_theta
        )
        x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
        if idx == cfg.encoder_skip_layer_id - 1:
            skip = x.clone()
    x = tok.layer_norm(x + skip)
    p = cfg.avg_pooler
    x = F.pad(x.T[None], (0, -x.shape[0] % p))
    x = tok.down_sample_norm(F.gelu(F.conv1d(x, tok.down_sample_layer[0].weight, stride=p))[0].T)
    residual, codes = x.clone(), []
    for book in tok.codebooks:
        d2 = ((residual[:, None, :] - book[None, :, :]) ** 2).sum(-1)
        codes.append(d2.argmin(1))
        residual = residual - book[codes[-1]]
    return x, torch.stack(codes, 1)


def _plan(lengths: list[int], cfg: AudioTokenizerConfig = TOK) -> _Plan:
    return _Plan(cfg, lengths, torch.device("cpu"))


def test_tokenizer_equals_segment_reference(model: AudioEncoder) -> None:
    lengths = [1, 2, 7, 40, 64, 150]  # 150 = segments of 64, 64, 22
    mels = _mels(lengths)
    ours = model.tokenize(mels)
    tok64 = copy.deepcopy(model.tokenizer).double()
    worst = 0.0
    for mel, codes in zip(mels, ours, strict=True):
        segs = mel.split(CFG.audio_segment_size)
        ref = [_ref_codes(tok64, s.double()) for s in segs]
        assert torch.equal(codes, torch.cat([c for _, c in ref]))
        feats = model.tokenizer.features(mel, _plan([s.shape[0] for s in segs]))
        worst = max(worst, (feats.double() - torch.cat([f for f, _ in ref])).abs().max().item())
    assert worst <= 1e-5, worst  # measured 4.7e-6: fp32 vs a float64 reference, O(1) LayerNorm outputs


def test_windows_and_skip_matter(model: AudioEncoder) -> None:
    """Ablations: the window, the hybrid pattern and the skip each matter in the test config."""
    mel = _mels([60], seed=3)[0]
    base = model.tokenizer.features(mel, _plan([60]))
    for change in (
        {"hybrid_attention": False},
        {"encoder_attn_window_size": (-1, -1)},
        {"encoder_skip_layer_id": None},
    ):
        other = TokenizerEncoder(dataclasses.replace(TOK, **change), CFG.audio_channels)
        other.load_state_dict(model.tokenizer.state_dict())
        assert (
            other.features(mel, _plan([60], dataclasses.replace(TOK, **change))) - base
        ).abs().max() > 1e-3


def test_codes_have_margin(model: AudioEncoder) -> None:
    """The random codebooks keep every code far from a tie: float noise cannot flip one."""
    mels = _mels([150, 33])
    for mel in mels:
        segs = [s.shape[0] for s in mel.split(CFG.audio_segment_size)]
        r = model.tokenizer.features(mel, _plan(segs)).float()
        for book in model.tokenizer.codebooks:
            d2 = torch.cdist(r, book) ** 2
            two = d2.topk(2, largest=False).values
            assert (two[:, 1] - two[:, 0]).min() > 1e-3  # measured 7e-3; fp32 noise here is ~1e-6
            r = r - book[d2.argmin(1)]


# --- the local transformer against transformers' Qwen2Model ---


@pytest.mark.parametrize("full", [True, False])
def test_local_transformer_equals_qwen2model(full: bool) -> None:
    cfg = dataclasses.replace(CFG, input_full_attention=full)
    ours = _model(cfg).input_local_transformer
    hf = Qwen2Model(
        Qwen2Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=64,
            rope_theta=cfg.rope_theta,
            rms_norm_eps=1e-6,
            vocab_size=8,
            attn_implementation="sdpa",
        )
    ).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert missing == ["embed_tokens.weight"] and unexpected == []
    x = torch.randn(6, CFG.group_size, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(inputs_embeds=x, is_causal=not full).last_hidden_state  # as vLLM calls it
        causal = hf(inputs_embeds=x).last_hidden_state
    assert (ours(x) - ref).abs().max().item() <= 1e-5  # measured 0 (same SDPA kernel)
    if full:  # bidirectionality is visible: a causal run differs
        assert (ours(x) - causal).abs().max().item() > 1e-3


def test_encode_codes_equals_manual_pipeline(model: AudioEncoder) -> None:
    g = torch.Generator().manual_seed(7)
    codes = torch.stack([torch.randint(0, v, (10,), generator=g) for v in CFG.speech_vocab_size], 1)
    padded = torch.cat([codes, codes[-1:].expand(2, -1)]).view(3, 4, 4)  # last code repeated
    h = sum(model.speech_embeddings[c](padded[..., c]) for c in range(4))
    hf = Qwen2Model(Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, rope_theta=CFG.rope_theta, vocab_size=8))  # fmt: skip
    hf.load_state_dict(model.input_local_transformer.state_dict(), strict=False)
    with torch.no_grad():
        local = hf.eval()(inputs_embeds=h, is_causal=False).last_hidden_state
    ref = model.projection(local.reshape(3, -1))
    extra = torch.cat([codes, torch.zeros(10, 3, dtype=torch.long)], 1)  # n_vq > C: first C used
    (out,) = model.encode_codes([extra])
    assert out.shape == (3, 48) and (out - ref).abs().max().item() <= 1e-5


def test_encode_codes_rejects_bad_codes(model: AudioEncoder) -> None:
    ok = torch.zeros(5, 4, dtype=torch.long)
    for bad, msg in [
        (torch.zeros(5, 3, dtype=torch.long), "n_vq"),
        (torch.zeros(0, 4, dtype=torch.long), "T >= 1"),
        (ok.float(), "integers"),
        (ok + torch.tensor([0, 0, 9, 0]), "channel 2"),
        (ok - 1, "channel 0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            model.encode_codes([ok, bad])


# --- token counts and batching ---


@pytest.mark.parametrize("frames", [1, 2, 15, 16, 17, 63, 64, 65, 100, 101, 129, 257, 1000])
def test_output_lengths_follow_the_formula(model: AudioEncoder, frames: int) -> None:
    if frames > 300:  # the count only: a forward of 1000 frames is not needed to pin it
        assert CFG.num_tokens(frames) == audio_num_tokens(frames)
        return
    (out,) = model(_mels([frames]))
    assert out.shape[0] == CFG.num_tokens(frames) == audio_num_tokens(frames)


def test_fused_batch_equals_each_alone(model: AudioEncoder) -> None:
    lengths = [33, 150, 1, 64, 97, 150]
    mels = _mels(lengths, seed=11)
    fused_codes = model.tokenize(mels)
    fused = model(mels)
    worst = 0.0
    for mel, codes, out in zip(mels, fused_codes, fused, strict=True):
        assert torch.equal(model.tokenize([mel])[0], codes)
        worst = max(worst, (model([mel])[0] - out).abs().max().item())
    assert worst <= 1e-6, worst  # measured 2.5e-7 (BLAS blocking differs with the batch shape)


def test_bf16_runs_close_to_fp32(model: AudioEncoder) -> None:
    half = _model().to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    codes = torch.stack([torch.randint(0, 8, (40,), generator=g) for _ in range(4)], 1)
    (a,) = model.encode_codes([codes])
    (b,) = half.encode_codes([codes])
    assert b.dtype == torch.bfloat16
    assert ((a - b.float()).norm() / a.norm()).item() < 3e-2
    out = half(_mels([70]))
    assert out[0].shape == (CFG.num_tokens(70), 48) and out[0].dtype == torch.bfloat16


# --- config and hub weights ---


def test_config_round_trip_and_hub_forms() -> None:
    assert AudioConfig.from_hf(*CFG.to_hf()) == CFG
    main, tok = CFG.to_hf()
    main = {**main, "speech_vocab_size": "17", "speech_zeroemb_idx": [16, 16, 8, 8, 99], "unknown": 1}
    cfg = AudioConfig.from_hf(main, {**tok, "codebook_size": [16, 8], "decoder_layers": 8})
    assert cfg.speech_vocab_size == (17, 17, 17, 17) and cfg.speech_zeroemb_idx == (16, 16, 8, 8)
    assert cfg.tokenizer.codebook_size == (16, 8, 8, 8, 8)
    with pytest.raises(ConfigError, match="speech_vocab_size"):
        AudioConfig.from_hf({**main, "speech_vocab_size": "17-17"}, tok)
    with pytest.raises(ConfigError, match="ln_type"):
        AudioTokenizerConfig.from_hf({**tok, "ln_type": "RMSNorm"})
    with pytest.raises(ConfigError, match="codebook size 16 > speech_vocab_size 9"):
        AudioEncoder(dataclasses.replace(CFG, speech_vocab_size=(9, 17, 9, 9)))


def test_random_weights_are_deterministic_and_hub_shaped() -> None:
    main, tok = random_audio_weights(CFG, 3)
    main2, tok2 = random_audio_weights(CFG, 3)
    assert all(torch.equal(main[k], main2[k]) for k in main) and all(
        torch.equal(tok[k], tok2[k]) for k in tok
    )
    assert not torch.equal(
        random_audio_weights(CFG, 4)[0]["speech_embeddings.0.weight"], main["speech_embeddings.0.weight"]
    )
    assert "audio_encoder.input_local_transformer.layers.1.self_attn.q_proj.bias" in main
    assert "audio_encoder.projection.mlp.2.weight" in main and "speech_embeddings.3.weight" in main
    assert "encoder.quantizer.vq.layers.4._codebook.embed" in tok  # every RVQ level, 5 > 4 channels
    assert "encoder.down_sample_layer.0.weight" in tok and "encoder.layers.3.self_attn.k_proj.weight" in tok


def test_hub_loading_names_what_is_wrong() -> None:
    main, tok = random_audio_weights(CFG, 0)
    noise = {
        "model.layers.0.mlp.gate_proj.weight": torch.zeros(1),
        "audio_tokenizer.encoder.conv1.weight": torch.zeros(1),
    }
    extra_tok = {
        "decoder.layers.0.fc1.weight": torch.zeros(1),
        "encoder.quantizer.vq.layers.0._codebook.inited": torch.ones(1),
    }
    sd = audio_state_dict_from_hub({**main, **noise}, {**tok, **extra_tok}, CFG)
    assert set(sd) == set(AudioEncoder(CFG).state_dict())
    broken = dict(main)
    del broken["audio_encoder.projection.mlp.0.weight"]
    broken["audio_encoder.projection.bias"] = torch.zeros(48)
    broken["speech_embeddings.1.weight"] = torch.zeros(3, 32)
    with pytest.raises(AudioWeightsError) as err:
        audio_state_dict_from_hub(broken, tok, CFG)
    text = str(err.value)
    assert "missing 1: projection.mlp.0.weight" in text and "unexpected 1: projection.bias" in text
    assert "speech_embeddings.1.weight (3, 32) (want (17, 32))" in text
    del tok["encoder.conv1.weight"]
    with pytest.raises(AudioWeightsError, match=r"tokenizer\.conv1\.weight"):
        audio_state_dict_from_hub(main, tok, CFG)


def test_load_audio_encoder_from_a_checkpoint_dir(tmp_path, model: AudioEncoder) -> None:  # type: ignore[no-untyped-def]
    main, tok = random_audio_weights(CFG, 0)
    audio_config, tok_config = CFG.to_hf()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mimo_v2", "audio_config": audio_config}))
    save_file({**main, "model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "audio_tokenizer").mkdir()
    (tmp_path / "audio_tokenizer" / "config.json").write_text(json.dumps(tok_config))
    save_file(tok, str(tmp_path / "audio_tokenizer" / "model.safetensors"))
    loaded = load_audio_encoder(tmp_path)
    mels = _mels([50, 90])
    assert all(torch.equal(a, b) for a, b in zip(loaded(mels), model(mels), strict=True))
