"""GGUF weights kept in their quantised type: ``LLM(quantization="auto")``.

With ``"auto"`` (the default) a GGUF checkpoint's projections and its token embedding
stored in one of numkern's types (``numkern.quant.QUANT_TYPES``: Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K, MXFP4) are not dequantised at load: their stored bytes
(``Checkpoint.take_raw``) are repacked by ``numkern.quant.repack`` into numkern's layout,
in the weight arena's huge pages (:mod:`engine.memory`), and the decoder runs them as
:class:`numkern.quant.QuantWeight` (docs/kernels.md, the quantised linear). A model's
resident weights are then about the file's bytes: no bf16 copy is made of them.

* Llama's q/k rows are put back in HF order on the stored rows (a row is whole blocks:
  ``engine.loader.gguf.raw_tensors``), before the repack.
* q|k|v and gate|up are fused by concatenating their stored rows when the parts share a
  type. Where they do not (a Q4_K_M file keeps ``attn_v`` in Q6_K in some layers while
  ``attn_q``/``attn_k`` are Q4_K) each run of one type is repacked and the runs joined
  as one weight of parts (``numkern.quant.join_rows``: one GEMM, each row block on its
  part's type); only where a run but the last is not whole 16-row blocks is the fused
  weight dequantised and packed in the model dtype as with ``"none"`` (logged).
* The token embedding, when quantised, stays one ``QuantWeight``: a step's lookup
  dequantises only its rows (:func:`embedding_rows`, bit for bit
  ``numkern.quant.dequantize``), and a tied LM head runs on the same bytes.
* Other types (F32/F16/BF16 norms and projections, IQ*, ...) take the dequantising path;
  every tensor's type is in :attr:`QuantLoader.types`, logged once per engine
  (``LLM.weight_types``).

``"none"`` dequantises every tensor as the engine did before (the accuracy reference of
``tests/test_engine_quant.py``). Any other value is a ValueError.
"""

from collections import defaultdict

import torch

from .memory import weight_empty
from .platform import log

QUANTIZATIONS = ("auto", "none")


def _joinable(runs):
    """Whether runs of one type each (``QuantLoader._runs``) make one weight of parts:
    every run but the last of whole 16-row blocks (``numkern.quant.join_rows``)."""
    return not any(rows % 16 for _, _, rows in runs[:-1])


def check_quantization(value):
    """``value`` if it is one of :data:`QUANTIZATIONS`, else a ValueError naming it."""
    if not (isinstance(value, str) and value in QUANTIZATIONS):
        raise ValueError(f"quantization: expected one of {QUANTIZATIONS}, got {value!r:.80}")
    return value


def _quant():
    import numkern.quant as q  # (numkern's public interface: repack, dequantize, types)

    return q


def _formats():
    import numkern.quant.formats as f  # the type table (BLOCK: K per GGML block)

    return f


