"""Tests of llmdump_serving.py (the packed-batch recorder) on the golden models:

- an HF-shaped module tree at batch size 1 (examples/torch/tiny_llama_torch.py) recorded
  without an adapter gives the same bytes as llmdump_torch.Recorder;
- the serving engine (examples/torch/serving_engine.py) recorded with its rows padded
  gives the same tensors as without padding, each sequence's rows matching the engine's;
  the sites filter keeps exactly the names it matches;
- malformed adapters and configs are errors naming the module (or the forward call)
  and the tensor, and leave no file;
- llmdump.split_rows and llmdump.Iterations.

    python3 test_llmdump_serving.py WORKDIR GOLDEN_DIR
"""
import os
import sys

import numpy as np
import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.path.insert(0, os.path.join(here, "..", "..", "examples", "torch"))
import llmdump  # noqa: E402
import llmdump_serving  # noqa: E402
import llmdump_torch  # noqa: E402
import serving_engine  # noqa: E402
import tiny_llama_torch  # noqa: E402
from test_llmdump import read_safetensors  # noqa: E402

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAILED:", what, file=sys.stderr)


def expect_error(fn, parts, what):
    """fn must raise DumpError whose message holds every string of `parts`."""
    try:
        fn()
    except llmdump.DumpError as e:
        msg = str(e)
        missing = [p for p in parts if p not in msg]
        check(not missing, "%s: the error %r does not name %s" % (what, msg, missing))
        return msg
    check(False, "%s: no error" % what)
    return ""


def test_hf_batch_one_bytes(work, golden):
    """Without an adapter the packed recorder is the single-sequence recorder, byte for byte."""
    model_dir = os.path.join(golden, "llama-gqa")
    paths = []
    for i, recorder in enumerate((llmdump_torch.Recorder, llmdump_serving.PackedRecorder)):
        model, config_text = tiny_llama_torch.load(model_dir)
        out = os.path.join(work, "hf%d.safetensors" % i)
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        with llmdump.DumpWriter(out, producer="test", model="llama-gqa", config=config_text,
                                scenario="decode", dtype="float32", steps=3) as w:
            with recorder(model, w):
                for _ in range(3):
                    logits = model(ids)
                    ids = logits[:, -1:].argmax(-1)
        paths.append(out)
    a, b = (open(p, "rb").read() for p in paths)
    check(len(a) > 50000 and a == b, "HF-shaped batch 1: PackedRecorder's file differs from Recorder's "
                                      "(%d vs %d bytes)" % (len(a), len(b)))


def run_engine(model_dir, out, pad_to=1, sites=None, requests="p0:5@0:2;p0:7@1:1;p0:7+p0:2@2:1"):
    model, c, config_text = serving_engine.load_model(model_dir)
    engine = serving_engine.Engine(model, c, block_size=4, num_blocks=32, chunk=3, pad_to=pad_to)
    reqs = serving_engine.parse_requests(requests, serving_engine.golden_prompt(model_dir))
    return serving_engine.record(engine, model_dir, config_text, reqs, out, sites)


