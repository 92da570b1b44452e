#!/usr/bin/env python3
"""A tiny Llama engine as a PyTorch module tree with HF's module names, recorded
by forward hooks (writers/python/llmdump_torch.py; docs/COOKBOOK.md): the
forward has no recording code at all.

    python3 examples/torch/tiny_llama_torch.py tests/golden/llama-gqa --tokens 1,2,3,4,5 --decode 3 --out pt.safetensors
    build/llmdiff bisect --model tests/golden/llama-gqa pt.safetensors

--bug rope-interleaved rotates adjacent pairs instead of HF's halves. The hooks
see module inputs and outputs (norms, projections, o_proj's input = attn.ctx,
down_proj's input = mlp.act, layer outputs, logits); the RoPE inside the
attention forward is not a module, so the bug is localised at the first
recorded consequence (attn.ctx), not at q_rope.
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch
from torch import nn

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "writers", "python"))
import llmdump  # noqa: E402
import llmdump_torch  # noqa: E402


def load_safetensors(path):
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
        else:
            raise SystemExit("%s: tensor %s: dtype %s not supported" % (path, name, e["dtype"]))
        out[name] = torch.from_numpy(x.reshape(e["shape"]).copy())
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    def __init__(self, c, bug):
        super().__init__()
        self.Hq, self.Hkv, self.Dh, self.bug = c["Hq"], c["Hkv"], c["Dh"], bug
        self.q_proj = nn.Linear(c["D"], self.Hq * self.Dh, bias=False)
        self.k_proj = nn.Linear(c["D"], self.Hkv * self.Dh, bias=False)
        self.v_proj = nn.Linear(c["D"], self.Hkv * self.Dh, bias=False)
        self.o_proj = nn.Linear(self.Hq * self.Dh, c["D"], bias=False)
        self.k_cache = self.v_cache = None

    def rope(self, x, cos, sin):  # x [1, H, T, Dh]
        if self.bug != "rope-interleaved":
            half = x.shape[-1] // 2
            return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
        c, s = cos[..., : x.shape[-1] // 2], sin[..., : x.shape[-1] // 2]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.Hq, self.Dh).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.Hkv, self.Dh).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.Hkv, self.Dh).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        self.k_cache = k if self.k_cache is None else torch.cat([self.k_cache, k], dim=2)
        self.v_cache = v if self.v_cache is None else torch.cat([self.v_cache, v], dim=2)
        group = self.Hq // self.Hkv
        kr = self.k_cache.repeat_interleave(group, dim=1)
        vr = self.v_cache.repeat_interleave(group, dim=1)
        scores = q @ kr.transpose(2, 3) / math.sqrt(self.Dh) + mask
        ctx = torch.softmax(scores, dim=-1) @ vr  # [1, Hq, T, Dh]
        return self.o_proj(ctx.transpose(1, 2).reshape(B, T, self.Hq * self.Dh))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c["D"], c["F"], bias=False)
        self.up_proj = nn.Linear(c["D"], c["F"], bias=False)
        self.down_proj = nn.Linear(c["F"], c["D"], bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c, bug):
        super().__init__()
        self.input_layernorm = RMSNorm(c["D"], c["eps"])
        self.self_attn = Attention(c, bug)
        self.post_attention_layernorm = RMSNorm(c["D"], c["eps"])
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    def __init__(self, c, bug):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["V"], c["D"])
        self.layers = nn.ModuleList(DecoderLayer(c, bug) for _ in range(c["L"]))
        self.norm = RMSNorm(c["D"], c["eps"])


class LlamaForCausalLM(nn.Module):
    def __init__(self, c, bug=None):
        super().__init__()
        self.c = c
        self.model = Model(c, bug)
        self.lm_head = nn.Linear(c["D"], c["V"], bias=False)
        self.past = 0
        inv = 1.0 / (c["theta"] ** (torch.arange(0, c["Dh"], 2, dtype=torch.int64).float() / c["Dh"]))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, input_ids):  # [1, T]
        T, P = input_ids.shape[1], self.past
        pos = torch.arange(P, P + T, dtype=torch.float32)
        emb = torch.cat([pos[:, None] * self.inv_freq[None], pos[:, None] * self.inv_freq[None]], dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        mask = torch.full((T, P + T), float("-inf")).triu(P + 1)[None, None]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        self.past = P + T
        return self.lm_head(self.model.norm(x))


def load(model_dir, bug=None):
    text = open(os.path.join(model_dir, "config.json")).read()
    j = json.loads(text)
    c = {"D": j["hidden_size"], "F": j["intermediate_size"], "L": j["num_hidden_layers"],
         "Hq": j["num_attention_heads"], "Hkv": j.get("num_key_value_heads", j["num_attention_heads"]),
         "V": j["vocab_size"], "eps": j.get("rms_norm_eps", 1e-6), "theta": j.get("rope_theta", 10000.0)}
    c["Dh"] = j.get("head_dim") or c["D"] // c["Hq"]
    model = LlamaForCausalLM(c, bug)
    weights = load_safetensors(os.path.join(model_dir, "model.safetensors"))
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(weights, strict=True)
    return model, text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--decode", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bug", choices=["rope-interleaved"])
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    model, config_text = load(a.model, a.bug)
    ids = torch.tensor([[int(t) for t in a.tokens.split(",")]])
    generated = []
    with llmdump.DumpWriter(a.out, producer="tiny_llama_torch.py (torch %s)" % torch.__version__,
                            model=os.path.basename(os.path.normpath(a.model)), config=config_text,
                            scenario="decode" if a.decode else "prefill", dtype="float32",
                            steps=1 + a.decode) as w:
        with llmdump_torch.Recorder(model, w):
            for _ in range(1 + a.decode):
                logits = model(ids)
                generated.append(int(logits[0, -1].argmax()))
                ids = torch.tensor([[generated[-1]]])
        w.add("generated", np.array(generated, np.int64))
    print("%s: %d forward calls, generated %s" % (a.out, 1 + a.decode, generated))


if __name__ == "__main__":
    main()
