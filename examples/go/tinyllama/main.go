// A tiny Llama engine in Go (standard library only), instrumented with the
// project's Go writer (docs/COOKBOOK.md). Reads an HF Llama checkpoint
// (config.json + model.safetensors, float32 or bfloat16), runs a prompt and
// greedy decode steps with a KV cache, and writes every intermediate under
// llm-dump/1's canonical names:
//
//	cd examples/go/tinyllama && go build -o tinyllama .
//	./tinyllama -model ../../../tests/golden/llama-gqa -tokens 1,2,3,4,5 -decode 3 -out go.safetensors
//	build/llmdiff bisect --model tests/golden/llama-gqa examples/go/tinyllama/go.safetensors
//
// -bug rope-interleaved rotates adjacent pairs instead of HF's halves.
package main

import (
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"llmdiff/writers/llmdump"
)

type tensor struct {
	shape []int64
	v     []float32
}

func die(format string, a ...interface{}) {
	fmt.Fprintf(os.Stderr, "tinyllama: "+format+"\n", a...)
	os.Exit(2)
}

// loadSafetensors reads F32 and BF16 tensors as float32.
func loadSafetensors(path string) map[string]tensor {
	raw, err := os.ReadFile(path)
	if err != nil {
		die("%v", err)
	}
	n := binary.LittleEndian.Uint64(raw[:8])
	var header map[string]json.RawMessage
	if err := json.Unmarshal(raw[8:8+n], &header); err != nil {
		die("%s: header: %v", path, err)
	}
	out := map[string]tensor{}
	for name, msg := range header {
		if name == "__metadata__" {
			continue
		}
		var e struct {
			Dtype   string   `json:"dtype"`
			Shape   []int64  `json:"shape"`
			Offsets []uint64 `json:"data_offsets"`
		}
		if err := json.Unmarshal(msg, &e); err != nil {
			die("%s: tensor %s: %v", path, name, err)
		}
		b := raw[8+n+e.Offsets[0] : 8+n+e.Offsets[1]]
		t := tensor{shape: e.Shape}
		switch e.Dtype {
		case "F32":
			t.v = make([]float32, len(b)/4)
			for i := range t.v {
				t.v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
			}
		case "BF16":
			t.v = make([]float32, len(b)/2)
			for i := range t.v {
				t.v[i] = llmdump.BF16ToF32(binary.LittleEndian.Uint16(b[2*i:]))
			}
		default:
			die("%s: tensor %s: dtype %s not supported", path, name, e.Dtype)
		}
		out[name] = t
	}
	return out
}

// matmul: y[T, out] = x[T, in] · W[out, in]ᵀ
func matmul(x []float32, w tensor, T int) []float32 {
	out, in := int(w.shape[0]), int(w.shape[1])
	y := make([]float32, T*out)
	for t := 0; t < T; t++ {
		for o := 0; o < out; o++ {
			var s float32
			for i := 0; i < in; i++ {
				s += x[t*in+i] * w.v[o*in+i]
			}
			y[t*out+o] = s
		}
	}
	return y
}

func rmsnorm(x []float32, w tensor, T int, eps float32) []float32 {
	D := int(w.shape[0])
	y := make([]float32, len(x))
	for t := 0; t < T; t++ {
		var ss float32
		for i := 0; i < D; i++ {
			ss += x[t*D+i] * x[t*D+i]
		}
		r := float32(1 / math.Sqrt(float64(ss/float32(D)+eps)))
		for i := 0; i < D; i++ {
			y[t*D+i] = x[t*D+i] * r * w.v[i]
		}
	}
	return y
}

type engine struct {
	configText           string
	D, F, L, Hq, Hkv, Dh int
	V                    int
	eps, theta           float64
	ropeBug              bool
	w                    map[string]tensor
	kCache, vCache       [][]float32 // per layer [Hkv, S, Dh]
	S                    int
}

func newEngine(dir string) *engine {
	text, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		die("%v", err)
	}
	var c map[string]interface{}
	if err := json.Unmarshal(text, &c); err != nil {
		die("config.json: %v", err)
	}
	num := func(k string, def float64) float64 {
		if v, ok := c[k].(float64); ok {
			return v
		}
		return def
	}
	e := &engine{configText: string(text)}
	e.D, e.F, e.L = int(num("hidden_size", 0)), int(num("intermediate_size", 0)), int(num("num_hidden_layers", 0))
	e.Hq = int(num("num_attention_heads", 0))
	e.Hkv = int(num("num_key_value_heads", float64(e.Hq)))
	e.Dh = int(num("head_dim", float64(e.D/e.Hq)))
	e.V = int(num("vocab_size", 0))
	e.eps, e.theta = num("rms_norm_eps", 1e-6), num("rope_theta", 10000)
	e.w = loadSafetensors(filepath.Join(dir, "model.safetensors"))
	e.kCache, e.vCache = make([][]float32, e.L), make([][]float32, e.L)
	return e
}