def test_padding_and_sites(work, golden):
    model_dir = os.path.join(golden, "qwen3-qknorm")
    plain, padded, some = (os.path.join(work, n) for n in ("plain.safetensors", "padded.safetensors", "sites.safetensors"))
    gen = run_engine(model_dir, plain)
    check(run_engine(model_dir, padded, pad_to=8) == gen, "padded rows changed the generated tokens")
    meta_a, ta = read_safetensors(plain)
    meta_b, tb = read_safetensors(padded)
    names_a = [t[0] for t in ta]
    check(names_a == [t[0] for t in tb], "padding changed the recorded names")
    check(meta_a["kv_cache"] == '{"kind": "paged", "block_size": 4, "num_blocks": 32}' and meta_a["steps"] == "6",
          "manifest kv_cache/steps: %s %s" % (meta_a.get("kv_cache"), meta_a.get("steps")))
    vals_a = {t[0]: np.frombuffer(t[3], "<f4" if t[1] == "F32" else "<i8").reshape(t[2]) for t in ta}
    vals_b = {t[0]: np.frombuffer(t[3], "<f4" if t[1] == "F32" else "<i8").reshape(t[2]) for t in tb}
    worst = max(float(np.abs(vals_a[n].astype(np.float64) - vals_b[n]).max() / (np.abs(vals_a[n]).max() + 1e-30))
                for n in names_a if vals_a[n].size)
    check(worst < 1e-5, "padded rows changed a recorded value by %.3g relative" % worst)
    # what the names hold: seq2 (9-token prompt in chunks of 3, joining at iteration 2)
    check(vals_a["seq2.step2.positions"].tolist() == [6, 7, 8], "seq2 step2 positions %s" % vals_a["seq2.step2.positions"])
    check(vals_a["seq2.step2.layers.0.attn.k_cache"].shape == (2, 9, 32), "seq2 step2 k_cache shape")
    check(vals_a["seq2.step2.layers.0.attn.q_rope"].shape == (4, 3, 32), "seq2 step2 q_rope shape")
    check(vals_a["seq2.step2.kv.context_len"].tolist() == [9], "seq2 step2 context_len")
    check(len(vals_a["seq2.step2.kv.block_table"]) == 3, "seq2 step2 block table cut to 3 blocks")
    check(vals_a["seq2.generated"].tolist() == gen[102], "seq2.generated")
    # the cache holds step 2's new keys at its last 3 positions, as the k_rope rows
    k_rope = vals_a["seq2.step2.layers.0.attn.k_rope"]  # [Hkv, 3, Dh]
    check(np.array_equal(vals_a["seq2.step2.layers.0.attn.k_cache"][:, 6:9], k_rope), "k_cache's new rows are k_rope")
    iters = sorted(n for n in names_a if n.startswith("iter"))
    check(len(iters) == 18 and vals_a["iter2.seqs"].tolist() == [1, 2, 0] and
          vals_a["iter2.num_tokens"].tolist() == [3, 3, 1], "iterations: %s %s" % (vals_a.get("iter2.seqs"), iters[:3]))
    run_engine(model_dir, some, sites=["seq1.*.layers.1.attn.k_cache", "iter*", "seq*.step*.tokens"])
    _, ts = read_safetensors(some)
    got = sorted(t[0] for t in ts)
    want = sorted(n for n in names_a if n.startswith("iter") or n.endswith(".tokens") or
                  (n.startswith("seq1.") and n.endswith("layers.1.attn.k_cache")))
    check(got == want, "sites filter: %d names, expected %d" % (len(got), len(want)))


