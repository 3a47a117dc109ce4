"""Tests for the random MiMo-V2 checkpoint maker (swaserve.model.checkpoint)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import AutoTokenizer, MiMoV2FlashForCausalLM

from swaserve.config import FULL, SWA, ModelConfig
from swaserve.model import checkpoint as ck
from swaserve.model import hub_format


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ck.make_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tiny_hf(tiny: Path) -> MiMoV2FlashForCausalLM:
    return MiMoV2FlashForCausalLM.from_pretrained(tiny).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny: Path):
    return AutoTokenizer.from_pretrained(tiny)


def _keys_and_dtypes(model_dir: Path) -> dict[str, torch.dtype]:
    return {k: t.dtype for k, t in hub_format.load_state_dict(model_dir).items()}


def test_tiny_shape_and_files(tiny: Path) -> None:
    files = sorted(p.name for p in tiny.iterdir())
    assert files == [
        "audio.safetensors",
        "audio_tokenizer",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "visual.safetensors",
    ]
    mc = ModelConfig.from_pretrained(tiny)
    assert mc.layer_types == (FULL, SWA, SWA, SWA, SWA, FULL, SWA, SWA)
    assert mc.mlp_types == ("dense",) + ("sparse",) * 7
    assert (mc.sliding_window, mc.window) == (9, 8)
    assert (mc.full.num_kv_heads, mc.swa.num_kv_heads) == (1, 2)
    assert (mc.full.has_sinks, mc.swa.has_sinks) == (False, True)
    assert (mc.vocab_size, mc.hidden_size, mc.n_routed_experts, mc.num_experts_per_tok) == (512, 64, 8, 2)
    assert (mc.n_group, mc.topk_group, mc.routed_scaling_factor, mc.value_scale) == (2, 1, 1.5, 0.707)
    assert mc.eos_token_ids == (ck.IM_END_ID, ck.ENDOFTEXT_ID)
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ck.IM_END_ID, ck.ENDOFTEXT_ID]
    assert gen["pad_token_id"] == ck.ENDOFTEXT_ID


def test_saved_key_layout_is_the_hub_layout(tiny: Path) -> None:
    dt = _keys_and_dtypes(tiny)
    assert "model.layers.1.self_attn.attention_sink_bias" in dt
    assert "model.layers.0.self_attn.attention_sink_bias" not in dt  # full layers have no sinks
    assert "model.layers.5.self_attn.attention_sink_bias" not in dt
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.7.mlp.experts.{e}.{proj}.weight" in dt
    assert not any("gate_up_proj" in k or k.endswith("self_attn.sinks") for k in dt)
    assert dt["model.layers.1.mlp.gate.weight"] == torch.float32
    assert dt["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32
    assert "lm_head.weight" in dt  # untied


def test_transformers_loads_tiny_and_matches_the_built_model(tiny: Path, tiny_hf) -> None:
    ref = ck.build_model("tiny", seed=0)
    ids = torch.randint(0, 512, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = tiny_hf(ids).logits, ref(ids).logits
    assert got.shape == (2, 23, 512)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert tiny_hf.model.layers[1].self_attn.k_proj.weight.shape == (2 * 32, 64)  # SWA: 2 kv heads
    assert tiny_hf.model.layers[0].self_attn.k_proj.weight.shape == (32, 64)


def test_logit_details_are_non_trivial(tiny: Path, tiny_hf) -> None:
    sd = hub_format.load_state_dict(tiny)
    sinks = [t for k, t in sd.items() if k.endswith("attention_sink_bias")]
    biases = [t for k, t in sd.items() if k.endswith("e_score_correction_bias")]
    norms = [t for k, t in sd.items() if k.endswith("norm.weight")]
    assert len(sinks) == 6 and len(biases) == 7 and len(norms) == 17
    assert all((s != 0).all() and s.std() > 0.2 for s in sinks)
    assert all((b != 0).all() and b.abs().max() <= 0.1 and b.std() > 0.02 for b in biases)
    assert all(not torch.equal(n, torch.ones_like(n)) for n in norms)
    # The correction bias changes which experts are picked for some tokens.
    router = tiny_hf.model.layers[3].mlp.gate
    h = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, _, with_bias = router(h)
        saved = router.e_score_correction_bias.clone()
        router.e_score_correction_bias.zero_()
        try:
            _, _, without_bias = router(h)
        finally:
            router.e_score_correction_bias.copy_(saved)
    changed = (with_bias.sort(-1).values != without_bias.sort(-1).values).any(-1).float().mean()
    assert 0.02 < changed < 0.9


def test_greedy_generation_is_not_degenerate(tiny_hf) -> None:
    g = torch.Generator().manual_seed(7)
    distinct = []
    for _ in range(4):
        prompt = torch.randint(3, 512, (1, 12), generator=g)
        with torch.no_grad():
            out = tiny_hf.generate(
                prompt,
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        distinct.append(len(set(out[0, 12:].tolist())))
    assert sum(d >= 16 for d in distinct) >= 3, distinct
    with torch.no_grad():
        logp = tiny_hf(torch.randint(3, 512, (1, 30), generator=g)).logits[0].log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    assert entropy.mean() < 0.8 * torch.log(torch.tensor(512.0))  # far from uniform


def test_deterministic_in_seed(tiny: Path, tmp_path: Path) -> None:
    again = ck.make_checkpoint("tiny", tmp_path / "again", seed=0)
    other = ck.make_checkpoint("tiny", tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_existing_output_dir(tiny: Path, tmp_path: Path) -> None:
    target = tmp_path / "t"
    target.mkdir()  # an empty dir is fine
    ck.make_checkpoint("tiny", target)
    with pytest.raises(FileExistsError):
        ck.make_checkpoint("tiny", target, seed=1)
    assert (target / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    ck.make_checkpoint("tiny", target, seed=1, overwrite=True)
    assert (target / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    with pytest.raises(ValueError, match="unknown preset"):
        ck.make_checkpoint("huge", tmp_path / "h")


def test_tokenizer_special_tokens(tokenizer) -> None:
    assert len(tokenizer) == 512
    assert tokenizer.convert_tokens_to_ids([ck.ENDOFTEXT, ck.IM_START, ck.IM_END]) == [0, 1, 2]
    assert tokenizer.eos_token == ck.IM_END and tokenizer.eos_token_id == ck.IM_END_ID
    assert tokenizer.pad_token_id == ck.ENDOFTEXT_ID
    assert tokenizer.encode("hello", add_special_tokens=True) == tokenizer.encode(
        "hello", add_special_tokens=False
    )
    # trained on real text: common words are single tokens, so text compresses well below 1 token/byte
    text = "\n".join(json.loads(line)["content"] for line in ck.CORPUS_PATH.read_text().splitlines()[:50])
    assert len(tokenizer.encode(text)) < 0.6 * len(text.encode())


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=80))
def test_tokenizer_round_trips_any_text(tokenizer, s: str) -> None:
    ids = tokenizer.encode(s, add_special_tokens=False)
    assert all(0 <= i < 512 for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == s


def test_tokenizer_round_trips_fixed_examples(tokenizer) -> None:
    for s in [
        "",
        " ",
        "  leading and trailing  ",
        "tabs\tand\r\nnewlines\n\n",
        "naïve café 東京 😀🚀",
        "def f(x):\n    return x ** 2  # comment",
        f"a{ck.IM_END}b{ck.ENDOFTEXT}",
    ]:
        assert tokenizer.decode(tokenizer.encode(s)) == s


def test_chat_template(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "content": "rain"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "get", "arguments": {"city": "Oslo"}}</tool_call>'
        "<|im_end|>\n<|im_start|>tool\nrain<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert no_prompt.endswith("Weather?<|im_end|>\n")
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    with_tools = tokenizer.apply_chat_template(messages[:2], tools=tools, tokenize=False)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n")
    assert '"name": "get"' in with_tools and with_tools.count("<|im_start|>system") == 1
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == ck.IM_START_ID and ids.count(ck.IM_END_ID) == 4 and ids.count(ck.IM_START_ID) == 5


def test_hub_style_config(tiny: Path, tmp_path: Path) -> None:
    hub = hub_format.to_hub_style(tiny, tmp_path / "hub")
    c = json.loads((hub / "config.json").read_text())
    for gone in ("layer_types", "mlp_layer_types", "rope_parameters", "sliding_window", "rms_norm_eps"):
        assert gone not in c
    assert c["hybrid_layer_pattern"] == [0, 1, 1, 1, 1, 0, 1, 1]
    assert c["moe_layer_freq"] == [0, 1, 1, 1, 1, 1, 1, 1]
    assert (c["sliding_window_size"], c["swa_num_key_value_heads"], c["num_key_value_heads"]) == (8, 2, 1)
    assert (c["rope_theta"], c["swa_rope_theta"], c["partial_rotary_factor"]) == (5e6, 1e4, 0.334)
    assert (c["add_swa_attention_sink_bias"], c["add_full_attention_sink_bias"]) == (True, False)
    assert (c["scoring_func"], c["topk_method"], c["layernorm_epsilon"]) == ("sigmoid", "noaux_tc", 1e-5)
    assert ModelConfig.from_pretrained(hub) == ModelConfig.from_pretrained(tiny)
    assert (hub / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    # transformers reads the hub spelling too (sliding_window_size) and gives the same logits.
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        a = MiMoV2FlashForCausalLM.from_pretrained(hub)(ids).logits
        b = MiMoV2FlashForCausalLM.from_pretrained(tiny)(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("block", [(24, 40), (128, 128)])
def test_fp8_checkpoint(tiny: Path, tmp_path: Path, block: tuple[int, int]) -> None:
    fp8 = hub_format.quantize_fp8(tiny, tmp_path / "fp8", block=block)
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (fp8 / "model.safetensors").exists()
    total = 0
    for shard in shards:
        with safe_open(str(fp8 / shard), framework="pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == shard}
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys)
    assert index["metadata"]["total_size"] == total
    q = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert q == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    mc = ModelConfig.from_pretrained(fp8)
    assert mc == ModelConfig.from_pretrained(tiny) and mc.quantization == q
    assert AutoTokenizer.from_pretrained(fp8).encode("hi there") == AutoTokenizer.from_pretrained(
        tiny
    ).encode("hi there")

    ref, sd = hub_format.load_state_dict(tiny), hub_format.load_state_dict(fp8)
    bm, bn = block
    fp8_names = {k for k in ref if hub_format.is_fp8_weight(k)}
    assert len(fp8_names) == 8 * 4 + 3 + 7 * 8 * 3  # attention + dense MLP + experts
    assert set(sd) == set(ref) | {k + "_scale_inv" for k in fp8_names}
    for k, w in ref.items():
        if k not in fp8_names:
            assert sd[k].dtype == w.dtype and torch.equal(sd[k], w), k  # router, norms, sinks, embeddings
            continue
        qw, s = sd[k], sd[k + "_scale_inv"]
        rows, cols = w.shape
        assert qw.dtype == torch.float8_e4m3fn and qw.shape == w.shape
        assert s.dtype == torch.float32 and s.shape == (-(-rows // bm), -(-cols // bn))
        assert torch.equal(s[-1, -1], w[(s.shape[0] - 1) * bm :, (s.shape[1] - 1) * bn :].abs().max() / 448)
        assert torch.equal(s[0, 0], w[:bm, :bn].abs().max() / 448)
    deq = hub_format.dequantize_fp8_state_dict(sd, block)
    assert set(deq) == set(ref)
    for k in fp8_names:
        w, d = ref[k], deq[k]
        scale = (
            sd[k + "_scale_inv"].repeat_interleave(bm, 0).repeat_interleave(bn, 1)[: w.shape[0], : w.shape[1]]
        )
        # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4; subnormals: absolute 2^-10 * scale.
        bound = w.abs() * 2**-4 + scale * 2**-10 + 1e-7
        assert ((d - w).abs() <= bound).all(), k
        assert not torch.equal(d, w)  # it really is quantized


def test_fp8_block_edge_cases() -> None:
    w = torch.zeros(5, 7)
    w[4, 6] = -3.0
    q, s = hub_format.quantize_fp8_block(w, (4, 4))
    assert s.shape == (2, 2) and torch.isfinite(s).all() and (s > 0).all()
    torch.testing.assert_close(hub_format.dequantize_fp8_block(q, s, (4, 4)), w, rtol=0, atol=0)
    assert s[1, 1] == pytest.approx(3.0 / 448)


def test_fp8_rejects_bad_input(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        hub_format.quantize_fp8(tiny, tmp_path / "a", num_shards=0)
    fp8 = hub_format.quantize_fp8(tiny, tmp_path / "b", num_shards=3)
    assert (
        len(set(json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"].values())) == 3
    )
    with pytest.raises(ValueError):
        hub_format.quantize_fp8(fp8, tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_default_preset(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    d = ck.make_checkpoint("default", tmp_path / "default", train=False)  # the shape; training: test_train.py
    elapsed = time.perf_counter() - t0
    assert elapsed < 30
    mc = ModelConfig.from_pretrained(d)
    assert mc.full_layers == [0, 5, 11] and (mc.sliding_window, mc.window) == (129, 128)
    assert (mc.vocab_size, mc.hidden_size, mc.num_layers, mc.n_routed_experts) == (4096, 256, 12, 16)
    assert (mc.num_experts_per_tok, mc.n_group, mc.topk_group, mc.max_position_embeddings) == (4, 4, 2, 32768)
    assert (mc.full.head_dim, mc.full.v_head_dim, mc.full.rotary_dim, mc.swa.rotary_dim) == (64, 48, 22, 22)
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == 4096 and tok.eos_token_id == ck.IM_END_ID
    model = MiMoV2FlashForCausalLM.from_pretrained(d)
    # transformers' own rotary dim for the preset must be what ModelConfig says.
    assert model.model.rotary_emb.full_attention_inv_freq.numel() * 2 == mc.full.rotary_dim
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog.")])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_cached_model_dir_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWASERVE_CACHE", str(tmp_path / "cache"))
    real = ck.make_checkpoint
    calls: list[str] = []

    def counting(preset: str, out_dir, seed: int = 0, **kw):
        calls.append(preset)
        time.sleep(0.2)  # widen the race window
        return real(preset, out_dir, seed, **kw)

    monkeypatch.setattr(ck, "make_checkpoint", counting)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ck.tiny_model_dir())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["tiny"]
    expected = tmp_path / "cache" / "models" / f"mimo-v2-tiny-v{ck.CHECKPOINT_VERSION}"
    assert results == [expected] * 3 and ck.tiny_model_dir() == expected
    assert ModelConfig.from_pretrained(expected).num_layers == 8
    assert sorted(p.name for p in expected.parent.iterdir() if not p.name.endswith(".lock")) == [
        expected.name
    ]
