"""The public decoder stack (docs/kernels.md, "The decoder run"): :class:`DecoderStack`
validates a model's layers, KV caches and head once; :meth:`DecoderStack.prepare`
validates one step's inputs once into an immutable :class:`DecoderStep`; and
:meth:`DecoderStack.run` runs one run of layers of that step (``DecoderStack.runs``) in
one kernel call (:func:`numkern.decoder.layer._run`), checking only what changes per run.
"""

import itertools
from typing import NamedTuple

import numba
import numpy as np
import torch

from .. import _boot  # noqa: F401  (numkern's Numba settings: see numkern/_boot.py)
from .. import _check as C
from ..attention import AttentionPlan
from ..attention.kernels import Heads, Scores, tile_witness
from ..gemm import _WITNESS as _PAIR_WITNESS
from ..gemm import GEMM_WITNESS, PATH, WIDEN_PARALLEL
from ..isa import amx_emulated, quant_path
from ..moe import ACTIVATIONS
from ..quant import QuantWeight
from ..simd_int8 import path_witness
from .layer import (
    LAYER,
    QUANTISABLE,
    LayerWeights,
    _Cache,
    _Head,
    _Model,
    _run,
    _Schedule,
    _Stream,
    _Tokens,
    _Work,
)
from .phases import N_HEAD, N_PHASE, phase_units
from .qgemm import _act
from .runs import Run, _check_cache, _check_groups, _plan_partial, _plan_runs

DENSE_ACTIVATIONS = ("silu", "gelu_tanh")  # f of the dense MLP's f(gate) * up

_F32 = C.WITNESS[torch.float32]
_ROWS = C.WITNESS[torch.int64]
_NO_QUANT = np.empty(0, np.bool_)  # no quantised weight (else a path witness: layer._linear)
_BYTES = np.empty(0, np.uint8)
_APART = "the KV caches' (the run writes them)"


def _pairs(dt):
    """The packed weights' carrier of model dtype ``dt`` (16-bit weights as K pairs)."""
    return _PAIR_WITNESS[dt][1]


def _weight_address(name, w, dt, shape):
    """``(address, type)`` of a projection: a packed ``dt`` tensor of ``shape`` (type 0)
    or a :class:`numkern.quant.QuantWeight` of that shape (type: its code + 1); ``(0,
    0)`` for None. TypeError/ValueError naming ``name`` otherwise."""
    if not isinstance(w, QuantWeight):
        return C.tensor_address(name, w, dt, shape), 0
    if tuple(w.shape) != tuple(shape):
        raise ValueError(
            f"{name}: expected a QuantWeight of shape {list(shape)}, got {list(w.shape)}"
        )
    C.check_tensor(f"{name}.data", w.data, torch.uint8, (w.nbytes,))
    return C.address(w.data), w.code + 1


def _cache_ranges(caches):
    """The byte ranges of the layers' KV caches (each a contiguous ``kv_cache_shape``
    tensor: its K and V halves), sorted, with each layer's name: ValueError when two layers
    share memory (each would overwrite the other's K and V)."""
    named = []
    for i, cv in enumerate(caches):
        if cv is not None:
            (k0, k1), (v0, v1) = C.contiguous_bytes(cv.kw), C.contiguous_bytes(cv.vw)
            named.append((f"caches[{i}]", (min(k0, v0), max(k1, v1))))
    return C.disjoint_ranges(named, "each layer writes its own cache")


class _GroupStep(NamedTuple):
    """One KV-cache group's part of a step: what the group's runs hand the kernel."""

    tokens: _Tokens  # the validated positions, the group's rotary table, its plan's slots
    arrays: object  # the group's plan's StepArrays (with this step's partial buffers)
    scores: Scores  # scale, the plan's causal and window, softcap


