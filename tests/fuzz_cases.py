"""The cases of ``tests/test_fuzz.py``: per public op, a hypothesis strategy of case specs
and a builder that turns a spec into tensors, a call and a check; the child-process pool
that runs them.

A spec is a plain dict (``op``, ``seed``, ``mut`` and the op's sizes and knobs): drawn by
hypothesis in the test process, it travels to a worker, which builds the case from it
(seeded), so a failing spec printed by the test is its own repro::

    python -c "from tests.fuzz_cases import run_case; print(run_case({...}))"

Every tensor a case builds lives in an *arena*: a 1-D buffer of its own with garbage
around the view (NaN for floats, a large sentinel for indices), so an op that reads
outside a view gets NaN or an absurd index, and one that writes outside it is caught:
the harness snapshots every arena before the call and compares after. On a
``ValueError``/``TypeError`` no arena may have changed; on success only the views the op
is documented to write may have, and those must equal the reference (computed from the
snapshot, so in-place and aliased calls are judged against the inputs as they were).

``mut`` is None for a valid call (most cases), or the name of one mutation of it:
``MUST_REFUSE`` ones must raise ``ValueError``/``TypeError``; the others (aliasing,
strides, NumPy inputs) may instead be accepted, and then must give the reference result.

Three more runs of a case, each on a fresh build of its spec (equal inputs, other
buffers):

* **Numba threads.** Every other spec runs on two Numba threads (``numba_threads``), the
  rest on one: a parallel loop's partition is exercised where it splits.
* **The torch op.** Where the op has a torch custom op (docs §12), the case runs through it
  too (:class:`TorchForm`), and must give the direct call's outcome: its result and
  every buffer bit for bit, or a refusal with nothing written. Our ValueError/TypeError
  reaches the caller unchanged (eager calls wrap nothing: same type and message); the
  dispatcher's own refusal of a value its schema cannot carry (a NumPy array, a str for
  an int) is a RuntimeError naming the argument; values it converts (True for an int is
  1) are judged against the direct call with the converted value.
* **Two Python threads.** A valid case runs twice more at the same moment, from two
  threads (a barrier), and each must give the single-threaded result bit for bit.
"""

import collections
import math
import os
import re
import sys
import time
import traceback

import numpy as np
import torch
from hypothesis import strategies as st

from numkern.testing.tolerances import tolerance

from .close import assert_within, ulp

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32, I64 = torch.int32, torch.int64
FLOATS = (BF, FP16, FP32)
SENTINEL = {I32: 0x5A5A5A5A, I64: 0x5A5A5A5A5A5A5A5A, torch.bool: True}
NONFINITE = (float("nan"), float("inf"), float("-inf"))


class Refuse(Exception):
    """A builder's note that its mutation does not apply to the drawn case."""


# ---------------------------------------------------------------------------------------
# arenas