func (e *engine) W(name string) tensor {
	t, ok := e.w[name]
	if !ok {
		die("model.safetensors: missing tensor %s", name)
	}
	return t
}

// rope: [T, H*Dh] rows -> RoPE'd head-major [H, T, Dh] at positions P..P+T-1.
func (e *engine) rope(x []float32, T, H, P int) []float32 {
	Dh, half := e.Dh, e.Dh/2
	out := make([]float32, H*T*Dh)
	for h := 0; h < H; h++ {
		for t := 0; t < T; t++ {
			src, dst := x[t*H*Dh+h*Dh:], out[(h*T+t)*Dh:]
			for i := 0; i < half; i++ {
				invFreq := float32(1 / math.Pow(e.theta, float64(2*i)/float64(Dh)))
				f := float64(float32(P+t) * invFreq)
				c, s := float32(math.Cos(f)), float32(math.Sin(f))
				a, b := i, i+half
				if e.ropeBug { // the bug: adjacent pairs
					a, b = 2*i, 2*i+1
				}
				dst[a] = src[a]*c - src[b]*s
				dst[b] = src[b]*c + src[a]*s
			}
		}
	}
	return out
}

// appendCache: cache [Hkv, S, Dh] + x [Hkv, T, Dh] -> [Hkv, S+T, Dh].
func (e *engine) appendCache(cache, x []float32, T int) []float32 {
	S, Dh := e.S, e.Dh
	grown := make([]float32, e.Hkv*(S+T)*Dh)
	for h := 0; h < e.Hkv; h++ {
		copy(grown[h*(S+T)*Dh:], cache[h*S*Dh:(h+1)*S*Dh])
		copy(grown[(h*(S+T)+S)*Dh:], x[h*T*Dh:(h+1)*T*Dh])
	}
	return grown
}

func (e *engine) forward(tokens []int64, step int, dump *llmdump.Writer) []float32 {
	T, P := len(tokens), e.S
	St := P + T
	D, Dh, Hq, Hkv := e.D, e.Dh, e.Hq, e.Hkv
	check := func(err error) {
		if err != nil {
			die("%v", err)
		}
	}
	rec := func(site string, shape []int64, v []float32) {
		check(dump.AddF32(llmdump.StepName(step, site), shape, v))
	}
	recL := func(l int, site string, shape []int64, v []float32) {
		check(dump.AddF32(llmdump.LayerName(step, l, site), shape, v))
	}
	i64 := func(xs ...int) []int64 {
		out := make([]int64, len(xs))
		for k, x := range xs {
			out[k] = int64(x)
		}
		return out
	}
	positions := make([]int64, T)
	for t := range positions {
		positions[t] = int64(P + t)
	}
	check(dump.AddI64(llmdump.StepName(step, "tokens"), i64(T), tokens))
	check(dump.AddI64(llmdump.StepName(step, "positions"), i64(T), positions))
	emb := e.W("model.embed_tokens.weight")
	x := make([]float32, T*D)
	for t, tok := range tokens {
		copy(x[t*D:(t+1)*D], emb.v[int(tok)*D:(int(tok)+1)*D])
	}
	rec("embed", i64(T, D), x)
	for l := 0; l < e.L; l++ {
		p := fmt.Sprintf("model.layers.%d.", l)
		h := rmsnorm(x, e.W(p+"input_layernorm.weight"), T, float32(e.eps))
		recL(l, "attn_norm", i64(T, D), h)
		q := matmul(h, e.W(p+"self_attn.q_proj.weight"), T)
		k := matmul(h, e.W(p+"self_attn.k_proj.weight"), T)
		v := matmul(h, e.W(p+"self_attn.v_proj.weight"), T)
		recL(l, "attn.q", i64(T, Hq*Dh), q)
		recL(l, "attn.k", i64(T, Hkv*Dh), k)
		recL(l, "attn.v", i64(T, Hkv*Dh), v)
		qRope, kRope := e.rope(q, T, Hq, P), e.rope(k, T, Hkv, P)
		recL(l, "attn.q_rope", i64(Hq, T, Dh), qRope)
		recL(l, "attn.k_rope", i64(Hkv, T, Dh), kRope)
		e.kCache[l] = e.appendCache(e.kCache[l], kRope, T)
		e.vCache[l] = e.appendCache(e.vCache[l], llmdump.HeadMajor(v, T, Hkv, Dh), T)
		recL(l, "attn.k_cache", i64(Hkv, St, Dh), e.kCache[l])
		recL(l, "attn.v_cache", i64(Hkv, St, Dh), e.vCache[l])
		// Query head hq reads kv head hq / (Hq / Hkv); causal over positions.
		scores, probs, ctx := make([]float32, Hq*T*St), make([]float32, Hq*T*St), make([]float32, T*Hq*Dh)
		scale := float32(1 / math.Sqrt(float64(Dh)))
		for hq := 0; hq < Hq; hq++ {
			kv := hq / (Hq / Hkv)
			for t := 0; t < T; t++ {
				srow, prow := scores[(hq*T+t)*St:], probs[(hq*T+t)*St:]
				mx := float32(math.Inf(-1))
				for s := 0; s < St; s++ {
					var dot float32
					for d := 0; d < Dh; d++ {
						dot += qRope[(hq*T+t)*Dh+d] * e.kCache[l][(kv*St+s)*Dh+d]
					}
					srow[s] = dot * scale
					if s <= P+t && srow[s] > mx {
						mx = srow[s]
					}
				}
				var sum float32
				for s := 0; s <= P+t; s++ {
					prow[s] = float32(math.Exp(float64(srow[s] - mx)))
					sum += prow[s]
				}
				for s := 0; s <= P+t; s++ {
					prow[s] /= sum
					for d := 0; d < Dh; d++ {
						ctx[t*Hq*Dh+hq*Dh+d] += prow[s] * e.vCache[l][(kv*St+s)*Dh+d]
					}
				}
			}
		}
		recL(l, "attn.scores", i64(Hq, T, St), scores)
		recL(l, "attn.probs", i64(Hq, T, St), probs)
		recL(l, "attn.ctx", i64(T, Hq*Dh), ctx)
		out := matmul(ctx, e.W(p+"self_attn.o_proj.weight"), T)
		recL(l, "attn.out", i64(T, D), out)
		for i := range x {
			x[i] += out[i]
		}
		recL(l, "attn_residual", i64(T, D), x)
		h = rmsnorm(x, e.W(p+"post_attention_layernorm.weight"), T, float32(e.eps))
		recL(l, "mlp_norm", i64(T, D), h)
		gate, up := matmul(h, e.W(p+"mlp.gate_proj.weight"), T), matmul(h, e.W(p+"mlp.up_proj.weight"), T)
		act := make([]float32, len(gate))
		for i := range act {
			act[i] = gate[i] / (1 + float32(math.Exp(float64(-gate[i])))) * up[i]
		}
		down := matmul(act, e.W(p+"mlp.down_proj.weight"), T)
		recL(l, "mlp.gate", i64(T, e.F), gate)
		recL(l, "mlp.up", i64(T, e.F), up)
		recL(l, "mlp.act", i64(T, e.F), act)
		recL(l, "mlp.down", i64(T, D), down)
		for i := range x {
			x[i] += down[i]
		}
		recL(l, "out", i64(T, D), x)
	}
	e.S = St
	h := rmsnorm(x, e.W("model.norm.weight"), T, float32(e.eps))
	rec("final_norm", i64(T, D), h)
	head, ok := e.w["lm_head.weight"]
	if !ok {
		head = emb
	}
	logits := matmul(h, head, T)
	rec("logits", i64(T, e.V), logits)
	last := logits[(T-1)*e.V:]
	rec("next_logits", i64(e.V), last)
	return last
}