class DecoderStep(NamedTuple):
    """One step's inputs to :meth:`DecoderStack.run`, validated once by
    :meth:`DecoderStack.prepare`: immutable (the kernels read validated, read-only copies
    of the positions and the plans' indices, so changing the tensors handed to
    ``prepare`` has no effect on the step). It holds the step's workspaces and schedule:
    run it from one thread at a time (each thread prepares its own step).

    ``stack``: the stack it was prepared for; ``num_tokens``: T; ``groups``: per KV-cache
    group what its runs read; ``schedule``: the workers, the shared widening threshold and
    the done counts of the last run; ``scratch``: the qkv, att, tmp, gu and act workspaces.
    """

    stack: object
    num_tokens: int
    groups: tuple
    schedule: _Schedule
    scratch: tuple
    qs: object  # the quantised GEMMs' shared activations (layer._run), or an empty array

    def phase_units(self, layers):
        """``{phase name: units done}`` of this step's last run that computed (T > 0), its
        layers ``layers = (l0, l1)``: e.g. ``"gate_up.widen"``, the units of the shared
        widening phase of the gate|up GEMMs (numkern.decoder.phases.PHASES; ``layers`` may
        be the run's :class:`Run`). A test's view of which phases handed out work; reading
        it costs the run nothing."""
        l0, l1 = layers[:2]
        return phase_units(self.schedule.units, l0, l1)


