"""llmdump_serving: record a PyTorch serving engine (vLLM-, SGLang- or llm_engine-shaped) as it
runs, as a several-sequence llm-dump/1 file (docs/DUMP_FORMAT.md, "Several sequences").

Such an engine runs one forward over the packed rows of a mixed batch (prompt chunks and
decodes, hidden_states [num_tokens, D]) with fused qkv_proj / gate_up_proj, an attention
metadata object and a paged KV cache. Forward hooks see the packed tensors; a small
Adapter says where the forward call's metadata is, and the recorder writes each
sequence's rows under its own names, its forward as it ran:

    adapter = llmdump_serving.Adapter(
        seq_ids="attn_metadata.seq_ids", cu_seqlens="attn_metadata.query_start_loc",
        positions="positions", slot_mapping="attn_metadata.slot_mapping",
        block_tables="attn_metadata.block_tables", context_lens="attn_metadata.seq_lens",
        kv_caches="kv_caches")
    with llmdump.DumpWriter("serve.safetensors", producer="my engine", model="qwen3-4b",
                            config=config_text, scenario="batch", dtype="float32") as w:
        with llmdump_serving.PackedRecorder(model, w, config_text, adapter) as rec:
            outputs = engine.generate(requests)
            for r in requests:
                rec.generated(r.id, outputs[r.id])

What it writes, per forward call of the root module (one engine iteration):
- `seq{b}.step{n}.<site>` for every mapped module: the packed rows split by cu_seqlens
  (rows past cu_seqlens[-1], padding, dropped), fused qkv split into attn.q/k/v and
  gate_up into mlp.gate/up by the config's sizes, q_rope/k_rope head-major;
  `b` numbers the engine's sequence ids in the order they first appear, `n` counts
  each sequence's own calls (a prompt chunk or a decode step);
- `positions`, `kv.block_table` (the table cut to the blocks its context_len covers),
  `kv.slot_mapping`, `kv.context_len` from the metadata; `attn.k_cache`/`v_cache`: the
  paged pool gathered through the block table after the attention layer wrote it;
- `next_logits` / `last_hidden` from each sequence's last row, `iter{N}.seqs`,
  `seq_steps`, `num_tokens`; on leaving, the manifest's `steps` (when the writer was
  given 0) and `kv_cache` ({"kind": "paged", ...} when the adapter names the pool).

Without an adapter it records an HF-shaped module tree at batch size 1 exactly as
llmdump_torch.Recorder does (same names, same bytes).

Tensors go to the writer as the hooks see them (the writer streams them to disk);
the recorder keeps only the current call's metadata and each sequence's last
final_norm row. `sites` (globs over the full names, as llmdiff's --sites) skips the
rest before any copy.

Adapter fields are a dotted path from a parameter of the root module's forward
("attn_metadata.query_start_loc": attribute or key lookups) or a callable taking the
bound arguments (a dict). A mapping entry is (regex over the module path, site
template or a tuple of them for a fused output, what[, predicate on the module]);
"what" is "output", "output.N" (element N of a tuple output), "input", "input.N",
"tokens", "residual_sum" (vLLM's (hidden, residual) layer output added up) or "kv"
(the gathered cache of that layer, after the module ran). Extend SERVING_MAPPING
for other names:

    mapping = llmdump_serving.SERVING_MAPPING + [
        (r"transformer\\.h\\.(\\d+)\\.attn\\.c_attn$", ("layers.{0}.attn.q", "layers.{0}.attn.k", "layers.{0}.attn.v"), "output"),
    ]
"""

import inspect
import json
import re

import numpy as np
import torch

import llmdump
import llmdump_torch

__all__ = ["PackedRecorder", "Adapter", "SERVING_MAPPING"]

_L = llmdump_torch._L


def _has_experts(module):
    return hasattr(module, "experts")


