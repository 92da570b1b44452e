package llmdump

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// LLMDUMP_PAIRS: "golden,expected,golden,expected..." where expected is llmdiff's
// rewrite of golden (writers/tests/llmdump_rewrite.cpp); CTest sets it.

type entry struct {
	name, dtype string
	shape       []int64
	data        []byte
}

func readSafetensors(t *testing.T, path string) (map[string]string, []entry) {
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(raw[:8])
	hdr, data := raw[8:8+n], raw[8+n:]
	dec := json.NewDecoder(bytes.NewReader(hdr))
	if _, err := dec.Token(); err != nil { // {
		t.Fatal(err)
	}
	meta := map[string]string{}
	var out []entry
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		key := tok.(string)
		if key == "__metadata__" {
			if err := dec.Decode(&meta); err != nil {
				t.Fatal(err)
			}
			continue
		}
		var e struct {
			DType       string   `json:"dtype"`
			Shape       []int64  `json:"shape"`
			DataOffsets []uint64 `json:"data_offsets"`
		}
		if err := dec.Decode(&e); err != nil {
			t.Fatal(err)
		}
		out = append(out, entry{key, e.DType, e.Shape, data[e.DataOffsets[0]:e.DataOffsets[1]]})
	}
	return meta, out
}

func workDir(t *testing.T) string {
	if d := os.Getenv("LLMDUMP_WORK"); d != "" {
		os.MkdirAll(d, 0o755)
		d, err := os.MkdirTemp(d, "t")
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	return t.TempDir()
}

func TestGoldenByteIdentity(t *testing.T) {
	pairs := os.Getenv("LLMDUMP_PAIRS")
	if pairs == "" {
		t.Skip("LLMDUMP_PAIRS not set (run through CTest)")
	}
	p := strings.Split(pairs, ",")
	if len(p)%2 != 0 {
		t.Fatalf("LLMDUMP_PAIRS has an odd count: %q", pairs)
	}
	dir := workDir(t)
	std := map[string]bool{"format": true, "producer": true, "model": true, "config": true, "scenario": true, "dtype": true, "steps": true}
	for i := 0; i < len(p); i += 2 {
		meta, tensors := readSafetensors(t, p[i])
		steps, _ := strconv.Atoi(meta["steps"])
		m := Manifest{Producer: meta["producer"], Model: meta["model"], Config: meta["config"], Scenario: meta["scenario"],
			DType: meta["dtype"], Steps: steps, Extra: map[string]string{}}
		for k, v := range meta {
			if !std[k] {
				m.Extra[k] = v
			}
		}
		out := filepath.Join(dir, fmt.Sprintf("go%d.safetensors", i/2))
		w, err := Create(out, m)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range tensors {
			var dt DType
			switch e.dtype {
			case "F32":
				dt = F32
			case "F16":
				dt = F16
			case "BF16":
				dt = BF16
			case "I64":
				dt = I64
			default:
				t.Fatalf("%s: unsupported dtype %s", e.name, e.dtype)
			}
			if err := w.Add(e.name, dt, e.shape, e.data); err != nil {
				t.Fatal(err)
			}
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		got, _ := os.ReadFile(out)
		want, err := os.ReadFile(p[i+1])
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s: output %s (%d bytes) differs from llmdiff's rewrite %s (%d bytes)", p[i], out, len(got), p[i+1], len(want))
		} else {
			os.Remove(out)
		}
	}
}

func TestWidening(t *testing.T) {
	for h := 0; h < 65536; h++ {
		if got, want := math.Float32bits(BF16ToF32(uint16(h))), uint32(h)<<16; got != want {
			t.Fatalf("bf16 %#x: %#x != %#x", h, got, want)
		}
		f := F16ToF32(uint16(h))
		exp, mant := (h>>10)&0x1f, h&0x3ff
		var want float64
		switch {
		case exp == 0:
			want = float64(mant) * math.Pow(2, -24)
		case exp == 0x1f:
			want = math.NaN()
			if mant == 0 {
				want = math.Inf(1)
			}
		default:
			want = (1 + float64(mant)/1024) * math.Pow(2, float64(exp-15))
		}
		if h>>15 == 1 {
			want = -want
		}
		if math.IsNaN(want) {
			if u := math.Float32bits(f); u&0x7fffffff != 0x7f800000|uint32(mant)<<13 {
				t.Fatalf("f16 NaN %#x widened to %#x", h, u)
			}
		} else if float64(f) != want || math.Signbit(float64(f)) != (h>>15 == 1) {
			t.Fatalf("f16 %#x: %v != %v", h, f, want)
		}
	}
}

func TestHelpers(t *testing.T) {
	if s := LayerName(2, 7, "attn.q_rope"); s != "step2.layers.7.attn.q_rope" {
		t.Error(s)
	}
	if s := StepName(0, "logits"); s != "step0.logits" {
		t.Error(s)
	}
	if s := SeqName(1, "generated"); s != "seq1.generated" {
		t.Error(s)
	}
	src := make([]float32, 12)
	for i := range src {
		src[i] = float32(i)
	}
	got := HeadMajor(src, 2, 3, 2)
	want := []float32{0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("HeadMajor: %v", got)
	}
}

func TestEscapesAndHeader(t *testing.T) {
	dir := workDir(t)
	w, err := Create(filepath.Join(dir, "x.safetensors"), Manifest{Producer: "a\"b\\c\n\x01\x7f/é", Steps: 3,
		Extra: map[string]string{"dtype": "overridden", "AAA": "x"}})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Abort()
	w.AddF32("s", nil, []float32{1})
	want := `{"__metadata__":{"AAA":"x","config":"","dtype":"","format":"llm-dump/1","model":"","producer":"a\"b\\c\n\u0001` + "\x7f/é" + `","scenario":"","steps":"3"},"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}`
	got := strings.TrimRight(string(w.Header()), " ")
	if got != want {
		t.Errorf("header\n got %s\nwant %s", got, want)
	}
	if len(w.Header())%8 != 0 {
		t.Error("header not padded to 8 bytes")
	}
}

func TestMalformed(t *testing.T) {
	dir := workDir(t)
	path := filepath.Join(dir, "m.safetensors")
	w, err := Create(path, Manifest{})
	if err != nil {
		t.Fatal(err)
	}
	err = w.Add("x", F32, []int64{2, 3}, make([]byte, 20))
	if err == nil || !strings.Contains(err.Error(), "tensor 'x': byte count 20 does not match shape [2, 3] of F32 (expected 24)") {
		t.Errorf("unclear or missing error: %v", err)
	}
	if err := w.AddF32("y", []int64{2, 3}, make([]float32, 5)); err == nil || !strings.Contains(err.Error(), "5 values do not match shape [2, 3]") {
		t.Errorf("unclear or missing error: %v", err)
	}
	if err := w.AddF32("x", []int64{2, 3}, make([]float32, 6)); err != nil {
		t.Errorf("writer unusable after a rejected call: %v", err)
	}
	for _, bad := range []error{
		w.AddF32("x", []int64{1}, []float32{0}),
		w.Add("n", F32, []int64{-1}, nil),
		w.AddF32("__metadata__", []int64{1}, []float32{0}),
		w.AddF32("bad\xff", []int64{1}, []float32{0}),
	} {
		if bad == nil {
			t.Error("malformed call accepted")
		}
	}
	w.Abort()
	if _, err := os.Stat(path); err == nil {
		t.Error("aborted writer left a file")
	}
	if _, err := Create(path, Manifest{Extra: map[string]string{"k": "\xc0\xaf"}}); err == nil {
		t.Error("invalid UTF-8 accepted")
	}
}

func TestAtomic(t *testing.T) {
	if os.Getenv("LLMDUMP_CRASH_PATH") != "" { // child: die mid-way
		w, _ := Create(os.Getenv("LLMDUMP_CRASH_PATH"), Manifest{})
		w.AddF32("a", []int64{3}, []float32{1, 2, 3})
		os.Exit(3)
	}
	dir := workDir(t)
	path := filepath.Join(dir, "dump.safetensors")
	w, _ := Create(path, Manifest{})
	w.AddF32("a", []int64{3}, []float32{1, 2, 3})
	w.Abort()
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("abort left files: %v", ents)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestAtomic$")
	cmd.Env = append(os.Environ(), "LLMDUMP_CRASH_PATH="+path)
	if err := cmd.Run(); err == nil {
		t.Error("child did not fail")
	}
	if _, err := os.Stat(path); err == nil {
		t.Error("crashed writer left a file at the final path")
	}
	os.WriteFile(path, []byte("old"), 0o644)
	w, _ = Create(path, Manifest{})
	w.AddF32("a", []int64{3}, []float32{1, 2, 3})
	if b, _ := os.ReadFile(path); string(b) != "old" {
		t.Error("final path touched before Close")
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	meta, ts := readSafetensors(t, path)
	if meta["format"] != Format || len(ts) != 1 {
		t.Error("finished file unreadable")
	}
	if err := w.AddF32("late", nil, []float32{1}); err == nil {
		t.Error("add after Close accepted")
	}
}

// The batch helpers on a golden cache: left padding stripped back, a paged
// pool (scattered blocks, both layouts) gathered back.
func TestBatchHelpers(t *testing.T) {
	pairs := strings.Split(os.Getenv("LLMDUMP_PAIRS"), ",")
	if len(pairs) < 2 {
		t.Fatal("LLMDUMP_PAIRS is not set (CTest sets it)")
	}
	_, entries := readSafetensors(t, pairs[0])
	var kc entry
	for _, e := range entries {
		if strings.HasSuffix(e.name, ".layers.0.attn.k_cache") {
			kc = e
		}
	}
	H, S, Dh := int(kc.shape[0]), int(kc.shape[1]), int(kc.shape[2])
	want := make([]float32, H*S*Dh)
	for i := range want {
		want[i] = math.Float32frombits(binary.LittleEndian.Uint32(kc.data[4*i:]))
	}
	pad := 3
	padded := make([]float32, H*(S+pad)*Dh)
	for h := 0; h < H; h++ {
		copy(padded[(h*(S+pad)+pad)*Dh:], want[h*S*Dh:(h+1)*S*Dh])
	}
	if got := TakeRows(padded, H, S+pad, Dh, pad, S); !reflect.DeepEqual(got, want) {
		t.Errorf("TakeRows does not strip the left padding of %s", kc.name)
	}
	bs, blocks := 2, 9
	used := (S + bs - 1) / bs
	var table []int64
	for b := 0; b < used; b++ {
		table = append(table, int64((b*5+3)%blocks))
	}
	for _, slotMajor := range []bool{true, false} {
		pool := make([]float32, blocks*bs*H*Dh)
		for s := 0; s < S; s++ {
			for h := 0; h < H; h++ {
				b, slot := int(table[s/bs]), s%bs
				at := ((b*H+h)*bs + slot) * Dh
				if slotMajor {
					at = ((b*bs+slot)*H + h) * Dh
				}
				copy(pool[at:at+Dh], want[(h*S+s)*Dh:(h*S+s+1)*Dh])
			}
		}
		got, err := GatherPaged(pool, blocks, bs, H, Dh, slotMajor, table, S)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("GatherPaged (slotMajor %v) does not rebuild %s: %v", slotMajor, kc.name, err)
		}
		bad := append([]int64{int64(blocks)}, table[1:]...)
		if _, err := GatherPaged(pool, blocks, bs, H, Dh, slotMajor, bad, S); err == nil {
			t.Error("GatherPaged accepted a block outside the pool")
		}
		if _, err := GatherPaged(pool, blocks, bs, H, Dh, slotMajor, table[:used-1], S); err == nil {
			t.Error("GatherPaged accepted a table too short")
		}
	}
}

// The per-sequence helpers on HF's golden batch (batch.safetensors beside the
// first golden dump): each iteration's embed rows packed as a serving engine
// holds them (two padding rows after them) and split back; the iterations
// numbered from engine ids are HF's iter{N} tensors.
func TestPackedHelpers(t *testing.T) {
	pairs := strings.Split(os.Getenv("LLMDUMP_PAIRS"), ",")
	if len(pairs) < 2 {
		t.Fatal("LLMDUMP_PAIRS is not set (CTest sets it)")
	}
	_, entries := readSafetensors(t, filepath.Join(filepath.Dir(pairs[0]), "batch.safetensors"))
	golden := map[string]entry{}
	for _, e := range entries {
		golden[e.name] = e
	}
	ints := func(e entry) []int64 {
		out := make([]int64, len(e.data)/8)
		for i := range out {
			out[i] = int64(binary.LittleEndian.Uint64(e.data[8*i:]))
		}
		return out
	}
	path := filepath.Join(workDir(t), "iterations.safetensors")
	w, err := Create(path, Manifest{})
	if err != nil {
		t.Fatal(err)
	}
	var it Iterations
	N := 0
	for ; ; N++ {
		pre := fmt.Sprintf("iter%d.", N)
		e, ok := golden[pre+"seqs"]
		if !ok {
			break
		}
		seqs, steps, tokens := ints(e), ints(golden[pre+"seq_steps"]), ints(golden[pre+"num_tokens"])
		var packed []float32
		cu, ids := []int64{0}, []int64{}
		var want [][]float32
		D := 0
		for j := range seqs {
			emb := golden[fmt.Sprintf("seq%d.step%d.embed", seqs[j], steps[j])]
			D = int(emb.shape[1])
			rows := make([]float32, len(emb.data)/4)
			for i := range rows {
				rows[i] = math.Float32frombits(binary.LittleEndian.Uint32(emb.data[4*i:]))
			}
			want = append(want, rows)
			packed = append(packed, rows...)
			cu = append(cu, cu[len(cu)-1]+emb.shape[0])
			ids = append(ids, 1000-7*seqs[j])
		}
		packed = append(packed, make([]float32, 2*D)...)
		got, err := SplitRows(packed, D, cu)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("SplitRows does not give back %s's members: %v", pre, err)
		}
		members, err := it.Call(w, ids, tokens)
		if err != nil {
			t.Fatal(err)
		}
		for j, m := range members {
			if int64(m.Seq) != seqs[j] || int64(m.Step) != steps[j] {
				t.Errorf("%s member %d numbered %v, HF's is seq%d step %d", pre, j, m, seqs[j], steps[j])
			}
		}
	}
	if N < 2 {
		t.Fatalf("the golden batch has %d iterations", N)
	}
	for _, cu := range [][]int64{{1, 2, 3}, {0, 3, 2}, {0, 2, 9}} {
		if _, err := SplitRows(make([]float32, 8), 1, cu); err == nil {
			t.Errorf("SplitRows accepted cu_seqlens %v", cu)
		}
	}
	if _, err := it.Call(nil, []int64{5, 5}, []int64{1, 1}); err == nil {
		t.Error("Iterations accepted an id twice")
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	_, written := readSafetensors(t, path)
	if len(written) != 3*N {
		t.Fatalf("%d iteration tensors written, expected %d", len(written), 3*N)
	}
	for _, e := range written {
		if !reflect.DeepEqual(e.data, golden[e.name].data) || !reflect.DeepEqual(e.shape, golden[e.name].shape) {
			t.Errorf("written %s differs from the golden's", e.name)
		}
	}
}
