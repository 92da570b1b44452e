"""llmdump: write llm-dump/1 files (docs/DUMP_FORMAT.md) from Python/numpy.

Files are byte-identical to llmdiff's own writer (dumps/formats/safetensors.cpp,
DumpWriter) for the same tensors added in the same order and the same manifest.

    import llmdump
    with llmdump.DumpWriter("out.safetensors", producer="myengine 1.2", model="llama-gqa",
                            config=open("config.json").read(), scenario="decode",
                            dtype="bfloat16", steps=4) as w:
        w.add(llmdump.step_name(0, "tokens"), np.array(ids, dtype=np.int64))
        w.add(llmdump.layer_name(0, 3, "attn.q_rope"), llmdump.head_major(q_rot, heads=8))
        w.add(llmdump.layer_name(0, 3, "attn_norm"), bf16_bits, dtype="BF16")  # uint16 bf16 bits
    # on leaving the block the file is renamed into place; an exception leaves nothing.

Tensor bytes go to a temporary data file as they are added; finish() writes
header + data to PATH.tmp.PID.N, fsyncs it and renames it onto PATH. Float
tensors are stored as F32 (the spec's rule): float16 arrays and bfloat16 bits
(uint16 with dtype="BF16") are widened exactly; integer arrays are stored as I64.
"""

import itertools
import os

import numpy as np

FORMAT = "llm-dump/1"
__all__ = ["DumpWriter", "DumpError", "step_name", "layer_name", "seq_name", "head_major", "strip_padding",
           "gather_paged", "split_rows", "Iterations",
           "bf16_to_f32", "f16_to_f32", "FORMAT"]

_counter = itertools.count()


class DumpError(ValueError):
    """A rejected call: bad name, duplicate, shape/data mismatch, unsupported dtype."""


def step_name(step, site):
    """"step{step}.{site}"."""
    return "step%d.%s" % (step, site)


def layer_name(step, layer, site):
    """"step{step}.layers.{layer}.{site}"."""
    return "step%d.layers.%d.%s" % (step, layer, site)


def seq_name(seq, name):
    """"seq{seq}.{name}" (several-sequence dumps)."""
    return "seq%d.%s" % (seq, name)