def _serving_mapping():
    hf = [e if e[1] != "layers.{0}.out" else (e[0], e[1], "residual_sum") for e in llmdump_torch.DEFAULT_MAPPING]
    return hf + [
        # vLLM / SGLang: fused projections, the attention layer taking q, k, v after RoPE.
        (_L + r"self_attn\.qkv_proj$", ("layers.{0}.attn.q", "layers.{0}.attn.k", "layers.{0}.attn.v"), "output"),
        (_L + r"self_attn\.attn$", "layers.{0}.attn.q_rope", "input.0"),
        (_L + r"self_attn\.attn$", "layers.{0}.attn.k_rope", "input.1"),
        (_L + r"self_attn\.attn$", ("layers.{0}.attn.k_cache", "layers.{0}.attn.v_cache"), "kv"),
        (_L + r"mlp\.gate_up_proj$", ("layers.{0}.mlp.gate", "layers.{0}.mlp.up"), "output"),
        # Mixture of experts (HF Qwen3-MoE / Mixtral names and the serving engines'): the
        # router's logits, the routed sum of a fused experts module, the block's output.
        (_L + r"(?:mlp|block_sparse_moe)\.gate$", "layers.{0}.moe.router_logits", "output"),
        (_L + r"(?:mlp|block_sparse_moe)\.experts$", "layers.{0}.moe.routed", "output"),
        (_L + r"(?:mlp|block_sparse_moe)$", "layers.{0}.moe.out", "output", _has_experts),
    ]


# HF's names (llmdump_torch.DEFAULT_MAPPING) and vLLM's / SGLang's (qkv_proj, gate_up_proj,
# the attention layer self_attn.attn, (hidden, residual) layer outputs).
SERVING_MAPPING = _serving_mapping()

_WHATS = re.compile(r"output|output\.\d+|input|input\.\d+|tokens|residual_sum|kv")
_HEAD_MAJOR = ("attn.q_rope", "attn.k_rope")


class Adapter:
    """Where a serving engine's forward call keeps its batch. seq_ids: [n] the engine's
    sequence ids in row order; cu_seqlens (or query_start_loc, the same): [n + 1]
    cumulative rows; optional: positions [rows], slot_mapping [rows] (-1 on padding
    rows), block_tables [n, max_blocks], context_lens [n] (the positions attention
    reads, S = cached + new), kv_caches (per layer a (k, v) pair of pools, or a
    [2, ...] tensor) laid out kv_layout, block_size (default: from the pool).
    padded=True: the engine pads its rows (e.g. to a captured graph's size); rows
    past cu_seqlens[-1] are then dropped, else they are an error."""

    def __init__(self, seq_ids, cu_seqlens=None, query_start_loc=None, positions=None, slot_mapping=None,
                 block_tables=None, context_lens=None, kv_caches=None, block_size=None,
                 kv_layout="block,slot,head,dim", padded=False):
        if (cu_seqlens is None) == (query_start_loc is None):
            raise llmdump.DumpError("Adapter: give one of cu_seqlens and query_start_loc")
        if kv_layout not in ("block,slot,head,dim", "block,head,slot,dim"):
            raise llmdump.DumpError("Adapter: kv_layout %r is not block,slot,head,dim or block,head,slot,dim" % kv_layout)
        self.fields = {"seq_ids": seq_ids, "cu_seqlens": cu_seqlens if cu_seqlens is not None else query_start_loc,
                       "positions": positions, "slot_mapping": slot_mapping, "block_tables": block_tables,
                       "context_lens": context_lens, "kv_caches": kv_caches}
        self.block_size, self.kv_layout, self.padded = block_size, kv_layout, padded

    def label(self, field):
        spec = self.fields[field]
        return "%s (%s)" % (field, spec if isinstance(spec, str) else getattr(spec, "__name__", "callable"))

    def read(self, field, arguments):
        spec = self.fields[field]
        if spec is None:
            return None
        if callable(spec):
            return spec(arguments)
        parts = spec.split(".")
        if parts[0] not in arguments:
            raise llmdump.DumpError("Adapter: %s: the forward has no parameter '%s' (it has %s)"
                                    % (self.label(field), parts[0], ", ".join(arguments)))
        value = arguments[parts[0]]
        for p in parts[1:]:
            value = value[p] if isinstance(value, dict) else getattr(value, p, None)
            if value is None:
                raise llmdump.DumpError("Adapter: %s: nothing at '%s'" % (self.label(field), p))
        return value


