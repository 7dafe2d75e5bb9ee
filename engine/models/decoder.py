"""A pre-norm decoder-only transformer: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE,
Mixtral, GPT-OSS.

The families differ in switches read from the config: q/k RMS norms (Qwen3*),
which layers are MoE and how their experts are named (Qwen3-MoE, Qwen2-MoE
``mlp.experts.N.*``, Mixtral ``block_sparse_moe.experts.N.w1/w3/w2``, GPT-OSS all in
one, biased, swigluoai), a shared expert (Qwen2-MoE), attention sinks (GPT-OSS),
attention biases (q/k/v, and o), and
each layer's sliding window (``ModelConfig.layer_windows``: layers of one window share
a KV-cache group, with its own block size and plan). Weights are
fused and packed once at load: q|k|v into one GEMM, gate|up into one (dense) or into
the MoE's w13 [E, 2I, H]. Every checkpoint tensor is taken exactly once; one left over
is an error (``Checkpoint.check_all_used``).

The model only decides which tensor goes where: :class:`numkern.decoder.LayerWeights`
per layer, bound with the layers' KV caches into one :class:`numkern.decoder.DecoderStack`
(:meth:`DecoderModel.bind`). :meth:`DecoderModel.forward` is the engine's one forward
path: embedding, then ``DecoderStack.prepare`` once per step (the plans, positions and
rotary tables validated once) and ``DecoderStack.run`` over each run of layers, an MoE
layer's experts between runs, and the logits of the sampled rows at the end.
"""

import torch

from numkern.decoder import DecoderStack, LayerWeights

from ..attention import AttentionLayer
from ..dist import LOCAL
from ..gdn import gdn_step, load_gdn
from ..layers import Rotary
from ..memory import pack
from ..quant import QuantLoader, embedding_rows
from ..shard import SINGLE, check_split
from .experts import load_moe


def _check_rows(name, shape, cfg):
    """The embedding or LM head of ``shape`` is [vocab_size, hidden_size] as the config
    says (the engine checks token ids against the config's vocab_size before they index
    it); checked before it is read."""
    want = [cfg.vocab_size, cfg.hidden_size]
    if list(shape) != want:
        field_name = "vocab_size" if len(shape) != 2 or shape[0] != want[0] else "hidden_size"
        raise ValueError(
            f"{field_name}: the config's [vocab_size, hidden_size] is {want}, the "
            f"checkpoint's {name} is {list(shape)}"
        )


class Heads:
    """One rank's attention heads (Megatron / vLLM): ``hq`` query heads from ``q0`` and
    ``hkv`` KV heads from ``kv0``, of ``d`` dims each. Query heads split evenly; KV heads
    split evenly too when there are at least as many as ranks, else each rank keeps the
    one its query heads read (rank r: KV head ``r // (world / hkv)``, replicated)."""

    def __init__(self, hq, hkv, d, shard):
        w, r = shard.world, shard.rank
        self.d = d
        self.q0, q1 = shard.part(hq, "num_attention_heads")
        self.hq = q1 - self.q0
        if hkv >= w:
            self.kv0, kv1 = shard.part(hkv, "num_key_value_heads")
            self.hkv = kv1 - self.kv0
        else:
            self.kv0, self.hkv = r // (w // hkv), 1

    def q_rows(self):  # of q_proj: this rank's heads' rows
        return slice(self.q0 * self.d, (self.q0 + self.hq) * self.d)

    def kv_rows(self):  # of k_proj / v_proj
        return slice(self.kv0 * self.d, (self.kv0 + self.hkv) * self.d)


def _take_parts(take, parts):
    """The tensors of ``parts`` (``[(name, part or None)]``), each name taken once: a name
    that comes twice (Qwen3-Next's q_proj: q rows and gate rows) with row-index parts is
    read once for both and split."""
    out = {}
    for n in dict.fromkeys(n for n, _ in parts):
        mine = [p for m, p in parts if m == n]
        if len(mine) == 1:
            out[n] = [take(n, mine[0])]
        else:
            idx = [p[0] for p in mine]
            out[n] = list(take(n, (torch.cat(idx),)).split([len(i) for i in idx]))
        out[n].reverse()
    return [out[n].pop() for n, _ in parts]


