#!/usr/bin/env python3
"""A tiny Llama engine in numpy, instrumented with llmdump (docs/COOKBOOK.md).

Reads an HF Llama checkpoint (config.json + model.safetensors, float32 or
bfloat16), runs a prompt and greedy decode steps with a KV cache, and writes
every intermediate it computes under llm-dump/1's canonical names:

    python3 examples/python/tiny_llama.py tests/golden/llama-gqa --tokens 1,2,3,4,5 --decode 3 --out py.safetensors
    build/llmdiff bisect --model tests/golden/llama-gqa py.safetensors

--bug rope-interleaved rotates adjacent pairs instead of HF's halves: the
classic RoPE port bug, for the cookbook's "what a report looks like".
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "writers", "python"))
import llmdump  # noqa: E402


def load_safetensors(path):
    """name -> float32 array (F32, BF16 and F16 widened)."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        buf = raw[8 + n + a:8 + n + b]
        if e["dtype"] == "F32":
            x = np.frombuffer(buf, np.float32)
        elif e["dtype"] == "BF16":
            x = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif e["dtype"] == "F16":
            x = np.frombuffer(buf, np.float16).astype(np.float32)
        else:
            raise SystemExit("%s: tensor %s: dtype %s not supported" % (path, name, e["dtype"]))
        out[name] = x.reshape(e["shape"])
    return out


def rmsnorm(x, w, eps):
    var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(var + np.float32(eps))).astype(np.float32) * w