class DecoderStack:
    """The layers of a decoder, their KV caches and its head, validated once.

    ``layers``: :class:`LayerWeights` per layer; ``caches``: the
    :class:`numkern.attention.CacheView` of each layer's KV cache; ``kv_groups``: each
    layer's KV-cache group, ints ``0..G-1`` (default: all 0, one group). The caches of
    one group share an ISA, a layout and a size (one block table and slot mapping per
    step address them); groups may differ in block size, window, ISA and size, and each
    step has one attention plan per group. ``final_norm`` fp32 ``[H]``; ``lm_head`` packed
    ``[vocab, H]`` in the model dtype (that of every packed weight and of the caches), or
    a :class:`numkern.quant.QuantWeight` with the model dtype given as ``dtype``; a
    layer's projections may be QuantWeights too (docs/kernels.md §8: their GEMMs run
    numkern.quant's blocks, on the path ``quant_path``).
    ``eps`` >= 0; ``scale`` > 0 defaults to ``head_dim ** -0.5``; ``softcap`` >= 0 (0:
    none); ``rotary_dim`` (even, at most head_dim) defaults to head_dim; ``is_neox`` a
    bool; ``attn_output_gate`` a bool: every attention layer's ``qkv`` then has ``Hq D``
    gate rows after its v rows (``[(2 Hq + 2 Hkv) D, H]``, its bias likewise), and its
    attention output is multiplied by their sigmoid before ``o`` (Qwen3-Next). Every
    dense layer has the same intermediate size. Raises ``TypeError``/``ValueError``
    naming the argument (``layers[3].qkv``) and what was expected. ``partial`` a bool:
    the stack holds one rank's share of a tensor-parallel model, and every run ends at
    its row-parallel projections (``runs``: half layers ending with ``"reduce"``; see
    :meth:`run`). The tensors must stay
    unchanged in place while the stack is used: the stack keeps references and addresses,
    not copies.

    Per step, as flashinfer's wrappers plan once and run per layer: :meth:`prepare`
    validates the step's plans, positions and rotary tables once and returns a
    :class:`DecoderStep`; :meth:`run` runs one run of layers (``runs``) with it, cheaply.
    """

    def __init__(
        self,
        layers,
        caches,
        *,
        num_heads,
        num_kv_heads,
        head_dim,
        eps,
        final_norm,
        lm_head,
        scale=None,
        softcap=0.0,
        rotary_dim=None,
        is_neox=True,
        kv_groups=None,
        activation="silu",
        logit_softcap=0.0,
        attn_output_gate=False,
        dtype=None,
        partial=False,
    ):
        hq = C.check_int("num_heads", num_heads, low=1)
        hkv = C.check_int("num_kv_heads", num_kv_heads, low=1)
        d = C.check_int("head_dim", head_dim, low=1)
        if hq % hkv:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads={hkv}, got {hq}")
        rot = d if rotary_dim is None else C.check_int("rotary_dim", rotary_dim, low=2)
        if rot % 2 or rot > d:
            raise ValueError(f"rotary_dim: expected an even number <= head_dim={d}, got {rot}")
        if not isinstance(is_neox, bool):
            raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
        eps = C.check_float("eps", eps, low=0.0)
        scale = C.check_float("scale", d**-0.5 if scale is None else scale, positive=True)
        softcap = C.check_float("softcap", softcap, low=0.0)
        logit_softcap = C.check_float("logit_softcap", logit_softcap, low=0.0)
        gated = C.check_bool("attn_output_gate", attn_output_gate)
        partial = C.check_bool("partial", partial)
        if activation not in DENSE_ACTIVATIONS:
            raise ValueError(
                f"activation: expected one of {DENSE_ACTIVATIONS} (the dense MLP's), got "
                f"{activation!r}"
            )
        layers = list(layers)
        caches = list(caches)
        if not layers:
            raise ValueError("layers: expected at least one LayerWeights")
        for i, lw in enumerate(layers):
            if not isinstance(lw, LayerWeights):
                raise TypeError(f"layers[{i}]: expected LayerWeights, got {type(lw).__name__}")
        if len(caches) != len(layers):
            raise ValueError(f"caches: expected {len(layers)} (one per layer), got {len(caches)}")
        head_q = isinstance(lm_head, QuantWeight)
        if not (head_q or isinstance(lm_head, torch.Tensor)) or len(lm_head.shape) != 2:
            raise TypeError(
                f"lm_head: expected a 2-D packed torch.Tensor or QuantWeight, got {lm_head!r:.60}"
            )
        if dtype is None and head_q:
            raise ValueError("dtype: expected the model dtype with a quantised lm_head, got None")
        dt = lm_head.dtype if dtype is None else dtype
        if dt not in C.FLOATS:
            raise TypeError(f"dtype: expected one of {C.FLOATS}, got {dt}")
        vocab, hid = lm_head.shape
        _weight_address("lm_head", lm_head, dt, (vocab, hid))
        C.check_tensor("final_norm", final_norm, torch.float32, (hid,))
        nq = hq * d
        nqkv = (hq + 2 * hkv) * d + (nq if gated else 0)  # q, k, v (, gate) rows
        dense = [lw.gate_up is not None for lw in layers]
        inter = {lw.gate_up.shape[0] // 2 for lw in layers if lw.gate_up is not None}
        if len(inter) > 1:
            raise ValueError(f"layers: dense MLPs of one intermediate size, got {sorted(inter)}")
        inter = inter.pop() if inter else 0
        mixer = [lw.qkv is not None for lw in layers]  # attention inside (else outside)
        if not any(mixer):
            raise ValueError("layers: expected at least one attention layer (qkv given)")
        groups = _check_groups(kv_groups, mixer)
        first = {}  # group -> its first layer's cache
        for i, (cv, g) in enumerate(zip(caches, groups)):
            if g is None:  # a layer whose token mixer runs outside has no KV cache
                if cv is not None:
                    raise ValueError(f"caches[{i}]: expected None (layers[{i}].qkv is None)")
                continue
            _check_cache(f"caches[{i}]", cv, first.setdefault(g, cv), hkv, d, dt)
        table = np.zeros(len(layers), LAYER)
        address = C.tensor_address  # (0 for an absent tensor)
        for i, (lw, cv) in enumerate(zip(layers, caches)):
            p = f"layers[{i}]."
            row = table[i]
            row["input_norm"] = address(p + "input_norm", lw.input_norm, torch.float32, (hid,))
            row["post_norm"] = address(p + "post_norm", lw.post_norm, torch.float32, (hid,))
            row["qkv"], row["qkv_q"] = _weight_address(p + "qkv", lw.qkv, dt, (nqkv, hid))
            row["o"], row["o_q"] = _weight_address(p + "o", lw.o, dt, (hid, nq))
            row["qkv_bias"] = address(p + "qkv_bias", lw.qkv_bias, torch.float32, (nqkv,))
            row["o_bias"] = address(p + "o_bias", lw.o_bias, torch.float32, (hid,))
            if (lw.q_norm is None) != (lw.k_norm is None):
                raise ValueError(f"{p}q_norm/k_norm: expected both or neither")
            row["q_norm"] = address(p + "q_norm", lw.q_norm, torch.float32, (d,))
            row["k_norm"] = address(p + "k_norm", lw.k_norm, torch.float32, (d,))
            row["sinks"] = address(p + "sinks", lw.sinks, torch.float32, (hq,))
            row["post_attn_norm"] = address(
                p + "post_attn_norm", lw.post_attn_norm, torch.float32, (hid,)
            )
            row["post_mlp_norm"] = address(
                p + "post_mlp_norm", lw.post_mlp_norm, torch.float32, (hid,)
            )
            if not mixer[i]:  # the token mixer runs outside (a Gated DeltaNet layer)
                attention = ("o", "qkv_bias", "o_bias", "q_norm", "sinks", "post_attn_norm")
                given = [f for f in attention if getattr(lw, f) is not None]
                if given:
                    raise ValueError(
                        f"{p}{given[0]}: expected None with qkv=None (the layer's token mixer "
                        f"runs outside the stack)"
                    )
            elif lw.o is None:
                raise ValueError(f"{p}o: expected a packed [H, Hq*D] tensor with qkv")
            if lw.post_mlp_norm is not None and lw.gate_up is None:
                raise ValueError(f"{p}post_mlp_norm: expected only with a dense MLP (gate_up/down)")
            if (lw.gate_up is None) != (lw.down is None):
                raise ValueError(f"{p}gate_up/down: expected both (a dense MLP) or neither")
            gate_up = _weight_address(p + "gate_up", lw.gate_up, dt, (2 * inter, hid))
            row["gate_up"], row["gate_up_q"] = gate_up
            row["down"], row["down_q"] = _weight_address(p + "down", lw.down, dt, (hid, inter))
            row["k_cache"] = C.address(cv.kw) if mixer[i] else 0
            row["v_cache"] = C.address(cv.vw) if mixer[i] else 0
        self.layers, self.caches, self.table = layers, caches, table  # (kept alive)
        self.final_norm, self.lm_head = final_norm, lm_head
        self.dtype = dt
        self.num_layers, self.hidden_size, self.vocab_size = len(layers), hid, vocab
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.intermediate_size = inter
        self.dense = tuple(dense)
        self.mixer = tuple(mixer)
        self.kv_groups = groups
        n_g = len(first)
        # one CacheGeometry per group (numkern.attention.CacheGeometry: blocks, block
        # size, isa, ...): a plan built from it must name the same one (§6.1)
        self.geometries = tuple(first[g].geometry for g in range(n_g))
        self.partial = partial
        self.runs = _plan_partial(dense, mixer) if partial else _plan_runs(dense, mixer, groups)
        # each planned run's kernel view, looked up per call (a Run of runs: no checks)
        self._kernel_runs = {}  # (empty while _layers checks each of them)
        self._kernel_runs = {
            r: self._plan_partial_run(r) if partial else self._layers(r) for r in self.runs
        }
        self.segments = tuple((r.l0, r.l1) for r in self.runs)
        act = ACTIVATIONS[activation]
        # bf16 GEMMs from gemm.DP_MIN_M rows on vdpbf16ps where this process's path is
        # dpbf16; where it is fma256 (no AVX-512) every dtype widens onto gemm's panel
        # tiles (gemm.TILES, passed to _block), else onto its 8x32 tiles
        if dt == torch.bfloat16 and PATH in ("amx", "dpbf16"):
            self.gemm_path = PATH
        else:
            self.gemm_path = "fma256" if PATH == "fma256" else "widen"
        if self.gemm_path == "amx" and amx_emulated():  # test-only: numkern.amx
            self.gemm_path = "amx-emulated"
        path = GEMM_WITNESS[self.gemm_path]
        # any quantised weight: the variant holding numkern.quant's blocks (layer._linear)
        self.quantised = head_q or any(int(table[f"{q}_q"].max()) for q in QUANTISABLE)
        # their path, once per stack: fp32 activations never quantised, else the CPU's
        # int8 dot product (numkern.isa.QUANT)
        self.quant_path = None
        quant = _NO_QUANT
        if self.quantised:
            self.quant_path = "fp32" if dt == torch.float32 else quant_path()[0]
            quant = path_witness(self.quant_path)
        model = (hid, inter, eps, rot, is_neox, _pairs(dt), act, logit_softcap, gated, path)
        self._model = _Model(*model, quant)
        self.activation, self.logit_softcap = activation, logit_softcap
        self.attn_output_gate = gated
        self._heads = Heads(hq, hkv, d)
        self._caches = tuple(
            _Cache(first[g].kw[:0], first[g].kr[:0], first[g].kw.size) for g in range(n_g)
        )
        self._layouts = tuple(first[g].layout for g in range(n_g))
        self._scale, self._softcap = scale, softcap
        # per token: the workspaces besides x (qkv, att, tmp, gu, act)
        self._widths = (nqkv, nq, hid, 2 * inter, inter)
        if head_q:  # the head's buffer (and an empty packed one), or the packed head
            self._head_w, self._head_q = _pairs(dt), C.as_numpy(lm_head.data).reshape(-1)
            self._head_qt = lm_head.code + 1
        else:
            self._head_w = C.as_numpy(lm_head).reshape(-1).view(_pairs(dt).dtype)
            self._head_q, self._head_qt = _BYTES, 0
        self._head_norm = final_norm.numpy()
        self._carrier = C.WITNESS[dt]
        self._spans = _cache_ranges(caches)  # the caches' memory, checked apart once
        # each phase's done count of a run: one per phase of the longest run
        self._phases = 1 + len(layers) * N_PHASE + N_HEAD

    @property
    def isas(self):
        """Each KV-cache group's attention isa (of its geometry)."""
        return tuple(geo.isa for geo in self.geometries)

    @property
    def num_blocks(self):
        """Each KV-cache group's block count (of its geometry)."""
        return tuple(geo.num_blocks for geo in self.geometries)

    def _plan_of(self, plan, g):
        """Group ``g``'s plan of the step's ``plan`` (one plan, or one per group)."""
        n_g = len(self.geometries)
        if isinstance(plan, AttentionPlan) and n_g == 1:
            return plan
        if not (isinstance(plan, (tuple, list)) and len(plan) == n_g):
            raise TypeError(
                f"plan: expected {'an AttentionPlan or ' if n_g == 1 else ''}a tuple of "
                f"{n_g} AttentionPlans (one per KV-cache group), got {plan!r:.60}"
            )
        return plan[g]

    def prepare(
        self, plan, positions, cos_sin_cache, *, workers=None, shared_widen_from=WIDEN_PARALLEL
    ):
        """Validate one step's inputs once, for every run of the step: returns a
        :class:`DecoderStep` for :meth:`run`.

        ``plan``: the step's :func:`numkern.attention.plan_attention` with ``block_table``,
        ``slot_mapping`` and ``num_blocks`` (for this stack's heads and its group's block
        size, ISA and cache; its window is the layers'), or with several KV-cache groups a
        tuple of one such plan per group: a run uses its group's; ``positions`` int64
        ``[T]``, rows of ``cos_sin_cache`` (fp32 NumPy ``[P, rotary_dim]``: cos, then sin;
        or a tuple of one per KV-cache group, when the groups' layers rotate differently:
        Gemma 3's local and global rope). The kernels read validated copies: changing
        ``positions`` in place after ``prepare`` has no effect on the step. ``workers``
        (default: Numba's thread count) and ``shared_widen_from`` change the schedule,
        never the result.
        """
        n_g = len(self.geometries)
        if isinstance(cos_sin_cache, (tuple, list)):  # one table per KV-cache group
            if len(cos_sin_cache) != n_g:
                raise ValueError(
                    f"cos_sin_cache: expected one array, or one per KV-cache group "
                    f"({n_g}), got {len(cos_sin_cache)}"
                )
            tables = tuple(cos_sin_cache)
        else:
            tables = (cos_sin_cache,) * n_g
        groups, pos, t_n = [], None, 0
        for g in range(n_g):
            p = self._plan_of(plan, g)
            name = "plan" if n_g == 1 else f"plan[{g}]"
            if not isinstance(p, AttentionPlan):
                raise TypeError(f"{name}: expected an AttentionPlan, got {type(p).__name__}")
            if p.slot_mapping is None or p.block_table is None:
                raise ValueError(
                    f"{name}: expected a plan built with block_table, slot_mapping and "
                    "num_blocks (the run writes the cache and reads the table the plan "
                    "validated)"
                )
            group = f" of KV-cache group {g}" if n_g > 1 else ""
            geo = self.geometries[g]
            if p.geometry is not None and p.geometry != geo:
                raise ValueError(f"{name}: built for {p.geometry}; the caches{group} have {geo}")
            want = (*self._heads, geo.block_size, geo.isa, geo.num_blocks)
            got = (p.num_heads, p.num_kv_heads, p.head_dim, p.block_size, p.isa, p.num_blocks)
            if got != want:
                raise ValueError(
                    f"{name}: built for (heads, kv heads, head_dim, block_size, isa, "
                    f"num_blocks) = {got}; the caches{group} have {want}"
                )
            t_n = p.num_tokens
            C.check_tensor("positions", positions, torch.int64, (t_n,))
            cs = tables[g]
            if not isinstance(cs, np.ndarray) or cs.dtype != np.float32:
                raise TypeError("cos_sin_cache: expected a float32 NumPy array [max_position, rot]")
            rot = self._model.rot
            if cs.ndim != 2 or cs.shape[1] != rot:
                raise ValueError(
                    f"cos_sin_cache: expected shape [max_position, {rot}], got {list(cs.shape)}"
                )
            if not cs.flags.c_contiguous:
                raise ValueError("cos_sin_cache: expected a C-contiguous array")
            if pos is None:
                pos = positions.numpy().copy()  # the kernels read this validated copy
                pos.flags.writeable = False
            if t_n and (int(pos.min()) < 0 or int(pos.max()) >= cs.shape[0]):
                raise ValueError(
                    f"positions: expected values in [0, {cs.shape[0]}) (rows of "
                    f"cos_sin_cache), got [{int(pos.min())}, {int(pos.max())}]"
                )
            scores = (self._scale, p.causal, p.sliding_window, self._softcap)
            groups.append(
                _GroupStep(
                    _Tokens(pos, cs, p.slot_mapping),
                    p.step_arrays(),
                    Scores(*scores, _F32, False, _F32, False, tile_witness()),
                )
            )
        nw = numba.get_num_threads() if workers is None else C.check_int("workers", workers, low=1)
        shared = C.check_int("shared_widen_from", shared_widen_from, low=0)
        flat = C.as_numpy(torch.empty(t_n * sum(self._widths), dtype=self.dtype))
        cuts = np.cumsum([0, *(t_n * w for w in self._widths)])
        scratch = tuple(flat[a:b] for a, b in itertools.pairwise(cuts))
        units = np.zeros(self._phases, np.int64)
        qs = _NO_QUANT
        if self.quantised:  # the quantised GEMMs' shared activations (_Schedule.qs)
            kmax = max(self.hidden_size, self._widths[1], self.intermediate_size)  # (K: H, Hq D, I)
            rows = t_n if t_n * kmax >= shared else 0
            qs = _act(rows, kmax, self._model.quant)
        schedule = _Schedule(nw, shared, units)
        return DecoderStep(self, t_n, tuple(groups), schedule, scratch, qs)

    def _plan_partial_run(self, run):
        """The kernel's view of a partial stack's run: ``(l0, l1, start_mlp, reduce,
        add_norm, hands)``; ``add_norm``: the address of the sandwich norm that follows the
        projection whose reduced output is this run's ``residual_add`` (post_attn_norm of
        ``l0`` after its o, post_mlp_norm of ``l0 - 1`` after its down; 0: none)."""
        l0, l1, outside, start = run
        table = self.table
        if start == "mlp":
            add_norm = int(table[l0]["post_attn_norm"])
        else:
            add_norm = int(table[l0 - 1]["post_mlp_norm"]) if l0 else 0
        return l0, l1, start == "mlp", outside == "reduce", add_norm, outside is not None

    def _layers(self, layers):
        """``(l0, l1, start_mlp, reduce, add_norm, hands)`` of the run ``layers``: a
        :class:`Run` of ``runs`` (a partial stack), or a :class:`Run` or ``(l0, l1)``."""
        kernel = self._kernel_runs.get(layers) if type(layers) is Run else None
        if kernel is not None:
            return kernel
        if self.partial:
            raise (ValueError if type(layers) is Run else TypeError)(
                f"layers: expected a numkern.decoder.Run of this partial stack's runs, "
                f"got {layers!r:.80}"
            )
        if not (isinstance(layers, tuple) and len(layers) in (2, 4)):
            raise TypeError(f"layers: expected a Run or a tuple (l0, l1), got {layers!r:.60}")
        if len(layers) == 4 and type(layers) is not Run:
            raise TypeError(f"layers: expected a Run or a tuple (l0, l1), got {layers!r:.60}")
        l0 = C.check_int("layers[0]", layers[0], low=0)
        l1 = C.check_int("layers[1]", layers[1], low=l0)
        n = self.num_layers
        if l1 > n:
            raise ValueError(f"layers: expected 0 <= l0 <= l1 <= {n}, got {layers}")
        one_group = len({g for g in self.kv_groups[l0:l1] if g is not None}) <= 1
        mixers_inside = all(self.mixer[l0 + 1 : l1])  # (l0's may have run outside)
        if not (all(self.dense[l0 : max(l0, l1 - 1)]) and one_group and mixers_inside):
            raise ValueError(
                f"layers: every layer but the last of a run needs a dense MLP, every layer but "
                f"the first its attention inside, and a run's attention layers share one "
                f"KV-cache group; runs: {self.segments}"
            )
        start_mlp = l1 > l0 and not self.mixer[l0]  # l0's mixer ran outside
        hands = self.hands_off(l0, l1)
        if len(layers) == 4:  # a Run: its labels must be those of its layers
            if l1 > l0 and not self.dense[l1 - 1]:
                outside = "mlp"
            else:
                outside = "mixer" if hands else None
            want = Run(l0, l1, outside, "mlp" if start_mlp else "attention")
            if layers != want:
                raise ValueError(
                    f"layers: expected {want} (outside and start of layers {l0}..{l1}; "
                    f"'reduce' only in a partial stack), got {layers}"
                )
        return l0, l1, start_mlp, False, 0, hands

    def run(
        self, step, hidden, *, layers, residual_add=None, logits_rows=None, logits=None, caches=None
    ):
        """The run ``layers`` of the step ``step`` (:meth:`prepare`'s) on ``hidden [T,
        H]`` (model dtype, updated in place: the residual stream); see docs/kernels.md,
        "The decoder run". ``layers``: a :class:`Run` of ``runs``, or (a stack that is not
        partial) any ``(l0, l1)`` the layers allow, or a Run with the labels of its layers.

        ``residual_add [T, H]`` (model dtype) is added to ``hidden`` first: the output of
        the previous run's MoE. With ``logits_rows`` (int64 ``[R]``, rows of ``hidden``) the
        logits of those rows are written to ``logits`` (fp32 ``[R, vocab]``); then ``l1``
        must be the last layer, with a dense MLP.

        A run starts at layer ``l0``'s attention, or at its MLP when ``l0``'s token mixer
        runs outside (``qkv=None``: ``residual_add`` is then the mixer's output). Returns
        ``post_norm(hidden)`` ``[T, H]`` of layer ``l1 - 1`` (a new tensor) when that
        layer's MLP runs outside (``gate_up=None``); else ``input_norm(hidden)`` of layer
        ``l1`` when that layer's token mixer runs outside; else None. ``runs`` lists the
        runs a step takes and what follows each. ``caches``: this call's KV caches instead
        of the stack's, one ``CacheView`` per layer (None for an outside mixer), each of
        the isa, layout and size of the stack's cache of its layer's group (a torch op whose
        cache writes are functionalised runs on the tensors it is handed); checked on every
        call.

        A partial stack (``partial=True``) takes its own ``runs`` only. A run whose
        ``outside`` is ``"reduce"`` ends with layer ``l0``'s ``o`` (start ``"attention"``) or
        ``down`` (start ``"mlp"``) and returns its output (a new ``[T, H]`` tensor, the
        model dtype, bias included: before the residual add and any sandwich norm). The
        next run takes the sum of the ranks' outputs as ``residual_add`` and applies that
        projection's sandwich norm (``post_attn_norm`` after o, ``post_mlp_norm`` after
        down) to it before the add.
        """
        if type(step) is not DecoderStep or step.stack is not self:
            raise TypeError(
                f"step: expected a DecoderStep of this stack (stack.prepare(...)), got "
                f"{type(step).__name__}"
            )
        l0, l1, start_mlp, reduce, add_norm, hands = self._layers(layers)
        table = self.table if caches is None else self._table_for(caches)
        # the run's KV-cache group (a run without attention layers reads none: group 0)
        g = next((g for g in self.kv_groups[l0:l1] if g is not None), 0)
        t_n, hid, dt = step.num_tokens, self.hidden_size, self.dtype
        shape = (t_n, hid)
        fast = type(hidden) is torch.Tensor and hidden.dtype == dt and hidden.shape == shape
        if not (fast and hidden.is_contiguous()):
            C.check_tensor("hidden", hidden, dt, shape)
        add = self._carrier
        if residual_add is not None:
            add = C.as_numpy(C.check_tensor("residual_add", residual_add, dt, shape)).reshape(-1)
        head = self._head(logits_rows, logits, t_n, l0, l1, reduce)
        # the run writes hidden, the caches and logits, and reads residual_add while it
        # writes hidden: memory shared among them would give garbage
        spans = self._spans if caches is None else _cache_ranges(caches)
        C.check_outside("hidden", hidden, spans, _APART)
        if residual_add is not None:
            C.check_apart("residual_add", residual_add, "hidden", hidden, "hidden is written")
        if logits_rows is not None:
            C.check_outside("logits", logits, spans, _APART)
            C.check_apart("logits", logits, "hidden", hidden, "hidden is written")
        x = torch.empty(shape, dtype=dt)  # the normed rows: what this call may return
        if t_n == 0:  # no rows: nothing to compute (the GEMM blocks take at least one row)
            return x if hands else None
        gs = step.groups[g]
        work = _Work(C.as_numpy(x).reshape(-1), *step.scratch)
        has_add = residual_add is not None
        hv = C.as_numpy(hidden).reshape(-1)
        stream = _Stream(hv, add, has_add, t_n, add_norm if has_add else 0, start_mlp, reduce)
        model = (self._model, self._heads, table)
        cache = (self._caches[g], self._layouts[g])
        tail = (gs.arrays, gs.scores, head, step.schedule, step.qs)
        _run(stream, work, *model, l0, l1, *cache, gs.tokens, *tail)
        return x if hands else None

    def hands_off(self, l0, l1):
        """Whether the run of layers ``(l0, l1)`` returns rows for an op outside: layer
        ``l1 - 1``'s MLP or layer ``l1``'s token mixer runs outside (a stack that is not
        partial; a partial stack's run returns rows unless its ``outside`` is None)."""
        if l1 > l0 and not self.dense[l1 - 1]:
            return True  # post_norm(h) of layer l1 - 1, for its MLP outside
        return l1 < self.num_layers and not self.mixer[l1]  # input_norm(h) of layer l1

    def _table_for(self, caches):
        """The layer table with the K/V addresses of ``caches`` (one CacheView per layer,
        None for an outside mixer), each checked against the stack's cache of its group."""
        if isinstance(caches, (str, bytes)) or not hasattr(caches, "__len__"):
            raise TypeError(f"caches: expected a sequence of CacheViews, got {caches!r:.60}")
        if len(caches) != self.num_layers:
            raise ValueError(
                f"caches: expected {self.num_layers} (one per layer), got {len(caches)}"
            )
        table = self.table.copy()
        hkv, d, dt = self.num_kv_heads, self.head_dim, self.dtype
        for i, (cv, g) in enumerate(zip(caches, self.kv_groups)):
            if g is None:
                if cv is not None:
                    raise ValueError(f"caches[{i}]: expected None (layers[{i}].qkv is None)")
                continue
            first = self.caches[self.kv_groups.index(g)]
            _check_cache(f"caches[{i}]", cv, first, hkv, d, dt)
            table[i]["k_cache"], table[i]["v_cache"] = C.address(cv.kw), C.address(cv.vw)
        return table

    def _head(self, rows, logits, t_n, l0, l1, reduce):
        carrier = self._carrier
        if rows is None:
            if logits is not None:
                raise ValueError("logits: given without logits_rows")
            w, qw = self._head_w[:0], self._head_q[:0]
            return _Head(_ROWS, _F32, w, qw, 0, carrier, carrier, _F32, 0)
        if reduce or l1 != self.num_layers or (l1 > l0 and not self.dense[l1 - 1]):
            raise ValueError(
                f"logits_rows: the head runs after the last layer, once its MLP has run and "
                f"been added (the last of runs); this run ends at layer {l1} of "
                f"{self.num_layers}{' with a reduce' if reduce else ''}"
            )
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"logits_rows: expected a torch.Tensor, got {type(rows).__name__}")
        C.check_ndim("logits_rows", rows, (1,))
        C.check_tensor("logits_rows", rows, torch.int64, (rows.shape[0],))
        r = rows.numpy().copy()
        if r.size and (int(r.min()) < 0 or int(r.max()) >= t_n):
            raise ValueError(
                f"logits_rows: expected rows in [0, {t_n}), got [{int(r.min())}, {int(r.max())}]"
            )
        r_n, vocab, hid = r.shape[0], self.vocab_size, self.hidden_size
        C.check_tensor("logits", logits, torch.float32, (r_n, vocab))
        ws = C.as_numpy(torch.empty(r_n * (hid + vocab), dtype=self.dtype))
        y, lg = ws[: r_n * hid], ws[r_n * hid :]
        w, qw, qt = self._head_w, self._head_q, self._head_qt
        return _Head(r, self._head_norm, w, qw, qt, y, lg, logits.numpy().reshape(-1), vocab)
