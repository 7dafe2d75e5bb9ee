"""The runs of a :class:`numkern.decoder.DecoderStack`: which layers one call takes
(:class:`Run`; :func:`_plan_runs`, and :func:`_plan_partial` for a stack whose runs end
at every row-parallel projection), each layer's KV-cache group (:func:`_check_groups`)
and the check that a group's caches agree (:func:`_check_cache`). docs/kernels.md, "The
decoder run", describes ``runs``, ``partial`` and ``kv_groups``.
"""

from typing import NamedTuple

from .. import _check as C
from ..attention import CacheGeometry, CacheView


class Run(NamedTuple):
    """One call of a step: layers ``l0..l1`` of the stack (``DecoderStack.runs``).

    ``start``: where the run begins in layer ``l0``, ``"attention"`` (its token mixer
    half, attention inside or, for ``l1 == l0``, the outside mixer's input norm) or
    ``"mlp"`` (its MLP half: the mixer ran before, outside or in the previous run).
    ``outside``: what follows the run, and what the run returns: ``"mlp"`` (layer
    ``l1 - 1``'s MLP runs outside; returns its ``post_norm(h)``), ``"mixer"`` (layer
    ``l1``'s token mixer runs outside; returns its ``input_norm(h)``), ``"reduce"`` (a
    partial stack: the run ends with layer ``l0``'s ``o`` (start ``"attention"``) or
    ``down`` (start ``"mlp"``) projection and returns its output, for the caller's
    all-reduce) or None (returns None: the head, or a KV-cache group change).
    """

    l0: int
    l1: int
    outside: str | None
    start: str


def _check_groups(kv_groups, mixer):
    """Each layer's group: ints ``0..G-1`` (every group used) for attention layers,
    None for the layers whose token mixer runs outside (default: all in group 0)."""
    n = len(mixer)
    if kv_groups is None:
        return tuple(0 if m else None for m in mixer)
    if isinstance(kv_groups, (str, bytes)) or not hasattr(kv_groups, "__len__"):
        raise TypeError(f"kv_groups: expected a sequence of ints, got {kv_groups!r:.60}")
    if len(kv_groups) != n:
        raise ValueError(f"kv_groups: expected {n} entries (one per layer), got {len(kv_groups)}")
    groups = []
    for i, (g, m) in enumerate(zip(kv_groups, mixer)):
        if not m:
            if g is not None:
                raise ValueError(f"kv_groups[{i}]: expected None (layers[{i}].qkv is None)")
            groups.append(None)
        else:
            groups.append(C.check_int(f"kv_groups[{i}]", g, low=0))
    used = {g for g in groups if g is not None}
    if used != set(range(max(used) + 1)):
        raise ValueError(f"kv_groups: expected the groups 0..G-1, each used, got {sorted(used)}")
    return tuple(groups)


def _plan_runs(dense, mixer, groups):
    """The runs one call each takes (:class:`Run`): a layer is two units, its
    mixer (attention inside, or outside) and its MLP (dense inside, or outside); a
    run is the units between two outside ones, and breaks where the KV-cache group
    changes. It starts at layer l0's attention, or at its MLP when l0's mixer ran
    outside; ``outside`` is what follows it: ``"mlp"`` (layer l1-1's MLP; the run
    returns its ``post_norm(h)``), ``"mixer"`` (layer l1's; the run returns its
    ``input_norm(h)``) or None (the head, or only a group change)."""
    n = len(dense)
    runs = []
    l0 = 0
    i = 0  # the layer whose units the scan is at
    mlp_half = False  # the run starts at layer l0's MLP (its mixer ran outside)

    def close(l1, outside):
        # (a run of no layer, l1 == l0, is only the add and the outside mixer's norm)
        runs.append(Run(l0, l1, outside, "mlp" if mlp_half and l1 > l0 else "attention"))

    while True:
        if i == n:
            close(n, None)
            return tuple(runs)
        if not mixer[i] and not (mlp_half and i == l0):
            close(i, "mixer")  # up to the outside mixer of layer i
            l0, mlp_half = i, True
            continue
        if not dense[i]:
            close(i + 1, "mlp")
            l0, i, mlp_half = i + 1, i + 1, False
            continue
        nxt = i + 1
        if (
            nxt < n
            and mixer[nxt]
            and groups[nxt] != next((groups[j] for j in range(l0, nxt) if mixer[j]), groups[nxt])
        ):
            close(nxt, None)  # another KV-cache group from here
            l0, mlp_half = nxt, False
        i = nxt


def _plan_partial(dense, mixer):
    """The runs of a partial stack (tensor parallelism): every projection whose output is
    a partial sum (o, down) ends a run with ``"reduce"``, so each run is one half of a
    layer. Per layer: its token mixer half (attention inside: ``(i, i + 1, "reduce",
    "attention")``; outside: ``(i, i, "mixer", "attention")``, the add and its input
    norm), then its MLP half (dense: ``(i, i + 1, "reduce", "mlp")``; outside: ``(i, i +
    1, "mlp", "mlp")``, the add and its post norm); then ``(n, n, None, "attention")``:
    the last add and the head."""
    runs = []
    for i, (d, m) in enumerate(zip(dense, mixer)):
        runs.append(Run(i, i + 1, "reduce", "attention") if m else Run(i, i, "mixer", "attention"))
        runs.append(Run(i, i + 1, "reduce" if d else "mlp", "mlp"))
    n = len(dense)
    runs.append(Run(n, n, None, "attention"))
    return tuple(runs)


def _check_cache(name, cv, first, hkv, d, dt):
    """``cv`` (the CacheView ``name``) checked: of ``(hkv, d, dt)``, its views as long as
    the extent the kernels address, and of the isa, layout and size of ``first`` (its
    KV-cache group's first cache)."""
    if not isinstance(cv, CacheView):
        raise TypeError(f"{name}: expected a numkern.attention.CacheView (cache_view())")
    got = (cv.num_kv_heads, cv.head_dim, cv.dtype)
    if got != (hkv, d, dt):
        raise ValueError(
            f"{name}: expected (kv heads, head_dim, dtype) = {(hkv, d, dt)}, got {got}"
        )
    geo = cv.geometry
    if not isinstance(geo, CacheGeometry):
        raise TypeError(f"{name}: expected a view with its CacheGeometry (cache_view())")
    if (geo.isa, geo.num_blocks, geo.num_kv_heads, geo.head_dim, geo.dtype) != (
        cv.isa,
        cv.num_blocks,
        hkv,
        d,
        dt,
    ):
        raise ValueError(f"{name}: expected a view of its geometry {geo} (cache_view())")
    lay = cv.layout
    # the extent the kernels address (a CacheView is a plain tuple: check, not trust)
    span = (cv.num_blocks - 1) * lay.k_block + (hkv - 1) * lay.k_head + lay.block_size * d
    if cv.kw.dtype != C.WITNESS[dt].dtype or min(cv.kw.size, cv.vw.size) < span:
        raise ValueError(f"{name}: expected the views of cache_view() ({span} elements)")
    same = (cv.isa, lay, cv.num_blocks, cv.geometry, cv.kw.size, cv.vw.size)
    want = (first.isa, first.layout, first.num_blocks, first.geometry, first.kw.size, first.kw.size)
    if same != want:
        raise ValueError(
            f"{name}: expected the isa, layout, size and geometry of its KV-cache group's "
            f"first cache, got {same[:4]} against {want[:4]}"
        )
