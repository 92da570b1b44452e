"""Tests of llmdump.py: byte identity with llmdiff's own writer, widening, helpers,
atomicity, malformed calls.

    python3 test_llmdump.py WORKDIR GOLDEN EXPECTED [GOLDEN EXPECTED ...]

EXPECTED is llmdiff's rewrite of GOLDEN (writers/tests/llmdump_rewrite.cpp).
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llmdump  # noqa: E402

STANDARD = ("format", "producer", "model", "config", "scenario", "dtype", "steps")
NP = {"F32": "<f4", "F16": "<u2", "BF16": "<u2", "I64": "<i8", "I32": "<i4"}
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAILED:", what, file=sys.stderr)


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n].decode("utf-8"))  # dicts keep the file's order
    meta = header.pop("__metadata__", {})
    tensors = []
    for name, e in header.items():
        b, en = e["data_offsets"]
        tensors.append((name, e["dtype"], e["shape"], raw[8 + n + b: 8 + n + en]))
    return meta, tensors


def rewrite(golden, out):
    meta, tensors = read_safetensors(golden)
    extra = {k: v for k, v in meta.items() if k not in STANDARD}
    with llmdump.DumpWriter(out, producer=meta.get("producer", ""), model=meta.get("model", ""),
                            config=meta.get("config", ""), scenario=meta.get("scenario", ""),
                            dtype=meta.get("dtype", ""), steps=int(meta.get("steps", "0")), extra=extra) as w:
        for name, dt, shape, data in tensors:
            arr = np.frombuffer(data, dtype=NP[dt]).reshape(shape)
            if dt == "F16":
                arr = arr.view(np.float16)
            w.add(name, arr, dtype="BF16" if dt == "BF16" else None)


def test_goldens(work, pairs):
    for i, (golden, expected) in enumerate(pairs):
        out = os.path.join(work, "py%d.safetensors" % i)
        rewrite(golden, out)
        with open(out, "rb") as a, open(expected, "rb") as b:
            got, want = a.read(), b.read()
        check(got == want, "%s: output (%d bytes) differs from llmdiff's rewrite %s (%d bytes)"
              % (golden, len(got), expected, len(want)))
        if got == want:
            os.remove(out)


def test_widening():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    f = llmdump.f16_to_f32(bits)
    ref = bits.view(np.float16).astype(np.float32)
    finite = ~np.isnan(ref)
    check(np.array_equal(f[finite].view(np.uint32), ref[finite].view(np.uint32)), "f16 widening (finite)")
    nan = ~finite
    h = bits[nan].astype(np.uint32)
    want = ((h >> 15) << 31) | 0x7F800000 | ((h & 0x3FF) << 13)
    check(np.array_equal(f[nan].view(np.uint32), want), "f16 widening keeps NaN payloads")
    b = llmdump.bf16_to_f32(bits)
    check(np.array_equal(b.view(np.uint32), bits.astype(np.uint32) << 16), "bf16 widening")
    check(np.array_equal(llmdump.f16_to_f32(bits.view(np.float16)).view(np.uint32), f.view(np.uint32)),
          "f16 widening from float16 arrays")


def test_helpers():
    check(llmdump.layer_name(2, 7, "attn.q_rope") == "step2.layers.7.attn.q_rope", "layer_name")
    check(llmdump.step_name(0, "logits") == "step0.logits", "step_name")
    check(llmdump.seq_name(1, "generated") == "seq1.generated", "seq_name")
    x = np.arange(12, dtype=np.float32).reshape(2, 6)  # [T=2, H*Dh=3*2]
    hm = llmdump.head_major(x, heads=3)
    check(hm.shape == (3, 2, 2) and hm.ravel().tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11], "head_major")
    check(np.array_equal(llmdump.head_major(x.reshape(2, 3, 2)), hm), "head_major of [T, H, Dh]")


def test_malformed(work):
    path = os.path.join(work, "malformed.safetensors")
    w = llmdump.DumpWriter(path)
    try:
        w.add("x", np.zeros(5, dtype=np.float32), shape=[2, 3])
        check(False, "shape/data mismatch accepted")
    except llmdump.DumpError as e:
        msg = str(e)
        check("'x'" in msg and "5 elements" in msg and "[2, 3]" in msg and "needs 6" in msg, "unclear error: " + msg)
    w.add("x", np.zeros(6, dtype=np.float32), shape=[2, 3])  # still usable
    for bad, args in (("duplicate", ("x", np.zeros(1, np.float32))),
                      ("float64", ("d", np.zeros(1))),
                      ("reserved name", ("__metadata__", np.zeros(1, np.float32))),
                      ("raw bytes size", ("r", b"\0" * 7, "F32")),
                      ("negative dim", ("n", np.zeros(0, np.float32), None, [-1, 0]))):
        try:
            w.add(*args)
            check(False, bad + " accepted")
        except llmdump.DumpError:
            pass
    w.abort()
    check(not os.path.exists(path), "aborted writer left a file")
    try:
        llmdump.DumpWriter(path, extra={"k": "\udcff"})
        check(False, "lone surrogate accepted")
    except llmdump.DumpError:
        pass


def test_atomic(work):
    d = tempfile.mkdtemp(dir=work)
    path = os.path.join(d, "dump.safetensors")
    try:
        with llmdump.DumpWriter(path, steps=1) as w:
            w.add("a", np.ones(1000, np.float32))
            raise RuntimeError("engine crashed")
    except RuntimeError:
        pass
    check(os.listdir(d) == [], "exception inside the with block left files: %s" % os.listdir(d))
    # A process killed mid-way leaves nothing at the final path.
    code = ("import sys, os, numpy as np; sys.path.insert(0, %r); import llmdump\n"
            "w = llmdump.DumpWriter(%r); w.add('a', np.ones(10, np.float32)); os.abort()"
            % (os.path.dirname(os.path.abspath(llmdump.__file__)), path))
    r = subprocess.run([sys.executable, "-B", "-c", code])
    check(r.returncode != 0, "child did not die")
    check(not os.path.exists(path), "killed writer left a file at the final path")
    with open(path, "w") as f:
        f.write("old")
    w = llmdump.DumpWriter(path)
    w.add("a", np.ones(3, np.float32))
    check(open(path).read() == "old", "final path touched before finish")
    w.finish()
    meta, tensors = read_safetensors(path)
    check(meta["format"] == "llm-dump/1" and tensors[0][0] == "a", "finished file unreadable")
    check(sorted(x for x in os.listdir(d) if ".tmp.%d." % os.getpid() in x) == [], "temporaries left")


def test_batch_helpers(golden):
    """A golden cache left-padded then stripped, and paged (scattered blocks, both layouts) then gathered."""
    _, tensors = read_safetensors(golden)
    steps = [t for t in tensors if t[0].endswith(".layers.0.attn.k_cache")]
    name, _, shape, raw = steps[-1]
    kc = np.frombuffer(raw, np.float32).reshape(shape)  # [Hkv, S, Dh]
    H, S, Dh = shape
    padded = np.concatenate([np.full((H, 3, Dh), -9, np.float32), kc], axis=1)
    check(np.array_equal(llmdump.strip_padding(padded, 3, axis=1), kc), "strip_padding of " + name)
    right = np.concatenate([kc, np.full((H, 2, Dh), -9, np.float32)], axis=1)
    check(np.array_equal(llmdump.strip_padding(right, 0, axis=1, length=S), kc), "strip_padding of right padding")
    bs, blocks = 2, 9
    used = -(-S // bs)
    table = [(b * 5 + 3) % blocks for b in range(used)]
    pool = np.full((blocks, bs, H, Dh), 5, np.float32)
    for s in range(S):
        pool[table[s // bs], s % bs] = kc[:, s]
    check(np.array_equal(llmdump.gather_paged(pool, table, S), kc), "gather_paged block,slot,head,dim")
    check(np.array_equal(llmdump.gather_paged(pool.transpose(0, 2, 1, 3), table, S, "block,head,slot,dim"), kc),
          "gather_paged block,head,slot,dim")
    for bad in ([blocks] + table[1:], table[:-1]):
        try:
            llmdump.gather_paged(pool, bad, S)
            check(False, "gather_paged accepted %s" % bad)
        except llmdump.DumpError:
            pass


def main():
    if len(sys.argv) < 2 or len(sys.argv) % 2 != 0:
        print(__doc__, file=sys.stderr)
        return 2
    work = sys.argv[1]
    os.makedirs(work, exist_ok=True)
    pairs = list(zip(sys.argv[2::2], sys.argv[3::2]))
    test_goldens(work, pairs)
    test_widening()
    test_helpers()
    test_malformed(work)
    test_atomic(work)
    if pairs:
        test_batch_helpers(pairs[0][0])
    if failures:
        print("%d check(s) failed" % len(failures), file=sys.stderr)
        return 1
    print("test_llmdump.py: all checks passed (%d golden dumps)" % len(pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