func main() {
	model := flag.String("model", "", "HF model directory (config.json + model.safetensors)")
	tokensArg := flag.String("tokens", "", "prompt token ids, comma separated")
	decode := flag.Int("decode", 0, "greedy decode steps after the prompt")
	out := flag.String("out", "", "the llm-dump/1 file to write")
	bug := flag.String("bug", "", "switch on a classic porting bug: rope-interleaved")
	flag.Parse()
	if *model == "" || *tokensArg == "" || *out == "" {
		die("usage: tinyllama -model DIR -tokens 1,2,3 [-decode N] -out DUMP [-bug rope-interleaved]")
	}
	if *bug != "" && *bug != "rope-interleaved" {
		die("unknown bug %s", *bug)
	}
	e := newEngine(*model)
	e.ropeBug = *bug == "rope-interleaved"
	var tokens []int64
	for _, s := range strings.Split(*tokensArg, ",") {
		t, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil {
			die("-tokens: %v", err)
		}
		tokens = append(tokens, t)
	}
	scenario := "prefill"
	if *decode > 0 {
		scenario = "decode"
	}
	dump, err := llmdump.Create(*out, llmdump.Manifest{Producer: "tinyllama (Go)", Model: filepath.Base(filepath.Clean(*model)),
		Config: e.configText, Scenario: scenario, DType: "float32", Steps: 1 + *decode})
	if err != nil {
		die("%v", err)
	}
	var generated []int64
	for step := 0; step <= *decode; step++ {
		logits := e.forward(tokens, step, dump)
		best := 0
		for i, v := range logits {
			if v > logits[best] {
				best = i
			}
		}
		generated = append(generated, int64(best))
		tokens = []int64{int64(best)}
	}
	if err := dump.AddI64("generated", []int64{int64(len(generated))}, generated); err != nil {
		die("%v", err)
	}
	if err := dump.Close(); err != nil {
		die("%v", err)
	}
	fmt.Printf("%s: %d forward calls, generated %v\n", *out, 1+*decode, generated)
}
