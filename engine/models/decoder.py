"""A pre-norm decoder-only transformer: Llama, Qwen3, Qwen3-MoE, Mixtral.

The families differ in three switches read from the config: q/k RMS norms (Qwen3*),
which layers are MoE and how their experts are named (Qwen3-MoE ``mlp.experts.N.*``,
Mixtral ``block_sparse_moe.experts.N.w1/w3/w2``), and attention biases. Weights are
fused and packed once at load: q|k|v into one GEMM, gate|up into one (dense) or into
the MoE's w13 [E, 2I, H]. Every checkpoint tensor is taken exactly once; one left over
is an error (``Checkpoint.check_all_used``).
"""

import itertools

import numba
import numpy as np
import torch

from numkern import _check as C
from numkern.gemm import WIDEN_PARALLEL

from .. import fused
from ..attention import AttentionLayer
from ..kernels import rope_
from ..kv_cache import AttentionSpec
from ..layers import FusedMoE, GatedMLP, Linear, RMSNorm, Rotary


class _Layer:
    pass


class DecoderModel:
    def __init__(self, ckpt, *, dtype, block_size, moe_isa):
        cfg = ckpt.config
        self.config = cfg
        self.dtype = dtype
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hq, self.hkv, self.d = hq, hkv, d
        qk_norm = cfg.architecture.startswith("Qwen3")
        mixtral = cfg.architecture == "MixtralForCausalLM"

        def take(name):
            return ckpt.take(name).to(dtype)

        self.embed = take("model.embed_tokens.weight")
        self.rotary = Rotary(d, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.layers = []
        window = cfg.sliding_window or -1
        self.attn_specs = {}
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            L = _Layer()
            L.ln1 = RMSNorm(take(p + "input_layernorm.weight"), cfg.rms_norm_eps)
            L.ln2 = RMSNorm(take(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
            a = p + "self_attn."
            qkv = torch.cat([take(a + n + "_proj.weight") for n in "qkv"])
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([take(a + n + "_proj.bias") for n in "qkv"]).float()
            L.qkv = Linear(qkv, bias)
            o_bias = take(a + "o_proj.bias").float() if cfg.attention_bias else None
            L.o = Linear(take(a + "o_proj.weight"), o_bias)
            L.q_norm = RMSNorm(take(a + "q_norm.weight"), cfg.rms_norm_eps) if qk_norm else None
            L.k_norm = RMSNorm(take(a + "k_norm.weight"), cfg.rms_norm_eps) if qk_norm else None
            L.attn = AttentionLayer(f"layer{i}", hq, hkv, d, sliding_window=window)
            self.attn_specs[L.attn.name] = AttentionSpec(block_size, hkv, d, dtype, window)
            if cfg.is_moe_layer(i):
                e_n = cfg.num_experts
                if mixtral:
                    m = p + "block_sparse_moe."
                    names = ("w1", "w3", "w2")
                else:
                    m = p + "mlp."
                    names = ("gate_proj", "up_proj", "down_proj")
                ex = m + "experts.{}.{}.weight"
                gate_up = [(take(ex.format(e, names[0])), take(ex.format(e, names[1])))
                           for e in range(e_n)]  # fmt: skip
                w13 = torch.stack([torch.cat(pair) for pair in gate_up])
                w2 = torch.stack([take(ex.format(e, names[2])) for e in range(e_n)])
                L.mlp = FusedMoE(take(m + "gate.weight"), w13, w2, cfg.num_experts_per_tok,
                                 cfg.norm_topk_prob, isa=moe_isa)  # fmt: skip
            else:
                L.mlp = GatedMLP(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight"),
                                 take(p + "mlp.down_proj.weight"))  # fmt: skip
            self.layers.append(L)
        self.norm = RMSNorm(take("model.norm.weight"), cfg.rms_norm_eps)
        # the layers in one Numba call (engine.fused) when the step's indices were validated
        # once; the op-by-op forward below stays for steps without them
        self.fused = True
        self.eps = float(cfg.rms_norm_eps)
        self._empty = np.zeros(0, np.float32)  # no q/k norm weights, no sinks
        self._bound = None  # (cache tensors, isas, fused.layers' arguments)
        self.workers = None  # fused.layers' workers; None: Numba's thread count
        self.shared_widen_from = WIDEN_PARALLEL  # GEMM inputs widened in a shared phase
        self._ws = torch.empty(0, dtype=dtype)  # the fused forward's workspaces
        self._inter = max((L.mlp.inter for L in self.layers if isinstance(L.mlp, GatedMLP)),
                          default=0)  # fmt: skip
        if cfg.tie_word_embeddings:
            self.lm_head = Linear(self.embed)
            ckpt.tensors.pop("lm_head.weight", None)  # some exports store the tied copy
        else:
            self.lm_head = Linear(take("lm_head.weight"))
        ckpt.check_all_used()

    def attention_layers(self):
        return [L.attn for L in self.layers]

    def forward(self, ids, positions, kv_caches, meta, logits_rows):
        """ids/positions [T] int64 -> logits [len(logits_rows), vocab] fp32."""
        if meta.indices is not None and self.fused:
            return self._forward_fused(ids, positions, kv_caches, meta, logits_rows)
        t_n = ids.shape[0]
        pos = positions.numpy()
        tables = self.rotary.tables(int(pos.max()) + 1)  # cos/sin, once per step
        h = self.embed[ids]  # [T, H]
        for L in self.layers:
            x = L.ln1(h)
            qkv = L.qkv(x)
            q = qkv[:, : self.hq * self.d].reshape(t_n, self.hq, self.d)
            k = qkv[:, self.hq * self.d : (self.hq + self.hkv) * self.d].reshape(
                t_n, self.hkv, self.d
            )
            v = qkv[:, (self.hq + self.hkv) * self.d :].reshape(t_n, self.hkv, self.d)
            if L.q_norm is not None:
                q = L.q_norm(q)
                k = L.k_norm(k)
            q = rope_(q.contiguous(), pos, *tables)
            k = rope_(k.contiguous(), pos, *tables)
            o = L.attn.forward(q, k, v.contiguous(), kv_caches[L.attn.name], meta)
            h = h + L.o(o.reshape(t_n, self.hq * self.d))
            h = h + L.mlp(L.ln2(h))
        x = self.norm(h[logits_rows])
        return self.lm_head(x).float()

    def _bind(self, kv_caches):
        """The address table of ``fused.layers`` (weights and this binding's caches) and
        the runs of layers it is called for: built once per binding of cache tensors and
        ISAs, not per step."""
        caches = tuple(kv_caches[L.attn.name] for L in self.layers)
        isas = tuple(L.attn.isa for L in self.layers)
        bound = self._bound
        if (bound is not None and bound[1] == isas
                and all(a is b for a, b in zip(bound[0], caches))):  # fmt: skip
            return bound[2]
        addr = np.zeros((len(self.layers), fused.N_ADDR), np.int64)
        runs = []  # (first, end, dense MLP): dense layers run together, an MoE layer alone
        for i, (L, kv) in enumerate(zip(self.layers, caches)):
            c = L.attn.layer_cache(kv)
            row = addr[i]
            row[fused.LN1] = L.ln1.weight.ctypes.data
            row[fused.LN2] = L.ln2.weight.ctypes.data
            for col, lin in ((fused.W_QKV, L.qkv), (fused.W_O, L.o)):
                row[col] = lin.w_np.ctypes.data
                row[col + 1] = lin.b_np.ctypes.data if lin.bias is not None else 0
            if L.q_norm is not None:
                row[fused.Q_NORM] = L.q_norm.weight.ctypes.data
                row[fused.K_NORM] = L.k_norm.weight.ctypes.data
            dense = isinstance(L.mlp, GatedMLP)
            if dense:
                row[fused.W_GU] = L.mlp.gate_up.w_np.ctypes.data
                row[fused.W_DOWN] = L.mlp.down.w_np.ctypes.data
            row[fused.K_CACHE] = c._kw.ctypes.data
            row[fused.V_CACHE] = c._vw.ctypes.data
            if dense and runs and runs[-1][2] and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1, True)
            else:
                runs.append((i, i + 1, dense))
        L0 = self.layers[0]
        c = L0.attn.layer_cache(caches[0])
        model = (addr, self.config.hidden_size, self.hq, self.hkv, self.d, self._inter,
                 self.eps, L0.qkv.bias is not None, L0.o.bias is not None,
                 L0.q_norm is not None, L0.qkv.w_np[:0])  # fmt: skip
        attn = (float(L0.attn.scale), float(L0.attn.softcap), self._empty, False)
        cache = (c._kw[:0], c._kr[:0], c._kw.size, c.b, c._kwb, c._kwh, c.amx)
        args = (runs, model, attn, cache)
        self._bound = (caches, isas, args)
        return args

    def _workspace(self, t_n, r_n):
        """The step's workspaces as NumPy views of one buffer, kept between steps (grown
        when a step needs more): x, qkv, att, tmp [T, hid], gu, act, then y [R, hid] and
        the head's logits [R, vocab] in the model dtype. Returns (x as a tensor, views)."""
        hid, hq, hkv, d = self.config.hidden_size, self.hq, self.hkv, self.d
        sizes = [t_n * n for n in (hid, (hq + 2 * hkv) * d, hq * d, hid, 2 * self._inter,
                                   self._inter)]  # fmt: skip
        sizes += [r_n * hid, r_n * self.lm_head.out_features]
        if self._ws.numel() < sum(sizes):
            self._ws = torch.empty(sum(sizes), dtype=self.dtype)
        flat = C.as_numpy(self._ws)
        views = [flat[a:b] for a, b in itertools.pairwise(np.cumsum([0, *sizes]))]
        return self._ws[: t_n * hid].view(t_n, hid), views

    def _forward_fused(self, ids, positions, kv_caches, meta, logits_rows):
        """The forward in one Numba call (see engine.fused), or one per run of dense
        layers and per MoE layer, whose expert block runs between them."""
        t_n, hid = ids.shape[0], self.config.hidden_size
        pos = positions.numpy()
        cos, sin = self.rotary.tables(int(pos.max()) + 1)
        h = self.embed[ids]  # [T, H], a new tensor: the residual stream, updated in place
        hn = C.as_numpy(h).reshape(-1)
        rows = logits_rows.numpy()
        r_n = rows.shape[0]
        x, work = self._workspace(t_n, r_n)
        logits = torch.empty(r_n, self.lm_head.out_features)
        head = (rows, self.norm.weight, self.lm_head.w_np, *work[6:], logits.numpy().reshape(-1))
        no_head = (rows[:0], self._empty, self.lm_head.w_np[:0], work[6][:0], work[7][:0],
                   self._empty)  # fmt: skip
        idx = meta.indices
        plan = idx.plan
        runs, model, attn, cache = self._bind(kv_caches)
        step = (pos, cos, sin, idx.slots, idx.qsl, idx.seq_lens, idx.block_table, plan.items,
                plan.merges, *plan.partial_buffers(), plan.causal, plan.sliding_window)  # fmt: skip
        nw = self.workers or numba.get_num_threads()
        n_l = len(self.layers)
        for l0, l1, dense in runs:
            last = dense and l1 == n_l  # the logits in the same call
            fused.layers(hn, *work[:6], t_n, l0, l1, dense, *model, *step, *attn, *cache, last,
                         *(head if last else no_head), nw,
                         self.shared_widen_from)  # fmt: skip
            if not dense:  # the MoE block, on x = norm2(h)
                fused.add(hn, C.as_numpy(self.layers[l0].mlp(x)).reshape(-1), t_n, hid)
        if not runs[-1][2]:  # the model ends with an MoE layer: the logits alone
            fused.layers(hn, *work[:6], t_n, n_l, n_l, False, *model, *step, *attn, *cache, True,
                         *head, nw, self.shared_widen_from)  # fmt: skip
        return logits
