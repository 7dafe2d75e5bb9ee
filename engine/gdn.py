"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) and their state cache.

A GDN layer is a token mixer with a fixed-size state per request instead of a KV cache:
the last ``K - 1`` inputs of its short causal convolution (the conv state, model dtype)
and the delta rule's ``[Hv, Dk, Dv]`` matrix (the recurrent state, fp32). Layers of equal
state shapes form a *state group*, one tensor pair per layer, indexed by a request's
*state slot*: the scheduler gives a request one slot when it is admitted (every state
group has ``max_num_seqs`` slots, so one id serves all groups), frees it when the
request finishes or is preempted, and a preempted request recomputes its state from its
tokens. A request's first chunk starts from a zero state (``has_initial_state`` False);
its later chunks and decode steps continue the slot's state.

:class:`GatedDeltaNet` runs one layer on numkern's public ops, from ``x``, the layer's
``input_norm(h)`` rows (``numkern.decoder.DecoderStack.run`` returns them), to the
``[T, H]`` output the next run adds to the residual stream:

1. one packed GEMM of ``x`` with the fused in-projection, rows ``q | k | v | z | b | a``
   (Qwen3-Next's per-k-head grouped ``in_proj_qkvz`` / ``in_proj_ba`` are put in this
   order at load; Qwen3.5's four projections are concatenated);
2. the causal conv + SiLU over ``q | k | v`` (``causal_conv1d_update`` on a decode step,
   ``causal_conv1d_fwd`` over the varlen chunk otherwise), reading and writing the conv
   state by slot;
3. the gated delta rule with L2-normalised q/k: on a decode step (every request one
   token, each with a state) the recurrent form with its gating fused in; otherwise
   ``fused_gdn_gating`` and the chunked form (new requests' slots zeroed first);
4. the gated RMSNorm of each head's output with ``z`` (``rms_norm_gated``), then the
   packed out-projection.

Which form runs is decided per step, from the step alone (:class:`GDNStep`); the kernels
are fixed and logged once per process.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

import numkern

from .kv_cache import BlockPool
from .memory import pack
from .platform import log_once

L2NORM_EPS = 1e-6  # transformers' l2norm of q and k (FLA's); vLLM's recurrent op fixes 1e-5


@dataclass(frozen=True)
class StateSpec:
    """One GDN layer's state per request: conv ``[conv_dim, conv_len]`` in ``dtype`` and
    the recurrent ``[num_v_heads, k_head_dim, v_head_dim]`` in fp32."""

    conv_dim: int
    conv_len: int  # the conv kernel size - 1
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: torch.dtype

    def bytes_per_slot(self):
        conv = self.conv_dim * self.conv_len * self.dtype.itemsize
        return conv + self.num_v_heads * self.k_head_dim * self.v_head_dim * 4


@dataclass
class StateGroup:
    spec: StateSpec
    layer_names: list
    num_slots: int = 0
    conv: dict = field(default_factory=dict)  # layer name -> [slots, conv_dim, conv_len]
    ssm: dict = field(default_factory=dict)  # layer name -> [slots, Hv, Dk, Dv] fp32

    def bytes_per_slot(self):
        return self.spec.bytes_per_slot() * len(self.layer_names)

    def allocate(self, num_slots):
        """States of ``num_slots`` slots for every layer, allocated and not written (a
        request's first chunk zeroes its recurrent state and reads no conv state: a slot's
        pages are first touched by the request that holds it). The conv state is vLLM's
        layout: memory ``[slots, conv_len, conv_dim]`` (channels contiguous), viewed as
        ``[slots, conv_dim, conv_len]``."""
        s = self.spec
        self.num_slots = num_slots
        self.conv = {
            n: torch.empty(num_slots, s.conv_len, s.conv_dim, dtype=s.dtype).transpose(1, 2)
            for n in self.layer_names
        }
        self.ssm = {
            n: torch.empty(num_slots, s.num_v_heads, s.k_head_dim, s.v_head_dim)
            for n in self.layer_names
        }

    def info(self):
        """What ``LLM.state_groups`` shows of the group (allocated)."""
        s = self.spec
        return StateGroupInfo(
            layer_names=tuple(self.layer_names),
            conv_state_shape=(s.conv_dim, s.conv_len),
            conv_state_dtype=s.dtype,
            ssm_state_shape=(s.num_v_heads, s.k_head_dim, s.v_head_dim),
            ssm_state_dtype=torch.float32,
            num_slots=self.num_slots,
        )


@dataclass(frozen=True)
class StateGroupInfo:
    """What ``LLM.state_groups`` shows of one GDN state group."""

    layer_names: tuple
    conv_state_shape: tuple  # per slot
    conv_state_dtype: torch.dtype
    ssm_state_shape: tuple  # per slot
    ssm_state_dtype: torch.dtype
    num_slots: int


def group_states(specs):
    """``{layer name: StateSpec}`` -> state groups of layers with equal specs."""
    groups = {}
    for name, spec in specs.items():
        groups.setdefault(spec, []).append(name)
    return [StateGroup(spec, names) for spec, names in groups.items()]


class SlotPool(BlockPool):
    """The state slots ``0..n-1``: a request holds one while it runs."""


class GDNStep(NamedTuple):
    """A step's GDN inputs, shared by every GDN layer: ``query_start_loc`` int32
    ``[R+1]``, each request's state ``slots`` int32 ``[R]`` and ``has_initial_state``
    bool ``[R]`` (False: its first chunk), the slots to zero before a chunked step
    (int64, those without a state), and ``decode``: every request one token with a
    state (the recurrent form and the conv update)."""

    query_start_loc: torch.Tensor
    slots: torch.Tensor
    has_initial_state: torch.Tensor
    new_slots: torch.Tensor
    decode: bool


def gdn_step(lens, slots, has_state):
    """The :class:`GDNStep` of requests with ``lens`` tokens this step, in ``slots``,
    ``has_state`` saying which continue a state (NumPy or lists)."""
    r_n = len(lens)
    qsl = torch.zeros(r_n + 1, dtype=torch.int32)
    torch.cumsum(torch.as_tensor(lens, dtype=torch.int32), 0, out=qsl[1:])
    sl = torch.as_tensor(slots, dtype=torch.int32)
    init = torch.as_tensor(has_state, dtype=torch.bool)
    new = sl[~init].to(torch.int64)
    decode = bool(init.all()) and all(int(n) == 1 for n in lens)
    return GDNStep(qsl, sl, init, new, decode)


class GatedDeltaNet:
    """One GDN layer (module docstring). Weights in the model dtype, transformers'
    shapes: ``in_proj [2 Hk Dk + 2 Hv Dv + 2 Hv, H]`` (rows q, k, v, z, b, a),
    ``conv [conv_dim, K]``, ``A_log``, ``dt_bias [Hv]``, ``norm [Dv]``, ``out_proj [H, Hv
    Dv]``."""

    def __init__(self, name, cfg, *, in_proj, conv, A_log, dt_bias, norm, out_proj, eps):
        self.name = name
        self.hk, self.hv = cfg.num_k_heads, cfg.num_v_heads
        self.dk, self.dv = cfg.k_head_dim, cfg.v_head_dim
        self.conv_dim = cfg.conv_dim
        self.value_dim = self.hv * self.dv
        n_in = self.conv_dim + self.value_dim + 2 * self.hv
        if tuple(in_proj.shape[:1]) != (n_in,):
            raise ValueError(f"{name}.in_proj: expected {n_in} rows, got {list(in_proj.shape)}")
        self.dtype = in_proj.dtype
        self.hidden = in_proj.shape[1]
        self.n_in = n_in
        # numkern.gdn is imported with the first GDN layer: most models have none, and
        # its import is ~40 ms of an engine's start
        from numkern import gdn

        self.ops = G = gdn
        self.in_proj = pack(in_proj)
        self.out_proj = pack(out_proj)
        conv = conv.reshape(self.conv_dim, -1).contiguous()
        self.conv_len = conv.shape[1] - 1
        # vLLM's packed conv weight where its layout applies (channels in blocks of 32, an
        # even width): the conv kernels' fast path (14 vs 25 us a decode step, bf16 B=1)
        self.conv_packed = self.conv_dim % G.conv.PACK_N == 0 and conv.shape[1] % 2 == 0
        self.conv = G.causal_conv1d_weight_pack(conv) if self.conv_packed else conv
        # the gating's parameters in the model dtype (the ops widen them to fp32, as HF)
        self.A_log = A_log.contiguous()
        self.dt_bias = dt_bias.contiguous()
        self.norm = norm.contiguous()
        self.eps = float(eps)
        self.conv_state = self.ssm_state = None
        log_once(
            ("gdn", self.dtype),
            "GDN layers (%s): numkern.gdn kernels — decode steps: causal_conv1d_update + "
            "recurrent delta rule (gating fused); other steps: causal_conv1d_fwd + "
            "fused_gdn_gating + chunked delta rule; conv weight %s; fp32 state",
            self.dtype,
            "packed (vLLM's layout)" if self.conv_packed else "plain",
        )

    def spec(self):
        return StateSpec(self.conv_dim, self.conv_len, self.hv, self.dk, self.dv, self.dtype)

    def bind(self, conv_state, ssm_state):
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def __call__(self, x, step):
        """``x [T, H]`` (the layer's ``input_norm(h)``), ``step`` a :class:`GDNStep` ->
        ``[T, H]``; the bound states of the step's slots are updated in place."""
        G, t_n, dt = self.ops, x.shape[0], self.dtype
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        cd, vd, kd = self.conv_dim, self.value_dim, hk * dk
        proj = torch.empty(t_n, self.n_in, dtype=dt)
        numkern.weight_packed_linear(proj, x, self.in_proj, None, True)
        mixed = proj[:, :cd]
        conv_state, ssm = self.conv_state, self.ssm_state
        if step.decode:
            conv = G.causal_conv1d_update(
                mixed, conv_state, self.conv, None, True, step.slots, self.conv_packed
            )
        else:
            if step.new_slots.numel():
                ssm.index_fill_(0, step.new_slots, 0.0)
            conv = G.causal_conv1d_fwd(
                mixed.t(),
                self.conv,
                None,
                conv_state,
                step.query_start_loc,
                step.slots,
                step.has_initial_state,
                True,
                self.conv_packed,
            ).t()
        q = conv[:, :kd].unflatten(1, (hk, dk))[None]
        k = conv[:, kd : 2 * kd].unflatten(1, (hk, dk))[None]
        v = conv[:, 2 * kd :].unflatten(1, (hv, dv))[None]
        z = proj[:, cd : cd + vd].unflatten(1, (hv, dv))
        b = proj[:, cd + vd : cd + vd + hv]
        a = proj[:, cd + vd + hv :]
        if step.decode:
            o = G.fused_sigmoid_gating_delta_rule_update(
                self.A_log, self.dt_bias, q, k, v, a, b, ssm, step.slots,
                step.query_start_loc, True, eps=L2NORM_EPS,
            )  # fmt: skip
        else:
            g, beta = G.fused_gdn_gating(self.A_log, a, b, self.dt_bias)
            o, _ = G.chunk_gated_delta_rule(
                q, k, v, g, beta, ssm, True, step.query_start_loc, False, True, step.slots,
                eps=L2NORM_EPS,
            )  # fmt: skip
        y = G.rms_norm_gated(o.view(t_n, hv, dv), z, self.norm, self.eps)
        out = torch.empty(t_n, self.hidden, dtype=dt)
        numkern.weight_packed_linear(out, y.view(t_n, vd), self.out_proj, None, True)
        return out


def qwen3_next_in_proj(qkvz, ba, cfg):
    """Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (grouped per k head: q, k, the
    group's v heads, their z; b of the group's v heads, then a) -> the rows ``q | k | v |
    z | b | a``, each head-major, as transformers' ``fix_query_key_value_ordering``
    splits them."""
    hk, r = cfg.num_k_heads, cfg.num_v_heads // cfg.num_k_heads
    dk, dv = cfg.k_head_dim, cfg.v_head_dim
    w = qkvz.reshape(hk, 2 * dk + 2 * r * dv, -1)
    cuts = (dk, dk, r * dv, r * dv)
    q, k, v, z = (p.reshape(-1, w.shape[-1]) for p in torch.split(w, cuts, dim=1))
    w2 = ba.reshape(hk, 2 * r, -1)
    b, a = (p.reshape(-1, w2.shape[-1]) for p in torch.split(w2, (r, r), dim=1))
    return torch.cat([q, k, v, z, b, a])


def load_gdn(cfg, take, name, m, shard=None):
    """Layer ``name``'s :class:`GatedDeltaNet` from the checkpoint (``m``: its
    ``linear_attn.`` prefix; ``take(tensor name, part=None)``: the model's reader), the
    rank's heads under tensor parallelism (``shard``, an ``engine.shard.Shard``; None or
    one rank: all): k heads ``[k0, k1)`` and v heads ``[v0, v1)`` (the v heads of its k
    heads: v head j reads k head ``j // (Hv / Hk)``), so its q, k and v rows of the
    in-projection and conv channels, its z, b and a rows (Qwen3-Next's grouped
    ``in_proj_qkvz`` / ``in_proj_ba``: its k heads' groups, contiguous rows), ``A_log``
    and ``dt_bias`` of its v heads, ``out_proj``'s columns of its v heads (a row-parallel
    projection without a bias: the model all-reduces the output); the gated norm's
    weight (per head dim) replicated. Its states hold its heads only."""
    g = cfg.gdn
    hk, hv, dk, dv = g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim
    k0, k1, v0, v1 = 0, hk, 0, hv
    if shard is not None and shard.world > 1:
        k0, k1 = shard.part(hk, "linear_num_key_heads")
        v0, v1 = shard.part(hv, "linear_num_value_heads")
    split = (k0, k1, v0, v1) != (0, hk, 0, hv)

    def part(*dims):  # None: the whole tensor, read as the unsplit engine reads it
        return dims if split else None

    mine = dataclasses.replace(g, num_k_heads=k1 - k0, num_v_heads=v1 - v0)
    ar = torch.arange
    # q | k | v channels of this rank's heads (of in_proj_qkv's rows and conv1d's)
    qkv = torch.cat([ar(k0 * dk, k1 * dk), ar((hk + k0) * dk, (hk + k1) * dk),
                     ar(2 * hk * dk + v0 * dv, 2 * hk * dk + v1 * dv)])  # fmt: skip
    vd = (slice(v0 * dv, v1 * dv),)
    if cfg.family.gdn_in_proj == "qkvz_ba":  # Qwen3-Next: grouped per k head
        r = hv // hk
        group = 2 * dk + 2 * r * dv
        in_proj = qwen3_next_in_proj(
            take(m + "in_proj_qkvz.weight", part(slice(k0 * group, k1 * group))),
            take(m + "in_proj_ba.weight", part(slice(k0 * 2 * r, k1 * 2 * r))),
            mine,
        )
    else:  # Qwen3.5: q|k|v, z, b, a apart
        in_proj = torch.cat([
            take(m + "in_proj_qkv.weight", part(qkv)),
            take(m + "in_proj_z.weight", part(*vd)),
            take(m + "in_proj_b.weight", part(slice(v0, v1))),
            take(m + "in_proj_a.weight", part(slice(v0, v1))),
        ])  # fmt: skip
    return GatedDeltaNet(
        name,
        mine,
        in_proj=in_proj,
        conv=take(m + "conv1d.weight", part(qkv)),
        A_log=take(m + "A_log", part(slice(v0, v1))),
        dt_bias=take(m + "dt_bias", part(slice(v0, v1))),
        norm=take(m + "norm.weight"),
        out_proj=take(m + "out_proj.weight", part(None, *vd)),
        eps=cfg.rms_norm_eps,
    )
