"""Tiny random HF models and the engine beside them: what the engine-vs-transformers
tests share (random weights whose norms and biases a loader cannot drop unnoticed, the
prompts, HF's greedy tokens and per-layer windows, an engine with small defaults, and the
bf16 bound: :func:`assert_bf16_parity`)."""

import copy
import json
import os

import torch
import transformers

from engine.llm import LLM, SamplingParams

# (mean, std) of parameters drawn at other scales: GPT-OSS's sinks as large as the
# attention scores (so that dropping one shows), its gate/up projections large enough
# that swigluoai's clamps at 7 bite (about 1 value in 10), its down projections small
# the smallest model the engine runs (the attention kernels' smallest head): 2 heads of 16
# (one KV head), 2 layers
TINY = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
)

EXPERT_SCALES = {"sinks": (1.0, 1.0), "gate_up_proj": (0.0, 0.5), "down_proj": (0.0, 0.03)}


def randomize(model, seed, *, norm=(1.0, 0.2), scales=EXPERT_SCALES):
    """Fill ``model``'s weights in place: ``mean + std * N(0, 1)`` with (mean, std) =
    ``norm`` for norms (Gemma's scale by 1 + w: pass (0.0, 0.3)), (0, 0.2) for biases,
    ``scales[name]`` by parameter name, else (0, 0.1), after seeding torch with ``seed``
    (None: the generator as it is). Returns it in eval mode."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            mean, std = scales.get(pname.rsplit(".", 1)[-1], (0.0, 0.1))
            if "norm" in pname:
                mean, std = norm
            elif pname.endswith("bias"):
                std = 0.2
            p.copy_(mean + std * torch.randn_like(p))
    return model.eval()


def random_model(cfg, seed, **kw):
    """transformers' model of ``cfg`` with eager attention (its soft-caps and sinks),
    randomized (:func:`randomize`); torch is seeded with ``seed`` before the model is
    built."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return randomize(model, None, **kw)


def prompt(n, salt=0):
    return [(37 * i + 11 * salt) % 250 + 3 for i in range(n)]


def hf_greedy(hf, ids, n):
    """HF's ``n`` greedy tokens after ``ids`` (EOS ignored)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


def hf_windows(hf):
    """The window HF's attention applies on each layer (-1: none): the attention
    module's own, or (Mistral, Mixtral, whose modules keep none) the config's on every
    layer."""
    layers = hf.model.layers
    if not any(hasattr(layer.self_attn, "sliding_window") for layer in layers):
        return [hf.config.sliding_window or -1] * len(layers)
    return [getattr(layer.self_attn, "sliding_window", None) or -1 for layer in layers]


def engine(path, **kw):
    """The engine on ``path`` in fp32, blocks of 32, an 8 MB KV pool (``kw`` overrides)."""
    kw = {"dtype": "float32", "block_size": 32, "kv_cache_memory": 8 << 20, **kw}
    return LLM(path, progress=False, **kw)


# A word-level tokenizer over the tiny models' 256 ids, so that their output decodes to
# text: five special tokens, the role names, then the words w8 ... w255. Its
# post-processor adds a BOS, as Llama's tokenizers do.
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = [*SPECIAL, "user", "assistant", "system", *(f"w{i}" for i in range(8, 256))]
# ChatML with a BOS and a role check; on several lines, so that trim_blocks counts
CHATML = """{% for m in messages %}
{% if m['role'] not in ('user', 'assistant') %}
{{ raise_exception('roles: user or assistant, got ' + m['role']) }}
{% endif %}
{{ bos_token if loop.first }}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def add_words(path):
    """Write the word tokenizer (``WORDS``) and CHATML as the chat template, BOS ``<s>``
    and EOS ``<|im_end|>``, into the checkpoint folder ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": CHATML}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


# -- bf16 against HF ---------------------------------------------------------------------
#
# The bound, derived: bf16 keeps 8 significant bits, and HF and numkern round at other
# points (HF rounds every op's output to bf16; numkern accumulates in fp32 and rounds on
# store), so neither is "the" bf16 answer: each lies about as far from the exact (fp32)
# logits as the other. HF's own bf16 run measures that distance on the very model and
# prompt, per token t: ``d_t = max_v |HF bf16 - HF fp32|``. The engine may lie at most
# ``2 max_t d_t`` from HF bf16 on any token (its own distance from fp32 up to HF's, plus
# HF's), and at most ``2 median_t d_t`` on the median token. The median bound is the one
# that bites on MoE models: a routing near-tie flips in a few tokens of a bf16 run, in
# each run its own, and makes ``max_t d_t`` large (measured 1.6 on Qwen2-MoE's prompt in
# test_engine_families, against a median of 0.06), while a real bug moves most tokens.
# Greedy tokens are compared where HF bf16's top-2 gap exceeds the max bound (elsewhere
# either token is a correct bf16 answer).
#
# That the bound bites: each test also passes deliberately wrong fp32 variants of the
# model (a norm swapped, a window dropped, experts swapped: what a loader bug would
# run), and on the median token each must lie more than ``2 x`` the median bound from
# HF bf16, so an engine with that bug fails the bound even after its own bf16 error (at
# most the bound) is taken off.
BF16_SLACK = 2.0  # the engine's distance from HF bf16, in units of HF bf16's from fp32
WRONG_MARGIN = 2.0  # a wrong variant's distance from HF bf16, in units of the bound


def hf_bf16(path, **kw):
    """HF's model of the checkpoint at ``path`` loaded in bf16 (rope's inv_freq computed in
    fp32, as from a published bf16 checkpoint; ``model.to(bfloat16)`` would round it)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager", **kw
    ).eval()