def _pad_rows(parts, rows):
    """``parts`` (2-D tensors of one width), a zero part appended to make ``rows`` rows in
    all (None: as they are): a vocab-parallel head's last rank."""
    have = sum(len(t) for t in parts)
    if rows is None or rows <= have:
        return parts
    return [*parts, parts[0].new_zeros(rows - have, parts[0].shape[1])]


def _whole(part, shard):
    """None (the whole tensor) for a part that selects nothing away (on one rank every
    range is the whole dimension): the unsplit engine reads its tensors as it always
    did; a selection of rows by index (Qwen3-Next's q rows and gate rows) stays."""
    if part is None or all(s is None for s in part):
        return None
    if shard.world == 1 and not any(isinstance(s, torch.Tensor) for s in part):
        return None
    return part


class DecoderModel:
    """The model of one rank (``shard``, an ``engine.shard.Shard``; ``comm``: its
    ``engine.dist.Comm``): under ``shard.world > 1`` it holds only its part of each split
    tensor (Megatron / vLLM): its attention heads' q|k|v rows and o columns (KV heads
    replicated where fewer than ranks: :class:`Heads`), its part of the dense MLP's gate|up
    rows and down columns, of the experts and Gated DeltaNet heads (``_moe``, ``_gdn``),
    and of the vocabulary (``ceil(vocab / world)`` embedding and LM-head rows, the last
    rank's padded with zero rows); norms, q/k norms and routers are replicated, and a
    row-parallel bias (o's) is added on rank 0 only. :meth:`forward` all-reduces each
    row-parallel projection's partial output (fp32, rounded once: ``Comm.all_reduce``)
    and all-gathers the logits. ``engine.shard.check_split`` refuses a config that does
    not split before any weight is read."""

    def __init__(self, ckpt, *, dtype, moe_isa, quantization="auto", shard=SINGLE, comm=LOCAL):
        cfg = ckpt.config
        if (comm.rank, comm.world) != (shard.rank, shard.world):
            raise ValueError(
                f"comm: expected rank {shard.rank} of {shard.world} (the shard's), got "
                f"rank {comm.rank} of {comm.world}"
            )
        if ckpt.shard not in (None, shard):
            raise ValueError(f"shard: expected the checkpoint's {ckpt.shard}, got {shard}")
        check_split(cfg, shard)  # before any weight is read
        self.config = cfg
        self.dtype = dtype
        self.shard, self.comm = shard, comm
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        heads = Heads(hq, hkv, d, shard)
        self.hq, self.hkv, self.d = heads.hq, heads.hkv, d  # this rank's heads
        qk_norm = cfg.family.qk_norm
        self.rot = int(d * cfg.partial_rotary_factor)  # rotary dims of each head
        sinks = cfg.family.attention_sinks  # per layer and head (GPT-OSS)

        def take(name, part=None):  # floats in the model dtype; codes as stored
            t = ckpt.take(name, _whole(part, shard))
            return t.to(dtype) if t.is_floating_point() else t

        def norm(name):  # fp32 [n] of the model-dtype weight (as HF computes with it)
            return (take(name).float() + cfg.norm_offset).contiguous()  # Gemma: 1 + w

        # GGUF weights kept in their quantised type (engine.quant), else packed
        self.quant = quant = QuantLoader(ckpt, quantization)

        def proj(*parts, pad_to=None):
            """The fused projection of ``parts`` (``(name, part or None)``: a tensor, or
            its rank's part, engine.loader.checkpoint.Part; a name may come twice with
            disjoint rows): a QuantWeight, or packed in the model dtype; zero rows added
            up to ``pad_to`` rows."""
            parts = [(n, _whole(p, shard)) for n, p in parts]
            w = quant.linear(parts, pad_to=pad_to)
            if w is not None:
                return w
            return pack(*_pad_rows(_take_parts(take, parts), pad_to))

        # the vocabulary's part of this rank: rows [v0, v1) of ceil(V / world) (its head
        # padded to vp rows; token ids outside embed to zeros, summed over the ranks)
        vocab, embed_name = cfg.vocab_size, "model.embed_tokens.weight"
        _check_rows(embed_name, ckpt.shape(embed_name), cfg)
        vp = -(-vocab // shard.world)
        self.v0, self.v1 = min(vocab, shard.rank * vp), min(vocab, (shard.rank + 1) * vp)
        vocab_rows = (slice(self.v0, self.v1),) if shard.world > 1 else None
        self.embed_q = quant.linear([(embed_name, vocab_rows)], pad_to=vp)
        if self.embed_q is None:
            rows = _pad_rows([take(embed_name, vocab_rows)], vp)  # (one rank: no copy)
            self.embed = rows[0] if len(rows) == 1 else torch.cat(rows)
        else:
            self.embed = None
        # each layer's rope (Gemma 3: one for its sliding layers, one for its full ones)
        ropes = cfg.layer_ropes or [(cfg.rope_theta, cfg.rope_scaling)] * cfg.num_hidden_layers
        self.rotaries = {}  # (theta, scaling) as a string -> Rotary
        self.layer_rotary = []
        for theta, scaling in ropes:
            key = repr((theta, scaling))
            if key not in self.rotaries:
                pos = cfg.max_position_embeddings
                self.rotaries[key] = Rotary(self.rot, theta, scaling, pos)
            self.layer_rotary.append(self.rotaries[key])
        self.embed_scale = None  # Gemma: the embedding times sqrt(H), in the model dtype
        if cfg.embed_scale != 1.0:
            self.embed_scale = torch.tensor(cfg.embed_scale, dtype=dtype)
        # this rank's part of the dense MLP's neurons
        mlp = (0, cfg.intermediate_size)
        if shard.world > 1 and any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
            mlp = shard.part(cfg.intermediate_size, "intermediate_size")
        neurons = (slice(*mlp),)
        self.weights = []  # LayerWeights per layer
        self.experts = {}  # layer index -> FusedMoE
        self.attn = []  # per layer: its AttentionLayer (heads, window), or None (GDN)
        self.mixers = {}  # layer index -> GatedDeltaNet (its token mixer runs outside)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            linear = cfg.layer_mixers[i] == "linear_attention"
            q, k, v = (a + n + "_proj.weight" for n in "qkv")
            kv = (heads.kv_rows(),)
            if linear:
                # the rank's heads (engine.gdn)
                self.mixers[i] = load_gdn(cfg, take, f"layer{i}", p + "linear_attn.", shard)
            elif cfg.attn_output_gate:  # q_proj: per head its q rows, then its gate rows
                qg = torch.arange(hq * 2 * d).reshape(hq, 2, d)[heads.q0 : heads.q0 + heads.hq]
                q_rows, g_rows = (qg[:, 0].reshape(-1),), (qg[:, 1].reshape(-1),)
                qkv = proj((q, q_rows), (k, kv), (v, kv), (q, g_rows))
            else:
                qkv = proj((q, (heads.q_rows(),)), (k, kv), (v, kv))
            # each weight packed once, straight into the weight arena (engine.memory);
            # q|k|v and gate|up fused into one GEMM each
            gate_up = down = None
            if cfg.is_moe_layer(i):
                # the rank's part (TP: each expert's neurons, EP: whole experts); a GGUF's
                # experts of a kept type stay quantised (engine.models.experts)
                self.experts[i] = load_moe(
                    cfg, take, p, moe_isa, (quantization, dtype), quant, shard
                )
            else:
                m = p + "mlp."
                gate_up = proj((m + "gate_proj.weight", neurons), (m + "up_proj.weight", neurons))
                down = proj((m + "down_proj.weight", (None, neurons[0])))
            sandwich = {}  # Gemma: the attention and MLP outputs normed before their adds
            post_norm = p + "post_attention_layernorm.weight"
            if cfg.sandwich_norms:
                sandwich = {
                    "post_attn_norm": norm(post_norm),
                    "post_mlp_norm": norm(p + "post_feedforward_layernorm.weight"),
                }
                post_norm = p + "pre_feedforward_layernorm.weight"
            if linear:
                self.weights.append(
                    LayerWeights(
                        input_norm=norm(p + "input_layernorm.weight"),
                        qkv=None,
                        o=None,
                        post_norm=norm(post_norm),
                        gate_up=gate_up,
                        down=down,
                    )
                )
                self.attn.append(None)
                continue
            o_bias = None  # a row-parallel bias: added on rank 0 only (the others read none)
            if cfg.attention_bias:
                o_bias = take(a + "o_proj.bias", None if shard.rank == 0 else (slice(0, 0),))
                o_bias = o_bias.float() if shard.rank == 0 else None
            self.weights.append(
                LayerWeights(
                    input_norm=norm(p + "input_layernorm.weight"),
                    qkv=qkv,
                    o=proj((a + "o_proj.weight", (None, heads.q_rows()))),
                    post_norm=norm(post_norm),
                    gate_up=gate_up,
                    down=down,
                    qkv_bias=self._qkv_bias(cfg, take, a, heads),
                    o_bias=o_bias,
                    q_norm=norm(a + "q_norm.weight") if qk_norm else None,
                    k_norm=norm(a + "k_norm.weight") if qk_norm else None,
                    sinks=self._sinks(take, a, heads) if sinks else None,
                    **sandwich,
                )
            )
            window = cfg.layer_windows[i]
            layer = AttentionLayer(
                f"layer{i}", self.hq, self.hkv, d, scale=cfg.attn_scale, sliding_window=window
            )
            self.attn.append(layer)
        self.final_norm = norm("model.norm.weight")
        if cfg.tie_word_embeddings:
            if "lm_head.weight" in ckpt.tensors:  # some exports store the tied copy
                del ckpt.tensors["lm_head.weight"]  # (unread: pop() would read it)
            head = self.embed_q if self.embed_q is not None else pack(self.embed)
        else:
            _check_rows("lm_head.weight", ckpt.shape("lm_head.weight"), cfg)
            head = proj(("lm_head.weight", vocab_rows), pad_to=vp)
        self.lm_head = head
        self.vocab_size = vocab  # the logits' width (this rank's head: vp rows)
        ckpt.check_all_used()
        quant.close()  # (holds no reference to the checkpoint's file map)
        self.stack = None  # the DecoderStack, once the caches are bound
        self.schedule = {}  # DecoderStack.prepare's workers / shared_widen_from (tests)

    @staticmethod
    def _sinks(take, a, heads):
        """fp32 [hq] sink logits of this rank's heads."""
        return take(a + "sinks", (slice(heads.q0, heads.q0 + heads.hq),)).float().contiguous()

    @staticmethod
    def _qkv_bias(cfg, take, a, heads):
        """fp32 q|k|v biases of this rank's heads (with the output gate: q|k|v|gate), or
        None."""
        if not cfg.qkv_bias:
            return None
        kv = [take(a + n + "_proj.bias", (heads.kv_rows(),)) for n in "kv"]
        if not cfg.attn_output_gate:
            return torch.cat([take(a + "q_proj.bias", (heads.q_rows(),)), *kv]).float()
        rows = slice(heads.q0 * 2 * heads.d, (heads.q0 + heads.hq) * 2 * heads.d)
        qg = take(a + "q_proj.bias", (rows,)).reshape(heads.hq, 2, heads.d)  # per head q, gate
        return torch.cat([qg[:, 0].reshape(-1), *kv, qg[:, 1].reshape(-1)]).float()

    def warmup_cases(self, plans):
        """``numkern.warmup``'s cases for this model's kernels, on one token at position 0
        with ``plans()`` (the step's attention plans, made by the case before): the
        decoder stack (a run of no layers: its kernel loads, nothing runs), the MoE
        experts of one layer, a GDN layer's chunked and decode kernels (in state slot 0,
        which the next request to take it starts from zero)."""
        x = torch.zeros(1, self.config.hidden_size, dtype=self.dtype)
        positions = torch.zeros(1, dtype=torch.int64)
        dt = str(self.dtype).removeprefix("torch.")

        def stack():
            cos_sin = tuple(r.cos_sin_cache(1) for r in self.group_rotary)
            if len(self.rotaries) == 1:
                cos_sin = cos_sin[0]
            step = self.stack.prepare(tuple(plans()), positions, cos_sin)
            # a partial stack (tensor parallelism) runs only its planned runs: its first
            # (layer 0's attention up to the o projection: KV slot 0 of block 0 written,
            # which a request writes before it reads); else a run of no layers
            first = self.stack.runs[0] if self.stack.partial else (0, 0)
            self.stack.run(step, x.clone(), layers=first)

        cases = [(f"decoder layers {dt}", stack)]
        if self.experts:
            moe = next(iter(self.experts.values()))
            cases.append((f"MoE experts {dt} ({moe.isa})", lambda: moe(x)))
            # a prefill's many rows per expert take other tiles (vdpbf16ps where the CPU
            # has it: numkern.moe's path rule), as does its router at M > 4: compiled here
            # too, so that the first prompt compiles nothing
            from numkern import moe as nk_moe

            rows = max(8, -(-moe.num_routed * nk_moe.DP_MIN_ROWS_PER_EXPERT // moe.topk))
            xs = torch.zeros(rows, self.config.hidden_size, dtype=self.dtype)
            cases.append((f"MoE experts {dt} ({moe.isa}, {rows} rows)", lambda: moe(xs)))
        if self.mixers:
            gdn = next(iter(self.mixers.values()))
            for what, has_state in (("chunked", False), ("decode", True)):
                step = gdn_step([1], [0], [has_state])
                cases.append((f"GDN {what} {dt}", lambda step=step: gdn(x, step)))
        return cases

    def weight_bytes(self):
        """Bytes of the weights this rank holds: its share of the split tensors plus the
        replicated ones (norms, routers, ...), each tensor counted once."""
        seen = set()

        def walk(obj, depth=0):
            if isinstance(obj, torch.Tensor):
                key = (obj.data_ptr(), obj.numel() * obj.element_size())
                if key not in seen:
                    seen.add(key)
                    yield key[1]
            elif hasattr(obj, "qtype") and hasattr(obj, "data"):  # a QuantWeight
                yield from walk(obj.data, depth)
            elif isinstance(obj, (list, tuple)):
                for x in obj:
                    yield from walk(x, depth)
            elif isinstance(obj, dict):
                for x in obj.values():
                    yield from walk(x, depth)
            elif depth < 3 and type(obj).__module__.startswith("engine."):  # FusedMoE, ...
                for x in vars(obj).values():
                    yield from walk(x, depth + 1)

        held = (self.weights, self.embed, self.embed_q, self.lm_head, self.final_norm)
        return sum(walk([*held, self.experts, self.mixers]))

    def attention_layers(self):
        return [L for L in self.attn if L is not None]

    def gdn_layers(self):
        return list(self.mixers.values())

    def bind(self, kv_caches, kv_groups, states=None):
        """Bind each attention layer's KV cache (``{layer name: numkern.attention.CacheView}``,
        made by the runner for its group's geometry) and its group (``{layer name: group
        index}``): the stack the forward runs; and each GDN layer's states (``{layer name:
        (conv state, recurrent state)}``)."""
        for layer in self.mixers.values():
            layer.bind(*states[layer.name])
        caches = [kv_caches[L.name] if L else None for L in self.attn]
        cfg = self.config
        groups = [kv_groups[L.name] if L else None for L in self.attn]
        # the rotary table of each group (the decoder rotates a run with its group's)
        rot = {}
        for g, r in zip(groups, self.layer_rotary):
            if g is None:
                continue
            if rot.setdefault(g, r) is not r:
                raise ValueError(
                    f"kv_groups: the layers of KV-cache group {g} rotate differently (one "
                    f"rotary table per group)"
                )
        self.group_rotary = [rot[g] for g in range(len(rot))]
        self.stack = DecoderStack(
            self.weights,
            caches,
            num_heads=self.hq,
            num_kv_heads=self.hkv,
            head_dim=self.d,
            eps=cfg.rms_norm_eps,
            final_norm=self.final_norm,
            lm_head=self.lm_head,
            scale=self.attention_layers()[0].scale,
            softcap=cfg.attn_softcap,
            kv_groups=groups,
            activation=cfg.hidden_act,
            logit_softcap=cfg.logit_softcap,
            rotary_dim=self.rot,
            attn_output_gate=cfg.attn_output_gate,
            dtype=self.dtype,
            partial=self.shard.world > 1,
        )

    def forward(self, ids, positions, plans, logits_rows, states=None):
        """ids/positions [T] int64, the step's attention plans (one per KV-cache group,
        with its validated indices), the step's :class:`engine.gdn.GDNStep` (GDN models)
        -> logits [len(logits_rows), vocab] fp32."""
        stack = self.stack
        if stack is None:
            raise RuntimeError("DecoderModel.forward: bind() the KV caches first")
        n_pos = int(positions.max()) + 1 if len(positions) else 1
        cos_sin = tuple(r.cos_sin_cache(n_pos) for r in self.group_rotary)
        if len(self.rotaries) == 1:
            cos_sin = cos_sin[0]
        h = self._embed(ids)  # [T, H], a new tensor: the residual stream, updated in place
        comm = self.comm
        logits = torch.empty(len(logits_rows), self.lm_head.shape[0])  # this rank's vocab
        step = stack.prepare(plans, positions, cos_sin, **self.schedule)  # once per step
        # the engine's one forward loop (docs/kernels.md section 8): a run hands off to
        # the experts or a Gated DeltaNet outside the stack, or (tensor parallel) ends at
        # a row-parallel projection; the sum over the ranks is the next run's residual_add
        add = None
        for run in stack.runs:
            head = {}
            if run.outside is None and run.l1 == stack.num_layers:  # the last run: the logits
                head = {"logits_rows": logits_rows, "logits": logits}
            x = stack.run(step, h, layers=run, residual_add=add, **head)
            if run.outside == "mlp":
                add = self.experts[run.l1 - 1](x)
            elif run.outside == "mixer":
                add = self.mixers[run.l1](x, states)
            elif run.outside == "reduce":
                add = x
            else:
                add = None
            if add is not None:
                add = comm.all_reduce(add)  # the identity on one rank
        if comm.world > 1:  # vocab-parallel head: the ranks' logits side by side
            logits = comm.all_gather(logits)[:, : self.vocab_size].contiguous()
        return logits

    def _embed(self, ids):
        """The embedding of ``ids`` [T] (times Gemma's scale): [T, H] in the model dtype, a
        new tensor. Vocab-parallel: each rank embeds the ids of its rows, zeros for the
        others', and the sum over the ranks is every row (one nonzero term: exact)."""
        local = ids
        if self.comm.world > 1:
            inside = (ids >= self.v0) & (ids < self.v1)
            local = torch.where(inside, ids - self.v0, 0)
        if self.embed_q is not None:  # only the step's rows dequantised
            h = embedding_rows(self.embed_q, local, self.dtype)
        else:
            h = self.embed[local]
        if self.comm.world > 1:
            h = self.comm.all_reduce(h.masked_fill_(~inside[:, None], 0))
        if self.embed_scale is not None:
            h = h * self.embed_scale
        return h
