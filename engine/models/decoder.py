"""A pre-norm decoder-only transformer: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral.

The families differ in four switches read from the config: q/k RMS norms (Qwen3*),
which layers are MoE and how their experts are named (Qwen3-MoE ``mlp.experts.N.*``,
Mixtral ``block_sparse_moe.experts.N.w1/w3/w2``), attention biases (q/k/v, and o), and
each layer's sliding window (``ModelConfig.layer_windows``: layers of one window share
a KV-cache group, with its own block size and plan). Weights are
fused and packed once at load: q|k|v into one GEMM, gate|up into one (dense) or into
the MoE's w13 [E, 2I, H]. Every checkpoint tensor is taken exactly once; one left over
is an error (``Checkpoint.check_all_used``).

The model only decides which tensor goes where: :class:`numkern.decoder.LayerWeights`
per layer, bound with the layers' KV caches into one :class:`numkern.decoder.DecoderStack`
(:meth:`DecoderModel.bind`). :meth:`DecoderModel.forward` is the engine's one forward
path: embedding, then ``DecoderStack.run`` over each run of layers, an MoE layer's
experts between runs, and the logits of the sampled rows at the end.
"""

import torch

import numkern
from numkern import attention as A
from numkern.decoder import DecoderStack, LayerWeights

from ..attention import AttentionLayer
from ..layers import FusedMoE, Rotary
from ..memory import place


class DecoderModel:
    def __init__(self, ckpt, *, dtype, moe_isa):
        cfg = ckpt.config
        self.config = cfg
        self.dtype = dtype
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hq, self.hkv, self.d = hq, hkv, d
        qk_norm = cfg.architecture.startswith("Qwen3")
        mixtral = cfg.architecture == "MixtralForCausalLM"

        def take(name):
            return ckpt.take(name).to(dtype)

        def norm(name):  # fp32 [n] of the model-dtype weight (as HF computes with it)
            return take(name).float().contiguous()

        def packed(w):  # packed once, into huge-page-advised memory (engine.memory)
            return place(numkern.convert_weight_packed(w.contiguous()))

        def bias(names, present):
            return torch.cat([take(n) for n in names]).float() if present else None

        self.embed = take("model.embed_tokens.weight")
        self.rotary = Rotary(d, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.weights = []  # LayerWeights per layer
        self.experts = {}  # layer index -> FusedMoE
        self.attn = []  # AttentionLayer per layer: its window, and its group's ISA
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat([take(a + n + "_proj.weight") for n in "qkv"])
            gate_up = down = None
            if cfg.is_moe_layer(i):
                self.experts[i] = self._moe(cfg, take, p, mixtral, moe_isa)
            else:
                gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
                gate_up = packed(torch.cat([gate, up]))
                down = packed(take(p + "mlp.down_proj.weight"))
            self.weights.append(
                LayerWeights(
                    input_norm=norm(p + "input_layernorm.weight"),
                    qkv=packed(qkv),
                    o=packed(take(a + "o_proj.weight")),
                    post_norm=norm(p + "post_attention_layernorm.weight"),
                    gate_up=gate_up,
                    down=down,
                    qkv_bias=bias([a + n + "_proj.bias" for n in "qkv"], cfg.qkv_bias),
                    o_bias=bias([a + "o_proj.bias"], cfg.attention_bias),
                    q_norm=norm(a + "q_norm.weight") if qk_norm else None,
                    k_norm=norm(a + "k_norm.weight") if qk_norm else None,
                )
            )
            window = cfg.layer_windows[i]
            self.attn.append(AttentionLayer(f"layer{i}", hq, hkv, d, sliding_window=window))
        self.final_norm = norm("model.norm.weight")
        if cfg.tie_word_embeddings:
            head = self.embed
            ckpt.tensors.pop("lm_head.weight", None)  # some exports store the tied copy
        else:
            head = take("lm_head.weight")
        self.lm_head = packed(head)
        self.vocab_size = head.shape[0]
        ckpt.check_all_used()
        self.stack = None  # the DecoderStack, once the caches are bound
        self.schedule = {}  # DecoderStack.run's workers / shared_widen_from (tests)

    @staticmethod
    def _moe(cfg, take, p, mixtral, isa):
        if mixtral:
            m, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
        else:
            m, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        ex = m + "experts.{}.{}.weight"
        experts = range(cfg.num_experts)
        w13 = torch.stack([torch.cat([take(ex.format(e, n)) for n in names[:2]]) for e in experts])
        w2 = torch.stack([take(ex.format(e, names[2])) for e in experts])
        router = take(m + "gate.weight")
        return FusedMoE(router, w13, w2, cfg.num_experts_per_tok, cfg.norm_topk_prob, isa=isa)

    def attention_layers(self):
        return list(self.attn)

    def bind(self, kv_caches, kv_groups):
        """Bind each layer's KV cache (``{layer name: kv_cache tensor}``), viewed in the ISA
        its group's builder gave the layer, and its group (``{layer name: group index}``):
        the stack the forward runs."""
        caches = [A.cache_view(kv_caches[L.name], L.isa) for L in self.attn]
        cfg = self.config
        self.stack = DecoderStack(
            self.weights,
            caches,
            num_heads=self.hq,
            num_kv_heads=self.hkv,
            head_dim=self.d,
            eps=cfg.rms_norm_eps,
            final_norm=self.final_norm,
            lm_head=self.lm_head,
            scale=self.attn[0].scale,
            kv_groups=[kv_groups[L.name] for L in self.attn],
        )

    def forward(self, ids, positions, plans, logits_rows):
        """ids/positions [T] int64, the step's attention plans (one per KV-cache group,
        with its validated indices) -> logits [len(logits_rows), vocab] fp32."""
        stack = self.stack
        if stack is None:
            raise RuntimeError("DecoderModel.forward: bind() the KV caches first")
        cos_sin = self.rotary.cos_sin_cache(int(positions.max()) + 1 if len(positions) else 1)
        h = self.embed[ids]  # [T, H], a new tensor: the residual stream, updated in place
        logits = torch.empty(len(logits_rows), self.vocab_size)
        sched = self.schedule
        add = None
        n = stack.num_layers
        for l0, l1 in stack.segments:
            head = {}
            if l1 == n and stack.dense[-1]:  # the logits in the same call
                head = {"logits_rows": logits_rows, "logits": logits}
            x = stack.run(
                h, plans, positions, cos_sin, layers=(l0, l1), residual_add=add, **head, **sched
            )
            add = self.experts[l1 - 1](x) if x is not None else None
        if add is not None:  # the model ends with an MoE layer: its output, then the logits
            head = {"logits_rows": logits_rows, "logits": logits}
            stack.run(
                h, plans, positions, cos_sin, layers=(n, n), residual_add=add, **head, **sched
            )
        return logits