def rotate(x, cos, sin, interleaved):
    """x [H, T, Dh]; cos/sin [T, Dh] in the rotate-half layout."""
    if not interleaved:
        half = x.shape[-1] // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rot * sin
    # The bug: pairs (2i, 2i+1) rotated by frequency i.
    c, s = cos[:, : x.shape[-1] // 2], sin[:, : x.shape[-1] // 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = odd * c + even * s
    return out


class TinyLlama:
    def __init__(self, model_dir, bug=None):
        self.config_text = open(os.path.join(model_dir, "config.json")).read()
        c = json.loads(self.config_text)
        self.D, self.F, self.L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        self.Hq = c["num_attention_heads"]
        self.Hkv = c.get("num_key_value_heads", self.Hq)
        self.Dh = c.get("head_dim") or self.D // self.Hq
        self.eps, self.theta = c.get("rms_norm_eps", 1e-6), c.get("rope_theta", 10000.0)
        self.w = load_safetensors(os.path.join(model_dir, "model.safetensors"))
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        self.bug = bug
        # HF's inv_freq: 1 / theta^(2i/Dh), computed in float32.
        self.inv_freq = (1.0 / (self.theta ** (np.arange(0, self.Dh, 2, dtype=np.int64).astype(np.float32) / self.Dh))
                         ).astype(np.float32)
        self.k_cache = [np.zeros((self.Hkv, 0, self.Dh), np.float32) for _ in range(self.L)]
        self.v_cache = [np.zeros((self.Hkv, 0, self.Dh), np.float32) for _ in range(self.L)]

    def forward(self, tokens, step, dump):
        """One forward call over `tokens`; records its sites; returns the last row's logits."""
        T, P = len(tokens), self.k_cache[0].shape[1]
        S = P + T
        rec = lambda site, x: dump.add(llmdump.step_name(step, site), x)  # noqa: E731
        rec_l = lambda l, site, x: dump.add(llmdump.layer_name(step, l, site), x)  # noqa: E731
        positions = np.arange(P, S, dtype=np.int64)
        rec("tokens", np.array(tokens, np.int64))
        rec("positions", positions)
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
        x = self.w["model.embed_tokens.weight"][np.array(tokens)]  # [T, D]
        rec("embed", x)
        mask = np.arange(S)[None, :] <= positions[:, None]  # [T, S]
        for l in range(self.L):
            p = "model.layers.%d." % l
            h = rmsnorm(x, self.w[p + "input_layernorm.weight"], self.eps)
            rec_l(l, "attn_norm", h)
            q = h @ self.w[p + "self_attn.q_proj.weight"].T  # [T, Hq*Dh]
            k = h @ self.w[p + "self_attn.k_proj.weight"].T  # [T, Hkv*Dh]
            v = h @ self.w[p + "self_attn.v_proj.weight"].T
            rec_l(l, "attn.q", q)
            rec_l(l, "attn.k", k)
            rec_l(l, "attn.v", v)
            interleaved = self.bug == "rope-interleaved"
            q_rope = rotate(llmdump.head_major(q, heads=self.Hq), cos, sin, interleaved)  # [Hq, T, Dh]
            k_rope = rotate(llmdump.head_major(k, heads=self.Hkv), cos, sin, interleaved)  # [Hkv, T, Dh]
            rec_l(l, "attn.q_rope", q_rope)
            rec_l(l, "attn.k_rope", k_rope)
            self.k_cache[l] = np.concatenate([self.k_cache[l], k_rope], axis=1)  # [Hkv, S, Dh]
            self.v_cache[l] = np.concatenate([self.v_cache[l], llmdump.head_major(v, heads=self.Hkv)], axis=1)
            rec_l(l, "attn.k_cache", self.k_cache[l])
            rec_l(l, "attn.v_cache", self.v_cache[l])
            group = self.Hq // self.Hkv
            k_rep = np.repeat(self.k_cache[l], group, axis=0)  # query head h reads kv head h // group
            v_rep = np.repeat(self.v_cache[l], group, axis=0)
            scores = (q_rope @ k_rep.transpose(0, 2, 1)) * np.float32(1.0 / np.sqrt(self.Dh))  # [Hq, T, S]
            rec_l(l, "attn.scores", scores)
            masked = np.where(mask[None], scores, -np.inf)
            e = np.exp(masked - masked.max(axis=-1, keepdims=True))
            probs = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
            rec_l(l, "attn.probs", probs)
            ctx = (probs @ v_rep).transpose(1, 0, 2).reshape(T, self.Hq * self.Dh)  # [T, Hq*Dh]
            rec_l(l, "attn.ctx", ctx)
            out = ctx @ self.w[p + "self_attn.o_proj.weight"].T
            rec_l(l, "attn.out", out)
            x = x + out
            rec_l(l, "attn_residual", x)
            h = rmsnorm(x, self.w[p + "post_attention_layernorm.weight"], self.eps)
            rec_l(l, "mlp_norm", h)
            gate = h @ self.w[p + "mlp.gate_proj.weight"].T
            up = h @ self.w[p + "mlp.up_proj.weight"].T
            act = (gate / (1.0 + np.exp(-gate))).astype(np.float32) * up
            down = act @ self.w[p + "mlp.down_proj.weight"].T
            rec_l(l, "mlp.gate", gate)
            rec_l(l, "mlp.up", up)
            rec_l(l, "mlp.act", act)
            rec_l(l, "mlp.down", down)
            x = x + down
            rec_l(l, "out", x)
        h = rmsnorm(x, self.w["model.norm.weight"], self.eps)
        rec("final_norm", h)
        logits = h @ self.lm_head.T  # [T, V]
        rec("logits", logits)
        rec("next_logits", logits[-1])
        return logits[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="HF model directory (config.json + model.safetensors)")
    ap.add_argument("--tokens", required=True, help="prompt token ids, comma separated")
    ap.add_argument("--decode", type=int, default=0, help="greedy decode steps after the prompt")
    ap.add_argument("--out", required=True, help="the llm-dump/1 file to write")
    ap.add_argument("--bug", choices=["rope-interleaved"], help="switch on a classic porting bug")
    a = ap.parse_args()
    engine = TinyLlama(a.model, a.bug)
    prompt = [int(t) for t in a.tokens.split(",")]
    with llmdump.DumpWriter(a.out, producer="tiny_llama.py (numpy %s)" % np.__version__,
                            model=os.path.basename(os.path.normpath(a.model)), config=engine.config_text,
                            scenario="decode" if a.decode else "prefill", dtype="float32",
                            steps=1 + a.decode) as dump:
        generated, tokens = [], prompt
        for step in range(1 + a.decode):
            next_token = int(np.argmax(engine.forward(tokens, step, dump)))
            generated.append(next_token)
            tokens = [next_token]
        dump.add("generated", np.array(generated, np.int64))
    print("%s: %d forward calls, generated %s" % (a.out, 1 + a.decode, generated))


if __name__ == "__main__":
    main()