def head_major(x, heads=None):
    """[T, H, Dh] (or [T, H*Dh] with heads=H) -> [H, T, Dh], contiguous."""
    x = np.asarray(x)
    if heads is not None:
        if x.ndim != 2 or x.shape[1] % heads:
            raise DumpError("head_major: cannot split shape %s into %d heads" % (list(x.shape), heads))
        x = x.reshape(x.shape[0], heads, x.shape[1] // heads)
    if x.ndim != 3:
        raise DumpError("head_major: expected [T, H, Dh], got shape %s" % list(x.shape))
    return np.ascontiguousarray(x.transpose(1, 0, 2))


def strip_padding(x, pad, axis=0, length=None):
    """One sequence of a padded batch without its padding: entries [pad, pad + length)
    of its token (or key) axis (`length` default: to the end). pad = the sequence's
    left padding; 0 with `length` for right padding. axis 0 for [T, X] tensors, 1 for
    head-major [H, T, Dh] ones and caches."""
    x = np.asarray(x)
    end = x.shape[axis] if length is None else pad + length
    if pad < 0 or end > x.shape[axis]:
        raise DumpError("strip_padding: rows [%d, %d) of an axis of %d" % (pad, end, x.shape[axis]))
    return np.ascontiguousarray(np.take(x, np.arange(pad, end), axis=axis))


def split_rows(x, cu_seqlens, what="tensor"):
    """A packed batch's rows [R, ...] per sequence: [x[cu[0]:cu[1]], x[cu[1]:cu[2]], ...] for
    cumulative row counts cu_seqlens [n + 1] (vLLM's query_start_loc, FlashAttention's
    cu_seqlens_q). Rows from cu[-1] on (padding) are dropped; fewer rows than cu[-1] is an
    error naming `what`. Works on numpy arrays and anything sliceable by rows."""
    cu = [int(c) for c in np.asarray(cu_seqlens).reshape(-1)]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise DumpError("split_rows: %s: cu_seqlens %s must start at 0 and never decrease" % (what, cu))
    rows = len(x)
    if rows < cu[-1]:
        raise DumpError("split_rows: %s has %d rows, but cu_seqlens ends at %d" % (what, rows, cu[-1]))
    return [x[a:b] for a, b in zip(cu, cu[1:])]


class Iterations:
    """Numbers a serving engine's forward calls as the format does ("Several sequences"):
    each engine sequence id gets b = 0, 1, ... in the order it first appears, each of its
    calls its own step n, each call an iteration N.

        it = llmdump.Iterations()
        members, names = it.call(seq_ids=[7, 3], num_tokens=[4, 1])   # [(b, n), ...] in row order
        for name, array in names: w.add(name, array)                    # iter{N}.seqs/seq_steps/num_tokens
    """

    def __init__(self):
        self.index = {}   # engine sequence id -> b
        self.steps = []   # per b: its calls so far
        self.count = 0    # calls so far

    def seq(self, seq_id):
        """b of an engine sequence id already seen (DumpError when not)."""
        if seq_id not in self.index:
            raise DumpError("Iterations: sequence id %r was in no forward call" % (seq_id,))
        return self.index[seq_id]

    def call(self, seq_ids, num_tokens):
        ids = [s.item() if hasattr(s, "item") else s for s in seq_ids]
        counts = [int(t) for t in num_tokens]
        if len(ids) != len(counts):
            raise DumpError("Iterations: call %d names %d sequences but %d token counts" % (self.count, len(ids), len(counts)))
        if len(set(ids)) != len(ids):
            raise DumpError("Iterations: call %d has a sequence id twice: %s" % (self.count, ids))
        members = []
        for s in ids:
            if s not in self.index:
                self.index[s] = len(self.steps)
                self.steps.append(0)
            b = self.index[s]
            members.append((b, self.steps[b]))
            self.steps[b] += 1
        pre = "iter%d." % self.count
        names = [(pre + "seqs", np.array([b for b, _ in members], np.int64)),
                 (pre + "seq_steps", np.array([n for _, n in members], np.int64)),
                 (pre + "num_tokens", np.array(counts, np.int64))]
        self.count += 1
        return members, names


def gather_paged(pool, block_table, length, layout="block,slot,head,dim"):
    """A paged KV pool as one sequence's logical cache [heads, length, dh]: position s
    in block block_table[s // block_size], slot s % block_size. pool is
    [blocks, block_size, heads, dh] ("block,slot,head,dim") or
    [blocks, heads, block_size, dh] ("block,head,slot,dim")."""
    pool = np.asarray(pool)
    if layout == "block,head,slot,dim":
        pool = pool.transpose(0, 2, 1, 3)
    elif layout != "block,slot,head,dim":
        raise DumpError("gather_paged: layout %r is not block,slot,head,dim or block,head,slot,dim" % layout)
    blocks, bs = pool.shape[0], pool.shape[1]
    table = np.asarray(block_table, dtype=np.int64)
    if length > len(table) * bs:
        raise DumpError("gather_paged: %d positions need %d blocks, the table has %d" % (length, -(-length // bs), len(table)))
    if ((table < 0) | (table >= blocks)).any():
        raise DumpError("gather_paged: a block id outside the pool of %d" % blocks)
    rows = pool[table].reshape(len(table) * bs, pool.shape[2], pool.shape[3])[:length]  # [length, heads, dh]
    return np.ascontiguousarray(rows.transpose(1, 0, 2))


def bf16_to_f32(bits):
    """bfloat16 bits (uint16 array) -> float32, exact."""
    b = np.ascontiguousarray(bits, dtype="<u2").astype("<u4")
    return (b << 16).view("<f4")


def f16_to_f32(x):
    """IEEE half (float16 array or uint16 bits) -> float32, exact and bit-identical to
    llmdiff's conversion (NaN payloads kept, no quieting)."""
    x = np.asarray(x)
    h = np.ascontiguousarray(x.view("<u2") if x.dtype == np.float16 else x, dtype="<u2").astype("<u4")
    sign = (h >> 15) << 31
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    out = sign | ((exp + 112) << 23) | (mant << 13)
    out = np.where(exp == 0x1F, sign | 0x7F800000 | (mant << 13), out)
    # zero and subnormals: mant * 2^-24 is exact in float32
    sub = (mant.astype("<f4") * np.float32(2.0 ** -24)).view("<u4") | sign
    out = np.where(exp == 0, sub, out).astype("<u4")
    return out.view("<f4")


def _utf8(s, what):
    if not isinstance(s, str):
        raise DumpError("%s must be a str, got %r" % (what, type(s).__name__))
    try:
        return s.encode("utf-8")
    except UnicodeEncodeError:
        raise DumpError("%s is not valid UTF-8: %r" % (what, s)) from None


_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _js(s):
    """A JSON string as nlohmann::json::dump() writes it (UTF-8, no ASCII escaping)."""
    out = ['"']
    for ch in s:
        e = _SHORT.get(ch)
        if e is not None:
            out.append(e)
        elif ord(ch) < 0x20:
            out.append("\\u%04x" % ord(ch))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _shape_str(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


class DumpWriter:
    """Streaming, atomic writer of one llm-dump/1 file. Use as a context manager or
    call finish() (abort() drops everything)."""

    def __init__(self, path, producer="", model="", config="", scenario="", dtype="", steps=0, extra=None):
        self.path = os.fspath(path)
        meta = {}
        # Manifest::to_map: extra keys first, the standard keys override them.
        for k, v in (extra or {}).items():
            _utf8(k, "metadata key"), _utf8(v, "metadata value of %r" % k)
            meta[k] = v
        std = {"format": FORMAT, "producer": producer, "model": model, "config": config,
               "scenario": scenario, "dtype": dtype}
        for k, v in std.items():
            _utf8(v, "manifest %r" % k)
            meta[k] = v
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
            raise DumpError("manifest 'steps' must be an int, got %r" % (steps,))
        meta["steps"] = str(int(steps))
        self._sort_meta(meta)
        self._tensors = []  # (name, stored dtype, shape, begin, end)
        self._names = set()
        self._offset = 0
        self._finished = False
        self._broken = False
        stem = "%s.tmp.%d.%d" % (self.path, os.getpid(), next(_counter))
        self._data_tmp = stem + ".data"
        self._final_tmp = stem
        self._data = open(self._data_tmp, "w+b")

    def _sort_meta(self, meta):
        self._meta = sorted(meta.items(), key=lambda kv: kv[0].encode("utf-8"))

    def manifest(self, key):
        """The manifest value of `key` ("" when absent)."""
        return dict(self._meta).get(key, "")

    def set_manifest(self, key, value):
        """Sets one manifest key before finish() (e.g. `steps` or `kv_cache`, known only
        once the run is over); `steps` takes an int."""
        if self._finished:
            raise DumpError("llmdump: %s: manifest key %r set after finish()" % (self.path, key))
        if key == "steps":
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise DumpError("manifest 'steps' must be an int, got %r" % (value,))
            value = str(int(value))
        _utf8(key, "metadata key"), _utf8(value, "manifest %r" % key)
        meta = dict(self._meta)
        meta[key] = value
        self._sort_meta(meta)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        else:
            self.abort()
        return False

    def __del__(self):
        try:
            if not self._finished:
                self.abort()
        except Exception:
            pass

    def _fail(self, name, what):
        raise DumpError("llmdump: %s: tensor '%s': %s" % (self.path, name, what))

    def add(self, name, data, dtype=None, shape=None):
        """Adds one tensor. data: numpy array (or anything np.asarray takes, or bytes with
        dtype given). dtype: "F32", "F16", "BF16" (data = uint16 bits or raw bytes), "I64",
        or None to take it from the array (float32, float16, any integer kind). shape:
        defaults to the array's; given, it must hold exactly as many elements."""
        if self._finished:
            raise DumpError("llmdump: %s: tensor '%s' added after finish()" % (self.path, name))
        if self._broken or self._data is None:
            raise DumpError("llmdump: %s: tensor '%s' added to an aborted or failed writer" % (self.path, name))
        if not isinstance(name, str) or not name or name == "__metadata__":
            self._fail(name, "invalid tensor name")
        _utf8(name, "tensor name")
        if name in self._names:
            self._fail(name, "duplicate tensor name")
        if isinstance(data, (bytes, bytearray, memoryview)):
            if dtype is None:
                self._fail(name, "raw bytes need an explicit dtype")
            width = {"F32": "<f4", "F16": "<u2", "BF16": "<u2", "I64": "<i8"}.get(dtype)
            if width is None:
                self._fail(name, "unsupported dtype %r (F32, F16, BF16, I64)" % (dtype,))
            raw = bytes(data)
            if len(raw) % np.dtype(width).itemsize:
                self._fail(name, "byte count %d is not a multiple of %s's size" % (len(raw), dtype))
            arr = np.frombuffer(raw, dtype=width)
        else:
            arr = np.asarray(data)
        if dtype is None:
            if arr.dtype == np.float32:
                dtype = "F32"
            elif arr.dtype == np.float16:
                dtype = "F16"
            elif arr.dtype.kind in "iu" and arr.dtype != np.uint64:
                dtype = "I64"
            elif arr.dtype == np.bool_:
                dtype = "I64"
            else:
                self._fail(name, "unsupported array dtype %s (float32, float16, integers; "
                                 "bfloat16 as uint16 bits with dtype='BF16'; convert float64 yourself)" % arr.dtype)
        if dtype not in ("F32", "F16", "BF16", "I64"):
            self._fail(name, "unsupported dtype %r (F32, F16, BF16, I64)" % (dtype,))
        if shape is None:
            shape = arr.shape
        try:
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            self._fail(name, "shape %r is not a sequence of ints" % (shape,))
        if any(d < 0 for d in shape):
            self._fail(name, "negative dimension in shape " + _shape_str(shape))
        count = 1
        for d in shape:
            count *= d
        if arr.size != count:
            self._fail(name, "data holds %d elements (array shape %s) but shape %s of %s needs %d"
                       % (arr.size, _shape_str(arr.shape), _shape_str(shape), dtype, count))
        if dtype == "F32":
            if arr.dtype != np.float32:
                if arr.dtype.kind != "f" or arr.dtype.itemsize > 4:
                    self._fail(name, "dtype F32 needs float32/float16 data, got %s" % arr.dtype)
            out = np.ascontiguousarray(arr, dtype="<f4")
            stored = "F32"
        elif dtype == "F16":
            if arr.dtype not in (np.float16, np.uint16, np.dtype("<u2")):
                self._fail(name, "dtype F16 needs float16 data or uint16 bits, got %s" % arr.dtype)
            out = f16_to_f32(arr.reshape(-1))
            stored = "F32"
        elif dtype == "BF16":
            if arr.dtype != np.uint16:
                self._fail(name, "dtype BF16 needs uint16 bits (numpy has no bfloat16), got %s" % arr.dtype)
            out = bf16_to_f32(arr.reshape(-1))
            stored = "F32"
        else:
            if arr.dtype.kind not in "iub" or arr.dtype == np.uint64:
                self._fail(name, "dtype I64 needs integer data, got %s" % arr.dtype)
            out = np.ascontiguousarray(arr, dtype="<i8")
            stored = "I64"
        raw = out.tobytes()
        try:
            self._data.write(raw)
        except OSError as e:
            self._broken = True
            raise OSError("llmdump: %s: write failed for tensor '%s': %s" % (self.path, name, e)) from e
        self._tensors.append((name, stored, shape, self._offset, self._offset + len(raw)))
        self._names.add(name)
        self._offset += len(raw)

    def header(self):
        """The header text (padded), as llmdiff writes it."""
        parts = []
        if self._meta:
            parts.append('"__metadata__":{' + ",".join(_js(k) + ":" + _js(v) for k, v in self._meta) + "}")
        for name, stored, shape, b, e in self._tensors:
            parts.append('%s:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}'
                         % (_js(name), stored, ",".join(str(d) for d in shape), b, e))
        text = ("{" + ",".join(parts) + "}").encode("utf-8")
        return text + b" " * (-len(text) % 8)

    def finish(self):
        """Writes header + data, fsyncs and renames onto the final path."""
        if self._finished:
            return
        if self._broken or self._data is None:
            raise DumpError("llmdump: %s: cannot finish an aborted or failed writer" % self.path)
        text = self.header()
        try:
            with open(self._final_tmp, "wb") as out:
                out.write(len(text).to_bytes(8, "little"))
                out.write(text)
                self._data.flush()
                self._data.seek(0)
                left = self._offset
                while left > 0:
                    chunk = self._data.read(min(left, 1 << 20))
                    if not chunk:
                        raise OSError("temporary data file is short")
                    out.write(chunk)
                    left -= len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(self._final_tmp, self.path)
        except BaseException:
            _remove(self._final_tmp)
            raise
        self._finished = True
        self._data.close()
        self._data = None
        _remove(self._data_tmp)

    close = finish

    def abort(self):
        """Drops everything written so far; nothing appears at the final path."""
        if self._data is not None:
            self._data.close()
            self._data = None
        _remove(self._data_tmp)
        _remove(self._final_tmp)


def _remove(p):
    try:
        os.remove(p)
    except FileNotFoundError:
        pass
