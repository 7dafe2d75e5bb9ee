"""GGUF for every family the engine runs: a tiny random HF model of each, written to GGUF
as llama.cpp's converter writes it (tests/gguf_convert.py: gguf's writer and tensor-name
map), loads to the same config and tensors as its HF directory and runs to the same
prompt logits as HF transformers (fp32); the keys and architectures the engine does not
implement are refused by name; BOS/EOS are added as llama.cpp adds them; the stored
bytes of each tensor (``LazyTensors.raw``) are the converter's rows in HF order."""

import dataclasses
import zlib

import gguf
import numpy as np
import pytest
import torch
import transformers

from engine.loader import load_checkpoint
from numkern.testing.quantize import quantize
from numkern.testing.tolerances import tolerance

from . import hf_models as hm
from .close import rtol_atol
from .gguf_convert import byte_vocab, convert

# the shapes the engine tests already run (hf_models.TINY; test_engine_families' SMALL;
# test_engine_gemma's TEXT, test_engine_gdn's TEXT), so no new kernel shape is compiled
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
GEMMA = dict(SMALL, head_dim=32, query_pre_attn_scalar=32, sliding_window=16)
GDN = dict(
    SMALL,
    num_hidden_layers=4,  # layers 0-2 linear attention, 3 full
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
)
ZERO_CENTRED = (0.0, 0.3)  # Gemma's and Qwen3-Next's norms scale by 1 + w
# name -> (config, norm init)
FAMILIES = {
    # q/k biases too: the converter permutes them with the weights
    "llama": (lambda: transformers.LlamaConfig(**hm.TINY, attention_bias=True), (1.0, 0.2)),
    "mistral": (lambda: transformers.MistralConfig(**hm.TINY, sliding_window=None), (1.0, 0.2)),
    "mixtral": (
        lambda: transformers.MixtralConfig(**SMALL, num_hidden_layers=2, num_local_experts=4,
                                           num_experts_per_tok=2, sliding_window=None),
        (1.0, 0.2),
    ),
    "qwen2": (lambda: transformers.Qwen2Config(**hm.TINY), (1.0, 0.2)),
    "qwen3": (lambda: transformers.Qwen3Config(**hm.TINY, head_dim=16), (1.0, 0.2)),
    "qwen2_moe": (
        lambda: transformers.Qwen2MoeConfig(**SMALL, num_hidden_layers=2, **MOE,
                                            shared_expert_intermediate_size=64),
        (1.0, 0.2),
    ),
    "qwen3_moe": (
        lambda: transformers.Qwen3MoeConfig(**SMALL, num_hidden_layers=2, **MOE, head_dim=32,
                                            norm_topk_prob=True),
        (1.0, 0.2),
    ),
    # layers 0 and 2 slide, 1 and 3 attend to all; soft-caps that bite
    "gemma2": (
        lambda: transformers.Gemma2Config(**GEMMA, num_hidden_layers=4,
                                          attn_logit_softcapping=3.0, final_logit_softcapping=2.0),
        ZERO_CENTRED,
    ),
    # llama.cpp's pattern: layers 0-4 slide, 5 full; a linear-scaled global rope and a
    # local one of another base
    "gemma3": (
        lambda: transformers.Gemma3TextConfig(
            **GEMMA, num_hidden_layers=6,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
            },
        ),
        ZERO_CENTRED,
    ),
    # sliding layers 0 and 2, full 1; YaRN; sinks; biased, interleaved experts
    "gpt_oss": (
        lambda: transformers.GptOssConfig(**SMALL, num_hidden_layers=3, head_dim=32,
                                          num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=24),
        (1.0, 0.2),
    ),
    "qwen3_next": (
        lambda: transformers.Qwen3NextConfig(**GDN, **MOE, shared_expert_intermediate_size=48),
        ZERO_CENTRED,
    ),
}  # fmt: skip
GGUF_ARCH = {"mistral": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe",
             "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "qwen3_next": "qwen3next"}  # fmt: skip


def _make(name, path, seed=None):
    make, norm = FAMILIES[name]
    hf = hm.random_model(make(), zlib.crc32(name.encode()) if seed is None else seed, norm=norm)
    if name == "qwen3_next":  # its GDN output norm is a plain w
        with torch.no_grad():
            for pname, p in hf.named_parameters():
                if pname.endswith("linear_attn.norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """name -> (HF directory, GGUF file, HF model), each made once when first asked."""
    made = {}

    def get(name):
        if name not in made:
            d = tmp_path_factory.mktemp(name)
            hf = _make(name, d)
            path = d / f"{name}.gguf"
            convert(d, path)
            made[name] = (str(d), str(path), hf)
        return made[name]

    return get


def _assert_same_checkpoint(gguf_ckpt, hf_ckpt, skip=()):
    """The same config (but the norm offset: llama.cpp bakes Gemma's and Qwen3-Next's
    1 + w into the weights, and the GGUF config runs them as stored) and the same tensors,
    the norms' 1 + w as the converter computed it."""
    a, b = gguf_ckpt.config, hf_ckpt.config
    offset = b.norm_offset - a.norm_offset
    fields = {f.name for f in dataclasses.fields(a)} - {"norm_offset", "torch_dtype", *skip}
    for f in sorted(fields):
        assert getattr(a, f) == getattr(b, f), f
    assert set(gguf_ckpt.tensors) == set(hf_ckpt.tensors) - (
        {"lm_head.weight"} if a.tie_word_embeddings else set()
    )
    for name in gguf_ckpt.tensors:
        want = hf_ckpt.tensors[name]
        if offset and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            want = want + offset
        got = gguf_ckpt.tensors[name]
        assert got.shape == want.shape, name
        if name.endswith("A_log"):  # stored as -exp(A_log): log(exp(a)) is a to ~1 ulp of exp
            torch.testing.assert_close(got, want, **rtol_atol("gguf_a_log"))
        else:
            assert torch.equal(got, want), name


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gguf_runs_as_its_hf_model(family, name):
    """The GGUF loads to its HF directory's config and tensors, and the engine's prompt
    logits (a 40-token prompt, past the 16/24-token windows) are HF transformers' (fp32)."""
    d, path, hf = family(name)
    ckpt = load_checkpoint(path, progress=False)
    want = {"mistral": "LlamaForCausalLM"}.get(name, type(hf).__name__)  # llama.cpp's llama
    assert ckpt.config.architecture == want
    skip = ("architecture",) if name == "mistral" else ()
    _assert_same_checkpoint(ckpt, load_checkpoint(d, progress=False), skip)
    prompt = hm.prompt(40)
    llm = hm.engine(path)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(llm.prompt_logits(prompt), ref, **rtol_atol("engine_logits"))


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_types_round_as_stored(family, tmp_path, dtype):
    """Weights written in F16/BF16 load as those values (norms and routers stay F32, as
    the converter keeps them)."""
    d, _, _ = family("qwen3_moe")
    path = tmp_path / f"{dtype}.gguf"
    written = convert(d, path, dtype=dtype)
    assert written["blk.0.ffn_gate_inp.weight"] == written["blk.0.attn_norm.weight"] == "F32"
    assert written["blk.0.ffn_up_exps.weight"] == dtype
    half = torch.float16 if dtype == "F16" else torch.bfloat16
    ckpt, ref = load_checkpoint(path, progress=False), load_checkpoint(d, progress=False)
    for name in (
        "model.layers.0.mlp.experts.3.up_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ):
        assert torch.equal(ckpt.tensors[name], ref.tensors[name].to(half).float()), name
    name = "model.layers.0.mlp.gate.weight"
    assert torch.equal(ckpt.tensors[name], ref.tensors[name])


def test_raw_rows_are_the_stored_blocks_in_hf_order(family, tmp_path):
    """Q8_0 weights: each HF tensor's RawTensor holds the file's blocks in HF row order
    (llama's q/k un-permuted, an expert's rows of the stacked tensor, Qwen3-Next's
    in_proj_qkvz regrouped from attn_qkv and attn_gate), and gguf's dequantization of
    those bytes is the tensor the loader gives; a value-changing tensor has none."""
    for name, q8 in (
        ("llama", "model.layers.1.self_attn.q_proj.weight"),
        ("qwen3_moe", "model.layers.1.mlp.experts.2.down_proj.weight"),
        ("qwen3_next", "model.layers.0.linear_attn.in_proj_qkvz.weight"),
    ):
        d, _, _ = family(name)
        path = tmp_path / f"{name}.gguf"
        convert(
            d,
            path,
            types=lambda n, shape: "Q8_0" if shape[-1] % 32 == 0 else None,
            quantize=quantize,
        )
        ckpt = load_checkpoint(path, progress=False)
        assert ckpt.tensors.raw_type(q8) == "Q8_0"
        raw = ckpt.tensors.raw(q8)
        assert (raw.type_name, raw.ggml_type) == ("Q8_0", gguf.GGMLQuantizationType.Q8_0)
        t = ckpt.tensors[q8]
        assert raw.shape == tuple(t.shape) and raw.data.dtype == torch.uint8
        deq = gguf.quants.dequantize(raw.data.numpy(), gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(deq, t.numpy()), name
        ref = load_checkpoint(d, progress=False).tensors[q8]
        assert (t - ref).abs().max() <= ref.abs().max() / 127  # really the model's, quantized
    assert ckpt.tensors.raw("model.layers.0.linear_attn.A_log") is None  # -exp stored
    assert ckpt.tensors.raw_type("model.layers.0.linear_attn.A_log") is None
    stored = ckpt.tensors.stored("blk.0.ssm_a")  # ... but its bytes as stored are there
    assert stored.shape == (4,) and stored.type_name == "F32"
    a_log = load_checkpoint(d, progress=False).tensors["model.layers.0.linear_attn.A_log"]
    assert torch.equal(stored.data.view(torch.float32), -torch.exp(a_log))  # the writer's
    assert ckpt.tensors.recipes["model.layers.0.linear_attn.A_log"].parts == ("blk.0.ssm_a",)
    taken = ckpt.take_raw("model.layers.0.linear_attn.out_proj.weight")
    assert taken is not None and "model.layers.0.linear_attn.out_proj.weight" not in ckpt.tensors


# -- refused by name -------------------------------------------------------------------------


def _rewrite(src, dst, *, arch=None, drop=(), add=None):
    """A copy of the GGUF file ``src`` with ``general.architecture`` replaced, the keys
    ``drop`` left out and ``add`` ({key: (value, GGUFValueType)}) added."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), arch or r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in drop or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, (value, vtype) in (add or {}).items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        w.add_tensor(
            t.name,
            np.array(t.data),
            raw_shape=list(reversed(t.shape.tolist())),
            raw_dtype=t.tensor_type,
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


U32, F32, BOOL = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.BOOL
STR = gguf.GGUFValueType.STRING
REFUSED = [
    # an architecture the engine does not run
    ("llama", dict(arch="phi3"), "general.architecture"),
    # keys that change the math and that the engine does not implement
    ("llama", dict(add={"llama.attention.sliding_window": (16, U32)}),
     "llama.attention.sliding_window"),
    ("qwen3", dict(add={"qwen3.attention.causal": (False, BOOL)}), "qwen3.attention.causal"),
    ("qwen3", dict(add={"qwen3.rope.scaling.type": ("longrope", STR)}),
     "qwen3.rope.scaling.type"),
    ("qwen2_moe", dict(add={"qwen2moe.expert_weights_norm": (True, BOOL)}),
     "qwen2moe.expert_weights_norm"),
    ("qwen3_moe", dict(add={"qwen3moe.expert_gating_func": (2, U32)}),
     "qwen3moe.expert_gating_func"),
    ("gemma3", dict(add={"gemma3.attention.scale": (0.5, F32)}), "gemma3.attention.scale"),
    ("gemma3", dict(add={"gemma3.attention.sliding_window_pattern": ([True] * 5, BOOL)}),
     "gemma3.attention.sliding_window_pattern"),
    # what the engine needs and the file lacks
    ("gemma2", dict(drop=("gemma2.attention.sliding_window",)),
     "gemma2.attention.sliding_window"),
    ("qwen3_next", dict(drop=("qwen3next.ssm.state_size",)), "qwen3next.ssm.state_size"),
]  # fmt: skip


@pytest.mark.parametrize("name, edit, named", REFUSED)
def test_refused_by_name(family, tmp_path, name, edit, named):
    _, path, _ = family(name)
    bad = _rewrite(path, tmp_path / "bad.gguf", **edit)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        load_checkpoint(bad, progress=False)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 8.0, "original_max_position_embeddings": 8192}  # fmt: skip


CTX_16K = dict(hm.TINY, max_position_embeddings=16384)  # past the original 8192


def test_llama3_rope_from_its_table(tmp_path):
    """Llama 3's rope, stored by the converter as a rope_freqs table of divisors (8 pairs
    here: wavelengths 6 to 10840, two of them in the smoothed band 1024-8192): its
    parameters recovered, the logits HF's."""
    cfg = transformers.LlamaConfig(**CTX_16K, rope_parameters=LLAMA3)
    hf = hm.random_model(cfg, 3)
    hf.save_pretrained(tmp_path)
    convert(tmp_path, tmp_path / "l3.gguf")
    ckpt = load_checkpoint(tmp_path / "l3.gguf", progress=False)
    got = ckpt.config.rope_scaling
    want = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    assert got.keys() == want.keys()
    assert got.pop("rope_type") == want.pop("rope_type")
    assert got == pytest.approx(want, rel=1e-6)
    prompt = hm.prompt(40)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    logits = hm.engine(str(tmp_path / "l3.gguf")).prompt_logits(prompt)
    torch.testing.assert_close(logits, ref, **rtol_atol("engine_logits"))


def test_llama3_rope_table_not_recoverable_is_refused(tmp_path):
    """At theta 5e5 only one of the 8 wavelengths falls in the smoothed band: the table
    does not pin the band's line, so it is refused rather than run as another rope."""
    cfg = transformers.LlamaConfig(**CTX_16K, rope_parameters=dict(LLAMA3, rope_theta=5e5))
    hm.random_model(cfg, 3).save_pretrained(tmp_path)
    convert(tmp_path, tmp_path / "l3.gguf")
    with pytest.raises(ValueError, match=r"rope_freqs\.weight"):
        load_checkpoint(tmp_path / "l3.gguf", progress=False)


# -- BOS and EOS as llama.cpp adds them ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    cfg = transformers.LlamaConfig(**dict(hm.TINY, bos_token_id=1, eos_token_id=2))
    hm.random_model(cfg, 5).save_pretrained(d)
    return d


@pytest.mark.parametrize(
    "pre, add_bos, add_eos, bos, eos",
    [
        ("default", None, None, False, False),  # a BPE vocabulary adds neither by default
        ("llama-bpe", None, None, True, False),  # ... but the Llama 3 one adds BOS
        ("llama-bpe", False, None, False, False),  # the keys override
        ("default", True, True, True, True),
        ("gpt2", None, True, False, True),
    ],
)
def test_bos_eos_as_llama_cpp(tiny_llama, tmp_path, pre, add_bos, add_eos, bos, eos):
    path = tmp_path / "t.gguf"
    convert(tiny_llama, path, add_bos=add_bos, add_eos=add_eos, pre=pre)
    tok = load_checkpoint(path, progress=False).tokenizer
    vocab, _ = byte_vocab(256)
    text = "hello"
    plain = [vocab.index(t) for t in ("he", "ll", "o")]
    want = [1] * bos + plain + [2] * eos
    assert tok.encode(text).ids == want
    assert tok.encode(text, add_special_tokens=False).ids == plain


# -- llama.cpp on the same files -------------------------------------------------------------

# llama.cpp's own error against HF fp32 (KV cache in F32): the table's llama_cpp kinds,
# measured on these models (numkern.testing.tolerances, with why)
LLAMA_CPP_KIND = {
    "gemma2": "llama_cpp_gemma",
    "gemma3": "llama_cpp_gemma",
    "gpt_oss": "llama_cpp_gpt_oss",
}
# that llama.cpp build predates the current converter's qwen3next layout (it wants
# another attn_qkv shape), so Qwen3-Next is left out
LLAMA_CPP_FAMILIES = [n for n in FAMILIES if n != "qwen3_next"]


@pytest.mark.parametrize("name", LLAMA_CPP_FAMILIES)
def test_llama_cpp_reads_the_writer_s_files_as_hf_runs_them(family, name):
    """The oracle for the writer itself (not in CI: llama-cpp-python compiles): llama.cpp
    runs each written file to HF's prompt logits, so the file means what the HF model
    computes, as the real converter's would."""
    llama_cpp = pytest.importorskip("llama_cpp")
    _, path, hf = family(name)
    prompt = hm.prompt(40)
    llm = llama_cpp.Llama(path, logits_all=True, n_ctx=128, n_batch=128, verbose=False,
                          n_threads=2, type_k=0, type_v=0)  # fmt: skip
    llm.eval(prompt)
    got = torch.from_numpy(np.array(llm.scores[: len(prompt)]))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    tol = tolerance(LLAMA_CPP_KIND.get(name, "llama_cpp"), torch.float32).abs
    assert (got - ref).abs().max().item() <= tol


# -- SentencePiece vocabularies (Gemma's, Llama 2's) -------------------------------------------

SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "▁h", "he", "ll", "llo", "▁he",
              "▁hel", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "lo", "▁a", "ha"]  # fmt: skip


def _spm_vocab():
    """(tokens, scores, ids of <s> and </s>): <unk>, <s>, </s>, the 256 byte tokens, the
    pieces (scores decreasing, "lo" and "ha" late) and a control token."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    tokens.append("<start_of_turn>")
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0]
    return tokens, scores


def spm_reference(text, tokens, scores, add_prefix):
    """llama.cpp's SPM tokenizer, written out: spaces as ▁ (one prepended), then merge the
    adjacent pair whose joined text is the highest-scoring token (leftmost on ties) until
    none is a token; what is left outside the vocabulary as its UTF-8 byte tokens."""
    vocab = {t: i for i, t in enumerate(tokens)}
    syms = list(("▁" if add_prefix else "") + text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(syms) - 1):
            j = vocab.get(syms[i] + syms[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        syms[i : i + 2] = [syms[i] + syms[i + 1]]
    ids = []
    for s in syms:
        ids += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()]
    return ids


SPM_TEXTS = ["hello world", "hello", "a hello wor ld", "hallo\nwelt ü", "  hehe  lol"]


@pytest.mark.parametrize("add_prefix", [None, False])
def test_sentencepiece_vocabulary_tokenizes_as_llama_cpp(tmp_path, add_prefix):
    """An SPM vocabulary (tokenizer.ggml.model "llama": scores, byte tokens) tokenizes as
    llama.cpp's algorithm does (written out above), BOS added by default, control tokens
    whole, decode the text back; ``add_space_prefix`` false (Gemma) prepends no space."""
    tokens, scores = _spm_vocab()
    cfg = transformers.LlamaConfig(**dict(hm.TINY, vocab_size=len(tokens), bos_token_id=1,
                                          eos_token_id=2))  # fmt: skip
    hm.random_model(cfg, 5).save_pretrained(tmp_path)
    path = tmp_path / "spm.gguf"
    special = {"<s>", "</s>", "<start_of_turn>"}
    convert(tmp_path, path, tokens=tokens, scores=scores, special=special,
            add_space_prefix=add_prefix)  # fmt: skip
    tok = load_checkpoint(path, progress=False).tokenizer
    prefix = add_prefix is None  # llama.cpp's default for SPM: true
    for text in SPM_TEXTS:
        want = spm_reference(text, tokens, scores, prefix)
        ids = tok.encode(text).ids
        assert ids == [1, *want], text
        assert tok.decode(ids) == text
    turn = tok.encode("<start_of_turn>hello", add_special_tokens=False).ids
    assert turn == [
        tokens.index("<start_of_turn>"),
        *spm_reference("hello", tokens, scores, prefix),
    ]


@pytest.mark.parametrize("add_prefix", [None, False])
def test_sentencepiece_tokens_are_llama_cpp_s(tmp_path, add_prefix):
    """llama.cpp itself tokenizes the same file the same (not in CI: llama-cpp-python
    compiles), special tokens parsed, BOS as it adds it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    tokens, scores = _spm_vocab()
    cfg = transformers.LlamaConfig(**dict(hm.TINY, vocab_size=len(tokens), bos_token_id=1,
                                          eos_token_id=2))  # fmt: skip
    hm.random_model(cfg, 5).save_pretrained(tmp_path)
    path = tmp_path / "spm.gguf"
    special = {"<s>", "</s>", "<start_of_turn>"}
    convert(tmp_path, path, tokens=tokens, scores=scores, special=special,
            add_space_prefix=add_prefix)  # fmt: skip
    tok = load_checkpoint(path, progress=False).tokenizer
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in [*SPM_TEXTS, "<start_of_turn>hello", "hi<start_of_turn> hello"]:
        assert tok.encode(text).ids == llm.tokenize(text.encode(), add_bos=True, special=True)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q4_1", "MXFP4"])
def test_quantized_files_load_as_gguf_dequantizes_them(tmp_path, qtype):
    """The writer with numkern.testing.quantize (what the quantized engine tests use): a
    Llama of hidden 256 (whole K-quant super-blocks) in ``qtype``; each weight loads as
    gguf's own dequantization of its stored bytes (q/k un-permuted), within the type's
    step of the HF weight."""
    cfg = transformers.LlamaConfig(**dict(hm.TINY, hidden_size=256, intermediate_size=256,
                                          num_hidden_layers=1))  # fmt: skip
    hm.random_model(cfg, 7).save_pretrained(tmp_path)
    path = tmp_path / "q.gguf"
    written = convert(tmp_path, path, types=lambda n, shape: qtype, quantize=quantize)
    assert written["blk.0.ffn_down.weight"] == written["token_embd.weight"] == qtype
    ckpt, ref = load_checkpoint(path, progress=False), load_checkpoint(tmp_path, progress=False)
    gtype = gguf.GGMLQuantizationType[qtype]
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        raw = ckpt.tensors.raw(name)
        assert raw.type_name == qtype
        want = gguf.quants.dequantize(raw.data.numpy(), gtype)
        got = ckpt.tensors[name]
        assert np.array_equal(got.numpy(), want), name
        w = ref.tensors[name]
        assert (got - w).abs().max() <= w.abs().max() / 3  # the model's, at 4-6 bits
