#!/usr/bin/env python3
"""A small continuous-batching serving engine in PyTorch (Llama, Qwen2, Qwen3,
Qwen3-MoE, Mixtral), shaped like vLLM, SGLang or a Qwen3 `llm_engine`: each
engine iteration is one forward call over the packed rows of every live
sequence (prompt chunks first, then one row per decoding sequence), fused
`qkv_proj` and `gate_up_proj`, an `AttentionMetadata` with `query_start_loc`,
`slot_mapping`, `block_tables`, `seq_lens`, and a paged KV cache written by
`write_to_kv_cache`, the residual stream beside the hidden state as vLLM
keeps it (fused add + RMSNorm). Sequences join at different iterations,
prompts are prefilled in chunks, finished sequences give their blocks back;
--pad-to pads each iteration's rows (as a captured graph's batch size would),
--last-logits computes logits for each sequence's last row only.

The forward has no recording code: writers/python/llmdump_serving.py records
it through forward hooks and the metadata (the `record` function below is
all of it; docs/COOKBOOK.md, "a PyTorch serving engine").

    python3 examples/torch/serving_engine.py tests/golden/qwen3-qknorm --out serve.safetensors
    build/llmdiff bisect --model tests/golden/qwen3-qknorm serve.safetensors

Requests: --requests 'PROMPT@JOIN:DECODE;...' (PROMPT: comma-separated ids,
or pN:M, the model's golden prompt ids N to M-1, joined by +; JOIN: the iteration it
arrives at; DECODE: decode steps after its prompt). --bug injects an engine
bug: slot-mapping-off-by-one (each slot one after its block's), batch-positions
(decode positions counted from the batch's first row), context-len-plus-one
(seq_lens one too long: attention reads a stale slot), block-table-order (the
paged-attention kernel gathers the first two blocks of a table swapped once
both are full).
"""
import argparse
import json
import math
import os
import struct
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "writers", "python"))
import llmdump  # noqa: E402
import llmdump_serving  # noqa: E402

BUGS = ("slot-mapping-off-by-one", "batch-positions", "context-len-plus-one", "block-table-order")


# ---- model configuration and weights -------------------------------------------------------

@dataclass
class Config:
    D: int
    F: int
    L: int
    Hq: int
    Hkv: int
    Dh: int
    V: int
    eps: float
    theta: float
    rope_scaling: dict
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    experts: int = 0       # 0: dense MLP
    top_k: int = 0
    expert_F: int = 0
    norm_topk: bool = False

    @staticmethod
    def from_hf(j):
        t = j.get("model_type", "llama")
        D, Hq = j["hidden_size"], j["num_attention_heads"]
        E = j.get("num_experts", j.get("num_local_experts", 0)) or 0
        return Config(D=D, F=j["intermediate_size"], L=j["num_hidden_layers"], Hq=Hq,
                      Hkv=j.get("num_key_value_heads") or Hq, Dh=j.get("head_dim") or D // Hq,
                      V=j["vocab_size"], eps=j.get("rms_norm_eps", 1e-6), theta=j.get("rope_theta", 10000.0),
                      rope_scaling=j.get("rope_scaling") or {},
                      qkv_bias=t == "qwen2" or bool(j.get("attention_bias", False)),
                      qk_norm=t in ("qwen3", "qwen3_moe"), tied=bool(j.get("tie_word_embeddings", False)),
                      experts=E, top_k=j.get("num_experts_per_tok", 0) if E else 0,
                      expert_F=j.get("moe_intermediate_size", j["intermediate_size"]) if E else 0,
                      norm_topk=(t == "mixtral" or bool(j.get("norm_topk_prob", False))) if E else False)


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
        elif e["dtype"] == "BF16":  # widened exactly; the engine computes in float32
            x = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit("%s: tensor %s: dtype %s not supported" % (path, name, e["dtype"]))
        out[name] = torch.from_numpy(x.reshape(e["shape"]).copy())
    return out


# ---- rotary embedding ----------------------------------------------------------------------

def rope_inv_freq(c):
    """[Dh/2] inverse frequencies, llama3 rope scaling applied as HF does."""
    inv = 1.0 / (c.theta ** (torch.arange(0, c.Dh, 2, dtype=torch.int64).float() / c.Dh))
    s = c.rope_scaling
    if s.get("rope_type", s.get("type")) == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, scaled)
    elif s:
        raise SystemExit("rope_scaling %r is not supported by this example" % (s,))
    return inv


