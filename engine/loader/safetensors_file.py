"""Reading safetensors files: ``safe_open`` (a memory map) whose failures are
ValueErrors naming the file and, where one is at fault, the tensor (what is wrong read
from the header as the format defines it). safetensors is imported where it is used, so
that the engine imports (and a GGUF checkpoint loads) without it."""

import contextlib
import json
import math
import os


class SafetensorsFile:
    """An open safetensors file whose failures are ValueErrors naming it (and the tensor)."""

    def __init__(self, path, f):
        self.path, self._f = path, f

    def keys(self):
        return self._f.keys()

    def tensor(self, name):
        from safetensors import SafetensorError

        try:
            return self._f.get_tensor(name)
        except (SafetensorError, TypeError, RuntimeError) as e:
            raise ValueError(f"{self.path}: tensor {name!r}: {e}") from None

    def box(self, name):
        """``(shape, read)``: the tensor's shape and ``read(box)``, the values in ``box``
        (one slice per dimension) read from the memory map alone
        (``safe_open(...).get_slice``)."""
        from safetensors import SafetensorError

        try:
            sl = self._f.get_slice(name)
            shape = tuple(sl.get_shape())
        except (SafetensorError, TypeError, RuntimeError) as e:
            raise ValueError(f"{self.path}: tensor {name!r}: {e}") from None

        def read(box):
            try:
                return sl[box]
            except (SafetensorError, TypeError, RuntimeError) as e:
                raise ValueError(f"{self.path}: tensor {name!r}: {e}") from None

        return shape, read

    def close(self):
        self._f.__exit__(None, None, None)


@contextlib.contextmanager
def open_safetensors(path):
    """``safe_open(path)`` as a :class:`SafetensorsFile`; a file safetensors refuses
    (truncated, a corrupt header) is a ValueError naming the file and, where one is at
    fault, the tensor (:func:`_safetensors_fault`)."""
    f = open_safetensors_file(path)
    try:
        yield f
    finally:
        f.close()


def open_safetensors_file(path):
    """``safe_open(path)`` as a :class:`SafetensorsFile` that stays open (its memory
    map) until :meth:`SafetensorsFile.close` or until it is dropped; errors as
    :func:`open_safetensors`'s."""
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(path, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{path}: {_safetensors_fault(path) or e}") from None
    return SafetensorsFile(path, f)


# bytes per element of the safetensors dtypes (the format's list)
_SAFETENSORS_ITEMSIZE = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64"), 8),
}
_SAFETENSORS_SUBBYTE = ("F4", "F6_E2M3", "F6_E3M2")  # packed: no whole bytes per element


def _safetensors_fault(path):
    """What is wrong with the safetensors file ``path``, read as the format defines it (an
    8-byte little-endian header length, a JSON header of ``name: {dtype, shape,
    data_offsets}``, then the tensors' bytes back to back): the first tensor, in data
    order, whose entry is malformed, whose size disagrees with its shape, or whose bytes
    run past the end of the file; '' when none is found."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, too short for a safetensors header (truncated?)"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"a header of {n} bytes does not fit in the file's {size} bytes (truncated?)"
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            return f"the header is not valid JSON ({e})"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    data = size - 8 - n
    entries = []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(e, dict) and isinstance(e.get("shape"), list)
        offsets = e.get("data_offsets") if ok else None
        ok = ok and isinstance(offsets, list) and len(offsets) == 2
        ok = ok and all(isinstance(v, int) and v >= 0 for v in [*offsets, *e["shape"]])
        if not ok:
            return f"tensor {name!r}: a malformed header entry {e!r:.200}"
        entries.append((offsets, name, e))
    end = 0
    for (start, stop), name, e in sorted(entries):
        if start != end or stop < start:
            return f"tensor {name!r}: data_offsets {[start, stop]} do not follow on byte {end}"
        end = stop
        if e.get("dtype") not in (*_SAFETENSORS_ITEMSIZE, *_SAFETENSORS_SUBBYTE):
            return f"tensor {name!r}: unknown dtype {e.get('dtype')!r:.40}"
        item = _SAFETENSORS_ITEMSIZE.get(e["dtype"])
        if item is not None and math.prod(e["shape"]) * item != stop - start:
            return (
                f"tensor {name!r}: {e['dtype']} {e['shape']} takes "
                f"{math.prod(e['shape']) * item} bytes, its data_offsets hold {stop - start}"
            )
        if stop > data:
            return (
                f"tensor {name!r}: its bytes {start}-{stop} of the data run past the file's "
                f"{data} data bytes (truncated?)"
            )
    if end < data:
        return f"{data - end} bytes after the last tensor's data"
    return ""


# a multimodal wrapper's language-model tensors, as stored by transformers 5
