"""The runs of a :class:`numkern.decoder.DecoderStack`: which layers one call takes
(:func:`_plan_runs`), each layer's KV-cache group (:func:`_check_groups`) and the check
that a group's caches agree (:func:`_check_cache`). docs/kernels.md, "The decoder run",
describes ``runs`` and ``kv_groups``.
"""

from .. import _check as C
from ..attention import CacheGeometry, CacheView


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
    """The runs one call each takes, ``(l0, l1, outside)``: a layer is two units, its
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
    while True:
        if i == n:
            runs.append((l0, n, None))
            return tuple(runs)
        if not mixer[i] and not (mlp_half and i == l0):
            runs.append((l0, i, "mixer"))  # up to the outside mixer of layer i
            l0, mlp_half = i, True
            continue
        if not dense[i]:
            runs.append((l0, i + 1, "mlp"))
            l0, i, mlp_half = i + 1, i + 1, False
            continue
        nxt = i + 1
        if (
            nxt < n
            and mixer[nxt]
            and groups[nxt] != next((groups[j] for j in range(l0, nxt) if mixer[j]), groups[nxt])
        ):
            runs.append((l0, nxt, None))  # another KV-cache group from here
            l0, mlp_half = nxt, False
        i = nxt


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
