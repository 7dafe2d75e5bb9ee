"""The engine's amx layouts on any CPU: the KV cache in the amx attention layout and the
MoE weights in the amx layout, chosen through ``LLM``'s test-only ``_layout_isa``.

The vector kernels read the amx variants' layouts (bf16 pairs), so with the AMX tiles of
those layouts turned off (the prefill attention's and the MoE experts' on a CPU with
tiles: tests/test_amx.py checks them) an engine on the amx layouts must give the bits of
one on vec: the same logits, bit for bit, and the same greedy tokens. A wrong layout
would give other logits.
The layouts themselves are checked against their formulas (vLLM's, as
``test_attention.test_reshape_and_cache_layout`` states them), so the test cannot pass
on an engine that quietly kept vec. Asking for amx as a user does (``isa=``,
``--isa``, ``NUMKERN_ISA``) stays a ValueError on a CPU without AMX (masked in a child
process, so the test means the same on an AMX CPU).
"""

import zlib

import pytest
import torch
import transformers

from engine.llm import SamplingParams
from numkern import isa as nk_isa

from . import hf_models as hm
from .conftest import run_child
from .test_decoder import _run_steps


@pytest.fixture(autouse=True)
def _no_layout_tiles(monkeypatch):
    """The vector kernels on the amx layouts (no prefill-attention or MoE tiles)."""
    from numkern.attention import kernels as attn_kernels
    from numkern.attention import ops as attn_ops
    from numkern.decoder import stack as decoder_stack
    from numkern.moe import fused

    for module in (attn_ops, decoder_stack):
        monkeypatch.setattr(module, "tile_witness", lambda: attn_kernels.NO_TILES)
    monkeypatch.setattr(fused, "_tiles_default", False)