class QuantLoader:
    """Which of a checkpoint's weights are kept quantised, and their repacking.

    ``ckpt``: an ``engine.loader.Checkpoint`` (its ``raw`` accessor: a GGUF file's);
    ``quantization``: ``"auto"`` or ``"none"``. :meth:`linear` takes a fused projection's
    parts; :attr:`types` maps each kept type (and ``"dequantised"``) to the HF names.
    """

    def __init__(self, ckpt, quantization):
        self.ckpt = ckpt
        # a GGUF checkpoint's stored types (engine.loader.gguf.LazyTensors.raw_type)
        self._raw_type = getattr(ckpt.tensors, "raw_type", None)
        self.enabled = check_quantization(quantization) == "auto" and self._raw_type is not None
        self.types = defaultdict(list)  # qtype (or "dequantised (why)") -> HF names
        self.nbytes = defaultdict(int)  # qtype -> bytes kept
        self._supported = frozenset(_quant().QUANT_TYPES) if self.enabled else frozenset()

    def _qtype(self, name):
        """The stored type of ``name`` ("Q4_K"), or None where the checkpoint keeps no
        bytes for it (values the loader changes), read without its bytes."""
        self.ckpt.require_name(name)
        return self._raw_type(name)

    def linear(self, parts, *, pad_to=None):
        """A :class:`numkern.quant.QuantWeight` of the row-wise concatenation of ``parts``
        (``[(hf name, part or None)]``: a tensor's stored rows, or its
        ``engine.loader.checkpoint.Part`` -- a rank's rows, or its columns as a
        ``slice(k0, k1)`` of the last dimension --; a name may come twice with disjoint
        rows), taken from the checkpoint, zero rows appended up to ``pad_to`` rows (a
        vocab-parallel LM head's last part; a zero block is zero in every kept type); or
        None (the caller dequantises and packs them) when quantization is off, a part's
        type is not kept (module docstring: the per-weight fallback), or a rank's columns
        are not whole quantisation blocks (a row-parallel weight whose K per rank splits
        a block: dequantised for this shard, logged by name)."""
        if not self.enabled:
            return None
        names = list(dict.fromkeys(n for n, _ in parts))
        qtypes = {n: self._qtype(n) for n in names}
        kinds = set(qtypes.values())
        if not kinds <= self._supported:
            if kinds & self._supported:  # a part is of a kept type, another not: fallback
                why = ", ".join(f"{n.rsplit('.', 2)[-2]} {t}" for n, t in qtypes.items())
                log.info("dequantised (types differ: %s): %s", why, ", ".join(names))
                self.types[f"dequantised (types differ: {why})"] += names
            else:
                self.types[f"{'/'.join(sorted(map(str, kinds)))} (dequantised)"] += names
            return None
        for n, part in parts:
            block = int(_formats().BLOCK[_quant().code_of(qtypes[n])])
            cols = part[1] if part is not None and len(part) > 1 else None
            if cols is not None and (cols.start % block or cols.stop % block):
                why = f"a rank's K of {cols.stop - cols.start} not whole {block}-value blocks"
                log.info("dequantised for this shard (%s %s): %s", qtypes[n], why, ", ".join(names))
                self.types[f"{qtypes[n]} (dequantised: {why})"] += names
                return None
        # consecutive parts of one type repacked together; several types joined as one
        # weight of parts (numkern.quant.join_rows: each row block on its part's type)
        runs = self._runs(parts, qtypes)
        if not _joinable(runs):
            why = ", ".join(f"{t} {r} rows" for t, _, r in runs)
            log.info("dequantised (types differ, not whole 16-row blocks: %s): %s", why,
                     ", ".join(names))  # fmt: skip
            self.types[f"dequantised (types differ, not whole 16-row blocks: {why})"] += names
            return None
        rows, k = self._take_rows(parts, names)
        groups = [(t, [rows[i] for i in idx], list(dict.fromkeys(parts[i][0] for i in idx)))
                  for t, idx, _ in runs]  # fmt: skip
        if pad_to is not None and pad_to > sum(len(r) for r in rows):
            pad = pad_to - sum(len(r) for r in rows)
            groups[-1][1].append(torch.zeros(pad, rows[0].shape[1], dtype=torch.uint8))
        ws = []
        for qtype, pieces, run_names in groups:
            data = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            w = _quant().repack(data, qtype, (data.shape[0], k), empty=weight_empty,
                                name="+".join(run_names))  # fmt: skip
            self.types[qtype] += run_names
            self.nbytes[qtype] += w.data.numel()
            ws.append(w)
        return ws[0] if len(ws) == 1 else _quant().join_rows(ws, empty=weight_empty)

    def _runs(self, parts, qtypes):
        """Runs of consecutive ``parts`` of one type (``qtypes``: name -> type), each
        ``(qtype, [indices into parts], rows)``, read without their bytes."""
        runs = []
        for i, (n, part) in enumerate(parts):
            rows = self._rows(n, part)
            if runs and runs[-1][0] == qtypes[n]:
                runs[-1][1].append(i)
                runs[-1][2] += rows
            else:
                runs.append([qtypes[n], [i], rows])
        return runs

    def _rows(self, name, part):
        """Rows of ``name``'s ``part`` (engine.loader.checkpoint.Part), without reading it."""
        n = self.ckpt.shape(name)[0]
        sel = part[0] if part else None
        if sel is None:
            return n
        if isinstance(sel, slice):
            return len(range(*sel.indices(n)))
        return len(sel)

    def _take_rows(self, parts, names):
        """The stored rows of each of ``parts`` (uint8 ``[rows, row_bytes]``, in order) and
        K: each tensor taken once (a name twice: disjoint rows, split after)."""
        pieces, k = {}, None
        for n in names:
            mine = [p for m, p in parts if m == n]
            if len(mine) == 1:
                raw = self.ckpt.take_raw(n, mine[0])
                pieces[n] = [raw.data]
            else:  # disjoint row selections of one tensor: taken once, then split
                idx = [p[0] for p in mine]
                raw = self.ckpt.take_raw(n, (torch.cat(idx), *mine[0][1:]))
                pieces[n] = list(raw.data.split([len(i) for i in idx]))
            if len(raw.shape) != 2:
                raise ValueError(f"{n}: expected a 2-D weight, got {raw.shape}")
            pieces[n].reverse()
            k = raw.shape[-1] if k is None else k
            if raw.shape[-1] != k:
                raise ValueError(f"{n}: expected a 2-D weight of {k} columns, got {raw.shape}")
        return [pieces[n].pop() for n, _ in parts], k

    def keeps(self, *fused):
        """Whether :meth:`linear` keeps each of ``fused`` (lists of HF names, each list
        one fused weight of whole tensors) quantised, read without their bytes: every
        name of a kept type, and a list of several types of whole 16-row blocks but its
        last tensor."""
        if not self.enabled:
            return False
        for names in fused:
            qtypes = {n: self._qtype(n) for n in names}
            if not set(qtypes.values()) <= self._supported:
                return False
            if not _joinable(self._runs([(n, None) for n in names], qtypes)):
                return False
        return True

    def interleaved_experts(self, gate_up, down, experts):
        """GGUF GPT-OSS's experts kept in their stored type: ``gate_up`` / ``down`` the HF
        names (``...experts.gate_up_proj``, ``...experts.down_proj``) whose GGUF sources
        are ``ffn_{gate,up}_exps [E, I, H]`` and ``ffn_down_exps [E, H, I]``; returns
        ``(w13 [e, 2I, H], w2 [e, H, I])`` QuantWeights of the experts ``experts`` (a
        ``(e0, e1)`` range), w13's rows gate i, up i interleaved as swigluoai wants (the
        stored rows interleaved before the repack, so no value changes), the HF names
        marked used; or None (the caller dequantises) when quantization is off, the file
        is not a GGUF one, or the types are not kept ones (gate and up of one type)."""
        recipes = getattr(self.ckpt.tensors, "recipes", None)
        stored = getattr(self.ckpt.tensors, "stored", None)
        if not self.enabled or recipes is None or stored is None or gate_up not in recipes:
            return None
        (g_name, u_name), (d_name,) = recipes[gate_up].parts, recipes[down].parts
        g, u, d = stored(g_name), stored(u_name), stored(d_name)
        t13, t2 = g.type_name, d.type_name
        if u.type_name != t13 or not {t13, t2} <= self._supported:
            why = f"{g.type_name}/{u.type_name}/{d.type_name}"
            self.types[f"{why} (dequantised experts)"] += [gate_up, down]
            return None
        _, i_n, h = g.shape
        block = _formats().BLOCK
        if h % block[_quant().code_of(t13)] or i_n % block[_quant().code_of(t2)]:
            self.types[f"{t13}/{t2} (dequantised experts: K not whole blocks)"] += [gate_up, down]
            return None
        e0, e1 = experts
        rows13 = torch.stack([g.data[e0:e1], u.data[e0:e1]], 2).reshape(e1 - e0, 2 * i_n, -1)
        w13 = _quant().repack(rows13, t13, (e1 - e0, 2 * i_n, h), empty=weight_empty,
                              name=gate_up)  # fmt: skip
        w2 = _quant().repack(d.data[e0:e1].contiguous(), t2, (e1 - e0, h, i_n),
                             empty=weight_empty, name=down)  # fmt: skip
        self.drop([gate_up, down])
        for qtype, name, w in ((t13, gate_up, w13), (t2, down, w2)):
            self.types[qtype].append(name)
            self.nbytes[qtype] += w.data.numel()
        return w13, w2

    def experts(self, w13, w2, *, neurons=None):
        """``(w13 [E, 2I, H], w2 [E, H, I])`` as :class:`numkern.quant.QuantWeight`
        experts (numkern.moe's quantised ``fused_moe``), from per expert the HF names of
        its rows (``w13``: ``[(gate, up)]``, ``w2``: ``[(down,)]``), taken; or None (the
        caller dequantises them) when quantization is off or the tensors of either are
        not of one kept type. ``neurons``: a rank's ``slice(i0, i1)`` of I (tensor
        parallel; None: all): gate and up rows ``[i0, i1)`` (whole rows in every type)
        and down's columns ``[i0, i1)``, which must be whole quantisation blocks of
        down's type: where they are not (Qwen3-30B-A3B's K = 768 at TP=2 under 256-value
        K-quants) None, the experts dequantised for this shard and logged by name."""
        if not self.enabled:
            return None
        groups = (w13, w2)
        qtypes = [{n: self._qtype(n) for e in g for n in e} for g in groups]
        kinds = [set(q.values()) for q in qtypes]
        if not all(len(k) == 1 and k <= self._supported for k in kinds):
            got = "/".join(sorted(map(str, set().union(*kinds))))
            self.types[f"{got} (dequantised experts)"] += [n for q in qtypes for n in q]
            return None
        if neurons is not None:
            (qtype2,) = kinds[1]
            block = int(_formats().BLOCK[_quant().code_of(qtype2)])
            if neurons.start % block or neurons.stop % block:
                why = f"a rank's K of {neurons.stop - neurons.start} not whole {block}-value blocks"
                names = [n for q in qtypes for n in q]
                log.info("dequantised for this shard (%s %s): %s", qtype2, why, ", ".join(names))
                self.types[f"{qtype2} (dequantised experts: {why})"] += names
                return None
        parts = ((neurons,), (None, neurons)) if neurons is not None else (None, None)
        out = []
        for g, q, (qtype,), part in zip(groups, qtypes, kinds, parts):
            raws = [[self.ckpt.take_raw(n, part) for n in e] for e in g]
            data = torch.stack([torch.cat([r.data for r in e]) for e in raws])
            shape = (*data.shape[:2], raws[0][0].shape[-1])
            w = _quant().repack(data, qtype, shape, empty=weight_empty, name=g[0][0])
            self.types[qtype] += list(q)
            self.nbytes[qtype] += w.data.numel()
            out.append(w)
        return tuple(out)

    def drop(self, names):
        """Mark the tensors ``names`` used without reading them: another rank's experts
        under expert parallelism (so ``Checkpoint.check_all_used`` still finds a tensor
        no rank takes)."""
        for n in names:
            self.ckpt.require_name(n)
            self.ckpt.tensors.pop(n)

    def close(self):
        """Let the checkpoint go (its file's map: the raw bytes were read into the arena);
        :attr:`types` and :attr:`nbytes` stay."""
        self.ckpt = self._raw_type = None

    def summary(self):
        """One line per type: ``"Q4_1: 210 tensors, 66.4 MB"`` (kept), then the fallbacks."""
        out = []
        for t, names in self.types.items():
            size = f", {self.nbytes[t] / 1e6:.1f} MB" if t in self.nbytes else ""
            out.append(f"{t}: {len(names)} tensors{size}")
        return out


def embedding_rows(w, ids, dtype):
    """Rows ``ids`` (int64 ``[T]``) of the quantised embedding ``w`` (a
    ``numkern.quant.QuantWeight [vocab, H]``) in ``dtype``: each row dequantised in fp32
    exactly as ``numkern.quant.dequantize`` gives it, then one cast."""
    return _quant().dequantize(w, rows=ids, dtype=dtype)