class Ctx:
    """One case: its random source, its arenas, the views the op may write."""

    def __init__(self, seed):
        torch.manual_seed(seed)  # builders of the op tests draw from the global generator
        self.g = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.bases = []
        self.written = []
        self.snap = None

    def base(self, numel, dtype, fill=None):
        b = torch.empty(numel, dtype=dtype)
        if fill is None:
            fill = float("nan") if dtype.is_floating_point else SENTINEL[dtype]
        b.fill_(fill)
        self.bases.append(b)
        return b

    def adopt(self, t):
        """A tensor made elsewhere (a fresh contiguous one, or a view of one) as an arena."""
        b = t if t._base is None else t._base
        if b.storage_offset() or not b.is_contiguous():
            b = torch.as_strided(b, (b.untyped_storage().nbytes() // b.element_size(),), (1,), 0)
        self.bases.append(b.reshape(-1))
        return t

    def view(
        self,
        shape,
        dtype,
        *,
        data=None,
        pads=None,
        inner=1,
        lead=None,
        tail=None,
        scale=1.0,
        fill=None,
        base=None,
        at=None,
    ):
        """A view of ``shape`` in an arena of its own (or of ``base`` at element ``at``):
        stride(-1) = ``inner``, each outer stride the packed one plus ``pads[i]``, ``lead``
        and ``tail`` garbage elements around it. Filled with ``data`` (or N(0, scale))."""
        nd = len(shape)
        pads = list(pads or [0] * max(nd - 1, 0))
        strides = [0] * nd
        if nd:
            strides[-1] = inner
            for i in range(nd - 2, -1, -1):
                strides[i] = strides[i + 1] * max(shape[i + 1], 1) + pads[i]
        extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        if base is None:
            lead = int(self.rng.integers(0, 4)) if lead is None else lead
            tail = int(self.rng.integers(0, 4)) if tail is None else tail
            base = self.base(lead + extent + tail, dtype, fill)
            at = lead
        v = torch.as_strided(base, tuple(shape), tuple(strides), at)
        if data is None:
            if dtype.is_floating_point:
                data = torch.randn(tuple(shape), generator=self.g) * scale
            else:
                data = torch.zeros(tuple(shape), dtype=dtype)
        if v.numel():
            v.copy_(data.to(dtype))
        return v

    def rand(self, shape, dtype=FP32, scale=1.0):
        return (torch.randn(tuple(shape), generator=self.g) * scale).to(dtype)

    def out(self, v):
        """Mark ``v`` as a view the op may write."""
        self.written.append(v)
        return v

    def take_snapshot(self):
        self.snap = [b.clone() for b in self.bases]

    def _locate(self, v):
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(v)
        p = v.data_ptr()
        for i, b in enumerate(self.bases):
            b0 = b.data_ptr()
            if b0 <= p < b0 + b.numel() * b.element_size() or (b0 == p and v.numel() == 0):
                off, rem = divmod(p - b0, v.element_size())
                if rem == 0 and b.element_size() == v.element_size():
                    return i, v, off
        raise LookupError("view outside every arena")

    def pre(self, v):
        """``v`` as it was before the call (a view of the snapshot)."""
        if v is None:
            return None
        if v.size == 0 if isinstance(v, np.ndarray) else v.numel() == 0:
            return torch.empty(tuple(v.shape), dtype=torch.as_tensor(v[..., :0]).dtype)
        i, t, off = self._locate(v)
        return torch.as_strided(self.snap[i].view(t.dtype), t.shape, t.stride(), off)

    def check_untouched(self, allow_written):
        for i, b in enumerate(self.bases):
            mask = torch.zeros(b.numel(), dtype=torch.bool)
            if allow_written:
                for w in self.written:
                    try:
                        j, t, off = self._locate(w)
                    except LookupError:
                        continue
                    if j == i and t.numel():
                        torch.as_strided(mask, t.shape, t.stride(), off).fill_(True)
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            it = ints[b.element_size()]
            a, z = self.snap[i].view(it), b.view(it)
            keep = ~mask
            if not torch.equal(a[keep], z[keep]):
                bad = int(torch.nonzero(keep & (a != z))[0])
                where = "outside the views it may write" if allow_written else "on an error"
                raise AssertionError(
                    f"arena {i} ({b.dtype}, {b.numel()} elements) changed {where}: element {bad}"
                )


def numpy_of(t):
    """``t`` as a NumPy array sharing its memory; bf16 (which NumPy lacks) as float64, a
    dtype no op takes."""
    if t.dtype == BF:
        return t.double().numpy()
    return t.numpy()


# ---------------------------------------------------------------------------------------
# comparisons


def finite_rows(ref, dims=1):
    """Bool mask over the first ``dims`` dims of ``ref``: rows whose elements are all finite."""
    r = ref.flatten(dims) if ref.dim() > dims else ref.unsqueeze(-1)
    return torch.isfinite(r).all(-1)


def check_nonfinite_rows(out, ref, dims=1):
    """Rows of ``ref`` holding a NaN/inf: ``out``'s same rows hold one too (the poison
    propagated to the rows it touches), rows without: all finite. The finite rows' mask."""
    ok = finite_rows(ref, dims)
    got = finite_rows(out.float(), dims)
    if not torch.equal(ok, got):
        bad = torch.nonzero(ok != got)[0].tolist()
        raise AssertionError(
            f"row {bad}: reference finite={bool(ok[tuple(bad)])}, op finite={bool(got[tuple(bad)])}"
        )
    return ok


def poison(cx, t):
    """A NaN, inf or -inf into one or two random elements of ``t`` (a view, written in
    place): the rows they sit in must come out non-finite, the others as without."""
    if t.numel() == 0:
        return
    for _ in range(int(cx.rng.integers(1, 3))):
        idx = tuple(int(cx.rng.integers(0, n)) for n in t.shape)
        t[idx] = NONFINITE[int(cx.rng.integers(0, 3))]


def same_bits(a, b):
    """Bitwise equal, any NaN matching any NaN."""
    a, b = a.contiguous(), b.contiguous()
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    keep = ~a.isnan()
    return torch.equal(a.view(ints)[keep], b.view(ints)[keep])


# ---------------------------------------------------------------------------------------
# one case


class Case:
    """What a builder returns: ``call()`` runs the op; ``check(result)`` raises
    AssertionError on a wrong result; ``must_refuse`` for mutations that no valid call
    has; ``torch``: the same call through the op's torch custom op (a :class:`TorchForm`),
    or None (no torch op, or none for what this case passes)."""

    def __init__(self, call, check, must_refuse=False, torch=None):
        self.call, self.check, self.must_refuse = call, check, must_refuse
        self.torch = torch


def same_names(a):
    """A :class:`TorchForm`'s ``names`` where the schema's are the direct call's."""
    return {k: k for k in a}


def torch_ops():
    """``torch.ops.numkern`` with numkern's custom ops defined (docs §12)."""
    import numkern.torch_ops  # noqa: F401  (defines the ops)

    return torch.ops.numkern


# What the dispatcher takes for a schema type (a value of another type is its RuntimeError
# "Expected a value of type ..."), by the Python type names its message uses.
_NP_INTS = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
_NP_FLOATS = {"float16", "float32", "float64"}
DISPATCHER_TAKES = {
    "Tensor": {"Tensor", "Parameter"},
    "int": {"int", "bool", *_NP_INTS},
    "SymInt": {"int", "bool", *_NP_INTS},
    "float": {"float", "int", "bool", *_NP_INTS, *_NP_FLOATS},
    "bool": {"bool", "int", "NoneType", "bool_", *_NP_INTS},  # None is False, 2 is True
    "str": {"str"},
    "List[Tensor]": {"list", "tuple"},
    "ScalarType": {"dtype"},
}
_DISPATCH_ERROR = re.compile(
    r"^numkern::\w+\(\) Expected a value of type '([^']+)' for argument '(\w+)' but instead "
    r"found type '(\w+)'"
)


def dispatcher_refusal(e):
    """For a RuntimeError of torch's dispatcher refusing a value its schema cannot carry
    (a NumPy array or a list for a Tensor, a str or None for an int, ...): the argument's
    name; None for any other exception."""
    m = _DISPATCH_ERROR.match(str(e)) if type(e) is RuntimeError else None
    if m is None:
        return None
    want, name, got = m.groups()
    base = want[len("Optional[") : -1] if want.startswith("Optional[") else want
    takes = DISPATCHER_TAKES.get(base, set()) | ({"NoneType"} if base != want else set())
    # a Python int past int64 is "found type 'int'" for an int: the one refusal by value
    return name if got not in takes or (base in ("int", "SymInt") and got == "int") else None


def _dispatched(want, v):
    """The value the dispatcher hands a kernel for ``v`` at a schema argument of type
    ``want``: Python scalars of another type are converted (True for an int is 1, None
    for a bool is False, a NumPy float is a float); anything else is ``v`` itself."""
    base = want[len("Optional[") : -1] if want.startswith("Optional[") else want
    if v is None:
        return False if want == "bool" else None
    if base in ("int", "SymInt") and isinstance(v, (bool, np.integer)):
        return int(v)
    if base == "float" and isinstance(v, (bool, int, np.number)) and type(v) is not float:
        return float(v)
    if base == "bool" and isinstance(v, (int, np.integer, np.bool_)) and type(v) is not bool:
        return bool(v)
    return v


class TorchForm:
    """A case's call through its torch custom op: ``op(**kwargs)``, ``kwargs[name] =
    args[key]`` for ``names = {schema name: key}`` (``args``: the dict the direct call
    reads, so the drawn mutation reaches both), ``const`` fixed schema values, ``prep()``
    schema values made at call time (it may call other torch ops: the scheduler metadata),
    ``post(result, kwargs)``: the op's result as the direct call returns it.
    ``same_message``: a refusal is the direct call's exception, type and message (the
    op's kernel calls the direct op); False where the torch path is other calls in another
    order (metadata, then attention or the decoder run), so that another check may speak
    first: then any ValueError/TypeError."""

    def __init__(self, op, args, names, *, const=None, prep=None, post=None, same_message=True):
        self.op, self.args, self.names = op, args, names
        self.const, self.prep, self.post = const or {}, prep, post
        self.same_message = same_message

    def call(self):
        kw = {n: self.args[k] for n, k in self.names.items()} | self.const
        if self.prep is not None:
            kw |= self.prep()
        res = self.op(**kw)
        return res if self.post is None else self.post(res, kw)

    def conversions(self):
        """``{key of args: the value the kernel receives}`` for the values the
        dispatcher converts (docs §12: a bool, None or NumPy scalar at a scalar)."""
        types = {a.name: str(a.type) for a in self.op.default._schema.arguments}
        out = {}
        for name, key in self.names.items():
            v = self.args[key]
            got = _dispatched(types[name], v)
            if got is not v:
                out[key] = got
        return out


def _build(spec):
    """(spec, ctx, case): the case of ``spec`` (with its mutation dropped when it does
    not fit the drawn sizes), built from its seed: each call gives fresh, equal inputs."""
    cx = Ctx(spec["seed"])
    try:
        return spec, cx, BUILDERS[spec["op"]](spec, cx)
    except Refuse:  # the mutation does not fit the drawn sizes: run the valid call
        spec = {**spec, "mut": None}
        cx = Ctx(spec["seed"])
        return spec, cx, BUILDERS[spec["op"]](spec, cx)


def bits_equal(a, b):
    """Results equal bit for bit (NaN payloads too): tensors, arrays, tuples, None."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (
            isinstance(a, (tuple, list))
            and isinstance(b, (tuple, list))
            and len(a) == len(b)
            and all(bits_equal(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(a)
    if isinstance(b, np.ndarray):
        b = torch.from_numpy(b)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def arenas_differ(cx, other):
    """The first arena of ``other`` (a build of the same spec) whose bits differ from
    ``cx``'s, as a message; None when all are equal."""
    if len(cx.bases) != len(other.bases):
        return f"{len(other.bases)} arenas against {len(cx.bases)}"
    for i, (a, b) in enumerate(zip(cx.bases, other.bases)):
        if not bits_equal(a, b):
            bad = int(torch.nonzero(a.view(torch.uint8) != b.view(torch.uint8))[0])
            return f"arena {i} ({a.dtype}, {a.numel()} elements) differs at byte {bad}"
    return None


def run_case(spec):
    """(status, detail, stats): status "ok" (checked against the reference), "refused"
    (ValueError or TypeError, nothing written) or "fail" (anything else, with the reason);
    stats: what ran: ``mut`` (the mutation applied: the spec's, or None where it did
    not fit the drawn sizes and the valid call ran instead), ``torch`` (the torch op's
    outcome: "ok", "refused", "dispatcher", or None where the case has no torch form) and
    ``threads`` (the call ran again from two Python threads at once).

    The case runs with ``spec["numba_threads"]`` Numba threads (default 1)."""
    import numba

    before = numba.get_num_threads()
    try:
        numba.set_num_threads(spec.get("numba_threads", 1))
    except ValueError as e:
        return "fail", f"harness error: NUMBA_NUM_THREADS too small: {e}", {}
    try:
        return _run_case(spec)
    finally:
        numba.set_num_threads(before)


def _run_case(spec):
    stats = {"mut": None, "torch": None, "threads": False}
    try:
        spec, cx, case = _build(spec)
        stats["mut"] = spec["mut"]
        cx.take_snapshot()
        try:
            result = case.call()
        except (ValueError, TypeError) as e:
            if spec["mut"] is None:
                return "fail", f"valid call refused: {type(e).__name__}: {e}", stats
            try:
                cx.check_untouched(False)
            except AssertionError as a:
                return "fail", f"refused ({type(e).__name__}: {e}) after writing: {a}", stats
            status, detail, result = "refused", f"{type(e).__name__}: {e}", e
        except Exception as e:
            tb = traceback.format_exc(limit=4)
            return "fail", f"raised {type(e).__name__}: {e}\n{tb}", stats
        else:
            if case.must_refuse:
                return "fail", f"accepted an invalid call (mutation {spec['mut']!r})", stats
            try:
                case.check(result)
                cx.check_untouched(True)
            except AssertionError as a:
                return "fail", f"wrong result: {a}", stats
            status, detail = "ok", ""
        if case.torch is not None:
            why = _torch_same(spec, cx, case, status, result, stats)
            if why:
                return "fail", f"torch op ({case.torch.op}): {why}", stats
        if status == "ok" and spec["mut"] is None and spec["op"] != "_selftest":
            why = _threads_same(spec, cx, result)
            if why:
                return "fail", f"two Python threads at once: {why}", stats
            stats["threads"] = True
        return status, detail, stats
    except Exception:
        return "fail", f"harness error:\n{traceback.format_exc()}", stats


def _torch_same(spec, cx, case, status, result, stats):
    """The case again, on fresh inputs, through its torch op: the same outcome as the
    direct call, or None. The dispatcher hands our kernels converted scalars (True for an
    int is 1, None for a bool is False): where it converts one, the reference outcome is
    the direct call's with the converted values (a refused direct call wrote nothing, so
    it runs again on the same inputs). Our ValueError/TypeError reaches the caller as it
    is (an eager call wraps nothing): the same type and message (the argument named as
    the schema names it: ``act``, not ``activation``), or any ValueError/TypeError where
    the form says other checks may speak first. A value the schema cannot carry (a NumPy
    array, a list, a str for an int) is the dispatcher's RuntimeError naming the argument,
    whatever the direct op does with it; any other exception fails. A refusal leaves
    every buffer as it was; a result is the direct call's, bit for bit, buffers included.
    """
    form = case.torch
    conv = form.conversions()
    if conv and status == "refused":
        form.args.update(conv)
        try:
            result, status = case.call(), "ok"
        except (ValueError, TypeError) as e:
            result, status = e, "refused"
    _, cx2, case2 = _build(spec)
    cx2.take_snapshot()
    try:
        got, kind = case2.torch.call(), "ok"
    except (ValueError, TypeError) as e:
        got, kind = e, "refused"
    except AssertionError as a:  # post() compared what the direct call does not return
        return str(a)
    except Exception as e:
        if dispatcher_refusal(e) is None:
            return f"raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        got, kind = e, "dispatcher"
    stats["torch"] = kind
    if kind != "ok":
        try:
            cx2.check_untouched(False)
        except AssertionError as a:
            return f"refused ({type(got).__name__}: {got}) after writing: {a}"
        if kind == "dispatcher":
            return None
        if status != "refused":
            return f"refused a call the direct op accepts: {type(got).__name__}: {got}"
        said = str(got), _renamed(str(got), form.names)
        if form.same_message and (type(got) is not type(result) or str(result) not in said):
            return (
                f"refused with {type(got).__name__}: {got}; the direct op with "
                f"{type(result).__name__}: {result}"
            )
        return None
    if status != "ok":
        return f"accepted a call the direct op refuses ({type(result).__name__}: {result})"
    if not bits_equal(got, result):
        return "a result other than the direct call's (bits)"
    differ = arenas_differ(cx, cx2)
    return None if differ is None else f"buffers other than the direct call's: {differ}"


def _renamed(message, names):
    """An error message naming a schema argument (its first word, docs §2.6) as the direct
    call names it (vLLM's ``act`` is numkern's ``activation``)."""
    first, sep, rest = message.partition(":")
    return names.get(first, first) + sep + rest if sep else message


_PAIR = []  # the two Python threads of _threads_same, started once per process


def _threads_same(spec, cx, result):
    """The valid case twice more, on two fresh builds, from two Python threads at once
    (each with this thread's Numba thread count): each must give the single-threaded
    result and buffers bit for bit. None, or what differed."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numba

    if not _PAIR:
        _PAIR.append(ThreadPoolExecutor(2, thread_name_prefix="fuzz-pair"))
    builds = [_build(spec) for _ in range(2)]
    n = numba.get_num_threads()
    barrier = threading.Barrier(2)

    def go(case):
        numba.set_num_threads(n)  # per calling thread (docs §2.7)
        barrier.wait(timeout=TIMEOUT_BARRIER)
        return case.call()

    futures = [_PAIR[0].submit(go, case) for _, _, case in builds]
    for t, ((_, cx2, _), f) in enumerate(zip(builds, futures)):
        try:
            got = f.result()
        except Exception as e:
            return f"thread {t} raised {type(e).__name__}: {e}"
        if not bits_equal(got, result):
            return f"thread {t}: a result other than the single-threaded call's (bits)"
        differ = arenas_differ(cx, cx2)
        if differ is not None:
            return f"thread {t}: buffers other than the single-threaded call's: {differ}"
    return None


TIMEOUT_BARRIER = 60  # s: a thread that never reaches the barrier (its build failed)


# ---------------------------------------------------------------------------------------
# strategies: shared pieces


def spec_of(draw, op):
    """The common keys of a spec: the op, a seed, no mutation (``draw_specs`` sets it)."""
    return {"op": op, "seed": draw(st.integers(0, 2**31 - 1)), "mut": None}


def dims(n=1, lo=0, hi=3):
    return st.lists(st.integers(lo, hi), min_size=n, max_size=n)


FLOAT_DT = st.sampled_from(FLOATS)


# ---------------------------------------------------------------------------------------
# numkern.convert_weight_packed


@st.composite
def convert_weight_packed_spec(draw):
    s = spec_of(draw, "convert_weight_packed")
    s["dt"] = draw(FLOAT_DT)
    s["e"] = draw(st.sampled_from([None, 1, 2, 3]))
    s["n"] = draw(st.integers(1, 70))
    k = draw(st.integers(1, 40))
    s["k"] = k if s["dt"] == FP32 else 2 * k
    s["poison"] = draw(st.booleans())
    return s


PACK_MUTS = ["noncontig", "odd_k", "zero_n", "zero_k", "ndim1", "ndim4", "int", "numpy", "list"]


def build_convert_weight_packed(s, cx):
    import numkern

    from .test_gemm import reference_pack

    dt, n, k = s["dt"], s["n"], s["k"]
    shape = (n, k) if s["e"] is None else (s["e"], n, k)
    mut, refuse = s["mut"], True
    if mut == "odd_k":
        shape = (*shape[:-1], k + 1)
        refuse = dt != FP32
    elif mut == "zero_n":
        shape = (*shape[:-2], 0, k)
    elif mut == "zero_k":
        shape = (*shape[:-1], 0)
    w = cx.view(shape, dt)
    if s["poison"]:
        poison(cx, w)
    arg = w
    if mut == "noncontig":
        if shape[-2] < 2:
            raise Refuse
        arg = cx.view(shape, dt, pads=[1] * (len(shape) - 1))
    elif mut == "ndim1":
        arg = w.reshape(-1)
    elif mut == "ndim4":
        arg = w.reshape(1, *w.shape) if w.dim() == 3 else w.reshape(1, 1, *w.shape)
    elif mut == "int":
        arg = cx.view(shape, I32)
    elif mut == "numpy":
        arg, refuse = numpy_of(w), dt == BF
    elif mut == "list":
        arg = w.tolist()

    def check(p):
        p = torch.as_tensor(p)
        src = cx.pre(w)
        assert p.shape == src.shape and p.dtype == src.dtype, (p.shape, p.dtype)
        bits = torch.int32 if dt == FP32 else torch.int16
        want = reference_pack(src)
        assert torch.equal(p.reshape(-1).view(bits), want.reshape(-1).view(bits)), "layout"

    a = {"weight": arg}
    form = TorchForm(torch_ops().convert_weight_packed, a, {"weight": "weight"})
    return Case(
        lambda: numkern.convert_weight_packed(a["weight"]),
        check,
        refuse and mut is not None,
        torch=form,
    )


# ---------------------------------------------------------------------------------------
# numkern.weight_packed_linear


LINEAR_PAIRS = [(BF, BF), (FP16, FP16), (FP32, FP32), (BF, FP32), (FP16, FP32)]
LINEAR_MUTS = [
    "vnni",
    "out_dtype",
    "k_mismatch",
    "odd_k16",
    "x_colstride",
    "out_rows",
    "w_noncontig",
    "bias_shape",
    "bias_dtype",
    "x_ndim",
    "out_alias_x",
    "numpy",
    "x_list",
    "x_int",
    "out_shape",
]


@st.composite
def weight_packed_linear_spec(draw):
    s = spec_of(draw, "weight_packed_linear")
    s["pair"] = draw(st.sampled_from(range(len(LINEAR_PAIRS))))
    s["m"] = draw(st.sampled_from([0, 1, 1, 2, 3, 4, 5, 8, 9, 17, 33]))
    s["n"] = draw(st.sampled_from([1, 2, 15, 16, 31, 32, 33, 48, 64, 65, 97]))
    s["k"] = draw(st.integers(1, 48)) * 2 - draw(st.integers(0, 1))
    s["bias"] = draw(st.booleans())
    s["out_fp32"] = draw(st.booleans())  # an fp32 weight's out: fp32, or x's dtype
    s["x_pads"], s["o_pads"] = draw(dims()), draw(dims())
    s["poison"] = draw(st.booleans())
    return s


def _linear_args(s, cx):
    import numkern

    dt, wdt = LINEAR_PAIRS[s["pair"]]
    odt = FP32 if wdt == FP32 and s["out_fp32"] else dt
    m, n, k = s["m"], s["n"], s["k"]
    if wdt != FP32 and k % 2:
        k += 1
    x = cx.view((m, k), dt, pads=s["x_pads"])
    if s["poison"]:
        poison(cx, x)
    w = cx.rand((n, k), wdt, 1 / math.sqrt(k))
    packed = cx.adopt(numkern.convert_weight_packed(w))
    bias = cx.view((n,), FP32) if s["bias"] else None
    out = cx.out(cx.view((m, n), odt, pads=s["o_pads"], data=torch.full((m, n), float("nan"))))
    return dict(out=out, mat1=x, mat2=packed, bias=bias, is_vnni=True), w


def build_weight_packed_linear(s, cx):
    import numkern

    from .test_gemm import assert_close_linear

    a, w = _linear_args(s, cx)
    dt, wdt = LINEAR_PAIRS[s["pair"]]
    m, k = a["mat1"].shape
    n = w.shape[0]
    mut, refuse = s["mut"], True
    x_t = a["mat1"]
    if mut == "vnni":
        a["is_vnni"] = [False, 1, None, "yes"][int(cx.rng.integers(0, 4))]
    elif mut == "out_dtype":
        other = [d for d in FLOATS if d not in (dt, FP32 if wdt == FP32 else dt)]
        a["out"] = cx.out(cx.view((m, n), other[int(cx.rng.integers(0, len(other)))]))
    elif mut == "k_mismatch":
        a["mat2"] = cx.adopt(numkern.convert_weight_packed(cx.rand((n, k + 2), wdt)))
    elif mut == "odd_k16":
        if wdt == FP32:
            raise Refuse
        x_t = a["mat1"] = cx.view((m, k + 1), dt)
        a["mat2"] = cx.view((n, k + 1), wdt)
    elif mut == "x_colstride":
        x_t = a["mat1"] = cx.view((m, k), dt, inner=2)
        refuse = k > 1
    elif mut == "out_rows":
        if m < 2:
            raise Refuse
        a["out"] = cx.out(cx.view((m, n), a["out"].dtype, pads=[-1]))
    elif mut == "w_noncontig":
        if n < 2:
            raise Refuse
        a["mat2"] = cx.view((n, k), wdt, pads=[2], data=a["mat2"])
    elif mut == "bias_shape":
        a["bias"] = cx.view((n + 1,), FP32)
    elif mut == "bias_dtype":
        a["bias"] = cx.view((n,), [BF, FP16, I32][int(cx.rng.integers(0, 3))])
    elif mut == "x_ndim":
        a["mat1"] = a["mat1"][None]
    elif mut == "out_shape":
        a["out"] = cx.out(cx.view((m, n + 1), a["out"].dtype))
    elif mut == "out_alias_x":
        # out over mat1's memory (same dtype): exactly on it, or shifted by a row
        if a["out"].dtype != dt or m == 0:
            raise Refuse
        row = max(k, n)
        shift = [0, 1, row][int(cx.rng.integers(0, 3))]
        base = cx.base(m * row + shift + 8, dt)
        x_t = a["mat1"] = cx.view((m, k), dt, base=base, at=0, pads=[row - k])
        a["out"] = cx.out(cx.view((m, n), dt, base=base, at=shift, pads=[row - n]))
        x_t.copy_(cx.rand((m, k), dt))  # out's fill overwrote part of mat1
        refuse = False
    elif mut == "numpy":
        keys = ["mat1", "out", "mat2", "bias"]
        key = keys[int(cx.rng.integers(0, 4))]
        if a[key] is None:
            raise Refuse
        refuse = a[key].dtype == BF
        a[key] = numpy_of(a[key])
    elif mut == "x_list":
        a["mat1"] = a["mat1"].tolist()
    elif mut == "x_int":
        a["mat1"] = cx.view((m, k), I32)

    out_t = a["out"] if isinstance(a["out"], torch.Tensor) else torch.from_numpy(a["out"])

    def check(_):
        x0 = cx.pre(x_t)
        b0 = cx.pre(a["bias"]) if isinstance(a["bias"], torch.Tensor) else a["bias"]
        if isinstance(b0, np.ndarray):
            b0 = torch.from_numpy(b0)
        ref = x0.float() @ w.float().T + (0 if b0 is None else b0)
        ok = check_nonfinite_rows(out_t, ref)
        if ok.any():
            assert_close_linear(out_t[ok], x0[ok], w, b0)

    def call():
        return numkern.weight_packed_linear(a["out"], a["mat1"], a["mat2"], a["bias"], a["is_vnni"])

    form = TorchForm(torch_ops().weight_packed_linear, a, same_names(a))
    return Case(call, check, refuse and mut is not None, torch=form)


# ---------------------------------------------------------------------------------------
# numkern.weight_packed_linear_cpu


LINEAR_CPU_MUTS = [
    "n_mismatch",
    "n_type",
    "n_zero",
    "w_3d",
    "x_colstride",
    "x_transposed",
    "bias_dtype",
    "numpy",
    "w_dtype",
]


@st.composite
def weight_packed_linear_cpu_spec(draw):
    s = spec_of(draw, "weight_packed_linear_cpu")
    s["pair"] = draw(st.sampled_from(range(len(LINEAR_PAIRS))))
    s["lead"] = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=0, max_size=2))
    s["n"] = draw(st.sampled_from([1, 3, 16, 32, 33, 64]))
    s["k"] = draw(st.integers(1, 40)) * 2
    s["bias"] = draw(st.booleans())
    s["poison"] = draw(st.booleans())
    return s


def build_weight_packed_linear_cpu(s, cx):
    import numkern

    from .test_gemm import assert_close_linear

    dt, wdt = LINEAR_PAIRS[s["pair"]]
    lead, n, k = tuple(s["lead"]), s["n"], s["k"]
    x = cx.view((*lead, k), dt, pads=[1] * len(lead))
    if s["poison"]:
        poison(cx, x)
    w = cx.rand((n, k), wdt, 1 / math.sqrt(k))
    packed = cx.adopt(numkern.convert_weight_packed(w))
    bias = cx.view((n,), FP32) if s["bias"] else None
    a = dict(x=x, packed_weight=packed, n=n, bias=bias)
    mut, refuse = s["mut"], True
    x_t = x
    if mut == "n_mismatch":
        a["n"] = n + 1
    elif mut == "n_type":  # a bool is not an int either (docs §2.6)
        a["n"] = [float(n), True, str(n), None][int(cx.rng.integers(0, 4))]
    elif mut == "n_zero":
        a["n"] = 0
    elif mut == "w_3d":
        a["packed_weight"] = packed[None]
    elif mut == "x_colstride":
        x_t = a["x"] = cx.view((*lead, k), dt, inner=3)
        refuse = False
    elif mut == "x_transposed":
        if len(lead) < 2:
            raise Refuse
        x_t = a["x"] = cx.view((lead[1], lead[0], k), dt).transpose(0, 1)
        refuse = False
    elif mut == "bias_dtype":
        a["bias"] = cx.view((n,), BF)
    elif mut == "numpy":
        refuse = dt == BF
        x_t = x
        a["x"] = numpy_of(x)
    elif mut == "w_dtype":
        other = {BF: FP16, FP16: BF, FP32: BF}[dt]  # no (x, weight) pair of the table
        a["packed_weight"] = cx.adopt(numkern.convert_weight_packed(cx.rand((n, k), other)))

    def check(y):
        x0 = cx.pre(x_t)
        odt = dt  # x's dtype, fp32 weights included (as vLLM's op: docs §4.3)
        assert isinstance(y, torch.Tensor) and y.dtype == odt, (type(y), getattr(y, "dtype", 0))
        assert y.shape == (*lead, n), (y.shape, lead, n)
        x2, y2 = x0.reshape(-1, k), y.reshape(-1, n)
        ref = x2.float() @ w.float().T + (0 if bias is None else bias)
        ok = check_nonfinite_rows(y2, ref)
        if ok.any():
            assert_close_linear(y2[ok], x2[ok], w, bias)

    def call():
        return numkern.weight_packed_linear_cpu(a["x"], a["packed_weight"], a["n"], a["bias"])

    form = TorchForm(torch_ops().weight_packed_linear_cpu, a, same_names(a))
    return Case(call, check, refuse and mut is not None, torch=form)


# ---------------------------------------------------------------------------------------
# numkern.norm.rms_norm, fused_add_rms_norm


NORM_MUTS = [
    "eps_neg",
    "eps_nan",
    "eps_type",
    "w_shape",
    "w_dtype",
    "out_dtype",
    "out_shape",
    "colstride",
    "out_alias",
    "uncollapsible",
    "numpy",
    "rows_overlap",
    "h_zero",
]


@st.composite
def rms_norm_spec(draw):
    s = spec_of(draw, "rms_norm")
    _norm_common(draw, s)
    return s


@st.composite
def fused_add_rms_norm_spec(draw):
    s = spec_of(draw, "fused_add_rms_norm")
    _norm_common(draw, s)
    return s


def _norm_common(draw, s):
    s["dt"] = draw(FLOAT_DT)
    s["wdt"] = draw(st.sampled_from([None, "same", FP32]))
    s["lead"] = draw(st.lists(st.sampled_from([0, 1, 2, 3, 7]), min_size=0, max_size=2))
    s["h"] = draw(st.sampled_from([1, 2, 7, 15, 16, 17, 32, 33, 64, 97]))
    s["pad"] = draw(st.integers(0, 3))
    s["pad2"] = draw(st.integers(0, 3))
    s["eps"] = draw(st.sampled_from([0.0, 1e-6, 1e-5, 0.1]))
    s["scale"] = draw(st.sampled_from([1.0, 1e-3, 50.0]))
    s["poison"] = draw(st.booleans())


def _norm_rows(cx, s, lead, h, dt, pad, **kw):
    """A ``[*lead, H]`` view with collapsible leading dims (row stride H + pad)."""
    pads = [0] * len(lead)
    if lead:
        pads[-1] = pad
    return cx.view((*lead, h), dt, pads=pads, scale=s["scale"], **kw)


def build_rms_norm(s, cx):
    from numkern import norm

    from .test_norm import reference

    return _build_norm(s, cx, norm.rms_norm, reference, fused=False)


def build_fused_add_rms_norm(s, cx):
    from numkern import norm

    from .test_norm import reference

    return _build_norm(s, cx, norm.fused_add_rms_norm, reference, fused=True)


def _build_norm(s, cx, op, reference, fused):
    dt, h = s["dt"], s["h"]
    lead = tuple(s["lead"]) if s["lead"] else ()
    if not lead and s["mut"] is None and fused:
        lead = (1,)
    wdt = None if s["wdt"] is None else (dt if s["wdt"] == "same" else FP32)
    x = _norm_rows(cx, s, lead or (), h, dt, s["pad"]) if lead else cx.view((h,), dt)
    rows = math.prod(lead)
    if s["poison"]:
        poison(cx, x)
    second = _norm_rows(cx, s, lead, h, dt, s["pad2"]) if lead else cx.view((h,), dt)
    w = None if wdt is None else cx.view((h,), wdt, scale=1.0)
    eps = s["eps"]
    mut, refuse = s["mut"], True
    if fused:
        a = dict(input=cx.out(x), residual=cx.out(second), weight=w, epsilon=eps)
        main, other = "input", "residual"
    else:
        a = dict(out=cx.out(second), input=x, weight=w, epsilon=eps)
        main, other = "input", "out"
    if mut == "eps_neg":
        a["epsilon"] = -1e-6
    elif mut == "eps_nan":
        a["epsilon"] = [float("nan"), float("inf")][int(cx.rng.integers(0, 2))]
    elif mut == "eps_type":
        a["epsilon"] = ["1e-6", None, True, [1e-6]][int(cx.rng.integers(0, 4))]
    elif mut == "w_shape":
        a["weight"] = cx.view((h + 1,), wdt or FP32)
    elif mut == "w_dtype":
        other_dt = {BF: FP16, FP16: BF, FP32: BF}[dt]
        a["weight"] = cx.view((h,), [other_dt, I32][int(cx.rng.integers(0, 2))])
    elif mut == "out_dtype":
        other_dt = {BF: FP16, FP16: FP32, FP32: BF}[dt]
        a[other] = cx.out(cx.view(second.shape, other_dt))
    elif mut == "out_shape":
        a[other] = cx.out(cx.view((*lead, h + 1), dt))
    elif mut == "colstride":
        if h < 2:
            raise Refuse
        a[other] = cx.out(cx.view(second.shape, dt, inner=2))
    elif mut == "rows_overlap":
        if rows < 2 or len(lead) != 1 or h < 2:  # (h = 1: a row stride of 0, unfillable)
            raise Refuse
        a[other] = cx.out(cx.view(second.shape, dt, pads=[-1]))
    elif mut == "uncollapsible":
        if len(lead) != 2 or lead[0] < 2 or lead[1] < 2:
            raise Refuse
        a[other] = cx.out(cx.view(second.shape, dt, pads=[3, 1]))
    elif mut == "h_zero":
        a[main] = cx.view((*lead, 0), dt)
        a[other] = cx.out(cx.view((*lead, 0), dt))
    elif mut == "out_alias":
        # the second buffer over the first's memory: exactly (in place), or shifted
        if not lead or rows == 0:
            raise Refuse
        shift = [0, 0, 1, h, h // 2 + 1][int(cx.rng.integers(0, 5))]
        base = cx.base(rows * (h + 2) + h + 8, dt)
        first = _norm_rows(cx, s, lead, h, dt, 2, base=base, at=0)
        twin = _norm_rows(
            cx, s, lead, h, dt, 2, base=base, at=shift, data=None if shift else first.clone()
        )
        if shift:
            first.copy_(cx.rand(first.shape, dt))  # twin's fill overwrote part of first
        a[main] = cx.out(first) if fused else first
        a[other] = cx.out(twin)
        refuse = False
    elif mut == "numpy":
        key = [main, other, "weight"][int(cx.rng.integers(0, 3))]
        if a[key] is None:
            raise Refuse
        refuse = a[key].dtype == BF
        a[key] = numpy_of(a[key])

    def as_t(v):
        return torch.from_numpy(v) if isinstance(v, np.ndarray) else v

    def check(_):
        xin = as_t(a[main])
        x0 = cx.pre(xin)
        w0 = cx.pre(as_t(a["weight"])) if a["weight"] is not None else None
        if fused:
            res = as_t(a["residual"])
            r0 = cx.pre(res)
            summed = (x0.float() + r0.float()).to(dt)
            assert same_bits(res, summed), "residual: not round(input + residual)"
            ref = reference(summed, w0, float(a["epsilon"]))
            out = xin
        else:
            ref = reference(x0, w0, float(a["epsilon"]))
            out = as_t(a["out"])
        if out.numel() == 0:
            return
        r2, o2 = ref.reshape(-1, h), out.reshape(-1, h)
        ok = check_nonfinite_rows(o2, r2)
        if ok.any():
            assert_within(o2[ok], r2[ok], r2[ok].abs(), dt, "norm")

    def call():
        if fused:
            return op(a["input"], a["residual"], a["weight"], a["epsilon"])
        return op(a["out"], a["input"], a["weight"], a["epsilon"])

    t_op = torch_ops().fused_add_rms_norm if fused else torch_ops().rms_norm
    return Case(call, check, refuse and mut is not None, torch=TorchForm(t_op, a, same_names(a)))


# ---------------------------------------------------------------------------------------
# numkern.rope.rotary_embedding


ROPE_MUTS = [
    "pos_oob",
    "pos_int32",
    "pos_strided",
    "q_colstride",
    "q_width",
    "k_alias_q",
    "k_dtype",
    "k_tokens",
    "head_size_type",
    "head_size_zero",
    "rot_odd",
    "rot_wide",
    "cache_noncontig",
    "cache_dtype",
    "neox_type",
    "q_rows_overlap",
    "q_heads_strided",
    "numpy",
]


@st.composite
def rotary_embedding_spec(draw):
    s = spec_of(draw, "rotary_embedding")
    s["dt"] = draw(FLOAT_DT)
    s["cdt"] = draw(st.sampled_from(["same", FP32]))
    s["t"] = draw(st.sampled_from([0, 1, 1, 2, 3, 5, 9]))
    s["hq"], s["hk"] = draw(st.integers(1, 4)), draw(st.integers(0, 3))
    s["hs"] = draw(st.sampled_from([2, 6, 13, 16, 32, 40, 64]))
    s["rot"] = draw(st.integers(1, 32))
    s["ndim"] = draw(st.sampled_from([2, 3]))
    s["p"] = draw(st.integers(1, 50))
    s["fused"] = draw(st.booleans())
    s["pads"] = draw(dims(2))
    s["neox"] = draw(st.booleans())
    s["poison"] = draw(st.booleans())
    return s


def build_rotary_embedding(s, cx):
    from numkern import rope

    from .test_rope import cos_sin, reference

    dt, t_n, hq, hk, hs = s["dt"], s["t"], s["hq"], s["hk"], s["hs"]
    rot = min(2 * s["rot"], hs - hs % 2)
    cdt = dt if s["cdt"] == "same" else FP32
    cache = cx.view((s["p"], rot), cdt, data=cos_sin(s["p"], rot, cdt), lead=0, tail=0)
    pos = cx.view((t_n,), I64, data=torch.randint(0, s["p"], (t_n,), generator=cx.g))

    def heads_view(h, base=None, at=None, row=None):
        width = h * hs
        pad = (row - width) if row else s["pads"][0]
        if s["ndim"] == 3:
            return cx.view((t_n, h, hs), dt, pads=[pad + 0, 0], base=base, at=at)
        return cx.view((t_n, width), dt, pads=[pad], base=base, at=at)

    if s["fused"] and hk:  # q and k column windows of one qkv buffer
        row = (hq + 2 * hk) * hs + s["pads"][1]
        base = cx.base(max(t_n, 1) * row + 4, dt)
        q = heads_view(hq, base, 1, row)
        k = heads_view(hk, base, 1 + hq * hs, row)
    else:
        q = heads_view(hq)
        k = heads_view(hk) if hk else None
    if s["poison"]:
        poison(cx, q)
    a = dict(
        positions=pos,
        query=cx.out(q),
        key=cx.out(k) if k is not None else None,
        head_size=hs,
        cos_sin_cache=cache,
        is_neox=s["neox"],
    )
    mut, refuse = s["mut"], True
    if mut == "pos_oob":
        if t_n == 0:
            raise Refuse
        pos[int(cx.rng.integers(0, t_n))] = [s["p"], -1, 2**40][int(cx.rng.integers(0, 3))]
    elif mut == "pos_int32":
        a["positions"] = pos.int()
    elif mut == "pos_strided":
        if t_n < 2:
            raise Refuse
        a["positions"] = cx.view((t_n,), I64, inner=2, data=pos)
    elif mut == "q_colstride":
        a["query"] = cx.out(cx.view(q.shape, dt, inner=2))
    elif mut == "q_width":
        a["query"] = cx.out(cx.view((t_n, hq * hs + 1), dt))
    elif mut == "k_alias_q":  # key over query's memory: the same, or overlapping heads
        a["key"] = cx.out(
            q if cx.rng.integers(0, 2) or hq < 2 else q[..., hs:] if q.dim() == 2 else q[:, 1:]
        )
        refuse = False
    elif mut == "k_dtype":
        a["key"] = cx.out(cx.view((t_n, hs), {BF: FP16, FP16: FP32, FP32: BF}[dt]))
    elif mut == "k_tokens":
        a["key"] = cx.out(cx.view((t_n + 1, hs), dt))
    elif mut == "head_size_type":
        a["head_size"] = [float(hs), True, str(hs), None][int(cx.rng.integers(0, 4))]
    elif mut == "head_size_zero":
        a["head_size"] = [0, -hs][int(cx.rng.integers(0, 2))]
    elif mut == "rot_odd":
        a["cos_sin_cache"] = cx.view((s["p"], rot - 1), cdt)
    elif mut == "rot_wide":
        a["cos_sin_cache"] = cx.view((s["p"], hs + 2 - hs % 2), cdt)
    elif mut == "cache_noncontig":
        a["cos_sin_cache"] = cx.view(
            (s["p"], rot), cdt, pads=[1] if s["p"] > 1 else None, inner=1 if s["p"] > 1 else 2
        )
    elif mut == "cache_dtype":
        a["cos_sin_cache"] = cx.view((s["p"], rot), FP16 if dt != FP16 else BF)
    elif mut == "neox_type":
        a["is_neox"] = [1, "yes", None][int(cx.rng.integers(0, 3))]
    elif mut == "q_rows_overlap":
        if t_n < 2:
            raise Refuse
        a["query"] = cx.out(cx.view((t_n, hq * hs), dt, pads=[-1]))
    elif mut == "q_heads_strided":
        if hq < 2:
            raise Refuse
        a["query"] = cx.out(cx.view((t_n, hq, hs), dt, pads=[0, 1]))
    elif mut == "numpy":
        key = ["positions", "query", "cos_sin_cache", "key"][int(cx.rng.integers(0, 4))]
        if a[key] is None:
            raise Refuse
        refuse = a[key].dtype == BF
        a[key] = numpy_of(a[key])

    def as_t(v):
        return torch.from_numpy(v) if isinstance(v, np.ndarray) else v

    def check(_):
        p0 = cx.pre(as_t(a["positions"]))
        c0 = cx.pre(as_t(a["cos_sin_cache"]))
        for name in ("query", "key"):
            x = as_t(a[name])
            if x is None or x.numel() == 0:
                continue
            if (
                name == "key"
                and x.data_ptr() == as_t(a["query"]).data_ptr()
                and x.shape == a["query"].shape
            ):
                continue  # accepted as the query itself: judged there
            x0 = cx.pre(x)
            ref, mag = reference(x0, p0, c0, hs, s["neox"])
            h = x.numel() // (t_n * hs)
            r3, o3, m3 = (v.reshape(t_n, h, hs) for v in (ref, x, mag))
            ok = check_nonfinite_rows(o3, r3, dims=2)
            if ok.any():
                assert_within(o3[ok], r3[ok], m3[ok], dt, "rope")

    def call():
        return rope.rotary_embedding(
            a["positions"], a["query"], a["key"], a["head_size"], a["cos_sin_cache"], a["is_neox"]
        )

    form = TorchForm(torch_ops().rotary_embedding, a, same_names(a))
    return Case(call, check, refuse and mut is not None, torch=form)


# ---------------------------------------------------------------------------------------
# numkern.moe: routing


ROUTING_MUTS = [
    "k_zero",
    "k_big",
    "k_type",
    "logits_int",
    "logits_1d",
    "logits_3d",
    "numpy",
    "logits_list",
]
GROUPED_MUTS = [
    *ROUTING_MUTS,
    "group_divisor",
    "topk_group_big",
    "topk_group_zero",
    "k_over_groups",
    "scoring",
    "bias_shape",
    "bias_int",
    "group_type",
]


@st.composite
def topk_softmax_spec(draw):
    s = spec_of(draw, "topk_softmax")
    s["dt"] = draw(FLOAT_DT)
    s["t"] = draw(st.sampled_from([0, 1, 1, 2, 3, 5, 9, 13]))
    s["e"] = draw(st.integers(1, 40))
    s["k"] = draw(st.integers(1, 8))
    s["renorm"] = draw(st.booleans())
    s["layout"] = draw(st.sampled_from(["contig", "padded", "transposed"]))
    s["scale"] = draw(st.sampled_from([1.0, 0.01, 30.0]))
    s["ties"] = draw(st.booleans())
    s["poison"] = draw(st.booleans())
    return s


@st.composite
def grouped_topk_spec(draw):
    s = draw(topk_softmax_spec())
    s["op"] = "grouped_topk"
    s["n_group"] = draw(st.integers(1, 4))
    s["per"] = draw(st.integers(1, 8))
    s["e"] = s["n_group"] * s["per"]
    s["topk_group"] = draw(st.integers(1, s["n_group"]))
    s["k"] = draw(st.integers(1, s["topk_group"] * s["per"]))
    s["scoring"] = draw(st.sampled_from(["softmax", "sigmoid"]))
    s["bias"] = draw(st.sampled_from([None, FP32, BF]))
    s["rscale"] = draw(st.sampled_from([1.0, 2.5]))
    return s


def _logits(s, cx):
    t_n, e_n = s["t"], s["e"]
    data = cx.rand((t_n, e_n), FP32, s["scale"])
    if s["ties"] and t_n and e_n > 1:  # a row of equal logits, and a repeated value
        data[0] = 0.5
        data[-1, e_n // 2] = data[-1, 0]
    if s["layout"] == "transposed":
        v = cx.view((e_n, t_n), s["dt"], data=data.T).T
    else:
        v = cx.view((t_n, e_n), s["dt"], data=data, pads=[2] if s["layout"] == "padded" else [0])
    if s["poison"]:
        poison(cx, v)
    return v


def _routing_mut(s, cx, a):
    """Mutations both routing ops share; returns whether the call must be refused."""
    mut, lg = s["mut"], a["logits"]
    if mut == "k_zero":
        a["topk"] = [0, -1][int(cx.rng.integers(0, 2))]
    elif mut == "k_big":
        a["topk"] = s["e"] + 1
    elif mut == "k_type":
        a["topk"] = [float(s["k"]), True, str(s["k"]), None][int(cx.rng.integers(0, 4))]
    elif mut == "logits_int":
        a["logits"] = cx.view(tuple(lg.shape), I32)
    elif mut == "logits_1d":
        a["logits"] = lg.reshape(-1) if lg.is_contiguous() else lg[0]
    elif mut == "logits_3d":
        a["logits"] = lg[None]
    elif mut == "numpy":
        a["logits"] = numpy_of(lg)
        return lg.dtype == BF
    elif mut == "logits_list":
        a["logits"] = lg.tolist()
    return mut is not None


def _check_routing(w, ids, t_n, k, e_n, ref_w, ref_ids, ok, kind="topk_softmax"):
    assert w.dtype == FP32 and ids.dtype == I32, (w.dtype, ids.dtype)
    assert w.shape == ids.shape == (t_n, k) and w.is_contiguous() and ids.is_contiguous()
    if t_n == 0:
        return
    assert int(ids.min()) >= 0 and int(ids.max()) < e_n, "expert id out of range"
    assert all(len(set(r)) == k for r in ids.tolist()), "an expert chosen twice"
    if ok.any():
        assert torch.equal(ids[ok], ref_ids[ok]), "ids differ from the reference"
        t = tolerance(kind, FP32)  # test_moe's
        torch.testing.assert_close(w[ok], ref_w[ok].float(), rtol=t.rel, atol=t.abs)


def build_topk_softmax(s, cx):
    from numkern import moe

    from .test_moe import topk_reference

    s = {**s, "k": min(s["k"], s["e"])}
    lg = _logits(s, cx)
    a = dict(logits=lg, topk=s["k"], renormalize=s["renorm"])
    refuse = _routing_mut(s, cx, a)

    def check(res):
        w, ids = res
        lf = cx.pre(lg).float().double()
        # the kernel's arithmetic: float64 exp and sum, each exp stored as fp32 first
        ex = torch.exp(lf - lf.max(1, keepdim=True).values)
        probs = (ex.float().double() / ex.sum(1, keepdim=True)).float()
        vals, ref_ids = topk_reference(probs, s["k"])
        ref_w = vals.double() / vals.double().sum(1, keepdim=True) if s["renorm"] else vals
        ok = torch.isfinite(probs).all(1) if s["t"] else torch.zeros(0, dtype=torch.bool)
        _check_routing(w, ids, s["t"], s["k"], s["e"], ref_w, ref_ids, ok)

    form = TorchForm(torch_ops().topk_softmax, a, same_names(a))
    return Case(
        lambda: moe.topk_softmax(a["logits"], a["topk"], a["renormalize"]), check, refuse, form
    )


def build_grouped_topk(s, cx):
    from numkern import moe

    from .test_moe import grouped_reference

    lg = _logits(s, cx)
    bias = None if s["bias"] is None else cx.view((s["e"],), s["bias"], scale=0.1)
    a = dict(
        logits=lg,
        topk=s["k"],
        renormalize=s["renorm"],
        num_expert_group=s["n_group"],
        topk_group=s["topk_group"],
        scoring_func=s["scoring"],
        routed_scaling_factor=s["rscale"],
        e_score_correction_bias=bias,
    )
    mut = s["mut"]
    refuse = _routing_mut(s, cx, a)
    if mut == "group_divisor":
        if s["e"] < 2:
            raise Refuse
        a["num_expert_group"] = s["e"] + 1
    elif mut == "topk_group_big":
        a["topk_group"] = s["n_group"] + 1
    elif mut == "topk_group_zero":
        a["topk_group"] = 0
    elif mut == "k_over_groups":
        if s["topk_group"] * s["per"] >= s["e"]:
            raise Refuse
        a["topk"] = s["topk_group"] * s["per"] + 1
    elif mut == "scoring":
        a["scoring_func"] = ["relu", None, "Softmax"][int(cx.rng.integers(0, 3))]
    elif mut == "bias_shape":
        a["e_score_correction_bias"] = cx.view((s["e"] + 1,), FP32)
    elif mut == "bias_int":
        a["e_score_correction_bias"] = cx.view((s["e"],), I32)
    elif mut == "group_type":
        a["num_expert_group"] = [float(s["n_group"]), True][int(cx.rng.integers(0, 2))]
        refuse = True

    def check(res):
        w, ids = res
        if s["t"] == 0:  # the reference takes no empty batch
            _check_routing(w, ids, 0, s["k"], s["e"], None, None, None)
            return
        l0 = cx.pre(lg)
        b0 = cx.pre(bias)
        ref_w, ref_ids = grouped_reference(
            l0, s["k"], s["renorm"], s["n_group"], s["topk_group"], s["scoring"], s["rscale"], b0
        )
        lf = l0.float()
        ok = torch.isfinite(lf).all(1) if s["t"] else torch.zeros(0, dtype=torch.bool)
        if s["scoring"] == "softmax":  # -inf logits are fine for softmax, not a whole row
            ok = torch.isfinite(torch.softmax(lf.double(), 1)).all(1) & ~torch.isnan(lf).any(1)
            ok &= ~torch.isposinf(lf).any(1)
        _check_routing(w, ids, s["t"], s["k"], s["e"], ref_w, ref_ids, ok, "grouped_topk")

    def call():
        return moe.grouped_topk(**a)

    return Case(call, check, refuse, torch=TorchForm(torch_ops().grouped_topk, a, same_names(a)))


# ---------------------------------------------------------------------------------------
# numkern.moe.prepack_moe_weight


PREPACK_MUTS = ["isa", "amx_dtype", "n48", "k16", "noncontig", "ndim2", "numpy", "int"]


@st.composite
def prepack_moe_weight_spec(draw):
    s = spec_of(draw, "prepack_moe_weight")
    s["isa"] = draw(st.sampled_from(["vec", "amx"]))
    s["dt"] = BF if s["isa"] == "amx" else draw(FLOAT_DT)
    s["e"] = draw(st.integers(1, 3))
    s["n"], s["k"] = draw(st.sampled_from([32, 64, 96])), draw(st.sampled_from([32, 64]))
    s["poison"] = draw(st.booleans())
    return s


def build_prepack_moe_weight(s, cx):
    from numkern import moe

    e_n, n, k, dt = s["e"], s["n"], s["k"], s["dt"]
    w = cx.view((e_n, n, k), dt)
    if s["poison"]:
        poison(cx, w)
    a = dict(weight=w, isa=s["isa"])
    mut, refuse = s["mut"], True
    if mut == "isa":
        a["isa"] = ["avx", "AMX", None, "vec16"][int(cx.rng.integers(0, 4))]
    elif mut == "amx_dtype":
        a["isa"] = "amx"
        a["weight"] = cx.view((e_n, n, k), [FP16, FP32][int(cx.rng.integers(0, 2))])
    elif mut == "n48":
        a["weight"] = cx.view((e_n, 48, k), dt)
    elif mut == "k16":
        a["weight"] = cx.view((e_n, n, k - 16), dt)
    elif mut == "noncontig":
        a["weight"] = cx.view((e_n, n, k), dt, pads=[0, 2])
    elif mut == "ndim2":
        a["weight"] = w[0]
    elif mut == "numpy":
        refuse = dt == BF
        a["weight"] = numpy_of(w)
    elif mut == "int":
        a["weight"] = cx.view((e_n, n, k), I32)

    def check(p):
        w0 = cx.pre(w)
        assert p.shape == w0.shape and p.dtype == w0.dtype
        ee, nn, kk = torch.meshgrid(
            torch.arange(e_n), torch.arange(n), torch.arange(k), indexing="ij"
        )
        if a["isa"] == "vec":  # docs/kernels.md §5.2
            flat = (nn // 16) * 16 * k + kk * 16 + nn % 16
        else:
            flat = (nn // 16) * 16 * k + (kk // 2) * 32 + (nn % 16) * 2 + kk % 2
        got = torch.as_tensor(p).reshape(e_n, -1)[ee, flat]
        assert same_bits(got, w0), "layout"

    def packed_weight():  # the op's output: a fresh contiguous tensor like weight
        w_ = a["weight"]
        if not isinstance(w_, torch.Tensor):
            return {"packed_weight": torch.empty(0)}
        return {"packed_weight": torch.zeros(tuple(w_.shape), dtype=w_.dtype)}

    form = TorchForm(
        torch_ops().prepack_moe_weight,
        a,
        same_names(a),
        prep=packed_weight,
        post=lambda _, kw: kw["packed_weight"],
    )
    return Case(
        lambda: moe.prepack_moe_weight(a["weight"], a["isa"]),
        check,
        refuse and mut is not None,
        torch=form,
    )


# ---------------------------------------------------------------------------------------
# numkern.moe.fused_moe


MOE_MUTS = [
    "ids_oob",
    "ids_int64",
    "weights_f64",
    "out_noncontig",
    "out_alias_in",
    "isa",
    "activation",
    "skip_weighted_k",
    "w13_h",
    "i_not_32",
    "bias_shape",
    "weights_shape",
    "w_dtype",
    "amx_fp16",
    "input_noncontig",
    "ids_noncontig",
]


@st.composite
def fused_moe_spec(draw):
    s = spec_of(draw, "fused_moe")
    s["isa"] = draw(st.sampled_from(["vec", "vec", "amx"]))
    s["dt"] = BF if s["isa"] == "amx" else draw(FLOAT_DT)
    s["t"] = draw(st.sampled_from([0, 1, 1, 2, 3, 5, 9]))
    s["e"] = draw(st.integers(1, 8))
    s["k"] = draw(st.integers(1, 4))
    s["h"], s["i"] = draw(st.sampled_from([32, 64])), draw(st.sampled_from([32, 64]))
    s["act"] = draw(st.sampled_from(["silu", "gelu", "gelu_tanh", "swigluoai"]))
    s["bias"] = draw(st.booleans())
    s["skip"] = draw(st.integers(0, 3)) == 0
    s["poison"] = draw(st.booleans())
    return s


def build_fused_moe(s, cx):
    from numkern import moe

    from .test_moe import assert_close_moe, moe_reference

    dt, t_n, e_n, h, i_n, isa = s["dt"], s["t"], s["e"], s["h"], s["i"], s["isa"]
    k = 1 if s["skip"] else min(s["k"], e_n)
    x = cx.view((t_n, h), dt, lead=0, tail=0) if cx.rng.integers(0, 2) else cx.view((t_n, h), dt)
    if s["poison"]:
        poison(cx, x)
    w13 = cx.rand((e_n, 2 * i_n, h), dt, 1 / math.sqrt(h))
    w2 = cx.rand((e_n, h, i_n), dt, 1 / math.sqrt(i_n))
    b13 = cx.view((e_n, 2 * i_n), dt) if s["bias"] else None
    b2 = cx.view((e_n, h), dt) if s["bias"] else None
    tw, ti = moe.topk_softmax(cx.rand((t_n, e_n)), k, True)
    tw, ti = cx.view((t_n, k), FP32, data=tw), cx.view((t_n, k), I32, data=ti)
    out = cx.out(cx.view((t_n, h), dt, data=torch.full((t_n, h), float("nan"))))
    a = dict(
        output=out,
        input=x,
        w13=cx.adopt(moe.prepack_moe_weight(w13, isa)),
        w2=cx.adopt(moe.prepack_moe_weight(w2, isa)),
        w13_bias=b13,
        w2_bias=b2,
        topk_weights=tw,
        topk_ids=ti,
        activation=s["act"],
        skip_weighted=s["skip"],
        isa=isa,
    )
    mut, refuse = s["mut"], True
    x_t = x
    if mut == "ids_oob":
        if t_n == 0:
            raise Refuse
        # (-1 is valid: an expert on another rank, skipped; -2 is the first invalid one)
        ti[int(cx.rng.integers(0, t_n)), int(cx.rng.integers(0, k))] = [
            e_n,
            -2,
            2**31 - 1,
            -(2**31),
        ][int(cx.rng.integers(0, 4))]
    elif mut == "ids_int64":
        a["topk_ids"] = ti.long()
    elif mut == "weights_f64":
        a["topk_weights"] = tw.double()
    elif mut == "out_noncontig":
        if t_n < 2:  # one padded row is contiguous
            raise Refuse
        a["output"] = cx.out(cx.view((t_n, h), dt, pads=[1]))
    elif mut == "out_alias_in":
        a["output"] = cx.out(x)
        refuse = False
    elif mut == "isa":
        a["isa"] = ["avx", "vec16", None][int(cx.rng.integers(0, 3))]
    elif mut == "activation":
        a["activation"] = ["relu", "SiLU", None][int(cx.rng.integers(0, 3))]
    elif mut == "skip_weighted_k":
        if e_n < 2:
            raise Refuse
        tw2, ti2 = moe.topk_softmax(cx.rand((t_n, e_n)), 2, True)
        a["topk_weights"], a["topk_ids"] = (
            cx.view((t_n, 2), FP32, data=tw2),
            cx.view((t_n, 2), I32, data=ti2),
        )
        a["skip_weighted"] = True
    elif mut == "w13_h":
        a["w13"] = cx.adopt(
            moe.prepack_moe_weight(cx.rand((e_n, 2 * i_n, h + 32), dt), "vec" if dt != BF else isa)
        )
    elif mut == "i_not_32":
        a["w13"] = cx.view((e_n, 2 * i_n - 16, h), dt)
        a["w2"] = cx.view((e_n, h, i_n - 8), dt)
    elif mut == "bias_shape":
        a["w13_bias"] = cx.view((e_n, 2 * i_n + 1), dt)
    elif mut == "weights_shape":
        a["topk_weights"] = cx.view((t_n, k + 1), FP32)
    elif mut == "w_dtype":
        a["w2"] = cx.view((e_n, h, i_n), {BF: FP16, FP16: FP32, FP32: BF}[dt])
    elif mut == "amx_fp16":
        a["isa"] = "amx"
        if dt == BF:
            a["input"] = cx.view((t_n, h), FP16)
    elif mut == "input_noncontig":
        if t_n < 2:  # one padded row is contiguous
            raise Refuse
        x_t = a["input"] = cx.view((t_n, h), dt, pads=[2], data=x)
    elif mut == "ids_noncontig":
        if t_n < 2:  # one padded row is contiguous
            raise Refuse
        a["topk_ids"] = cx.view((t_n, k), I32, pads=[1], data=ti)

    def check(_):
        x0 = cx.pre(x_t)
        ref, scale = moe_reference(
            x0, w13, w2, cx.pre(b13), cx.pre(b2), cx.pre(tw), cx.pre(ti), s["act"], s["skip"]
        )
        o = a["output"]
        ok = check_nonfinite_rows(o, ref)
        if ok.any():
            assert_close_moe(o[ok], ref[ok], scale[ok])

    names = same_names(a) | {"topk_id": "topk_ids", "act": "activation"}
    del names["topk_ids"], names["activation"]
    form = TorchForm(torch_ops().cpu_fused_moe, a, names)
    return Case(lambda: moe.fused_moe(**a), check, refuse and mut is not None, torch=form)


# ---------------------------------------------------------------------------------------
# numkern.attention: reshape_and_cache, plan_attention, paged_attention

# (isa, dtypes, head dims, block sizes): small sizes each variant serves (docs §3.2)
ATTN_VARIANTS = {
    "vec": ((BF, FP16, FP32), (16, 32, 48, 64), (32, 64)),
    "vec16": ((BF, FP16, FP32), (16, 32, 48), (16, 32, 48)),
    "amx": ((BF,), (32, 64), (32, 64)),
}


@st.composite
def _attn_config(draw, s):
    s["isa"] = draw(st.sampled_from(list(ATTN_VARIANTS)))
    dts, ds, bs = ATTN_VARIANTS[s["isa"]]
    s["dt"], s["d"], s["b"] = (
        draw(st.sampled_from(dts)),
        draw(st.sampled_from(ds)),
        draw(st.sampled_from(bs)),
    )
    s["hkv"], s["grp"] = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    return s


CACHE_MUTS = [
    "slot_oob",
    "slot_int32",
    "slot_len",
    "key_dtype",
    "key_colstride",
    "key_heads",
    "cache_layout",
    "isa",
    "block_rule",
    "amx_fp32",
    "cache_numpy",
    "numpy",
    "value_tokens",
    "key_alias_cache",
]


@st.composite
def reshape_and_cache_spec(draw):
    s = draw(_attn_config(spec_of(draw, "reshape_and_cache")))
    s["nb"] = draw(st.integers(1, 4))
    s["t"] = draw(st.sampled_from([0, 1, 1, 2, 3, 5, 9]))
    s["pads"], s["vpads"] = draw(dims(2)), draw(dims(2))
    s["skips"] = draw(st.integers(0, 2))
    s["poison"] = draw(st.booleans())
    return s


def _cache_index(isa, b, d, o):
    """Element offsets of token ``o``'s K and V rows inside a (block, head) half-slab."""
    dd = torch.arange(d)
    if isa == "amx":
        return (o // 16) * 16 * d + (dd // 2) * 32 + (o % 16) * 2 + dd % 2, (dd // 16) * b * 16 + (
            o // 2
        ) * 32 + (dd % 16) * 2 + o % 2
    return dd * b + o, o * d + dd


def build_reshape_and_cache(s, cx):
    from numkern import attention as A

    isa, dt, d, b, hkv, nb = s["isa"], s["dt"], s["d"], s["b"], s["hkv"], s["nb"]
    t_n = min(s["t"], nb * b)
    kv = cx.out(cx.view(A.kv_cache_shape(nb, hkv, b, d), dt))
    kc, vc = A.split_kv_cache(kv)
    key = cx.view((t_n, hkv, d), dt, pads=s["pads"])
    value = cx.view((t_n, hkv, d), dt, pads=s["vpads"])
    if s["poison"]:
        poison(cx, key)
    slots = torch.randperm(nb * b, generator=cx.g)[:t_n]
    for _ in range(s["skips"] if t_n else 0):
        slots[int(cx.rng.integers(0, t_n))] = -int(cx.rng.integers(1, 5))
    sm = cx.view((t_n,), I64, data=slots)
    a = dict(key=key, value=value, key_cache=kc, value_cache=vc, slot_mapping=sm, isa=isa)
    mut = s["mut"]
    if mut == "slot_oob":
        if t_n == 0:
            raise Refuse
        sm[int(cx.rng.integers(0, t_n))] = [nb * b, nb * b + 7, 2**62][int(cx.rng.integers(0, 3))]
    elif mut == "slot_int32":
        a["slot_mapping"] = cx.view((t_n,), I32, data=slots)
    elif mut == "slot_len":
        a["slot_mapping"] = (
            cx.view((t_n + 1,), I64) if t_n == 0 or cx.rng.integers(0, 2) else sm[:-1]
        )
    elif mut == "key_dtype":
        a["key"] = cx.view((t_n, hkv, d), {BF: FP16, FP16: FP32, FP32: BF}[dt])
    elif mut == "key_colstride":
        a["key"] = cx.view((t_n, hkv, d), dt, inner=2)
    elif mut == "key_heads":
        a["key"] = cx.view((t_n, hkv + 1, d), dt)
    elif mut == "cache_layout":  # half-slabs not contiguous: a [nb, Hkv, D, B] view transposed
        a["key_cache"] = cx.view((nb, hkv, d, b), dt).transpose(2, 3)
    elif mut == "isa":
        a["isa"] = ["avx", None, "VEC"][int(cx.rng.integers(0, 3))]
    elif mut == "block_rule":
        if isa == "vec16" and b % 32 == 0:
            raise Refuse
        a["isa"] = "vec" if isa == "vec16" else isa
        if isa != "vec16":  # a block of 16 in a 32-multiple variant
            kv2 = cx.view(A.kv_cache_shape(nb, hkv, 16, d), dt)
            a["key_cache"], a["value_cache"] = A.split_kv_cache(kv2)
    elif mut == "amx_fp32":
        a["isa"] = "amx"
        if dt == BF:
            kv2 = cx.view(A.kv_cache_shape(nb, hkv, b, d), FP32)
            a["key_cache"], a["value_cache"] = A.split_kv_cache(kv2)
    elif mut == "cache_numpy":
        if dt == BF:
            raise Refuse
        a["key_cache"] = kc.numpy()
    elif mut == "numpy":
        if dt == BF:
            raise Refuse
        name = ["key", "value", "slot_mapping"][int(cx.rng.integers(0, 3))]
        a[name] = a[name].numpy()
    elif mut == "value_tokens":
        a["value"] = cx.view((t_n + 1, hkv, d), dt)
    elif mut == "key_alias_cache":  # key read from the cache memory it writes
        flat = kv.view(-1)
        if t_n == 0 or flat.numel() < t_n * hkv * d:
            raise Refuse
        at = int(cx.rng.integers(0, flat.numel() - t_n * hkv * d + 1))
        key = a["key"] = flat[at : at + t_n * hkv * d].view(t_n, hkv, d)
    refuse = mut not in (None, "numpy", "key_alias_cache")

    def check(_):
        want = cx.pre(kv).clone()
        flat = want.view(-1)
        k0, v0 = cx.pre(key), cx.pre(value)
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            blk, o = divmod(slot, b)
            ki, vi = _cache_index(isa, b, d, o)
            for h in range(hkv):
                at = (blk * hkv + h) * 2 * b * d
                flat[at + ki] = k0[t, h]
                flat[at + b * d + vi] = v0[t, h]
        assert same_bits(kv, want), "cache contents"

    form = TorchForm(torch_ops().cpu_attn_reshape_and_cache, a, same_names(a))
    return Case(lambda: A.reshape_and_cache(**a), check, refuse, torch=form)


PLAN_MUTS = [
    "heads_multiple",
    "head_dim",
    "block_size",
    "window",
    "isa",
    "qsl_int64",
    "qsl_decreasing",
    "qsl_start",
    "seq_short",
    "bt_oob",
    "bt_narrow",
    "nb_without_table",
    "slots_without_nb",
    "slot_oob",
    "heads_type",
    "table_changed",
    "threads",
]
PAGED_MUTS = [
    "bt_oob",
    "bt_int64",
    "bt_narrow",
    "seq_short",
    "qsl_start",
    "q_dtype",
    "out_shape",
    "out_dtype",
    "d_mismatch",
    "alibi_shape",
    "sinks_dtype",
    "amx_fp32",
    "out_alias_q",
    "window",
    "plan_mismatch",
    "scale_type",
    "softcap_type",
    "q_colstride",
    "tokens",
    "out_alias_cache",
    "out_overlap_q",
]


@st.composite
def paged_attention_spec(draw, op="paged_attention"):
    s = draw(_attn_config(spec_of(draw, op)))
    r_n = draw(st.integers(1, 3))
    qs = draw(st.lists(st.sampled_from([0, 1, 1, 1, 2, 3, 5]), min_size=r_n, max_size=r_n))
    extra = draw(st.lists(st.integers(0, 80), min_size=r_n, max_size=r_n))
    s["reqs"] = [(q, q + e) for q, e in zip(qs, extra)]
    s["causal"] = draw(st.integers(0, 3)) > 0
    s["window"] = draw(st.sampled_from([-1, -1, 1, 3, 17, 40]))
    s["softcap"] = draw(st.sampled_from([0.0, 0.0, 5.0, 30.0]))
    s["alibi"], s["sinks"] = draw(st.booleans()), draw(st.sampled_from([None, FP32, BF]))
    s["scale"] = draw(st.sampled_from([0.5, 1.0, 2.0]))
    s["qpads"], s["opads"] = draw(dims(2)), draw(dims(2))
    s["plan"] = draw(st.sampled_from([None, "plain", "tables", "slots"]))
    s["threads"] = draw(st.sampled_from([None, 1, 2, 7]))
    s["poison"] = draw(st.sampled_from([None, "q", "k", "v"]))
    return s


@st.composite
def plan_attention_spec(draw):
    s = draw(paged_attention_spec("plan_attention"))
    s["plan"] = draw(st.sampled_from(["plain", "tables", "slots"]))
    return s


def build_paged_attention(s, cx):
    return _build_attention(s, cx, planning=False)


def build_plan_attention(s, cx):
    return _build_attention(s, cx, planning=True)


def _build_attention(s, cx, planning):
    from numkern import attention as A

    from .test_attention import assert_close_attn, build, reference

    isa, dt, d, b, hkv = s["isa"], s["dt"], s["d"], s["b"], s["hkv"]
    hq = hkv * s["grp"]
    reqs = s["reqs"]
    q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, hq, hkv, d, b, dt, isa, seed=s["seed"] % 1000)
    cx.adopt(kc._base)
    nb = kc.shape[0]
    t_n = q.shape[0]
    seen_v = None  # (request, key, kv head) of a non-finite V element
    if s["poison"] in ("k", "v") and any(kl for _, kl in reqs):  # a key's K or V row
        r = next(i for i, (_, kl) in enumerate(reqs) if kl)
        ql, kl = reqs[r]
        # half the time among the request's newest keys: later than some of its queries
        lo = max(0, kl - ql - 1) if cx.rng.integers(0, 2) else 0
        j, h = int(cx.rng.integers(lo, kl)), int(cx.rng.integers(0, hkv))
        kvs = ks if s["poison"] == "k" else vs
        if s["poison"] == "v":
            seen_v = (r, j, h)
        kvs[r][j, h, int(cx.rng.integers(0, d))] = NONFINITE[int(cx.rng.integers(0, 3))]
        slot = torch.tensor([int(bt[r, j // b]) * b + j % b])
        A.reshape_and_cache(ks[r][j : j + 1], vs[r][j : j + 1], kc, vc, slot, isa)
    query = cx.view((t_n, hq, d), dt, pads=s["qpads"], data=q)
    if s["poison"] == "q":
        poison(cx, query)
    out = cx.out(cx.view((t_n, hq, d), dt, pads=s["opads"], data=torch.full(q.shape, float("nan"))))
    qsl_t, sl_t = cx.view((len(reqs) + 1,), I32, data=qsl), cx.view((len(reqs),), I32, data=sl)
    bt_t = cx.view(tuple(bt.shape), I32, data=bt)
    alibi = cx.view((hq,), FP32, scale=0.1) if s["alibi"] else None
    sinks = cx.view((hq,), s["sinks"]) if s["sinks"] is not None else None
    slots = None
    if s["plan"] == "slots":
        pos = [torch.arange(kl - ql, kl) for ql, kl in reqs]
        slots = torch.cat([bt[r, p // b].long() * b + p % b for r, p in enumerate(pos)])
        slots = cx.view((t_n,), I64, data=slots)
    kw = dict(
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=b,
        causal=s["causal"],
        sliding_window=s["window"],
        isa=isa,
        num_threads=s["threads"],
    )
    pa = dict(query_start_loc=qsl_t, seq_lens=sl_t, **kw)
    if s["plan"] in ("tables", "slots"):
        pa.update(block_table=bt_t, num_blocks=nb, slot_mapping=slots)
    call = dict(
        query=query,
        key_cache=kc,
        value_cache=vc,
        output=out,
        query_start_loc=qsl_t,
        seq_lens=sl_t,
        block_table=bt_t,
        scale=s["scale"] * d**-0.5,
        causal=s["causal"],
        sliding_window=s["window"],
        softcap=s["softcap"],
        alibi_slopes=alibi,
        sinks=sinks,
        isa=isa,
    )
    mut, refuse = s["mut"], mut_refuses(s["mut"])
    need = [(kl + b - 1) // b for _, kl in reqs]
    used = [r for r, n in enumerate(need) if n]
    target = pa if planning else call

    def entry(r):
        return int(bt_t[r, int(cx.rng.integers(max(0, _first_block(s, r)), need[r]))])

    if mut in ("bt_oob", "bt_narrow", "table_changed") and not used:
        raise Refuse
    if mut == "bt_oob":
        r = used[int(cx.rng.integers(0, len(used)))]
        lo = max(0, _first_block(s, r))
        if lo >= need[r]:
            raise Refuse
        bt_t[r, int(cx.rng.integers(lo, need[r]))] = [nb, -1, 2**31 - 1][int(cx.rng.integers(0, 3))]
        if planning and s["plan"] == "plain":
            pa.update(block_table=bt_t, num_blocks=nb)
    elif mut == "bt_int64":
        target["block_table"] = bt_t.long()
    elif mut == "bt_narrow":
        target["block_table"] = cx.view(
            (bt.shape[0], max(need) - 1), I32, data=bt[:, : max(need) - 1]
        )
        if planning:
            pa.update(num_blocks=nb)
    elif mut == "seq_short":
        r = [i for i, (ql, _) in enumerate(reqs) if ql]
        if not r:
            raise Refuse
        sl_t[r[0]] = reqs[r[0]][0] - 1
    elif mut == "qsl_start":
        qsl_t[0] = 1
    elif mut == "qsl_decreasing":
        if len(reqs) < 2:
            raise Refuse
        qsl_t[1] = int(qsl_t[2]) + 1
    elif mut == "qsl_int64":
        pa["query_start_loc"] = qsl_t.long()
    elif mut == "heads_multiple":
        if hkv < 2:
            raise Refuse
        pa["num_heads"] = hq + 1
    elif mut == "head_dim":
        pa["head_dim"] = d + 8
    elif mut == "block_size":
        pa["block_size"] = b + 8
    elif mut == "window":
        target["sliding_window"] = [0, -2][int(cx.rng.integers(0, 2))]
    elif mut == "isa":
        pa["isa"] = ["avx", None][int(cx.rng.integers(0, 2))]
    elif mut == "nb_without_table":
        pa.update(block_table=None, slot_mapping=None, num_blocks=nb)
    elif mut == "slots_without_nb":
        pa.update(block_table=None, num_blocks=None, slot_mapping=cx.view((t_n,), I64))
    elif mut == "slot_oob":
        if t_n == 0:
            raise Refuse
        sm = cx.view((t_n,), I64, data=torch.zeros(t_n, dtype=I64))
        sm[int(cx.rng.integers(0, t_n))] = nb * b
        pa.update(block_table=bt_t, num_blocks=nb, slot_mapping=sm)
    elif mut == "heads_type":
        pa["num_heads"] = [float(hq), True, str(hq)][int(cx.rng.integers(0, 3))]
    elif mut == "table_changed":  # the call's table differs from the plan's
        pa.update(block_table=bt_t, num_blocks=nb)
        bt2 = bt_t.clone()
        r = used[0]
        bt2[r, need[r] - 1] = (int(bt2[r, need[r] - 1]) + 1) % nb
        call["block_table"] = cx.view(tuple(bt.shape), I32, data=bt2)
    elif mut == "threads":
        pa["num_threads"] = [0, -1, 10**6][int(cx.rng.integers(0, 3))]
        refuse = False
    elif mut == "q_dtype":
        call["query"] = cx.view((t_n, hq, d), {BF: FP16, FP16: FP32, FP32: BF}[dt])
    elif mut == "out_shape":
        call["output"] = cx.out(cx.view((t_n, hq + 1, d), dt))
    elif mut == "out_dtype":
        call["output"] = cx.out(cx.view((t_n, hq, d), {BF: FP32, FP16: BF, FP32: FP16}[dt]))
    elif mut == "d_mismatch":
        call["query"] = cx.view((t_n, hq, d + 16), dt)
        call["output"] = cx.out(cx.view((t_n, hq, d + 16), dt))
    elif mut == "alibi_shape":
        call["alibi_slopes"] = cx.view((hq + 1,), FP32)
    elif mut == "sinks_dtype":
        call["sinks"] = cx.view((hq,), [FP16, I32][int(cx.rng.integers(0, 2))])
    elif mut == "amx_fp32":
        if dt != BF:
            call["isa"] = "amx"
            pa["isa"] = "amx"
        else:
            call["query"] = cx.view((t_n, hq, d), FP32)
    elif mut == "out_alias_q":  # in place: exactly the query
        call["output"] = cx.out(query)
    elif mut == "out_overlap_q":  # a head further along the query's own buffer
        if t_n == 0:
            raise Refuse
        base = cx.base(t_n * (hq + 1) * d + d, dt)
        q2 = cx.view((t_n, hq, d), dt, base=base, at=0, pads=[d, 0], data=query)
        call["query"] = q2
        call["output"] = cx.out(cx.view((t_n, hq, d), dt, base=base, at=d, pads=[d, 0]))
        q2.copy_(query)  # the output's fill overwrote part of it
    elif mut == "out_alias_cache":  # output written over the cache it reads
        flat = kc._base.view(-1)
        if t_n == 0 or flat.numel() < t_n * hq * d:
            raise Refuse
        at = int(cx.rng.integers(0, flat.numel() - t_n * hq * d + 1))
        call["output"] = cx.out(flat[at : at + t_n * hq * d].view(t_n, hq, d))
    elif mut == "scale_type":
        call["scale"] = ["0.1", None, float("nan"), True][int(cx.rng.integers(0, 4))]
    elif mut == "softcap_type":
        call["softcap"] = ["5", None, float("nan"), -1.0][int(cx.rng.integers(0, 4))]
    elif mut == "q_colstride":
        call["query"] = cx.view((t_n, hq, d), dt, inner=2)
    elif mut == "tokens":
        call["query"] = cx.view((t_n + 1, hq, d), dt)
        call["output"] = cx.out(cx.view((t_n + 1, hq, d), dt))
    elif mut == "plan_mismatch":
        pa["causal"] = not s["causal"]
        if s["plan"] is None:
            s = {**s, "plan": "plain"}
    planned = planning or s["plan"] is not None
    if planned:

        def run():
            plan = A.plan_attention(**pa)
            return A.paged_attention(**call, plan=plan)
    else:

        def run():
            return A.paged_attention(**call)

    form = None
    plan_only = planning and mut == "bt_narrow"  # the plan's table; the call's is whole
    if not (mut in ATTN_NO_TORCH or plan_only or (mut == "heads_type" and pa["num_heads"] is True)):
        form = _attention_torch_form(call, pa, planned, len(reqs), hq, hkv, d, dt)

    def check(_):
        o = call["output"]
        if o.numel() == 0:
            return
        q0 = cx.pre(call["query"])
        al = cx.pre(alibi)
        sk = cx.pre(sinks)
        if seen_v is not None:  # (vs: a finite copy)
            vs_ref = [v.clone() for v in vs]
            row = vs_ref[seen_v[0]][seen_v[1]]
            row.copy_(torch.nan_to_num(row, nan=0.0, posinf=0.0, neginf=0.0))
        else:
            vs_ref = vs
        ref = reference(
            q0,
            qsl,
            sl,
            ks,
            vs_ref,
            hkv,
            scale=call["scale"],
            causal=s["causal"],
            window=s["window"],
            softcap=s["softcap"],
            alibi=al,
            sinks=sk,
        )
        if seen_v is not None:
            _poison_seers(ref, seen_v, reqs, qsl, hq // hkv, s["causal"], s["window"])
        ok = check_nonfinite_rows(o, ref, dims=2)
        if ok.any():
            assert_close_attn(o[ok], ref[ok])

    return Case(run, check, refuse, torch=form)


def _poison_seers(ref, seen, reqs, qsl, grp, causal, window):
    """NaN into the rows of ``ref [T, Hq, D]`` that see key ``j`` of request ``r`` in kv
    head ``h`` (``seen``): its non-finite V reaches them, and only them (softmax weighs no
    masked key; the reference's masked matmul would make 0 * NaN of every row)."""
    r, j, h = seen
    ql, kl = reqs[r]
    for i in range(ql):
        p = kl - ql + i  # the reference's masks (docs §6.5): a window is two-sided uncausal
        seen_by = (j <= p or not causal) and (window <= 0 or abs(p - j) < window)
        if seen_by:
            ref[int(qsl[r]) + i, h * grp : (h + 1) * grp] = float("nan")


# attention mutations the torch ops cannot express: their plans carry no block table, slot
# mapping nor block size (the attention call takes the table, its cache the block size);
# also a narrow table given to the plan only, and True for num_heads, which reaches the plan
# op as 1 (the direct plan refuses the bool)
ATTN_NO_TORCH = ("nb_without_table", "slots_without_nb", "slot_oob", "table_changed", "block_size")


def _attention_torch_form(call, pa, planned, r_n, hq, hkv, d, dt):
    """The call as vLLM's ``cpu_attention_with_kv_cache`` with the scheduler metadata of
    the plan: ``plan_attention``'s op with the plan's arguments (a planned case), else
    ``get_scheduler_metadata`` as vLLM calls it, for the query's dtype."""
    T = torch_ops()

    def metadata():
        q = call["query"]
        q_dt = q.dtype if isinstance(q, torch.Tensor) and q.dtype in FLOATS else dt
        if planned:
            kw = {k: v for k, v in pa.items() if k not in ("block_table", "slot_mapping")}
            kw.pop("num_blocks", None)
            qsl, sl = kw.pop("query_start_loc"), kw.pop("seq_lens")
            md = T.plan_attention(qsl, sl, **kw, dtype=str(q_dt).split(".")[1])
        else:
            md = T.get_scheduler_metadata(
                r_n,
                hq,
                hkv,
                d,
                call["seq_lens"],
                q_dt,
                call["query_start_loc"],
                call["causal"],
                call["sliding_window"],
                call["isa"],
                True,
                None,
            )
        return {"scheduler_metadata": md}

    names = {n: n for n in ("query", "key_cache", "value_cache", "output", "query_start_loc")}
    names |= {n: n for n in ("seq_lens", "scale", "causal", "alibi_slopes", "block_table")}
    names |= {"softcap": "softcap", "sliding_window_size": "sliding_window", "s_aux": "sinks"}
    return TorchForm(
        T.cpu_attention_with_kv_cache,
        call,
        names,
        const={"dynamic_causal": None},
        prep=metadata,
        same_message=False,
    )


def _first_block(s, r):
    """The first block of request r the kernels read (docs §6.4: with a window, from the
    tile of its first visible key)."""
    ql, kl = s["reqs"][r]
    w = s["window"]
    if w <= 0:
        return 0
    lo = max(0, kl - ql - w + 1)
    return (lo - lo % 32) // s["b"]


def mut_refuses(mut):
    """Whether an attention mutation names an invalid call (the rest: either outcome)."""
    return mut is not None and mut not in (
        "out_alias_q",
        "out_alias_cache",
        "out_overlap_q",
        "threads",
    )


# ---------------------------------------------------------------------------------------
# numkern.gdn: causal_conv1d_fwd, causal_conv1d_update


CONV_COMMON_MUTS = [
    "slot_oob",
    "slot_dup",
    "idx_int64",
    "w_dtype",
    "w_shape",
    "states_dim",
    "states_cols",
    "bias_shape",
    "packed_odd",
    "silu_type",
    "states_none",
    "x_ndim",
]
FWD_MUTS = [
    *CONV_COMMON_MUTS,
    "qsl_end",
    "qsl_decreasing",
    "qsl_int64",
    "init_int",
    "slots_none_short",
]
UPDATE_MUTS = [
    *CONV_COMMON_MUTS,
    "x_alias_states",
    "accepted_oob",
    "accepted_2d",
    "accepted_missing",
    "slots_none_short",
]


@st.composite
def _conv_config(draw, s):
    s["dt"] = draw(FLOAT_DT)
    s["dim"] = draw(st.sampled_from([16, 32, 40, 64]))
    s["w"] = draw(st.sampled_from([2, 3, 4, 4]))
    s["packed"] = draw(st.booleans()) and s["dim"] % 32 == 0 and s["w"] % 2 == 0
    s["bias"], s["silu"] = draw(st.booleans()), draw(st.booleans())
    s["extra"] = draw(st.integers(0, 2))
    s["dim_first"] = draw(st.booleans())
    s["poison"] = draw(st.booleans())
    return s


@st.composite
def causal_conv1d_fwd_spec(draw):
    s = draw(_conv_config(spec_of(draw, "causal_conv1d_fwd")))
    r_n = draw(st.integers(0, 4))
    s["lens"] = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 9, 33]), min_size=r_n, max_size=r_n))
    s["batch"] = draw(st.integers(0, 4)) == 0  # x [R, dim, T], no query_start_loc
    s["slots"] = draw(st.sampled_from(["none", "perm", "pad"]))
    s["init"] = draw(st.sampled_from([None, "rand"]))
    s["xpad"] = draw(st.integers(0, 3))
    return s


@st.composite
def causal_conv1d_update_spec(draw):
    s = draw(_conv_config(spec_of(draw, "causal_conv1d_update")))
    s["b"] = draw(st.sampled_from([0, 1, 1, 2, 3, 5]))
    s["q"] = draw(st.sampled_from([None, None, 1, 2, 3]))  # None: x [B, dim]
    s["slots"] = draw(st.sampled_from(["none", "perm", "pad"]))
    s["xpad"] = draw(st.integers(0, 3))
    return s


def _conv_parts(s, cx, n_req, cols):
    """weight (plain fp and the argument), bias, states [S, dim, cols], slots list."""
    from numkern.gdn import conv

    dt, dim, width = s["dt"], s["dim"], s["w"]
    w = cx.rand((dim, width), dt, 0.5)
    w_arg = (
        cx.adopt(conv.causal_conv1d_weight_pack(w))
        if s["packed"]
        else (
            cx.view((dim, 1, width), dt, data=w[:, None])
            if cx.rng.integers(0, 2)
            else cx.view((dim, width), dt, data=w)
        )
    )
    bias = cx.view((dim,), dt) if s["bias"] else None
    n_slots = n_req + int(cx.rng.integers(0, 3))
    if s["dim_first"]:
        st_ = cx.view((n_slots, dim, cols), dt, pads=[int(cx.rng.integers(0, 3)), 0])
    else:  # vLLM's: [S, cols, dim] memory, viewed [S, dim, cols]
        st_ = cx.view((n_slots, cols, dim), dt).transpose(1, 2)
    perm = torch.randperm(n_slots, generator=cx.g)[:n_req].tolist()
    if s["slots"] == "pad" and n_req:
        perm[int(cx.rng.integers(0, n_req))] = conv.PAD_SLOT_ID
    return w, w_arg, bias, st_, perm


def _conv_mut(s, cx, a, n_req, slots_key, perm):
    """The mutations both conv ops share, on the call's arguments ``a``."""
    dt, dim, width = s["dt"], s["dim"], s["w"]
    mut = s["mut"]
    idx = a[slots_key]
    live = [i for i, p in enumerate(perm) if p >= 0]
    if mut == "slot_oob":
        if idx is None or not live:
            raise Refuse
        idx[live[0]] = [a["conv_states"].shape[0], -2, 2**31 - 1][int(cx.rng.integers(0, 3))]
    elif mut == "slot_dup":
        if idx is None or len(live) < 2:
            raise Refuse
        idx[live[1]] = idx[live[0]]
    elif mut == "idx_int64":
        if idx is None:
            raise Refuse
        a[slots_key] = idx.long()
    elif mut == "w_dtype":
        a["weight"] = cx.view((dim, width), {BF: FP16, FP16: FP32, FP32: BF}[dt])
    elif mut == "w_shape":
        a["weight"] = cx.view((dim, 2, width), dt)
    elif mut == "states_dim":
        a["conv_states"] = cx.view((a["conv_states"].shape[0], dim + 1, width + 2), dt)
    elif mut == "states_cols":
        if width < 2:
            raise Refuse
        a["conv_states"] = cx.view((a["conv_states"].shape[0], dim, width - 2), dt)
    elif mut == "bias_shape":
        a["bias"] = cx.view((dim + 1,), dt)
    elif mut == "packed_odd":
        if dim % 32 == 0 and width % 2 == 0:
            a["weight"] = cx.view((dim, width + 1), dt)
        a["is_weight_packed"] = True
    elif mut == "silu_type":
        a["silu_activation"] = [1, None, "yes"][int(cx.rng.integers(0, 3))]
    elif mut == "states_none":
        a["conv_states"] = None
    elif mut == "x_ndim":
        a["x"] = a["x"][None] if cx.rng.integers(0, 2) else a["x"].reshape(-1)
    elif mut == "slots_none_short":
        if a["conv_states"].shape[0] < 1:
            raise Refuse
        a[slots_key] = None
        a["conv_states"] = a["conv_states"][: max(n_req - 1, 0)]
        if n_req == 0:
            raise Refuse
    return mut is not None


def build_causal_conv1d_fwd(s, cx):
    from numkern.gdn import conv

    from .test_gdn_conv import ref_fwd

    dt, dim, width = s["dt"], s["dim"], s["w"]
    lens = list(s["lens"])
    if s["batch"]:
        lens = [lens[0] if lens else 3] * len(lens)
    n_req, t_n = len(lens), sum(lens)
    cols = width - 1 + s["extra"]
    w, w_arg, bias, st_, perm = _conv_parts(s, cx, n_req, cols)
    if s["batch"]:
        tl = lens[0] if lens else 0
        x = cx.view((n_req, tl, dim), dt, pads=[0, s["xpad"]]).transpose(1, 2)
        qsl = None
    else:  # vLLM's x: [dim, T] over a [T, dim] buffer, or a dim-first one
        if cx.rng.integers(0, 2):
            x = cx.view((t_n, dim), dt, pads=[s["xpad"]]).t()
        else:
            x = cx.view((dim, t_n), dt, pads=[s["xpad"]])
        qsl = cx.view((n_req + 1,), I32, data=torch.tensor(np.cumsum([0, *lens])))
    if s["poison"]:
        poison(cx, x)
    idx = None if s["slots"] == "none" else cx.view((n_req,), I32, data=torch.tensor(perm))
    slots = list(range(n_req)) if idx is None else perm
    init_l = [bool(cx.rng.integers(0, 2)) for _ in range(n_req)]
    init = None if s["init"] is None else cx.view((n_req,), torch.bool, data=torch.tensor(init_l))
    a = dict(
        x=x,
        weight=w_arg,
        bias=bias,
        conv_states=cx.out(st_),
        query_start_loc=qsl,
        cache_indices=idx,
        has_initial_state=init,
        silu_activation=s["silu"],
        is_weight_packed=s["packed"],
    )
    mut = s["mut"]
    if mut in ("qsl_end", "qsl_decreasing", "qsl_int64") and qsl is None:
        raise Refuse
    if mut == "qsl_end":
        qsl[-1] = t_n + 1
    elif mut == "qsl_decreasing":
        if n_req < 2:
            raise Refuse
        qsl[1] = int(qsl[2]) + 1
    elif mut == "qsl_int64":
        a["query_start_loc"] = qsl.long()
    elif mut == "init_int":
        a["has_initial_state"] = cx.view((n_req,), I32)
    if s["slots"] == "none" and mut in ("slot_oob", "slot_dup", "idx_int64"):
        raise Refuse
    refuse = _conv_mut(s, cx, a, n_req, "cache_indices", perm)

    def check(out):
        x0 = cx.pre(x)
        x_td = x0.permute(0, 2, 1).reshape(t_n, dim) if s["batch"] else x0.t()
        q_ = np.cumsum([0, *lens]).tolist()
        st0 = cx.pre(st_)
        ref, mag, ref_st = ref_fwd(
            x_td,
            w,
            bias,
            st0,
            q_,
            slots,
            init_l if init is not None else [False] * n_req,
            s["silu"],
        )
        assert out.shape == x.shape and out.dtype == dt, (out.shape, out.dtype)
        o_td = out.permute(0, 2, 1).reshape(t_n, dim) if s["batch"] else out.t()
        ok = check_nonfinite_rows(o_td, ref)
        if ok.any():
            assert_within(o_td[ok], ref[ok], mag[ok], dt, "gdn_conv")
        assert same_bits(st_, ref_st.to(dt)), "conv_states"

    const = {"pad_slot_id": conv.PAD_SLOT_ID}
    form = TorchForm(torch_ops().causal_conv1d_fwd_cpu, a, same_names(a), const=const)
    return Case(lambda: conv.causal_conv1d_fwd(**a), check, refuse, torch=form)


def build_causal_conv1d_update(s, cx):
    from numkern.gdn import conv

    from .test_gdn_conv import ref_fwd, ref_spec_update

    dt, dim, width, n_req, q = s["dt"], s["dim"], s["w"], s["b"], s["q"]
    cols = width - 1 + s["extra"] + (q - 1 if q else 0)
    w, w_arg, bias, st_, perm = _conv_parts(s, cx, n_req, cols)
    if q:  # the speculative reference takes no padding slot: the pad request gets a slot
        free = sorted(set(range(st_.shape[0])) - set(perm))
        perm = [p if p >= 0 else free.pop() for p in perm]
    if q:
        x = cx.view((n_req, q, dim), dt, pads=[s["xpad"], 0])
        hi = min(q, cols - width + 2)
        acc_l = [int(cx.rng.integers(1, hi + 1)) for _ in range(n_req)]
        acc = cx.view((n_req,), I32, data=torch.tensor(acc_l, dtype=I32))
    else:
        x = cx.view((n_req, dim), dt, pads=[s["xpad"]])
        acc = None
    if s["poison"]:
        poison(cx, x)
    idx = (
        None if s["slots"] == "none" else cx.view((n_req,), I32, data=torch.tensor(perm, dtype=I32))
    )
    slots = list(range(n_req)) if idx is None else perm
    a = dict(
        x=x,
        conv_states=cx.out(st_),
        weight=w_arg,
        bias=bias,
        silu_activation=s["silu"],
        conv_state_indices=idx,
        is_weight_packed=s["packed"],
        num_accepted_tokens=acc,
    )
    mut = s["mut"]
    if mut == "accepted_oob":
        if not q or not n_req:
            raise Refuse
        acc[int(cx.rng.integers(0, n_req))] = [0, q + 1, -1][int(cx.rng.integers(0, 3))]
    elif mut == "accepted_2d":
        if q:
            raise Refuse
        a["num_accepted_tokens"] = cx.view((n_req,), I32, data=torch.ones(n_req))
    elif mut == "accepted_missing":
        if not q:
            raise Refuse
        a["num_accepted_tokens"] = None
    elif mut == "x_alias_states":  # x read from the states it rewrites (a column of them)
        if q or n_req > st_.shape[0]:
            raise Refuse
        x = a["x"] = st_[:n_req, :, int(cx.rng.integers(0, cols))]
    if s["slots"] == "none" and mut in ("slot_oob", "slot_dup", "idx_int64"):
        raise Refuse
    refuse = _conv_mut(s, cx, a, n_req, "conv_state_indices", perm)
    refuse = refuse and mut != "x_alias_states"

    def check(out):
        x0, st0 = cx.pre(x), cx.pre(st_)
        assert out.shape == x.shape and out.dtype == dt, (out.shape, out.dtype)
        if q:
            ref, mag, ref_st = ref_spec_update(x0, st0, w, bias, s["silu"], slots, acc_l)
            o2, r2, m2 = (v.reshape(n_req * q, dim) for v in (out, ref, mag))
        else:
            ref, mag, ref_st = ref_fwd(
                x0, w, bias, st0, list(range(n_req + 1)), slots, [True] * n_req, s["silu"]
            )
            o2, r2, m2 = out, ref, mag
        ok = check_nonfinite_rows(o2, r2)
        if ok.any():
            assert_within(o2[ok], r2[ok], m2[ok], dt, "gdn_conv")
        assert same_bits(st_, ref_st.to(dt)), "conv_states"

    const = {"pad_slot_id": conv.PAD_SLOT_ID}
    form = TorchForm(torch_ops().causal_conv1d_update_cpu, a, same_names(a), const=const)
    return Case(lambda: conv.causal_conv1d_update(**a), check, refuse, torch=form)


# ---------------------------------------------------------------------------------------
# numkern.gdn.gating.fused_gdn_gating


GATING_MUTS = [
    "a_colstride",
    "b_shape",
    "alog_dtype",
    "dtb_dtype",
    "a_int",
    "alog_noncontig",
    "numpy",
    "a_ndim",
]


@st.composite
def fused_gdn_gating_spec(draw):
    s = spec_of(draw, "fused_gdn_gating")
    s["dt"] = draw(FLOAT_DT)
    s["ldt"] = draw(st.sampled_from(["same", FP32]))
    s["t"] = draw(st.sampled_from([0, 1, 1, 2, 3, 7]))
    s["h"] = draw(st.integers(1, 40))
    s["pads"] = draw(dims(2))
    s["scale"] = draw(st.sampled_from([1.0, 8.0, 30.0]))
    s["poison"] = draw(st.booleans())
    return s


def build_fused_gdn_gating(s, cx):
    from numkern.gdn import gating

    from .test_gdn_gating import ref_gating

    dt, t_n, h = s["dt"], s["t"], s["h"]
    ldt = dt if s["ldt"] == "same" else FP32
    alog = cx.view((h,), ldt)
    a_ = cx.view((t_n, h), dt, pads=[s["pads"][0]], scale=s["scale"])
    b_ = cx.view((t_n, h), dt, pads=[s["pads"][1]], scale=s["scale"])
    dtb = cx.view((h,), dt, scale=s["scale"])
    if s["poison"]:
        poison(cx, [a_, b_][int(cx.rng.integers(0, 2))])
    a = dict(A_log=alog, a=a_, b=b_, dt_bias=dtb)
    mut, refuse = s["mut"], True
    if mut == "a_colstride":
        if h < 2:
            raise Refuse
        a["a"] = cx.view((t_n, h), dt, inner=2)
    elif mut == "b_shape":
        a["b"] = cx.view((t_n, h + 1), dt)
    elif mut == "alog_dtype":
        a["A_log"] = cx.view((h,), {BF: FP16, FP16: BF, FP32: BF}[dt])
    elif mut == "dtb_dtype":
        a["dt_bias"] = cx.view((h,), {BF: FP32, FP16: FP32, FP32: BF}[dt])
    elif mut == "a_int":
        a["a"] = cx.view((t_n, h), I32)
    elif mut == "alog_noncontig":
        if h < 2:
            raise Refuse
        a["A_log"] = cx.view((h,), ldt, inner=2)
    elif mut == "numpy":
        key = ["A_log", "a", "b", "dt_bias"][int(cx.rng.integers(0, 4))]
        refuse = a[key].dtype == BF
        a[key] = numpy_of(a[key])
    elif mut == "a_ndim":
        a["a"] = a_[None]

    def check(res):
        g, beta = res
        assert g.shape == (1, t_n, h) and g.dtype == FP32 and g.is_contiguous()
        assert beta.shape == (1, t_n, h) and beta.dtype == dt and beta.is_contiguous()
        g_ref, beta_ref = ref_gating(cx.pre(alog), cx.pre(a_), cx.pre(b_), cx.pre(dtb))
        # g: the fp32 sum x = a + dt_bias (docs §11.4) is off by up to 2^-24 |x|, which
        # exp(x) turns into a relative error |x| 2^-24 of g: the bound grows with |x|
        x = cx.pre(a_).double() + cx.pre(dtb).double()
        g_mag = g_ref.abs() * (1 + x.abs().nan_to_num(0.0) / 8)
        for got, ref, mag, d_ in (
            (g[0], g_ref, g_mag, FP32),
            (beta[0], beta_ref, beta_ref.abs(), dt),
        ):
            ok = check_nonfinite_rows(got, ref)
            if ok.any():
                assert_within(got[ok], ref[ok], mag[ok], d_, "gdn_gating_fuzz")

    form = TorchForm(torch_ops().fused_gdn_gating_cpu, a, same_names(a))
    return Case(lambda: gating.fused_gdn_gating(**a), check, refuse and mut is not None, torch=form)


# ---------------------------------------------------------------------------------------
# numkern.gdn.rule: chunk_gated_delta_rule, fused_sigmoid_gating_delta_rule_update


RULE_MUTS = [
    "slot_oob",
    "slot_dup",
    "cu_end",
    "cu_decreasing",
    "cu_int64",
    "dk_odd",
    "hv_multiple",
    "state_dtype",
    "state_noncontig",
    "q_colstride",
    "l2_type",
    "eps_neg",
    "v_tokens",
    "slots_len",
]
CHUNK_MUTS = [*RULE_MUTS, "head_first", "g_dtype", "beta_shape"]
RECUR_MUTS = [*RULE_MUTS, "sp_beta", "alog_shape", "a_dtype"]


@st.composite
def _rule_config(draw, s):
    s["dt"] = draw(FLOAT_DT)
    s["hk"] = draw(st.integers(1, 2))
    s["hv"] = s["hk"] * draw(st.integers(1, 2))
    s["dk"], s["dv"] = draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))
    s["l2"] = draw(st.booleans())
    # mostly the schema's eps (the torch op takes no other): test_fuzz requires half the
    # cases to run through the torch op too
    s["eps"] = draw(st.sampled_from([1e-5, 1e-5, 1e-5, 1e-6]))
    s["pad"] = draw(st.booleans())
    s["poison"] = draw(st.sampled_from([None, None, "q", "k", "v"]))
    return s


@st.composite
def chunk_gated_delta_rule_spec(draw):
    s = draw(_rule_config(spec_of(draw, "chunk_gated_delta_rule")))
    r_n = draw(st.integers(0, 3))
    s["lens"] = draw(st.lists(st.sampled_from([0, 1, 2, 5, 9, 63, 65]), min_size=r_n, max_size=r_n))
    s["bdt"] = draw(st.sampled_from(["same", FP32]))
    return s


@st.composite
def fused_sigmoid_gating_delta_rule_update_spec(draw):
    s = draw(_rule_config(spec_of(draw, "fused_sigmoid_gating_delta_rule_update")))
    r_n = draw(st.integers(0, 4))
    s["lens"] = draw(st.lists(st.sampled_from([0, 1, 1, 1, 2, 5]), min_size=r_n, max_size=r_n))
    s["ldt"] = draw(st.sampled_from(["same", FP32]))
    s["sp"] = draw(st.sampled_from([(1.0, 20.0), (0.5, 1.0), (2.0, 5.0)]))
    return s


def _rule_inputs(s, cx):
    from .test_gdn_rule import case

    lens, n = list(s["lens"]), len(s["lens"])
    n_slots = n + int(cx.rng.integers(0, 3))
    perm = torch.randperm(max(n_slots, 1), generator=cx.g)[:n].tolist()
    if s["pad"] and n:
        perm[int(cx.rng.integers(0, n))] = -1
    q, k, v, pool, cu, slots = case(
        lens, s["hk"], s["hv"], s["dk"], s["dv"], s["dt"], s["l2"], perm, n_slots
    )
    cx.adopt(q._base)
    pool = cx.out(cx.adopt(pool))
    if s["poison"]:
        poison(cx, {"q": q, "k": k, "v": v}[s["poison"]])
    cu = cx.view((n + 1,), I32, data=cu)
    idx = cx.view((n,), I32, data=slots)
    return q, k, v, pool, cu, idx, perm


def _rule_mut(s, cx, a, names, perm):
    qn, kn, vn, sn = names
    mut, dt = s["mut"], s["dt"]
    live = [i for i, p in enumerate(perm) if p >= 0]
    idx, cu = a["idx"], a["cu"]
    q = a[qn]
    if mut == "slot_oob":
        if not live:
            raise Refuse
        idx[live[0]] = [a[sn].shape[0], -2][int(cx.rng.integers(0, 2))]
    elif mut == "slot_dup":
        if len(live) < 2:
            raise Refuse
        idx[live[1]] = idx[live[0]]
    elif mut == "cu_end":
        cu[-1] = int(cu[-1]) + 1
    elif mut == "cu_decreasing":
        if len(perm) < 2:
            raise Refuse
        cu[1] = int(cu[2]) + 1
    elif mut == "cu_int64":
        a["cu"] = cu.long()
    elif mut == "dk_odd":
        a[qn] = cx.view((1, q.shape[1], q.shape[2], 24), dt)
        a[kn] = cx.view((1, q.shape[1], q.shape[2], 24), dt)
    elif mut == "hv_multiple":
        if s["hk"] < 2:
            raise Refuse
        a[vn] = cx.view((1, q.shape[1], s["hv"] + 1, s["dv"]), dt)
    elif mut == "state_dtype":
        a[sn] = cx.view(tuple(a[sn].shape), [BF, torch.float64][int(cx.rng.integers(0, 2))])
    elif mut == "state_noncontig":
        a[sn] = cx.view(tuple(a[sn].shape), FP32, pads=[0, 0, 1])
    elif mut == "q_colstride":
        a[qn] = cx.view(tuple(q.shape), dt, inner=2)
    elif mut == "l2_type":
        a["l2"] = [1, None, "yes"][int(cx.rng.integers(0, 3))]
    elif mut == "eps_neg":
        a["eps"] = [-1e-5, float("nan"), "1e-5"][int(cx.rng.integers(0, 3))]
    elif mut == "v_tokens":
        a[vn] = cx.view((1, q.shape[1] + 1, s["hv"], s["dv"]), dt)
    elif mut == "slots_len":
        a["idx"] = cx.view((len(perm) + 1,), I32)
    return mut is not None


def _rule_close(out, ref, dtype, what, dp=False):
    """test_gdn_rule's bound (one unit of ``dtype`` plus fp32 slack of the largest output;
    ``dp``: the chunked op's bf16 path, DP_BOUND of the largest entry) for the rows of
    ``ref [rows, n]`` that are finite."""
    ok = check_nonfinite_rows(out, ref)
    if not ok.any():
        return
    o, r = out[ok].double(), ref[ok].double()
    if dp:
        err = (o - r).abs().max().item() / max(r.abs().max().item(), 1e-30)
        assert err <= tolerance("gdn_rule_dp", BF).peak, (
            f"{what}: {err:.3g} of the largest entry (bf16 path)"
        )
        return
    t = tolerance("gdn_rule", dtype)
    tol = t.rel * r.abs() + t.peak * r.abs().max() + 1e-30
    worst = ((o - r).abs() / tol).max().item()
    assert worst <= 1.0, f"{what}: worst error {worst:.3g} x tolerance"


def build_chunk_gated_delta_rule(s, cx):
    from numkern.gdn import rule

    from .test_gdn_rule import reference

    q, k, v, pool, cu, idx, perm = _rule_inputs(s, cx)
    dt, t_n, hv = s["dt"], q.shape[1], s["hv"]
    g = cx.view((1, t_n, hv), FP32, data=-torch.rand(1, t_n, hv, generator=cx.g) * 0.2)
    bdt = dt if s["bdt"] == "same" else FP32
    beta = cx.view((1, t_n, hv), bdt, data=torch.rand(1, t_n, hv, generator=cx.g))
    a = dict(
        query=q,
        key=k,
        value=v,
        g=g,
        beta=beta,
        state=pool,
        ofs=True,
        cu=cu,
        hf=False,
        l2=s["l2"],
        idx=idx,
        eps=s["eps"],
    )
    mut = s["mut"]
    if mut == "head_first":
        a["hf"] = True
    elif mut == "g_dtype":
        a["g"] = cx.view((1, t_n, hv), dt if dt != FP32 else BF)
    elif mut == "beta_shape":
        a["beta"] = cx.view((1, t_n, hv + 1), bdt)
    refuse = _rule_mut(s, cx, a, ("query", "key", "value", "state"), perm)

    def check(res):
        out, st_ = res
        assert st_ is pool, "the pool itself is returned"
        assert out.shape == (1, t_n, hv, s["dv"]) and out.dtype == dt
        ref_o, ref_s = reference(
            cx.pre(q)[0],
            cx.pre(k)[0],
            cx.pre(v)[0],
            cx.pre(g)[0],
            cx.pre(beta)[0],
            cx.pre(pool),
            torch.tensor(perm),
            cx.pre(cu),
            s["l2"],
            s["eps"],
        )
        dp = dt == BF and rule.DP_BF16  # the bf16 path (docs/kernels.md §11.5)
        _rule_close(
            out[0].reshape(t_n * hv, s["dv"]), ref_o.reshape(t_n * hv, s["dv"]), dt, "output", dp
        )
        n_s = pool.shape[0] * hv
        _rule_close(
            pool.reshape(n_s, s["dk"] * s["dv"]),
            ref_s.reshape(n_s, s["dk"] * s["dv"]),
            FP32,
            "state",
            dp,
        )

    def call():
        return rule.chunk_gated_delta_rule(
            a["query"],
            a["key"],
            a["value"],
            a["g"],
            a["beta"],
            a["state"],
            a["ofs"],
            a["cu"],
            a["hf"],
            a["l2"],
            a["idx"],
            eps=a["eps"],
        )

    names = dict(zip(CHUNK_SCHEMA, ("query", "key", "value", "g", "beta", "state", "ofs")))
    names |= dict(zip(CHUNK_SCHEMA[7:], ("cu", "hf", "l2", "idx", "eps")))

    def final_states(res, kw):
        """vLLM returns the pool; numkern's op (docs §12.4) the requests' slots, new."""
        out, final = res
        slots = kw["initial_state_indices"].long()
        want = torch.zeros(final.shape, dtype=final.dtype)
        live = slots >= 0
        want[live] = kw["initial_state"][slots[live]]
        assert bits_equal(final, want), "final states: not the requests' slots of the pool"
        return out, kw["initial_state"]

    form = TorchForm(torch_ops().chunk_gated_delta_rule_cpu, a, names, post=final_states)
    return Case(call, check, refuse, torch=form)


CHUNK_SCHEMA = (  # chunk_gated_delta_rule_cpu's arguments, in order
    "query",
    "key",
    "value",
    "g",
    "beta",
    "initial_state",
    "output_final_state",
    "cu_seqlens",
    "head_first",
    "use_qk_l2norm_in_kernel",
    "initial_state_indices",
    "eps",
)
RECURRENT_SCHEMA = (  # fused_sigmoid_gating_delta_rule_update_cpu's, in order
    "A_log",
    "dt_bias",
    "q",
    "k",
    "v",
    "a",
    "b",
    "initial_state_source",
    "initial_state_indices",
    "cu_seqlens",
    "use_qk_l2norm_in_kernel",
    "softplus_beta",
    "softplus_threshold",
)


def build_fused_sigmoid_gating_delta_rule_update(s, cx):
    from numkern.gdn import rule

    from .test_gdn_rule import gating, reference

    q, k, v, pool, cu, idx, perm = _rule_inputs(s, cx)
    dt, t_n, hv = s["dt"], q.shape[1], s["hv"]
    ldt = dt if s["ldt"] == "same" else FP32
    alog = cx.view((hv,), ldt, scale=0.5)
    dtb = cx.view((hv,), ldt)
    a_ = cx.view((t_n, hv), dt)
    b_ = cx.view((t_n, hv), dt)
    sp_beta, sp_thr = s["sp"]
    a = dict(
        A_log=alog,
        dt_bias=dtb,
        q=q,
        k=k,
        v=v,
        a=a_,
        b=b_,
        state=pool,
        idx=idx,
        cu=cu,
        l2=s["l2"],
        sp_beta=sp_beta,
        sp_thr=sp_thr,
        eps=s["eps"],
    )
    mut = s["mut"]
    if mut == "sp_beta":
        a["sp_beta"] = [0.0, -1.0, float("nan"), "1"][int(cx.rng.integers(0, 4))]
    elif mut == "alog_shape":
        a["A_log"] = cx.view((hv + 1,), ldt)
    elif mut == "a_dtype":
        a["a"] = cx.view((t_n, hv), {BF: FP16, FP16: FP32, FP32: BF}[dt])
    refuse = _rule_mut(s, cx, a, ("q", "k", "v", "state"), perm)

    def check(out):
        assert out.shape == (t_n, 1, hv, s["dv"]) and out.dtype == dt
        g, beta = gating(cx.pre(alog), cx.pre(dtb), cx.pre(a_), cx.pre(b_), sp_beta, sp_thr)
        ref_o, ref_s = reference(
            cx.pre(q)[0],
            cx.pre(k)[0],
            cx.pre(v)[0],
            g,
            beta,
            cx.pre(pool),
            torch.tensor(perm),
            cx.pre(cu),
            s["l2"],
            s["eps"],
        )
        _rule_close(out.reshape(t_n * hv, s["dv"]), ref_o.reshape(t_n * hv, s["dv"]), dt, "output")
        n_s = pool.shape[0] * hv
        _rule_close(
            pool.reshape(n_s, s["dk"] * s["dv"]),
            ref_s.reshape(n_s, s["dk"] * s["dv"]),
            FP32,
            "state",
        )

    def call():
        return rule.fused_sigmoid_gating_delta_rule_update(
            a["A_log"],
            a["dt_bias"],
            a["q"],
            a["k"],
            a["v"],
            a["a"],
            a["b"],
            a["state"],
            a["idx"],
            a["cu"],
            a["l2"],
            a["sp_beta"],
            a["sp_thr"],
            eps=a["eps"],
        )

    form = None
    if a["eps"] == rule.RECURRENT_EPS and type(a["eps"]) is float:  # the schema has no eps
        keys = ("A_log", "dt_bias", "q", "k", "v", "a", "b", "state", "idx", "cu", "l2")
        names = dict(zip(RECURRENT_SCHEMA, (*keys, "sp_beta", "sp_thr")))
        form = TorchForm(torch_ops().fused_sigmoid_gating_delta_rule_update_cpu, a, names)
    return Case(call, check, refuse, torch=form)


# ---------------------------------------------------------------------------------------
# numkern.gdn.norm.rms_norm_gated


GATED_MUTS = [
    "out_alias",
    "out_noncontig",
    "z_shape",
    "w_shape",
    "w_dtype",
    "eps_neg",
    "eps_type",
    "x_colstride",
    "out_dtype",
    "numpy",
    "x_ndim",
    "z_dtype",
]


@st.composite
def rms_norm_gated_spec(draw):
    s = spec_of(draw, "rms_norm_gated")
    s["dt"] = draw(FLOAT_DT)
    s["wdt"] = draw(st.sampled_from(["same", FP32]))
    s["shape"] = draw(
        st.sampled_from(
            [(0, 16), (1, 16), (3, 97), (5, 32), (2, 3, 16), (1, 4, 40), (3, 2, 7), (0, 2, 16)]
        )
    )
    s["eps"] = draw(st.sampled_from([1e-6, 1e-5, 0.0]))
    s["xpads"], s["zpads"] = draw(dims(2)), draw(dims(2))
    s["out"] = draw(st.sampled_from([None, None, "given", "x", "z"]))
    s["poison"] = draw(st.booleans())
    return s


def build_rms_norm_gated(s, cx):
    from numkern.gdn import norm as gnorm

    dt, shape = s["dt"], tuple(s["shape"])
    wdt = dt if s["wdt"] == "same" else FP32
    nd = len(shape)
    x = cx.view(shape, dt, pads=s["xpads"][: nd - 1], scale=3.0)
    z = cx.view(shape, dt, pads=s["zpads"][: nd - 1], scale=3.0)
    if s["out"] in ("x", "z"):  # in place: a contiguous x (or z)
        if s["out"] == "x":
            x = cx.view(shape, dt, pads=[0] * (nd - 1), scale=3.0)
        else:
            z = cx.view(shape, dt, pads=[0] * (nd - 1), scale=3.0)
    if s["poison"]:
        poison(cx, x)
    w = cx.view((shape[-1],), wdt)
    out = {None: None, "given": cx.view(shape, dt, pads=[0] * (nd - 1)), "x": x, "z": z}[s["out"]]
    if out is not None:
        cx.out(out)
    a = dict(x=x, z=z, weight=w, eps=s["eps"], out=out)
    mut, refuse = s["mut"], True
    if mut == "out_alias":  # out over part of x
        if x.numel() < 2:
            raise Refuse
        n = math.prod(shape)
        base = cx.base(n + 8, dt)
        x = a["x"] = cx.view(shape, dt, base=base, at=0, pads=[0] * (nd - 1))
        a["out"] = cx.out(
            cx.view(shape, dt, base=base, at=int(cx.rng.integers(1, 4)), pads=[0] * (nd - 1))
        )
        x.copy_(cx.rand(shape, dt, 3.0))
        refuse = False
    elif mut == "out_noncontig":
        if shape[0] < 2:
            raise Refuse
        a["out"] = cx.out(cx.view(shape, dt, pads=[1] + [0] * (nd - 2)))
    elif mut == "z_shape":
        a["z"] = cx.view((*shape[:-1], shape[-1] + 1), dt)
    elif mut == "w_shape":
        a["weight"] = cx.view((shape[-1] + 1,), wdt)
    elif mut == "w_dtype":
        a["weight"] = cx.view((shape[-1],), {BF: FP16, FP16: BF, FP32: BF}[dt])
    elif mut == "eps_neg":
        a["eps"] = [-1e-6, float("nan"), float("inf")][int(cx.rng.integers(0, 3))]
    elif mut == "eps_type":
        a["eps"] = ["1e-6", None, True][int(cx.rng.integers(0, 3))]
    elif mut == "x_colstride":
        if shape[-1] < 2:
            raise Refuse
        x = a["x"] = cx.view(shape, dt, inner=2)
    elif mut == "out_dtype":
        a["out"] = cx.out(cx.view(shape, {BF: FP32, FP16: BF, FP32: FP16}[dt]))
    elif mut == "numpy":
        key = ["x", "z", "weight"][int(cx.rng.integers(0, 3))]
        refuse = a[key].dtype == BF
        a[key] = numpy_of(a[key])
    elif mut == "x_ndim":
        a["x"], a["z"] = x.reshape(-1), z.reshape(-1)
    elif mut == "z_dtype":
        a["z"] = cx.view(shape, {BF: FP16, FP16: BF, FP32: BF}[dt])

    def check(res):
        from .test_gdn_norm import hf_reference

        assert isinstance(res, torch.Tensor) and res.shape == shape and res.dtype == dt
        if a["out"] is not None:
            o = a["out"] if isinstance(a["out"], torch.Tensor) else torch.from_numpy(a["out"])
            assert res.data_ptr() == o.data_ptr(), "out= is returned"
        x0, z0, w0 = cx.pre(x), cx.pre(z), cx.pre(w)
        ref = hf_reference(x0, z0, w0, s["eps"])
        o2, r2 = res.reshape(-1, shape[-1]), ref.reshape(-1, shape[-1])
        ok = check_nonfinite_rows(o2, r2)
        if not ok.any():
            return
        o2, r2 = o2[ok].double(), r2[ok].double()
        t = tolerance("gdn_norm", dt)  # test_gdn_norm's bound
        if dt == FP32:  # the vector exp, rsqrt and division
            tol = t.rel * r2.abs().clamp(min=2.0**-126)
        else:  # three roundings: at most two units apart
            tol = t.ulps * ulp(r2, dt)
        worst = ((o2 - r2).abs() / tol).max().item()
        assert worst <= 1.0, f"worst error {worst:.3g} x tolerance"

    form = None
    if mut not in ("out_alias", "out_noncontig", "out_dtype"):
        # the op's schema has no out: it returns a new tensor, copied into a given out
        def into_out(res, kw):
            if a["out"] is None:
                return res
            return a["out"].copy_(res)

        names = {n: n for n in ("x", "z", "weight", "eps")}
        form = TorchForm(torch_ops().rms_norm_gated, a, names, post=into_out)
    return Case(lambda: gnorm.rms_norm_gated(**a), check, refuse and mut is not None, form)


# ---------------------------------------------------------------------------------------
# the harness's own cases (tests/test_fuzz.py checks the pool with them)


def build_selftest(s, cx):
    """``mut``: None (a valid no-op), "segv" (the worker kills itself with SIGSEGV), "hang"
    (it sleeps past any timeout), "wrong" (a wrong result), "write" (writes a buffer, then
    refuses)."""
    import signal

    buf = cx.view((4,), FP32)

    def call():
        if s["mut"] == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif s["mut"] == "hang":
            time.sleep(3600)
        elif s["mut"] == "write":
            buf[0] = 1.0
            raise ValueError("buf: refused after writing")
        return 1 if s["mut"] == "wrong" else 0

    def check(res):
        assert res == 0, "wrong result"

    return Case(call, check, s["mut"] == "write")


BUILDERS = {
    "convert_weight_packed": build_convert_weight_packed,
    "weight_packed_linear": build_weight_packed_linear,
    "weight_packed_linear_cpu": build_weight_packed_linear_cpu,
    "rms_norm": build_rms_norm,
    "fused_add_rms_norm": build_fused_add_rms_norm,
    "rotary_embedding": build_rotary_embedding,
    "topk_softmax": build_topk_softmax,
    "grouped_topk": build_grouped_topk,
    "prepack_moe_weight": build_prepack_moe_weight,
    "fused_moe": build_fused_moe,
    "reshape_and_cache": build_reshape_and_cache,
    "plan_attention": build_plan_attention,
    "paged_attention": build_paged_attention,
    "causal_conv1d_fwd": build_causal_conv1d_fwd,
    "causal_conv1d_update": build_causal_conv1d_update,
    "fused_gdn_gating": build_fused_gdn_gating,
    "chunk_gated_delta_rule": build_chunk_gated_delta_rule,
    "fused_sigmoid_gating_delta_rule_update": build_fused_sigmoid_gating_delta_rule_update,
    "rms_norm_gated": build_rms_norm_gated,
    "_selftest": build_selftest,
}
STRATEGIES = {  # op -> (strategy of valid specs, mutations)
    "convert_weight_packed": (convert_weight_packed_spec, PACK_MUTS),
    "weight_packed_linear": (weight_packed_linear_spec, LINEAR_MUTS),
    "weight_packed_linear_cpu": (weight_packed_linear_cpu_spec, LINEAR_CPU_MUTS),
    "rms_norm": (rms_norm_spec, NORM_MUTS),
    "fused_add_rms_norm": (fused_add_rms_norm_spec, NORM_MUTS),
    "rotary_embedding": (rotary_embedding_spec, ROPE_MUTS),
    "topk_softmax": (topk_softmax_spec, ROUTING_MUTS),
    "grouped_topk": (grouped_topk_spec, GROUPED_MUTS),
    "prepack_moe_weight": (prepack_moe_weight_spec, PREPACK_MUTS),
    "fused_moe": (fused_moe_spec, MOE_MUTS),
    "reshape_and_cache": (reshape_and_cache_spec, CACHE_MUTS),
    "plan_attention": (plan_attention_spec, PLAN_MUTS),
    "paged_attention": (paged_attention_spec, PAGED_MUTS),
    "causal_conv1d_fwd": (causal_conv1d_fwd_spec, FWD_MUTS),
    "causal_conv1d_update": (causal_conv1d_update_spec, UPDATE_MUTS),
    "fused_gdn_gating": (fused_gdn_gating_spec, GATING_MUTS),
    "chunk_gated_delta_rule": (chunk_gated_delta_rule_spec, CHUNK_MUTS),
    "fused_sigmoid_gating_delta_rule_update": (
        fused_sigmoid_gating_delta_rule_update_spec,
        RECUR_MUTS,
    ),
    "rms_norm_gated": (rms_norm_gated_spec, GATED_MUTS),
}


# the decoder run (numkern.decoder.DecoderStack.run): its cases in a module of their own
from .fuzz_decoder import DECODER_MUTS, build_decoder_run, decoder_run_spec  # noqa: E402

BUILDERS["decoder_run"] = build_decoder_run
STRATEGIES["decoder_run"] = (decoder_run_spec, list(DECODER_MUTS))


# ---------------------------------------------------------------------------------------
# the pool of child processes


def draw_specs(op, n):
    """``n`` specs of ``op`` from its strategy: hypothesis, derandomized (the same specs on
    every run), no example database."""
    from hypothesis import HealthCheck, Phase, given, settings

    strategy, muts = STRATEGIES[op]
    specs = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy())
    def collect(spec):
        specs.append(spec)

    collect()
    # every third case a mutation, in turn: each is tried (a draw favours some), and
    # valid calls stay two thirds (a mutation that does not fit its sizes runs valid);
    # every other case on two Numba threads (both kinds of case, each op)
    for i, spec in enumerate(specs):
        if i % 3 == 2 and muts:
            spec["mut"] = muts[(i // 3) % len(muts)]
            FIT.get((op, spec["mut"]), lambda s: None)(spec)
        spec["numba_threads"] = 1 + i % 2
    return specs


def _two_leading_dims(spec):
    if len(spec["lead"]) != 2 or min(spec["lead"]) < 2:
        spec["lead"] = [max(2, n) for n in (spec["lead"] + [3, 2])[:2]]


# sizes a mutation needs and a draw may not give, set on the cases that name it: the
# norms' uncollapsible output needs two leading dims of 2 or more, which 7 of 300 drawn
# cases name; which cases hypothesis draws has differed between a plain process and
# pytest (the same seed), and in one of those none of the 7 had such dims
FIT = {
    ("rms_norm", "uncollapsible"): _two_leading_dims,
    ("fused_add_rms_norm", "uncollapsible"): _two_leading_dims,
}


NUMBA_THREADS = 2  # the most a case asks for (spec["numba_threads"])


def _one_compile_per_kernel(lock_dir):
    """In a worker: one kernel signature compiles in one worker at a time. A worker that
    needs a kernel another is compiling waits for it and then loads it from the disk cache
    (0.1-0.3 s) instead of compiling it too. On a cold cache the fuzz is almost all
    compilation, and both workers used to compile the same kernels at once (2 x 24 s of
    CPU for weight_packed_linear's, on two cores: no faster than one worker compiling
    them); now a kernel is compiled once, and with the pool handing the workers cases from
    the two ends of an op's list (other dtypes), mostly different kernels side by side
    (the non-heavy fuzz on a cold cache, 2 vCPUs: 369 s before, 232 s after).

    The lock is a file per (kernel, signature) under ``lock_dir``, taken inside Numba's
    own compiler lock (so threads of one worker never wait on each other through it), and
    only for kernels with a disk cache (for others waiting would gain nothing); nested
    compiles of the kernels a kernel calls follow the call graph, which has no cycles.
    A lock held past ``COMPILE_WAIT_S`` is ignored (a worker killed while compiling
    frees its locks anyway)."""
    import fcntl
    import hashlib

    from numba.core import caching, sigutils
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.dispatcher import Dispatcher

    plain = Dispatcher.compile

    def compile(self, sig):
        args, _ = sigutils.normalize_signature(sig)
        if tuple(args) in self.overloads or isinstance(self._cache, caching.NullCache):
            return plain(self, sig)
        fn = self.py_func
        key = f"{fn.__module__}.{fn.__qualname__}{tuple(args)}".encode()
        path = os.path.join(lock_dir, hashlib.sha256(key).hexdigest()[:32])
        with global_compiler_lock, open(path, "a") as f:
            deadline = time.monotonic() + COMPILE_WAIT_S
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
            return plain(self, sig)  # closing the file releases the lock

    Dispatcher.compile = compile


COMPILE_WAIT_S = 240  # the longest a worker waits for another's compile (1-40 s a kernel)


def _worker(conn, lock_dir):
    """A child: runs the specs it receives (None: exit), one at a time, on the Numba
    threads each asks for (1 or 2), its torch references on one thread; a kernel another
    worker is compiling it waits for (:func:`_one_compile_per_kernel`, locks in
    ``lock_dir``).

    Two workers share the two cores: spinning OpenMP threads would oversubscribe them
    (measured here: 300 fused_moe cases in 0.9 s on one thread a worker, 96 s with two
    spinning OpenMP threads a worker on a loaded machine), so waiting threads sleep
    (``OMP_WAIT_POLICY``). Half the cases run on two Numba threads, where the parallel
    loops split their work (a partitioning bug shows there, not on one thread); the
    kernels' results do not depend on the thread count (docs §2.5; attention's split
    comes from the plan, judged against the reference)."""
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # before Numba's OpenMP layer starts
    if "numba" not in sys.modules:  # the pool's size, read at Numba's import
        have = int(os.environ.get("NUMBA_NUM_THREADS", os.cpu_count() or 1))
        os.environ["NUMBA_NUM_THREADS"] = str(max(have, NUMBA_THREADS))
    import numba

    numba.set_num_threads(1)
    torch.set_num_threads(1)  # the references' torch ops
    _one_compile_per_kernel(lock_dir)
    while True:
        spec = conn.recv()
        if spec is None:
            return
        conn.send(run_case(spec))


class Pool:
    """Child processes that run specs (forkserver: a replacement starts from a process
    that already imported torch and numkern). A worker that dies (a signal, an abort) is
    reported with its case and replaced, and so is one whose case runs past
    ``timeout`` seconds (killed). The workers compile each kernel once between them
    (:func:`_one_compile_per_kernel`)."""

    def __init__(self, workers, timeout):
        import multiprocessing as mp
        import tempfile

        self.mp = mp
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload([__name__])
        self.timeout = timeout
        self.lock_dir = tempfile.TemporaryDirectory(prefix="numkern-fuzz-locks-")
        self.workers = [self._start() for _ in range(workers)]

    def _start(self):
        here, there = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(there, self.lock_dir.name), daemon=True)
        p.start()
        there.close()
        return {"proc": p, "conn": here, "job": None, "t0": 0.0}

    def _retire(self, w):
        w["proc"].kill()
        w["proc"].join()
        w["conn"].close()

    def map(self, specs):
        """One ``(status, detail, stats)`` per spec, in order; statuses of ``run_case`` plus
        "crash" (the worker died) and "hang" (it ran past the timeout)."""
        from multiprocessing.connection import wait

        todo = collections.deque(enumerate(specs))
        results = [None] * len(specs)
        while todo or any(w["job"] is not None for w in self.workers):
            for i, w in enumerate(self.workers):
                if w["job"] is None and todo:
                    if not w["proc"].is_alive():  # died between cases: a fresh one
                        self._retire(w)
                        w = self.workers[i] = self._start()
                    # every other worker from the far end: cases drawn apart differ
                    # more, so on a cold cache the workers compile different kernels
                    w["job"] = todo.pop() if i % 2 else todo.popleft()
                    w["t0"] = time.monotonic()
                    w["conn"].send(w["job"][1])
            busy = [w for w in self.workers if w["job"] is not None]
            left = min(w["t0"] + self.timeout - time.monotonic() for w in busy)
            wait([w["conn"] for w in busy] + [w["proc"].sentinel for w in busy], max(left, 0))
            for i, w in enumerate(self.workers):
                if w["job"] is None:
                    continue
                idx = w["job"][0]
                res = None
                if w["conn"].poll():
                    try:
                        res = w["conn"].recv()
                    except (EOFError, OSError):
                        res = None
                if res is not None:
                    results[idx] = res
                    w["job"] = None
                    continue
                if not w["proc"].is_alive():
                    w["proc"].join()
                    code = w["proc"].exitcode
                    how = f"signal {-code} ({_signame(-code)})" if code < 0 else f"exit {code}"
                    results[idx] = ("crash", f"the worker died: {how}", {})
                elif time.monotonic() - w["t0"] > self.timeout:
                    results[idx] = ("hang", f"no result after {self.timeout} s (killed)", {})
                else:
                    continue
                self._retire(w)
                self.workers[i] = self._start()
        return results

    def close(self):
        for w in self.workers:
            try:
                w["conn"].send(None)
            except OSError:
                pass
        for w in self.workers:
            w["proc"].join(5)
            if w["proc"].is_alive():
                w["proc"].kill()
                w["proc"].join()
            w["conn"].close()
        self.lock_dir.cleanup()


def _signame(n):
    import signal

    try:
        return signal.Signals(n).name
    except ValueError:
        return "?"