class RotaryEmbedding(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)

    def forward(self, positions):  # [R] -> cos, sin [R, Dh]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):  # x [R, H, Dh], cos/sin [R, Dh]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# ---- attention metadata and the paged cache -------------------------------------------------

@dataclass
class AttentionMetadata:
    """One engine iteration's batch: rows [prefill chunks | decodes | padding]."""
    seq_ids: torch.Tensor          # [n] the engine's request ids, in row order
    query_start_loc: torch.Tensor  # [n + 1] cumulative rows (cu_seqlens_q)
    seq_lens: torch.Tensor         # [n] positions attention reads (cached + new)
    context_lens: torch.Tensor     # [n] positions cached before this call
    block_tables: torch.Tensor     # [n, max_blocks] block ids, -1 past a sequence's own
    slot_mapping: torch.Tensor     # [num_rows] cache slot of each row, -1 for padding rows
    num_prefill_tokens: int
    num_decode_tokens: int
    logits_indices: torch.Tensor = None  # [n] each sequence's last row, when only those get logits


def write_to_kv_cache(k, v, kv_cache, slot_mapping):
    """k, v [R, Hkv, Dh] into the pool [blocks, block_size, Hkv, Dh] at their slots (-1: skipped)."""
    k_cache, v_cache = kv_cache
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def gather_from_cache(cache, table, length, swap_first_blocks=False):
    """[blocks, block_size, Hkv, Dh] through a block table -> [length, Hkv, Dh].
    swap_first_blocks: the block-table-order bug, the first two blocks read swapped once both are full."""
    if swap_first_blocks and length >= 2 * cache.shape[1]:
        table = torch.cat([table[1:2], table[0:1], table[2:]])
    return cache[table].reshape(-1, *cache.shape[2:])[:length]