def test_malformed(work, golden):
    model_dir = os.path.join(golden, "llama-gqa")
    out = os.path.join(work, "bad.safetensors")
    model, c, config_text = serving_engine.load_model(model_dir)
    prompt = serving_engine.golden_prompt(model_dir)

    def record(adapter=None, config=config_text, engine_bug=None, mapping=None):
        engine = serving_engine.Engine(model, c, block_size=4, num_blocks=16, chunk=3)
        reqs = serving_engine.parse_requests("p0:5@0:1;p0:3@0:1", prompt)
        adapter = adapter or llmdump_serving.Adapter(
            seq_ids="attn_metadata.seq_ids", cu_seqlens="attn_metadata.query_start_loc", positions="positions",
            slot_mapping="attn_metadata.slot_mapping", block_tables="attn_metadata.block_tables",
            context_lens="attn_metadata.seq_lens", kv_caches="kv_caches")
        if engine_bug:
            engine_bug(engine)
        with llmdump.DumpWriter(out, config=config_text, scenario="batch", dtype="float32") as w:
            with llmdump_serving.PackedRecorder(engine.model, w, config, adapter, mapping=mapping):
                engine.generate(reqs)

    # rows that do not add up to cu_seqlens: a query_start_loc one row short of the rows
    def short_loc(arguments):
        return arguments["attn_metadata"].query_start_loc - torch.tensor([0] * (len(arguments["attn_metadata"].seq_ids)) + [1])
    expect_error(lambda: record(llmdump_serving.Adapter(seq_ids="attn_metadata.seq_ids", cu_seqlens=short_loc)),
                 ["model.embed_tokens", "tokens", "6 rows", "cu_seqlens", "ends at 5", "forward call 0"],
                 "rows beyond cu_seqlens")
    expect_error(lambda: record(llmdump_serving.Adapter(seq_ids="attn_metadata.seq_ids", cu_seqlens=short_loc,
                                                        positions="positions")),
                 ["forward call 0", "positions", "6 rows", "ends at 5", "padded"], "positions beyond cu_seqlens")
    # positions fewer than the rows cu_seqlens covers
    expect_error(lambda: record(llmdump_serving.Adapter(seq_ids="attn_metadata.seq_ids",
                                                        cu_seqlens="attn_metadata.query_start_loc",
                                                        positions=lambda a: a["positions"][:-1])),
                 ["forward call 0", "positions", "cu_seqlens"], "positions short of cu_seqlens")
    # a slot outside the pool (16 blocks of 4: 64 slots)
    def far_slots(engine):
        build = engine._metadata

        def metadata(batch, counts):
            ids, pos, md = build(batch, counts)
            md.slot_mapping = md.slot_mapping + 64
            return ids, pos, md
        engine._metadata = metadata
    msg = expect_error(lambda: record(engine_bug=far_slots), ["slot_mapping", "attn_metadata.slot_mapping", "outside the pool",
                                                              "64 slots"], "slot outside the pool")
    check("ForCausalLM forward call 0" in msg, "slot outside the pool: %r names no module and forward call" % msg)
    # a fused size that does not match the config
    wrong = config_text.replace('"num_key_value_heads": 2', '"num_key_value_heads": 4')
    expect_error(lambda: record(config=wrong), ["model.layers.0.self_attn.qkv_proj", "layers.0.attn.q/k/v", "128", "192",
                                                "num_key_value_heads 4"], "fused qkv against the config")
    wrong = config_text.replace('"intermediate_size": 160', '"intermediate_size": 150')
    expect_error(lambda: record(config=wrong), ["model.layers.0.mlp.gate_up_proj", "layers.0.mlp.gate/up", "300", "320"],
                 "fused gate_up against the config")
    # an adapter path the forward does not have, seq_ids against cu_seqlens
    expect_error(lambda: record(llmdump_serving.Adapter(seq_ids="metadata.seq_ids",
                                                        cu_seqlens="attn_metadata.query_start_loc")),
                 ["seq_ids", "metadata.seq_ids", "no parameter 'metadata'"], "unknown forward parameter")
    expect_error(lambda: record(llmdump_serving.Adapter(seq_ids=lambda a: a["attn_metadata"].seq_ids[:1],
                                                        cu_seqlens="attn_metadata.query_start_loc")),
                 ["forward call 0", "seq_ids", "1 sequences", "cu_seqlens"], "seq_ids against cu_seqlens")
    expect_error(lambda: record(mapping=[(r"lm_head$", "logits", "outputs")]), ["outputs"], "mapping's what")
    check(not os.path.exists(out), "a failed recording left %s" % out)


def test_helpers():
    x = np.arange(20).reshape(10, 2)
    parts = llmdump.split_rows(x, [0, 3, 4, 8])  # rows 8, 9: padding
    check([p[:, 0].tolist() for p in parts] == [[0, 2, 4], [6], [8, 10, 12, 14]], "split_rows")
    expect_error(lambda: llmdump.split_rows(x, [0, 3, 11], what="hidden"), ["hidden", "10 rows", "11"], "split_rows short")
    expect_error(lambda: llmdump.split_rows(x, [0, 3, 2]), ["never decrease"], "split_rows order")
    it = llmdump.Iterations()
    m0, n0 = it.call([17, 5], [4, 3])
    m1, n1 = it.call([5, 17, 9], [1, 1, 2])
    check(m0 == [(0, 0), (1, 0)] and m1 == [(1, 1), (0, 1), (2, 0)], "Iterations members %s %s" % (m0, m1))
    check([n for n, _ in n1] == ["iter1.seqs", "iter1.seq_steps", "iter1.num_tokens"] and
          [a.tolist() for _, a in n1] == [[1, 0, 2], [1, 1, 0], [1, 1, 2]], "Iterations names")
    expect_error(lambda: it.call([3, 3], [1, 1]), ["call 2", "twice"], "Iterations duplicate")
    expect_error(lambda: it.seq(42), ["42"], "Iterations unknown id")


def main():
    work, golden = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    torch.set_grad_enabled(False)
    test_helpers()
    test_hf_batch_one_bytes(work, golden)
    test_padding_and_sites(work, golden)
    test_malformed(work, golden)
    if failures:
        print("%d failed" % len(failures))
        sys.exit(1)
    print("test_llmdump_serving: all checks passed")


if __name__ == "__main__":
    main()