def variant(hf, edit):
    """A copy of ``hf`` with ``edit(copy)`` applied (no grad): a deliberately wrong model."""
    wrong = copy.deepcopy(hf)
    with torch.no_grad():
        edit(wrong)
    return wrong


def swap_norms(a, b, layer=0):
    """An edit: layer ``layer``'s norms ``a`` and ``b`` trade weights (a loader's name mixup)."""

    def edit(m):
        la = m.model.layers[layer]
        wa, wb = getattr(la, a).weight, getattr(la, b).weight
        tmp = wa.clone()
        wa.copy_(wb)
        wb.copy_(tmp)

    return edit


def no_window(m):
    """An edit: every layer attends to all keys (HF builds its masks from the config)."""
    m.config.sliding_window = 1 << 20


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def _per_token(a, b):
    return (a - b).abs().amax(1)  # [T]: each token's largest logit error


def assert_bf16_bound(ours, ref, ref32, what=""):
    """Check ``ours`` against HF bf16 ``ref`` and HF fp32 ``ref32`` ([T, V] each) by the
    bound above; returns (max bound, median bound)."""
    d = _per_token(ref, ref32)
    tol, tol_med = BF16_SLACK * d.max().item(), BF16_SLACK * d.median().item()
    e = _per_token(ours, ref)
    assert e.max().item() <= tol, f"{what}: {e.max().item():.4g} from HF bf16, bound {tol:.4g}"
    med = e.median().item()
    assert med <= tol_med, f"{what}: median token {med:.4g} from HF bf16, bound {tol_med:.4g}"
    top2 = ref.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > tol
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear]), what
    return tol, tol_med


def assert_bf16_parity(llm, hf32, hf, prompt, *, steps=8, wrong=()):
    """The engine ``llm`` (bf16) against HF's bf16 model ``hf`` and fp32 model ``hf32`` by
    the bound above: the prompt's logits, then ``steps`` greedy decode steps' logits and
    tokens (on the engine's own tokens). On the median token each model in ``wrong``
    (fp32) must lie beyond WRONG_MARGIN times the prompt's median bound. Returns (prompt
    bounds, decode bounds, each wrong model's median distance), for the numbers in the
    comments."""
    ref = _logits(hf, prompt)
    tol = assert_bf16_bound(llm.prompt_logits(prompt), ref, _logits(hf32, prompt), "prompt")
    far = [_per_token(_logits(w, prompt), ref).median().item() for w in wrong]
    for i, d in enumerate(far):
        assert d > WRONG_MARGIN * tol[1], f"wrong variant {i}: only {d:.4g} from HF bf16"
    llm.record_logits = True
    sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    out = llm.generate([prompt], sp)[0]
    n = len(prompt)
    full = prompt + out.token_ids
    ref, ref32 = _logits(hf, full)[n - 1 : -1], _logits(hf32, full)[n - 1 : -1]
    ours = torch.stack(out.logits)
    step_tol = assert_bf16_bound(ours, ref, ref32, "decode")
    assert out.token_ids == ours.argmax(-1).tolist()  # greedy took the logits' argmax
    nums = ", ".join(f"{d:.3g}" for d in far)
    print(
        f"\nbf16 bounds (max, median): prompt {tol[0]:.3g}, {tol[1]:.3g}; decode "
        f"{step_tol[0]:.3g}, {step_tol[1]:.3g}; wrong variants' median: {nums}"
    )
    return tol, step_tol, far