class PagedAttention(nn.Module):
    """Per sequence, its queries against its own keys: fresh rows for a prompt's
    first chunk (varlen prefill), the paged cache for a later chunk or a decode."""

    def __init__(self, c):
        super().__init__()
        self.Hq, self.Hkv, self.Dh, self.bug = c.Hq, c.Hkv, c.Dh, None

    def forward(self, q, k, v, kv_cache, md):  # q [R, Hq*Dh], k/v [R, Hkv*Dh] -> [R, Hq*Dh]
        R = q.shape[0]
        q, k, v = q.view(R, self.Hq, self.Dh), k.view(R, self.Hkv, self.Dh), v.view(R, self.Hkv, self.Dh)
        write_to_kv_cache(k, v, kv_cache, md.slot_mapping)
        out = torch.zeros(R, self.Hq, self.Dh)
        group = self.Hq // self.Hkv
        loc = md.query_start_loc.tolist()
        for i in range(len(loc) - 1):
            a, b = loc[i], loc[i + 1]
            T, S, P = b - a, int(md.seq_lens[i]), int(md.context_lens[i])
            if P == 0:  # whole prompt or its first chunk: the fresh rows
                S, ks, vs = T, k[a:b], v[a:b]
            else:
                nb = -(-S // kv_cache[0].shape[1])
                table = md.block_tables[i, :nb]
                swap = self.bug == "block-table-order"
                ks, vs = gather_from_cache(kv_cache[0], table, S, swap), gather_from_cache(kv_cache[1], table, S, swap)
            qh = q[a:b].transpose(0, 1)                                # [Hq, T, Dh]
            kh = ks.transpose(0, 1).repeat_interleave(group, dim=0)   # [Hq, S, Dh]
            vh = vs.transpose(0, 1).repeat_interleave(group, dim=0)
            scores = qh @ kh.transpose(1, 2) * self.Dh ** -0.5        # [Hq, T, S]
            mask = torch.full((T, S), float("-inf")).triu(S - T + 1)
            out[a:b] = (torch.softmax(scores + mask, dim=-1) @ vh).transpose(0, 1)
        return out.reshape(R, self.Hq * self.Dh)


# ---- layers --------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """With a residual (vLLM's fused add + norm): x + residual is the new residual
    stream, returned beside its norm."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = residual = x + residual
        y = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        return y if residual is None else (y, residual)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.qkv_proj = nn.Linear(c.D, (c.Hq + 2 * c.Hkv) * c.Dh, bias=c.qkv_bias)
        if c.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(c.Dh, c.eps), RMSNorm(c.Dh, c.eps)
        self.attn = PagedAttention(c)
        self.o_proj = nn.Linear(c.Hq * c.Dh, c.D, bias=False)

    def forward(self, x, cos, sin, kv_cache, md):  # x [R, D]
        c, R = self.c, x.shape[0]
        q, k, v = self.qkv_proj(x).split([c.Hq * c.Dh, c.Hkv * c.Dh, c.Hkv * c.Dh], dim=-1)
        q, k = q.reshape(R, c.Hq, c.Dh), k.reshape(R, c.Hkv, c.Dh)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ctx = self.attn(q.reshape(R, -1), k.reshape(R, -1), v, kv_cache, md)
        return self.o_proj(ctx)


class MLP(nn.Module):
    def __init__(self, D, F):
        super().__init__()
        self.F = F
        self.gate_up_proj = nn.Linear(D, 2 * F, bias=False)
        self.down_proj = nn.Linear(F, D, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split([self.F, self.F], dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class FusedExperts(nn.Module):
    """Every expert's gate_up and down weights stacked: w13 [E, 2F, D], w2 [E, D, F]."""

    def __init__(self, c):
        super().__init__()
        self.F, self.K, self.norm_topk = c.expert_F, c.top_k, c.norm_topk
        self.w13 = nn.Parameter(torch.zeros(c.experts, 2 * c.expert_F, c.D))
        self.w2 = nn.Parameter(torch.zeros(c.experts, c.D, c.expert_F))

    def forward(self, x, router_logits):  # x [R, D], router_logits [R, E] -> [R, D]
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.K, dim=-1)  # [R, K]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            gate, up = (x[rows] @ self.w13[e].T).split([self.F, self.F], dim=-1)
            y = (nn.functional.silu(gate) * up) @ self.w2[e].T
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


class SparseMoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate = nn.Linear(c.D, c.experts, bias=False)
        self.experts = FusedExperts(c)

    def forward(self, x):
        return self.experts(x, self.gate(x))


class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.D, c.eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.D, c.eps)
        self.mlp = SparseMoE(c) if c.experts else MLP(c.D, c.F)

    def forward(self, x, residual, cos, sin, kv_cache, md):
        """vLLM's layout: the residual stream travels beside the hidden state; the
        layer's output is their sum (hidden, residual)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.V, c.D)
        self.rotary_emb = RotaryEmbedding(c)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.L))
        self.norm = RMSNorm(c.D, c.eps)


class ForCausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = Model(c)
        self.lm_head = nn.Linear(c.D, c.V, bias=False)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        """[R], [R] -> logits [R, V], or [n, V] for each sequence's last row when the
        metadata has logits_indices (vLLM computes only the rows it samples)."""
        cos, sin = self.model.rotary_emb(positions)
        x, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, attn_metadata)
        x, _ = self.model.norm(x, residual)
        if attn_metadata.logits_indices is not None:
            x = x[attn_metadata.logits_indices]
        return self.lm_head(x)


def load_model(model_dir):
    text = open(os.path.join(model_dir, "config.json")).read()
    c = Config.from_hf(json.loads(text))
    w = load_safetensors(os.path.join(model_dir, "model.safetensors"))
    if "lm_head.weight" not in w:
        w["lm_head.weight"] = w["model.embed_tokens.weight"]
    state = {}
    for name, t in w.items():  # fuse HF's separate projections into the serving layout
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or ".mlp.up_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            kv = [w[name.replace("q_proj", p)] for p in ("k_proj", "v_proj")]
            state[name.replace("q_proj", "qkv_proj")] = torch.cat([t] + kv)
        elif ".mlp.gate_proj." in name:
            state[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, w[name.replace("gate_proj", "up_proj")]])
        elif ".experts." in name:
            continue
        else:
            state[name.replace("block_sparse_moe.", "mlp.")] = t
    for l in range(c.L):
        if not c.experts:
            continue
        p = "model.layers.%d." % l
        moe = p + ("block_sparse_moe." if p + "block_sparse_moe.gate.weight" in w else "mlp.")
        names = ("w1", "w3", "w2") if moe.endswith("block_sparse_moe.") else ("gate_proj", "up_proj", "down_proj")
        e_w = lambda e, n: w["%sexperts.%d.%s.weight" % (moe, e, n)]  # noqa: E731
        state[p + "mlp.experts.w13"] = torch.stack([torch.cat([e_w(e, names[0]), e_w(e, names[1])])
                                                    for e in range(c.experts)])
        state[p + "mlp.experts.w2"] = torch.stack([e_w(e, names[2]) for e in range(c.experts)])
    model = ForCausalLM(c)
    model.load_state_dict(state, strict=True)
    return model, c, text


# ---- the serving loop ----------------------------------------------------------------------

@dataclass
class Request:
    id: int
    prompt: list
    join: int
    decode: int


class Sequence:
    def __init__(self, req):
        self.req, self.cached, self.blocks, self.generated, self.done = req, 0, [], [], False

    def pending(self, chunk):  # the tokens of its next call
        p = self.req.prompt
        if self.cached < len(p):
            return p[self.cached:self.cached + chunk]
        return [self.generated[-1]]


class Engine:
    def __init__(self, model, c, block_size=4, num_blocks=64, chunk=3, pad_to=1, bug=None, last_logits=False):
        self.model, self.c, self.bug, self.last_logits = model, c, bug, last_logits
        self.block_size, self.chunk, self.pad_to = block_size, chunk, pad_to
        self.kv_caches = [(torch.zeros(num_blocks, block_size, c.Hkv, c.Dh),
                           torch.zeros(num_blocks, block_size, c.Hkv, c.Dh)) for _ in range(c.L)]
        self.free = list(range(num_blocks))
        for layer in model.model.layers:  # the paged-attention kernel's own bug
            layer.self_attn.attn.bug = bug
        self.iterations, self.rows, self.seconds = 0, 0, 0.0

    def _metadata(self, batch, counts):
        """Rows, positions and metadata of one iteration; batch: (seq, tokens) in row order."""
        B = self.block_size
        ids, positions, slots, loc, seq_lens, ctx, tables = [], [], [], [0], [], [], []
        for s, toks in batch:
            S = s.cached + len(toks)
            reads = S + 1 if self.bug == "context-len-plus-one" else S  # positions attention reads
            while len(s.blocks) * B < reads:
                if not self.free:
                    raise SystemExit("serving_engine: out of cache blocks at seq %d" % s.req.id)
                s.blocks.append(self.free.pop(0))
            row0 = loc[-1]
            decode = s.cached >= len(s.req.prompt)
            for t in range(len(toks)):
                p = s.cached + t
                slot = s.blocks[p // B] * B + p % B
                slots.append(slot + 1 if self.bug == "slot-mapping-off-by-one" else slot)
                positions.append(p + row0 if self.bug == "batch-positions" and decode else p)
            ids.append(toks), loc.append(row0 + len(toks)), seq_lens.append(reads), ctx.append(s.cached)
            tables.append(list(s.blocks))
        R = loc[-1]
        pad = -R % self.pad_to
        tokens = [t for toks in ids for t in toks] + [0] * pad
        width = max(len(t) for t in tables)
        md = AttentionMetadata(
            seq_ids=torch.tensor([s.req.id for s, _ in batch]), query_start_loc=torch.tensor(loc),
            seq_lens=torch.tensor(seq_lens), context_lens=torch.tensor(ctx),
            block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables]),
            slot_mapping=torch.tensor(slots + [-1] * pad),
            num_prefill_tokens=counts[0], num_decode_tokens=counts[1],
            logits_indices=torch.tensor(loc[1:]) - 1 if self.last_logits else None)
        return torch.tensor(tokens), torch.tensor(positions + [0] * pad), md

    def step(self, live):
        prefill = [(s, s.pending(self.chunk)) for s in live if s.cached < len(s.req.prompt)]
        decode = [(s, s.pending(self.chunk)) for s in live if s.cached >= len(s.req.prompt)]
        batch = prefill + decode
        counts = (sum(len(t) for _, t in prefill), len(decode))
        input_ids, positions, md = self._metadata(batch, counts)
        t0 = time.perf_counter()
        logits = self.model(input_ids, positions, self.kv_caches, md)  # [R, V], or [n, V] with last_logits
        self.seconds += time.perf_counter() - t0
        self.iterations += 1
        self.rows += int(md.query_start_loc[-1])
        for i, (s, toks) in enumerate(batch):
            s.cached += len(toks)
            if s.cached >= len(s.req.prompt):
                row = i if self.last_logits else int(md.query_start_loc[i + 1]) - 1
                s.generated.append(int(logits[row].argmax()))
            if len(s.generated) > s.req.decode:  # its last decode step done
                s.done = True
                self.free.extend(s.blocks)

    def generate(self, requests):
        """Every request to its end; {request id: generated tokens}."""
        seqs, it = [], 0
        while any(not s.done for s in seqs) or any(r.join >= it for r in requests):
            seqs += [Sequence(r) for r in requests if r.join == it]
            live = [s for s in seqs if not s.done]
            if live:
                self.step(live)
            it += 1
        return {s.req.id: s.generated for s in seqs}


def parse_requests(text, golden_prompt):
    out = []
    for i, part in enumerate(text.split(";")):
        prompt, _, rest = part.partition("@")
        join, _, decode = rest.partition(":")
        ids = []
        for piece in prompt.split("+"):
            if piece.startswith("p"):
                a, b = piece[1:].split(":")
                ids += golden_prompt[int(a):int(b)]
            else:
                ids += [int(t) for t in piece.split(",")]
        out.append(Request(id=100 + i, prompt=ids, join=int(join or 0), decode=int(decode or 0)))
    return out


def golden_prompt(model_dir):
    """The model's golden prompt ids (prefill.safetensors step0.tokens)."""
    path = os.path.join(model_dir, "prefill.safetensors")
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    e = json.loads(raw[8:8 + n])["step0.tokens"]
    a, b = e["data_offsets"]
    return np.frombuffer(raw[8 + n + a:8 + n + b], np.int64).tolist()


def record(engine, model_dir, config_text, requests, out, sites=None):
    """The whole recording: an adapter naming the metadata, the recorder around the run."""
    adapter = llmdump_serving.Adapter(
        seq_ids="attn_metadata.seq_ids", cu_seqlens="attn_metadata.query_start_loc",
        positions="positions", slot_mapping="attn_metadata.slot_mapping",
        block_tables="attn_metadata.block_tables", context_lens="attn_metadata.seq_lens",
        kv_caches="kv_caches", padded=True)
    with llmdump.DumpWriter(out, producer="serving_engine.py (torch %s)" % torch.__version__,
                            model=os.path.basename(os.path.normpath(model_dir)), config=config_text,
                            scenario="batch", dtype="float32") as w:
        with llmdump_serving.PackedRecorder(engine.model, w, config_text, adapter, sites=sites) as rec:
            generated = engine.generate(requests)
            for r in requests:
                rec.generated(r.id, generated[r.id])
    return generated


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--requests", default="p0:5@0:3;p0:7@1:2;p0:7+p0:2@2:2")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=3)
    ap.add_argument("--pad-to", type=int, default=1, help="pad each iteration's rows to a multiple of N")
    ap.add_argument("--last-logits", action="store_true", help="logits for each sequence's last row only")
    ap.add_argument("--bug", choices=BUGS)
    ap.add_argument("--sites", help="comma-separated globs over the dump's names")
    ap.add_argument("--out", help="the dump (none: run without recording)")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    model, c, config_text = load_model(a.model)
    requests = parse_requests(a.requests, golden_prompt(a.model) if "p" in a.requests else [])
    engine = Engine(model, c, a.block_size, a.num_blocks, a.chunk, a.pad_to, a.bug, a.last_logits)
    t0 = time.perf_counter()
    if a.out:
        generated = record(engine, a.model, config_text, requests, a.out, a.sites.split(",") if a.sites else None)
    else:
        generated = engine.generate(requests)
    wall = time.perf_counter() - t0
    print("%s: %d sequences, %d engine iterations, %d token rows, %.3f s in forward, %.3f s in all; generated %s"
          % (a.out or "(not recorded)", len(requests), engine.iterations, engine.rows, engine.seconds, wall,
             [generated[r.id] for r in requests]))


if __name__ == "__main__":
    main()
