#!/usr/bin/env python3
"""Writes fuzz/corpus/gguf/small.gguf: a GGUF v3 file with metadata of several
value types and one small tensor of each of a few ggml types (F32, F16, Q8_0,
Q4_K), laid out as ggml writes it (32-byte alignment)."""
import os
import random
import struct

def s(x):
    b = x.encode()
    return struct.pack("<Q", len(b)) + b

kv = [
    ("general.architecture", 8, s("llama")),
    ("general.alignment", 4, struct.pack("<I", 32)),
    ("llama.block_count", 4, struct.pack("<I", 1)),
    ("llama.rope.freq_base", 6, struct.pack("<f", 10000.0)),
    ("general.flag", 7, struct.pack("<?", True)),
    ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + s("a") + s("bc")),
    ("llama.ids", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", -1, 0, 7)),
]
rng = random.Random(0)
q4k = struct.pack("<ee", 0.01, 0.002) + bytes(rng.randrange(256) for _ in range(140))
tensors = [
    ("a.f32", [8], 0, struct.pack("<8f", *range(8))),
    ("b.f16", [16], 1, struct.pack("<16e", *[-2 + 4 * i / 15 for i in range(16)])),
    ("c.q8_0", [32], 8, struct.pack("<e", 0.5) + bytes(range(0, 64, 2))),
    ("d.q4_k", [256], 12, q4k),
]
head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
for key, t, v in kv:
    head += s(key) + struct.pack("<I", t) + v
data = b""
for name, ne, t, raw in tensors:
    head += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
    head += struct.pack("<IQ", t, len(data))
    data += raw + b"\0" * ((-len(raw)) % 32)
head += b"\0" * ((-len(head)) % 32)
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "gguf", "small.gguf")
with open(out, "wb") as f:
    f.write(head + data)