def _ints(x):
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64)


def _numpy(x):
    x = x.detach()
    if x.dtype in (torch.bfloat16, torch.float16, torch.float64):
        x = x.float()
    return x.cpu().numpy()


class _Call:
    """One forward call's batch: its members (b, step) in row order, their rows
    (cu [n + 1]; rows: the packed rows with padding, None when no positions say),
    the metadata read from the forward's arguments, each member's last final_norm row."""

    def __init__(self, members, cu=None, rows=None, iteration_names=(), kv_caches=None, tables=None, context=None):
        self.members, self.cu, self.rows, self.iteration_names = members, cu, rows, iteration_names
        self.kv_caches, self.tables, self.context = kv_caches, tables, context  # tables [n, max_blocks], context [n]
        self.final_rows = {}


class PackedRecorder:
    """Forward hooks on `model` writing a serving engine's packed calls to `writer` (an
    llmdump.DumpWriter) per sequence, while active. config: the model's config.json (text or
    dict), for the fused splits and heads; adapter: an Adapter (None: HF-shaped, batch 1)."""

    def __init__(self, model, writer, config=None, adapter=None, mapping=None, sites=None, derive=True):
        self.model, self.writer, self.adapter, self.derive = model, writer, adapter, derive
        cfg = json.loads(config) if isinstance(config, str) else (config or {})
        self.sizes = _sizes(cfg)
        self.mapping = []
        for entry in mapping or SERVING_MAPPING:
            pattern, site, what = entry[:3]
            if not _WHATS.fullmatch(what):
                raise llmdump.DumpError("mapping: '%s' is not output[.N], input[.N], tokens, residual_sum or kv" % what)
            sites_ = tuple(site) if isinstance(site, (tuple, list)) else (site,)
            self.mapping.append((re.compile(pattern), sites_, what, entry[3] if len(entry) > 3 else None))
        self.globs = re.compile("|".join("(?:%s)" % re.escape(g).replace(r"\*", ".*").replace(r"\?", ".")
                                         for g in sites)) if sites else None
        self.numbering = llmdump.Iterations()
        self.call = None
        self.handles = []
        self.signature = inspect.signature(model.forward)
        self.pool = None  # (blocks, block_size) once seen
        self.cached = {}  # b -> its rows in earlier calls

    # ---- hooks on and off

    def __enter__(self):
        self.handles.append(self.model.register_forward_pre_hook(self._begin_step))
        self.handles.append(self.model.register_forward_hook(self._end))
        if self.adapter is not None:  # the metadata: the root forward's own arguments, keywords included
            forward = self.model.forward

            def metadata_then_forward(*args, **kwargs):
                self._read_metadata(args, kwargs)
                return forward(*args, **kwargs)
            self.model.forward = metadata_then_forward
        for path, module in self.model.named_modules():
            if not path:
                continue
            pre, post = [], []
            for regex, sites_, what, when in self.mapping:
                m = regex.fullmatch(path)
                if not m or (when is not None and not when(module)):
                    continue
                names = tuple(s.format(*m.groups()) for s in sites_)
                (pre if what.startswith("input") or what == "tokens" else post).append((names, what, m.groups()))
            if pre:
                self.handles.append(module.register_forward_pre_hook(self._input_hook(path, pre)))
            if post:
                self.handles.append(module.register_forward_hook(self._output_hook(path, post)))
        return self

    def __exit__(self, exc_type, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        self.model.__dict__.pop("forward", None)
        if exc_type is None:
            if self.writer.manifest("steps") in ("", "0"):
                self.writer.set_manifest("steps", self.numbering.count)
            if self.pool is not None:
                self.writer.set_manifest("kv_cache", '{"kind": "paged", "block_size": %d, "num_blocks": %d}'
                                         % (self.pool[1], self.pool[0]))
        return False

    def generated(self, seq_id, tokens):
        """The tokens an engine sequence produced: `seq{b}.generated` (`generated` without an adapter)."""
        name = "generated" if self.adapter is None else llmdump.seq_name(self.numbering.seq(seq_id), "generated")
        self._write(name, np.asarray(tokens, dtype=np.int64).reshape(-1))

    # ---- one forward call

    def _begin_step(self, module, args):
        if self.adapter is None:
            self.call = _Call(self.numbering.call([0], [0])[0], None, None)

    def _read_metadata(self, args, kwargs):
        """The forward call's batch from its arguments, checked; each member's
        positions and kv.* written."""
        a = self.adapter
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        where = "%s forward call %d" % (type(self.model).__name__, self.numbering.count)
        cu = _ints(a.read("cu_seqlens", arguments)).reshape(-1)
        if cu.size == 0 or cu[0] != 0 or (np.diff(cu) < 0).any():
            raise llmdump.DumpError("%s: %s: %s must start at 0 and never decrease"
                                    % (where, a.label("cu_seqlens"), cu.tolist()))
        ids = [int(i) for i in _ints(a.read("seq_ids", arguments)).reshape(-1)]
        count = len(ids)
        if count != cu.size - 1:
            raise llmdump.DumpError("%s: %s has %d sequences, %s has %d entries (sequences + 1)"
                                    % (where, a.label("seq_ids"), count, a.label("cu_seqlens"), cu.size))
        positions = self._per_row(a, "positions", arguments, cu, where, exact=not a.padded)
        slots = self._per_row(a, "slot_mapping", arguments, cu, where)
        tables = a.read("block_tables", arguments)
        if tables is not None:
            tables = _ints(tables)
            if tables.ndim != 2 or tables.shape[0] != count:
                raise llmdump.DumpError("%s: %s has shape %s, expected [%d sequences, blocks]"
                                        % (where, a.label("block_tables"), list(tables.shape), count))
        context = a.read("context_lens", arguments)
        if context is not None:
            context = _ints(context).reshape(-1)
            if context.size != count:
                raise llmdump.DumpError("%s: %s has %d entries for %d sequences"
                                        % (where, a.label("context_lens"), context.size, count))
        kv_caches = a.read("kv_caches", arguments)
        if kv_caches is not None:
            self._pool_shape(kv_caches, where)
        if slots is not None and self.pool is not None:
            size = self.pool[0] * self.pool[1]
            outside = np.nonzero((slots[:cu[-1]] < 0) | (slots[:cu[-1]] >= size))[0]
            if outside.size:
                r = int(outside[0])
                raise llmdump.DumpError("%s: %s: slot %d of row %d is outside the pool of %d slots (%d blocks of %d)"
                                        % (where, a.label("slot_mapping"), slots[r], r, size, self.pool[0], self.pool[1]))
        members, names = self.numbering.call(ids, np.diff(cu))
        self.call = _Call(members, [int(c) for c in cu], None if positions is None else positions.size, names,
                          kv_caches, tables, context)
        for i, (b, n) in enumerate(members):
            if positions is not None:
                self._seq(b, n, "positions", positions[cu[i]:cu[i + 1]])
            if tables is not None:
                self._seq(b, n, "kv.block_table", self._table(i, where))
            if slots is not None:
                self._seq(b, n, "kv.slot_mapping", slots[cu[i]:cu[i + 1]])
            if context is not None:
                self._seq(b, n, "kv.context_len", context[i:i + 1])

    def _per_row(self, a, field, arguments, cu, where, exact=False):
        """A per-row adapter field [rows] (None when not given): at least cu_seqlens[-1]
        rows, exactly that many when `exact`."""
        x = a.read(field, arguments)
        if x is None:
            return None
        x = _ints(x).reshape(-1)
        if x.size < cu[-1] or (exact and x.size > cu[-1]):
            raise llmdump.DumpError("%s: %s has %d rows, but %s ends at %d%s"
                                    % (where, a.label(field), x.size, a.label("cu_seqlens"), cu[-1],
                                       " (an engine that pads its rows: Adapter(padded=True))" if x.size > cu[-1] else ""))
        return x

    def _end(self, module, inputs, output):
        call = self.call
        if self.derive:
            logits = output.logits if hasattr(output, "logits") else (
                output[0] if isinstance(output, (tuple, list)) else output)
            if isinstance(logits, torch.Tensor):
                if self.adapter is None:
                    self._write(llmdump.step_name(call.members[0][1], "next_logits"),
                                llmdump_torch._array(logits, "logits")[-1])
                else:
                    per_seq, _ = self._split(logits, "logits", "the root module's output")
                    for (b, n), x in zip(call.members, per_seq):
                        self._seq(b, n, "next_logits", _numpy(x[-1]))
            for (b, n) in call.members:
                if b in call.final_rows:
                    self._seq(b, n, "last_hidden", call.final_rows[b])
        for name, array in call.iteration_names:
            self._write(name, array)
        for i, (b, n) in enumerate(call.members):
            if call.cu is not None:
                self.cached[b] = self.cached.get(b, 0) + call.cu[i + 1] - call.cu[i]
        self.call = None

    # ---- writing

    def _name(self, b, n, site):
        name = llmdump.step_name(n, site)
        return name if self.adapter is None else llmdump.seq_name(b, name)

    def _wants(self, name):
        return self.globs is None or self.globs.fullmatch(name) is not None

    def _write(self, name, array):
        if self._wants(name):
            self.writer.add(name, array)

    def _seq(self, b, n, site, array):
        self._write(self._name(b, n, site), array)

    def _wanted(self, sites):
        """Whether any member of the current call wants one of these sites."""
        return self.globs is None or any(self._wants(self._name(b, n, s)) for b, n in self.call.members for s in sites)

    # ---- packed tensors to per-sequence ones

    def _split(self, x, site, where):
        """A packed [rows, ...] tensor as each member's rows (torch views), and whether
        they are each member's last row only (logits computed for the sampled rows)."""
        call = self.call
        if self.adapter is None:  # HF-shaped, batch of one
            if x.dim() >= 2 and x.shape[0] == 1:
                x = x[0]
            return [x], False
        n, expected = len(call.members), call.rows or call.cu[-1]
        if x.dim() >= 2 and x.shape[0] == 1 and expected > 1 and x.shape[1] == expected:
            x = x[0]  # [1, rows, ...]: a batch dimension of one over the packed rows
        rows = x.shape[0] if x.dim() else 0
        if site == "logits" and rows == n and rows != expected:
            return [x[i:i + 1] for i in range(n)], True
        if rows < call.cu[-1] or (rows > call.cu[-1] and not self.adapter.padded) or \
                (call.rows is not None and rows != call.rows):
            raise llmdump.DumpError("%s: %s (%s): %d rows, but %s ends at %d%s in forward call %d"
                                    % (where, site, "x".join(str(d) for d in x.shape), rows,
                                       self.adapter.label("cu_seqlens"), call.cu[-1],
                                       "" if call.rows is None else " and positions has %d rows" % call.rows,
                                       self.numbering.count - 1))
        return [x[a:b] for a, b in zip(call.cu, call.cu[1:])], False

    def _emit(self, site, x, path):
        """One site's packed value to each member's canonical tensor."""
        if not isinstance(x, torch.Tensor):
            raise llmdump.DumpError("%s: %s: the hooked value is a %s, not a tensor" % (path, site, type(x).__name__))
        short = site.split(".", 2)[2] if site.startswith("layers.") else site
        if not self._wanted([site]) and site != "final_norm":  # final_norm's last rows: last_hidden
            return
        parts, last_only = self._split(x, site, path)
        for i, ((b, n), rows) in enumerate(zip(self.call.members, parts)):
            if last_only:  # a row subset (docs/DUMP_FORMAT.md "Row subsets"): each sequence's last row
                self._seq(b, n, "rows", np.array([self.call.cu[i + 1] - self.call.cu[i] - 1], np.int64))
            if short in _HEAD_MAJOR:  # [T, H*Dh] or [T, H, Dh] -> [H, T, Dh]
                heads = self.sizes["Hq" if short == "attn.q_rope" else "Hkv"]
                rows = rows.reshape(rows.shape[0], heads, -1).transpose(0, 1)
            elif site.endswith(llmdump_torch._PER_HEAD) and rows.dim() == 3:
                rows = rows.reshape(rows.shape[0], -1)
            a = _numpy(rows)
            if site == "final_norm":
                self.call.final_rows[b] = a[-1]
            self._seq(b, n, site, np.ascontiguousarray(a))

    def _fused(self, names, x, path):
        """A fused projection's output split along its last axis by the config's sizes."""
        if len(names) == 1:
            return [x]
        widths = [self._width(s, path) for s in names]
        if x.shape[-1] != sum(widths):
            raise llmdump.DumpError("%s: output (%s) has %d columns, but %s need %s = %d from the config (%s)"
                                    % (path, "x".join(str(d) for d in x.shape), x.shape[-1],
                                       names[0].rsplit(".", 1)[0] + "." + "/".join(s.rsplit(".", 1)[-1] for s in names),
                                       "+".join(str(w) for w in widths), sum(widths), self._config_note(names)))
        return list(x.split(widths, dim=-1))

    def _width(self, site, path):
        s = self.sizes
        key = site.split(".", 2)[2] if site.startswith("layers.") else site
        table = {"attn.q": "Hq", "attn.k": "Hkv", "attn.v": "Hkv"}
        if key in table:
            if s.get(table[key]) is None or s.get("Dh") is None:
                raise llmdump.DumpError("%s: splitting %s needs num_attention_heads, num_key_value_heads and "
                                        "head_dim (or hidden_size) in the config" % (path, site))
            return s[table[key]] * s["Dh"]
        if key in ("mlp.gate", "mlp.up"):
            if s.get("F") is None:
                raise llmdump.DumpError("%s: splitting %s needs intermediate_size in the config" % (path, site))
            return s["F"]
        raise llmdump.DumpError("%s: no width is known for a fused %s" % (path, site))

    def _config_note(self, names):
        s = self.sizes
        if any(n.endswith(("attn.q", "attn.k", "attn.v")) for n in names):
            return "num_attention_heads %s, num_key_value_heads %s, head_dim %s" % (s.get("Hq"), s.get("Hkv"), s.get("Dh"))
        return "intermediate_size %s" % s.get("F")

    # ---- the paged cache

    def _pool_shape(self, kv_caches, where):
        k = self._layer_pool(kv_caches, 0, where)[0]
        if k.dim() != 4:
            raise llmdump.DumpError("%s: %s: a layer's pool has shape %s, expected 4 axes (%s)"
                                    % (where, self.adapter.label("kv_caches"), list(k.shape), self.adapter.kv_layout))
        blocks = k.shape[0]
        bs = k.shape[1] if self.adapter.kv_layout == "block,slot,head,dim" else k.shape[2]
        if self.adapter.block_size is not None and self.adapter.block_size != bs:
            raise llmdump.DumpError("%s: %s: the pool's block size is %d, the adapter says %d"
                                    % (where, self.adapter.label("kv_caches"), bs, self.adapter.block_size))
        self.pool = (int(blocks), int(bs))

    def _layer_pool(self, kv_caches, layer, where):
        """Layer `layer`'s (k, v) pools: a pair, or a [2, ...] tensor as vLLM keeps them."""
        try:
            pair = kv_caches[layer]
            return pair[0], pair[1]
        except (IndexError, KeyError, TypeError):
            raise llmdump.DumpError("%s: %s has no (k, v) pools of layer %d"
                                    % (where, self.adapter.label("kv_caches"), layer)) from None

    def _table(self, i, where):
        """Member i's block table, cut to the blocks its context covers."""
        table = self.call.tables[i]
        S = self._context(i)
        nb = -(-S // self.pool[1]) if self.pool is not None else int((table >= 0).sum())
        if nb > table.size:
            raise llmdump.DumpError("%s: %s: sequence row %d reads %d positions, %d blocks, its table has %d"
                                    % (where, self.adapter.label("block_tables"), i, S, nb, table.size))
        table = table[:nb]
        if self.pool is not None and ((table < 0) | (table >= self.pool[0])).any():
            raise llmdump.DumpError("%s: %s: sequence row %d names block %d, outside the pool of %d blocks"
                                    % (where, self.adapter.label("block_tables"), i,
                                       int(table[(table < 0) | (table >= self.pool[0])][0]), self.pool[0]))
        return table

    def _context(self, i):
        if self.call.context is not None:
            return int(self.call.context[i])
        b, _ = self.call.members[i]
        return self.cached.get(b, 0) + self.call.cu[i + 1] - self.call.cu[i]

    def _gather(self, names, layer, path):
        call = self.call
        if call.kv_caches is None or call.tables is None or not self._wanted(names):
            return  # the adapter names no pool or no tables: the caches are not observable
        where = "%s in forward call %d" % (path, self.numbering.count - 1)
        pools = self._layer_pool(call.kv_caches, layer, where)
        for i, (b, n) in enumerate(call.members):
            table = torch.as_tensor(self._table(i, where))
            S = self._context(i)
            for name, pool in zip(names, pools):
                if self.adapter.kv_layout == "block,head,slot,dim":
                    pool = pool.transpose(1, 2)
                rows = pool[table].reshape(-1, *pool.shape[2:])[:S]  # [S, Hkv, Dh]
                self._seq(b, n, name, np.ascontiguousarray(_numpy(rows.transpose(0, 1))))

    # ---- hook factories

    def _input_hook(self, path, entries):
        def hook(module, inputs):
            for names, what, groups in entries:
                if what == "tokens":
                    x = inputs[0]
                    for (b, n), rows in zip(self.call.members, self._split(x, names[0], path)[0]):
                        if self.adapter is None:
                            arr = np.asarray(llmdump_torch._array(x, names[0]), dtype=np.int64).reshape(-1)
                        else:
                            arr = _ints(rows).reshape(-1)
                        self._seq(b, n, names[0], arr)
                    continue
                index = int(what.split(".")[1]) if "." in what else 0
                if index >= len(inputs):
                    raise llmdump.DumpError("%s: %s: the module got %d positional inputs, no input %d"
                                            % (path, names[0], len(inputs), index))
                x = inputs[index]
                x = x[0] if isinstance(x, (tuple, list)) else x
                for name, part in zip(names, self._fused(names, x, path)):
                    self._emit(name, part, path)
        return hook

    def _output_hook(self, path, entries):
        def hook(module, inputs, output):
            for names, what, groups in entries:
                if what == "kv":
                    self._gather(names, int(groups[0]), path)
                    continue
                if what == "residual_sum" and isinstance(output, (tuple, list)) and len(output) >= 2 and \
                        isinstance(output[1], torch.Tensor) and output[1].shape == output[0].shape:
                    x = output[0] + output[1]
                elif what.startswith("output."):
                    x = output[int(what.split(".")[1])]
                else:
                    x = output[0] if isinstance(output, (tuple, list)) else output
                for name, part in zip(names, self._fused(names, x, path)):
                    self._emit(name, part, path)
        return hook


def _sizes(cfg):
    """Heads, head_dim and the MLP width from an HF config (None where absent)."""
    Hq = cfg.get("num_attention_heads")
    D = cfg.get("hidden_size")
    Dh = cfg.get("head_dim") or (D // Hq if D and Hq else None)
    return {"Hq": Hq, "Hkv": cfg.get("num_key_value_heads") or Hq, "Dh": Dh, "F": cfg.get("intermediate_size")}
