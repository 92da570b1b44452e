"""llmdump_torch: record a HF-style PyTorch model's intermediates as an llm-dump/1 file.

Forward hooks map module paths to canonical names (docs/DUMP_FORMAT.md), so an
engine written as a torch.nn.Module tree with HF's module names records
itself without a line changed in its forward:

    import llmdump, llmdump_torch
    with llmdump.DumpWriter("out.safetensors", producer="my torch engine", model="llama-gqa",
                            config=config_text, scenario="decode", dtype="float32", steps=4) as w:
        with llmdump_torch.Recorder(model, w):
            logits = model(prompt_ids)          # step 0
            logits = model(next_id)             # step 1, ...

Each call of the root module is one forward call (a step). Batch size 1: a
leading batch dimension of 1 is dropped. What a hook sees (module inputs and
outputs) is recorded; what a forward computes between modules (the residual
adds, RoPE and attention inside a fused function) is not, unless the model
names it through a module. The mapping is a list of (regex over the module
path, matched whole; site template, what to record); pass your own, or extend DEFAULT_MAPPING,
for other module names:

    mapping = llmdump_torch.DEFAULT_MAPPING + [
        (r"transformer\\.h\\.(\\d+)\\.attn\\.rotary$", "layers.{0}.attn.q_rope", "output"),
    ]

"what" is "output" (the module's output; the first element of a tuple),
"input" (its first positional input) or "tokens" (its first input, as token
ids). A site ending in a Qwen3-style per-head [T, H, Dh] output is flattened
to the format's [T, H*Dh] for attn.q_norm / attn.k_norm.
"""

import re

import numpy as np
import torch

import llmdump

__all__ = ["Recorder", "DEFAULT_MAPPING"]

_L = r"(?:model\.)?layers\.(\d+)\."

# HF Llama / Mistral / Qwen2 / Qwen3 module paths (LlamaForCausalLM and friends).
DEFAULT_MAPPING = [
    (r"(?:model\.)?embed_tokens$", "tokens", "tokens"),
    (r"(?:model\.)?embed_tokens$", "embed", "output"),
    (_L + r"input_layernorm$", "layers.{0}.attn_norm", "output"),
    (_L + r"self_attn\.q_proj$", "layers.{0}.attn.q", "output"),
    (_L + r"self_attn\.k_proj$", "layers.{0}.attn.k", "output"),
    (_L + r"self_attn\.v_proj$", "layers.{0}.attn.v", "output"),
    (_L + r"self_attn\.q_norm$", "layers.{0}.attn.q_norm", "output"),
    (_L + r"self_attn\.k_norm$", "layers.{0}.attn.k_norm", "output"),
    (_L + r"self_attn\.o_proj$", "layers.{0}.attn.ctx", "input"),
    (_L + r"self_attn\.o_proj$", "layers.{0}.attn.out", "output"),
    (_L + r"post_attention_layernorm$", "layers.{0}.mlp_norm", "output"),
    (_L + r"mlp\.gate_proj$", "layers.{0}.mlp.gate", "output"),
    (_L + r"mlp\.up_proj$", "layers.{0}.mlp.up", "output"),
    (_L + r"mlp\.down_proj$", "layers.{0}.mlp.act", "input"),
    (_L + r"mlp\.down_proj$", "layers.{0}.mlp.down", "output"),
    (r"(?:model\.)?layers\.(\d+)$", "layers.{0}.out", "output"),
    (r"(?:model\.)?norm$", "final_norm", "output"),
    (r"lm_head$", "logits", "output"),
]

_PER_HEAD = ("attn.q_norm", "attn.k_norm")


def _array(x, site):
    if isinstance(x, (tuple, list)):
        x = x[0]
    if not isinstance(x, torch.Tensor):
        raise llmdump.DumpError("%s: the hooked value is a %s, not a tensor" % (site, type(x).__name__))
    x = x.detach()
    if x.dim() >= 2 and x.shape[0] == 1:  # batch of one
        x = x[0]
    if site.endswith(_PER_HEAD) and x.dim() == 3:  # [T, H, Dh] -> [T, H*Dh]
        x = x.reshape(x.shape[0], -1)
    if x.dtype in (torch.bfloat16, torch.float16, torch.float64):
        x = x.float()
    return x.cpu().numpy()


class Recorder:
    """Forward hooks on `model` writing to `writer` (an llmdump.DumpWriter) while active."""

    def __init__(self, model, writer, mapping=None, derive=True):
        self.model, self.writer = model, writer
        self.mapping = [(re.compile(p), site, what) for p, site, what in (mapping or DEFAULT_MAPPING)]
        for _, _, what in self.mapping:
            if what not in ("output", "input", "tokens"):
                raise llmdump.DumpError("mapping: '%s' is not output, input or tokens" % what)
        self.derive = derive  # next_logits and last_hidden from the last rows
        self.step = -1
        self.handles = []
        self.matched = set()

    def __enter__(self):
        self.handles.append(self.model.register_forward_pre_hook(self._begin_step))
        self.handles.append(self.model.register_forward_hook(self._end_step))
        for path, module in self.model.named_modules():
            for regex, site, what in self.mapping:
                m = regex.fullmatch(path)
                if not m or not path:
                    continue
                name = site.format(*m.groups())
                self.matched.add(site)
                if what == "output":
                    self.handles.append(module.register_forward_hook(self._output_hook(name)))
                else:
                    self.handles.append(module.register_forward_pre_hook(self._input_hook(name, what)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        return False

    def _begin_step(self, module, inputs):
        self.step += 1
        self.final = None

    def _end_step(self, module, inputs, output):
        if not self.derive:
            return
        logits = output[0] if isinstance(output, (tuple, list)) else output
        if hasattr(output, "logits"):
            logits = output.logits
        if isinstance(logits, torch.Tensor):
            a = _array(logits, "logits")
            self.writer.add(llmdump.step_name(self.step, "next_logits"), a[-1])
        if self.final is not None:
            self.writer.add(llmdump.step_name(self.step, "last_hidden"), self.final[-1])

    def _add(self, name, array):
        self.writer.add(llmdump.step_name(self.step, name), array)
        if name == "final_norm":
            self.final = array

    def _output_hook(self, name):
        def hook(module, inputs, output):
            self._add(name, _array(output, name))
        return hook

    def _input_hook(self, name, what):
        def hook(module, inputs):
            x = _array(inputs[0], name)
            if what == "tokens":
                x = np.asarray(x, dtype=np.int64).reshape(-1)
            self._add(name, x)
        return hook