# A tiny bf16 Qwen3-MoE: head_dim 32 (amx serves multiples of 32), layer 0 MoE (4
# experts, top 2, N and K multiples of 32 as the MoE layouts need), layer 1 dense.
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    max_position_embeddings=512,
)
B = 32  # block size
# one prompt in one block, one over two, one over three; decode steps cross a block edge
PROMPTS = [hm.prompt(5), hm.prompt(40, 1), hm.prompt(70, 2)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A bf16 checkpoint of :data:`CONFIG` (random weights, perturbed norms)."""
    path = tmp_path_factory.mktemp("qwen3_moe_bf16")
    cfg = transformers.Qwen3MoeConfig(**CONFIG)
    model = hm.random_model(cfg, zlib.crc32(b"amx layout"))
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engines(checkpoint):
    """isa -> engine on that layout, its caches NaN-filled (unwritten slots compare equal)."""
    out = {}
    for isa in ("vec", "amx"):
        llm = hm.engine(checkpoint, dtype="bfloat16", block_size=B, _layout_isa=isa)
        for g in llm.scheduler.groups:
            for t in g.caches.values():
                t.fill_(float("nan"))
        out[isa] = llm
    return out


def _amx_cache(kv, b, d):
    """The vec KV cache ``kv`` rewritten in the amx layout, as bits (int16): per block and
    head, K at ``(o//16)*16*d + (i//2)*32 + (o%16)*2 + i%2`` (vec: ``i*b + o``) and V at
    ``(i//16)*16*b + (o//2)*32 + (i%16)*2 + o%2`` (vec: ``o*d + i``), token o, dim i."""
    x = kv.view(torch.int16).reshape(-1, 2, b * d)
    k = x[:, 0].reshape(-1, d, b).transpose(1, 2)  # [N, b, d]
    v = x[:, 1].reshape(-1, b, d)
    ka = k.reshape(-1, b // 16, 16, d // 2, 2).permute(0, 1, 3, 2, 4)
    va = v.reshape(-1, b // 2, 2, d // 16, 16).permute(0, 3, 1, 4, 2)
    return torch.stack([ka.reshape(-1, b * d), va.reshape(-1, b * d)], 1).reshape(kv.shape)


def _moe_unpacked(w, isa):
    """``[E, N, K]`` of a :func:`numkern.moe.prepack_moe_weight` result: vec is
    ``[E, N/16, K, 16]``, amx ``[E, N/16, K/2, 16, 2]``."""
    e, n, k = w.shape
    if isa == "amx":
        return w.reshape(e, n // 16, k // 2, 16, 2).permute(0, 1, 3, 2, 4).reshape(e, n, k)
    return w.reshape(e, n // 16, k, 16).permute(0, 1, 3, 2).reshape(e, n, k)


def test_engine_on_amx_layouts_gives_the_bits_of_vec(engines):
    vec, amx = engines["vec"], engines["amx"]
    assert [g.isa for g in amx.kv_cache_groups] == ["amx"]
    assert [g.isa for g in vec.kv_cache_groups] == ["vec"]
    (i,) = amx.model.experts  # layer 0
    ev, ea = vec.model.experts[i], amx.model.experts[i]
    assert (ev.isa, ea.isa) == ("vec", "amx")
    for name in ("w13", "w2"):  # the same weights, each engine in its layout
        wv, wa = getattr(ev, name), getattr(ea, name)
        assert not torch.equal(wv, wa), name
        assert torch.equal(_moe_unpacked(wa, "amx"), _moe_unpacked(wv, "vec")), name

    got = {}
    for isa, llm in engines.items():
        llm.record_logits = True
        outs = llm.generate(PROMPTS, GREEDY)
        got[isa] = ([o.token_ids for o in outs], [torch.stack(o.logits) for o in outs])
        assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert got["amx"][0] == got["vec"][0]
    for a, v in zip(got["amx"][1], got["vec"][1]):
        assert torch.isfinite(a).all() and a.std() > 0.1
        assert torch.equal(a, v)

    # the caches hold the same tokens, each in its layout (the layer's KV written once)
    (gv,), (ga,) = vec.scheduler.groups, amx.scheduler.groups
    d = gv.spec.head_size
    for name in gv.layer_names:
        kv, ka = gv.caches[name], ga.caches[name]
        written = ~torch.isnan(kv.view(-1).float())
        assert int(written.sum()) >= 2 * d * sum(map(len, PROMPTS))
        assert not torch.equal(ka.view(torch.int16), kv.view(torch.int16))
        assert torch.equal(ka.view(torch.int16), _amx_cache(kv, B, d)), name

    # one prefill's logits at every position
    ids = hm.prompt(97, 3)
    assert torch.equal(amx.prompt_logits(ids), vec.prompt_logits(ids))


def test_decoder_stack_on_the_amx_layout_gives_the_bits_of_vec():
    """The fused layers (numkern.decoder) read the amx KV layout on any CPU: a prefill
    step and a decode step over shuffled blocks of a NaN-filled cache, vec's bits."""
    vec, _ = _run_steps(torch.bfloat16, "vec", qk_norm=True, bias=True)
    amx, _ = _run_steps(torch.bfloat16, "amx", qk_norm=True, bias=True)
    for a, v in zip(amx, vec):
        assert torch.isfinite(a).all()
        assert torch.equal(a, v)


def test_layout_override_rules():
    """The override skips only the CPU check: names, dtypes and shapes are checked as
    ever, and the reason says it is a test's."""
    bf = torch.bfloat16
    assert "test-only layout override" in nk_isa.LAYOUT_OVERRIDE

    def layout(name):  # the one place the test-only flag is taken
        return nk_isa.resolve_override(name, layout_only=True)

    checked = nk_isa.resolve_override("vec")  # vec runs everywhere: only the reason differs
    for over, why in ((checked, "override"), (layout("vec"), nk_isa.LAYOUT_OVERRIDE)):
        assert nk_isa.attention_isa(bf, 32, 64, override=over) == ("vec", why)
        assert nk_isa.moe_isa(bf, override=over) == ("vec", why)
    assert nk_isa.attention_isa(bf, 32, 64, override=layout("amx"))[0] == "amx"
    assert nk_isa.moe_isa(bf, override=layout("amx"))[0] == "amx"
    with pytest.raises(ValueError, match=r"isa override: expected one of .*got 'avx'"):
        layout("avx")
    with pytest.raises(ValueError, match="moe isa override: expected one of"):
        nk_isa.moe_isa(bf, override=layout("vec16"))
    with pytest.raises(TypeError, match="moe isa override: 'amx' needs bfloat16, got float32"):
        nk_isa.moe_isa(torch.float32, override=layout("amx"))


def test_layout_isa_argument_errors(checkpoint):
    """Checked before the checkpoint is read (its path is not even looked at)."""
    for kw in ({"_layout_isa": "vec16"}, {"_layout_isa": "amx", "isa": "vec"}):
        with pytest.raises(ValueError, match="_layout_isa: expected one of"):
            hm.engine("/nonexistent", dtype="bfloat16", **kw)
    with pytest.raises(TypeError, match="'amx' needs bfloat16, got float32"):
        hm.engine("/nonexistent", dtype="float32", _layout_isa="amx")


_NO_AMX = """
import contextlib, io, logging, os, sys
from engine.__main__ import main
from engine.llm import LLM
from numkern import isa

assert "amx" not in isa.supported_isas()
path = sys.argv[1]
gone = path + "/none"  # the refusals come before a checkpoint is looked for
kw = dict(dtype="bfloat16", block_size=32, kv_cache_memory=8 << 20, progress=False)


def refused(what, call, match):
    try:
        call()
    except ValueError as e:
        assert match in str(e), (what, e)
        print(what, "refused")
    else:
        raise SystemExit(f"{what}: amx accepted on a CPU without AMX")


def cli(*args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(["generate", "--model", gone, "--max-tokens", "1", *args, "hi"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            return code, err.getvalue() + ("" if isinstance(e.code, int) else str(e.code))
    return 0, err.getvalue()


def cli_refused(what, args, code, match):
    got, err = cli(*args)
    assert got == code and match in err, (what, got, err)
    print(what, "refused")


why = "'amx' cannot run on this CPU"
refused("LLM isa=", lambda: LLM(gone, isa="amx", **kw), "isa override: " + why)
cli_refused("--isa", ["--isa", "amx"], 2, "error: --isa: " + why)
os.environ["NUMKERN_ISA"] = "amx"
refused("LLM NUMKERN_ISA", lambda: LLM(gone, **kw), "NUMKERN_ISA: " + why)
cli_refused("CLI NUMKERN_ISA", [], 1, "error: NUMKERN_ISA: " + why)
del os.environ["NUMKERN_ISA"]

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s", force=True)
llm = LLM(path, _layout_isa="amx", **kw)
print("groups", [g.isa for g in llm.kv_cache_groups])
"""


def test_amx_is_still_an_error_for_users_without_amx(checkpoint):
    """With AMX masked off: ``isa="amx"``, ``--isa amx`` and ``NUMKERN_ISA=amx`` are
    ValueErrors (the CLI: one line, exit 2 for the option, 1 for the variable), before
    the checkpoint is read; the test-only ``_layout_isa`` builds the engine on the amx
    layouts, and its decision log says so."""
    code = _NO_AMX + "\n"
    out = run_child(
        f"import sys; sys.argv[1:] = [{checkpoint!r}]\n" + code,
        {"NUMKERN_CPU_FEATURES": "-amx-tile"},
    )
    assert out.count("refused") == 4, out
    assert "groups ['amx']" in out, out
    assert "attention ISA amx" in out and "MoE ISA amx" in out, out
    assert out.count(nk_isa.LAYOUT_OVERRIDE) == 2, out
