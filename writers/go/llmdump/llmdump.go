// Package llmdump writes llm-dump/1 files (docs/DUMP_FORMAT.md of llmdiff):
// a safetensors file of canonical intermediates plus a manifest. Files are
// byte-identical to llmdiff's own writer for the same tensors added in the
// same order and the same manifest.
//
// Tensor bytes go to a temporary data file as they are added; Close writes
// header + data to PATH.tmp.PID.N, fsyncs it and renames it onto PATH, so a
// half-written file never appears under PATH. Float tensors are stored as F32
// (the spec's rule): F16 and BF16 input is widened exactly. Standard library only.
package llmdump

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"unicode/utf8"
)

// Format is the manifest's format value.
const Format = "llm-dump/1"

// DType is the element type of the data handed to Add.
type DType int

const (
	F32  DType = iota // float32, stored as is
	F16               // IEEE half, widened to F32
	BF16              // bfloat16, widened to F32
	I64               // int64, stored as is
)

func (d DType) String() string {
	switch d {
	case F32:
		return "F32"
	case F16:
		return "F16"
	case BF16:
		return "BF16"
	case I64:
		return "I64"
	}
	return fmt.Sprintf("DType(%d)", int(d))
}

func (d DType) size() int {
	switch d {
	case F16, BF16:
		return 2
	case F32:
		return 4
	}
	return 8
}

// Manifest holds the spec's manifest keys; Extra keys are written too (a
// standard key in Extra is overridden by the field).
type Manifest struct {
	Producer, Model, Config, Scenario, DType string
	Steps                                    int
	Extra                                    map[string]string
}

type tensor struct {
	name       string
	stored     DType
	shape      []int64
	begin, end uint64
}

// Writer streams one dump to disk. Create one with Create; finish with Close,
// or drop everything with Abort.
type Writer struct {
	path, dataTmp, finalTmp string
	data                    *os.File
	buf                     *bufio.Writer
	offset                  uint64
	tensors                 []tensor
	names                   map[string]bool
	metaKeys                []string
	meta                    map[string]string
	finished, broken        bool
}

var counter uint32

// Error is a rejected call (bad name, duplicate, shape/data mismatch) or an I/O failure.
type Error struct{ Path, Tensor, Msg string }

func (e *Error) Error() string {
	if e.Tensor != "" {
		return fmt.Sprintf("llmdump: %s: tensor '%s': %s", e.Path, e.Tensor, e.Msg)
	}
	return fmt.Sprintf("llmdump: %s: %s", e.Path, e.Msg)
}

// Create opens a writer for path.
func Create(path string, m Manifest) (*Writer, error) {
	meta := map[string]string{}
	for k, v := range m.Extra {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return nil, &Error{Path: path, Msg: "metadata key or value is not valid UTF-8"}
		}
		meta[k] = v
	}
	std := [][2]string{{"format", Format}, {"producer", m.Producer}, {"model", m.Model}, {"config", m.Config},
		{"scenario", m.Scenario}, {"dtype", m.DType}, {"steps", strconv.Itoa(m.Steps)}}
	for _, kv := range std {
		if !utf8.ValidString(kv[1]) {
			return nil, &Error{Path: path, Msg: "manifest '" + kv[0] + "' is not valid UTF-8"}
		}
		meta[kv[0]] = kv[1]
	}
	w := &Writer{path: path, names: map[string]bool{}, meta: meta}
	for k := range meta {
		w.metaKeys = append(w.metaKeys, k)
	}
	sort.Strings(w.metaKeys) // byte order, as std::map<std::string, ...>
	n := atomic.AddUint32(&counter, 1) - 1
	stem := fmt.Sprintf("%s.tmp.%d.%d", path, os.Getpid(), n)
	w.dataTmp, w.finalTmp = stem+".data", stem
	f, err := os.OpenFile(w.dataTmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, &Error{Path: path, Msg: "cannot create temporary file: " + err.Error()}
	}
	w.data = f
	w.buf = bufio.NewWriterSize(f, 1<<20)
	return w, nil
}

func shapeStr(shape []int64) string {
	s := make([]string, len(shape))
	for i, d := range shape {
		s[i] = strconv.FormatInt(d, 10)
	}
	return "[" + strings.Join(s, ", ") + "]"
}

// Add adds one tensor from raw little-endian bytes of dtype; len(data) must be
// product(shape) * size of dtype. A rejected call leaves the writer usable.
func (w *Writer) Add(name string, dtype DType, shape []int64, data []byte) error {
	fail := func(msg string) error { return &Error{Path: w.path, Tensor: name, Msg: msg} }
	if w.finished {
		return fail("added after Close")
	}
	if w.broken || w.data == nil {
		return fail("added to an aborted or failed writer")
	}
	if name == "" || name == "__metadata__" || !utf8.ValidString(name) {
		return fail("invalid tensor name")
	}
	if w.names[name] {
		return fail("duplicate tensor name")
	}
	if dtype < F32 || dtype > I64 {
		return fail(fmt.Sprintf("unknown dtype %d", int(dtype)))
	}
	count := uint64(1)
	for _, d := range shape {
		if d < 0 {
			return fail("negative dimension in shape " + shapeStr(shape))
		}
		if d != 0 && count > math.MaxUint64/8/uint64(d) {
			return fail("shape " + shapeStr(shape) + " overflows")
		}
		count *= uint64(d)
	}
	if expected := count * uint64(dtype.size()); expected != uint64(len(data)) {
		return fail(fmt.Sprintf("byte count %d does not match shape %s of %s (expected %d)",
			len(data), shapeStr(shape), dtype, expected))
	}
	stored := F32
	if dtype == I64 {
		stored = I64
	}
	var err error
	switch dtype {
	case F32, I64:
		_, err = w.buf.Write(data)
	default:
		var out [4]byte
		for i := 0; i+1 < len(data) && err == nil; i += 2 {
			h := uint16(data[i]) | uint16(data[i+1])<<8
			var f float32
			if dtype == BF16 {
				f = BF16ToF32(h)
			} else {
				f = F16ToF32(h)
			}
			u := math.Float32bits(f)
			out[0], out[1], out[2], out[3] = byte(u), byte(u>>8), byte(u>>16), byte(u>>24)
			_, err = w.buf.Write(out[:])
		}
	}
	if err != nil {
		w.broken = true
		return fail("write failed: " + err.Error())
	}
	n := count * uint64(stored.size())
	w.tensors = append(w.tensors, tensor{name, stored, append([]int64(nil), shape...), w.offset, w.offset + n})
	w.names[name] = true
	w.offset += n
	return nil
}

func checkCount(shape []int64, n int) (bool, uint64) {
	c := uint64(1)
	for _, d := range shape {
		if d < 0 {
			return true, 0 // let Add report it
		}
		c *= uint64(d)
	}
	return c == uint64(n), c
}

// AddF32 adds a float32 tensor; len(data) must be product(shape).
func (w *Writer) AddF32(name string, shape []int64, data []float32) error {
	if ok, c := checkCount(shape, len(data)); !ok {
		return &Error{Path: w.path, Tensor: name, Msg: fmt.Sprintf("%d values do not match shape %s of F32 (expected %d)", len(data), shapeStr(shape), c)}
	}
	b := make([]byte, 4*len(data))
	for i, f := range data {
		u := math.Float32bits(f)
		b[4*i], b[4*i+1], b[4*i+2], b[4*i+3] = byte(u), byte(u>>8), byte(u>>16), byte(u>>24)
	}
	return w.Add(name, F32, shape, b)
}

// AddI64 adds an int64 tensor; len(data) must be product(shape).
func (w *Writer) AddI64(name string, shape []int64, data []int64) error {
	if ok, c := checkCount(shape, len(data)); !ok {
		return &Error{Path: w.path, Tensor: name, Msg: fmt.Sprintf("%d values do not match shape %s of I64 (expected %d)", len(data), shapeStr(shape), c)}
	}
	b := make([]byte, 8*len(data))
	for i, v := range data {
		u := uint64(v)
		for k := 0; k < 8; k++ {
			b[8*i+k] = byte(u >> (8 * k))
		}
	}
	return w.Add(name, I64, shape, b)
}

// AddHalf adds F16 or BF16 bits (widened to F32); len(bits) must be product(shape).
func (w *Writer) AddHalf(name string, dtype DType, shape []int64, bits []uint16) error {
	if dtype != F16 && dtype != BF16 {
		return &Error{Path: w.path, Tensor: name, Msg: "AddHalf needs F16 or BF16, got " + dtype.String()}
	}
	if ok, c := checkCount(shape, len(bits)); !ok {
		return &Error{Path: w.path, Tensor: name, Msg: fmt.Sprintf("%d values do not match shape %s of %s (expected %d)", len(bits), shapeStr(shape), dtype, c)}
	}
	b := make([]byte, 2*len(bits))
	for i, h := range bits {
		b[2*i], b[2*i+1] = byte(h), byte(h>>8)
	}
	return w.Add(name, dtype, shape, b)
}

// jsonString writes s as nlohmann::json::dump() does (UTF-8 kept, control characters escaped).
func jsonString(sb *strings.Builder, s string) {
	sb.WriteByte('"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch c {
		case '"':
			sb.WriteString(`\"`)
		case '\\':
			sb.WriteString(`\\`)
		case '\b':
			sb.WriteString(`\b`)
		case '\f':
			sb.WriteString(`\f`)
		case '\n':
			sb.WriteString(`\n`)
		case '\r':
			sb.WriteString(`\r`)
		case '\t':
			sb.WriteString(`\t`)
		default:
			if c < 0x20 {
				fmt.Fprintf(sb, `\u%04x`, c)
			} else {
				sb.WriteByte(c)
			}
		}
	}
	sb.WriteByte('"')
}

// Header returns the header text (padded to 8 bytes) as llmdiff writes it.
func (w *Writer) Header() []byte {
	var sb strings.Builder
	sb.WriteByte('{')
	first := true
	if len(w.metaKeys) > 0 {
		sb.WriteString(`"__metadata__":{`)
		for i, k := range w.metaKeys {
			if i > 0 {
				sb.WriteByte(',')
			}
			jsonString(&sb, k)
			sb.WriteByte(':')
			jsonString(&sb, w.meta[k])
		}
		sb.WriteByte('}')
		first = false
	}
	for _, t := range w.tensors {
		if !first {
			sb.WriteByte(',')
		}
		first = false
		jsonString(&sb, t.name)
		sb.WriteString(`:{"dtype":"` + t.stored.String() + `","shape":[`)
		for i, d := range t.shape {
			if i > 0 {
				sb.WriteByte(',')
			}
			sb.WriteString(strconv.FormatInt(d, 10))
		}
		fmt.Fprintf(&sb, `],"data_offsets":[%d,%d]}`, t.begin, t.end)
	}
	sb.WriteByte('}')
	for sb.Len()%8 != 0 {
		sb.WriteByte(' ')
	}
	return []byte(sb.String())
}

// Close writes header and data, fsyncs and renames onto the final path.
func (w *Writer) Close() error {
	if w.finished {
		return nil
	}
	if w.broken || w.data == nil {
		return &Error{Path: w.path, Msg: "cannot finish an aborted or failed writer"}
	}
	ioErr := func(err error) error {
		os.Remove(w.finalTmp)
		return &Error{Path: w.path, Msg: "cannot write: " + err.Error()}
	}
	if err := w.buf.Flush(); err != nil {
		return ioErr(err)
	}
	header := w.Header()
	out, err := os.OpenFile(w.finalTmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return &Error{Path: w.path, Msg: "cannot create a temporary file: " + err.Error()}
	}
	var n [8]byte
	for i := range n {
		n[i] = byte(uint64(len(header)) >> (8 * i))
	}
	bw := bufio.NewWriterSize(out, 1<<20)
	_, err = bw.Write(n[:])
	if err == nil {
		_, err = bw.Write(header)
	}
	if err == nil {
		_, err = w.data.Seek(0, io.SeekStart)
	}
	if err == nil {
		var copied int64
		copied, err = io.CopyN(bw, w.data, int64(w.offset))
		if err == nil && uint64(copied) != w.offset {
			err = io.ErrUnexpectedEOF
		}
	}
	if err == nil {
		err = bw.Flush()
	}
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return ioErr(err)
	}
	if err := os.Rename(w.finalTmp, w.path); err != nil {
		os.Remove(w.finalTmp)
		return &Error{Path: w.path, Msg: "cannot rename the temporary file into place: " + err.Error()}
	}
	w.data.Close()
	w.data = nil
	os.Remove(w.dataTmp)
	w.finished = true
	return nil
}

// Abort drops everything written so far; nothing appears at the final path.
func (w *Writer) Abort() {
	if w.finished {
		return
	}
	if w.data != nil {
		w.data.Close()
		w.data = nil
	}
	os.Remove(w.dataTmp)
	os.Remove(w.finalTmp)
}

// StepName is "step{step}.{site}".
func StepName(step int, site string) string { return fmt.Sprintf("step%d.%s", step, site) }

// LayerName is "step{step}.layers.{layer}.{site}".
func LayerName(step, layer int, site string) string {
	return fmt.Sprintf("step%d.layers.%d.%s", step, layer, site)
}

// SeqName is "seq{seq}.{name}" (several-sequence dumps).
func SeqName(seq int, name string) string { return fmt.Sprintf("seq%d.%s", seq, name) }

// HeadMajor turns [T, H, Dh] (e.g. [T, H*Dh]) into [H, T, Dh].
func HeadMajor(src []float32, T, H, Dh int) []float32 {
	dst := make([]float32, len(src))
	for h := 0; h < H; h++ {
		for t := 0; t < T; t++ {
			copy(dst[(h*T+t)*Dh:(h*T+t+1)*Dh], src[(t*H+h)*Dh:(t*H+h+1)*Dh])
		}
	}
	return dst
}

// TakeRows strips one sequence's padding: src is the sequence's slice of a
// batched tensor laid out as [outer, n, inner] with n padded token (or key)
// rows (outer 1 for [Tpad, X], H for head-major [H, Tpad, Dh] and caches); the
// result is rows [first, first+count) of every outer block, [outer, count,
// inner]. first = the left padding, or 0 for right padding.
func TakeRows(src []float32, outer, n, inner, first, count int) []float32 {
	dst := make([]float32, outer*count*inner)
	for o := 0; o < outer; o++ {
		copy(dst[o*count*inner:(o+1)*count*inner], src[(o*n+first)*inner:(o*n+first+count)*inner])
	}
	return dst
}

// SplitRows splits a packed batch (a serving engine's [rows, inner] tensor over
// every sequence of one forward call) per sequence by cuSeqlens [n+1] (vLLM's
// query_start_loc, FlashAttention's cu_seqlens_q): sequence i's rows are
// [cu[i], cu[i+1]), views of src. Rows from cu[n] on (padding) belong to none.
// An error when cuSeqlens does not start at 0, decreases or ends past the rows.
func SplitRows[T any](src []T, inner int, cuSeqlens []int64) ([][]T, error) {
	rows := 0
	if inner > 0 {
		rows = len(src) / inner
	}
	if len(cuSeqlens) == 0 || cuSeqlens[0] != 0 || cuSeqlens[len(cuSeqlens)-1] > int64(rows) {
		return nil, fmt.Errorf("llmdump: SplitRows: cu_seqlens %v must start at 0 and end at most at the %d rows",
			cuSeqlens, rows)
	}
	out := make([][]T, 0, len(cuSeqlens)-1)
	for i := 0; i+1 < len(cuSeqlens); i++ {
		a, b := int(cuSeqlens[i]), int(cuSeqlens[i+1])
		if b < a {
			return nil, fmt.Errorf("llmdump: SplitRows: cu_seqlens %v decreases at %d", cuSeqlens, i+1)
		}
		out = append(out, src[a*inner:b*inner])
	}
	return out, nil
}

// Member is one sequence of an engine forward call: its number b in the dump
// (seq{b}.) and its step there (step{n}.).
type Member struct{ Seq, Step int }

// Iterations numbers a serving engine's forward calls as the format does
// (docs/DUMP_FORMAT.md, "Several sequences"): each engine sequence id gets
// b = 0, 1, ... in the order it first appears, each of its calls its own step,
// each call an iteration N. The zero value is ready to use.
type Iterations struct {
	index map[int64]int
	steps []int
	Count int // forward calls so far
}

// Seq is b of an engine sequence id already seen.
func (it *Iterations) Seq(id int64) (int, bool) {
	b, ok := it.index[id]
	return b, ok
}

// Call numbers one forward call over the engine's sequence ids (row order) and
// their token counts, and, when w is not nil, adds iter{N}.seqs,
// iter{N}.seq_steps and iter{N}.num_tokens to it. An error when an id is there
// twice or the counts do not match the ids (nothing numbered), or when w
// refuses a tensor.
func (it *Iterations) Call(w *Writer, seqIDs, numTokens []int64) ([]Member, error) {
	if len(seqIDs) != len(numTokens) {
		return nil, fmt.Errorf("llmdump: Iterations: call %d has %d sequence ids but %d token counts", it.Count,
			len(seqIDs), len(numTokens))
	}
	seen := map[int64]bool{}
	for _, id := range seqIDs {
		if seen[id] {
			return nil, fmt.Errorf("llmdump: Iterations: call %d has sequence id %d twice", it.Count, id)
		}
		seen[id] = true
	}
	if it.index == nil {
		it.index = map[int64]int{}
	}
	members := make([]Member, len(seqIDs))
	seqs, steps := make([]int64, len(seqIDs)), make([]int64, len(seqIDs))
	for j, id := range seqIDs {
		b, ok := it.index[id]
		if !ok {
			b = len(it.steps)
			it.index[id] = b
			it.steps = append(it.steps, 0)
		}
		members[j] = Member{b, it.steps[b]}
		seqs[j], steps[j] = int64(b), int64(it.steps[b])
		it.steps[b]++
	}
	n := it.Count
	it.Count++
	if w != nil {
		shape := []int64{int64(len(seqIDs))}
		for _, t := range []struct {
			name string
			data []int64
		}{{"seqs", seqs}, {"seq_steps", steps}, {"num_tokens", numTokens}} {
			if err := w.AddI64(fmt.Sprintf("iter%d.%s", n, t.name), shape, t.data); err != nil {
				return members, err
			}
		}
	}
	return members, nil
}

// GatherPaged turns a paged KV pool into one sequence's logical cache
// [heads, length, dh]: position s lives in block blockTable[s/blockSize], slot
// s%blockSize. The pool is [blocks, blockSize, heads, dh] (slotMajor) or
// [blocks, heads, blockSize, dh]. An error for a block id outside the pool or
// a table too short for length.
func GatherPaged(pool []float32, blocks, blockSize, heads, dh int, slotMajor bool, blockTable []int64,
	length int) ([]float32, error) {
	if blockSize <= 0 || length > len(blockTable)*blockSize {
		return nil, fmt.Errorf("llmdump: GatherPaged: %d positions need more than %d blocks of %d", length,
			len(blockTable), blockSize)
	}
	dst := make([]float32, heads*length*dh)
	for s := 0; s < length; s++ {
		b, slot := int(blockTable[s/blockSize]), s%blockSize
		if b < 0 || b >= blocks {
			return nil, fmt.Errorf("llmdump: GatherPaged: block %d is outside the pool of %d", b, blocks)
		}
		for h := 0; h < heads; h++ {
			at := ((b*heads+h)*blockSize + slot) * dh
			if slotMajor {
				at = ((b*blockSize+slot)*heads + h) * dh
			}
			copy(dst[(h*length+s)*dh:(h*length+s+1)*dh], pool[at:at+dh])
		}
	}
	return dst, nil
}

// BF16ToF32 widens bfloat16 bits exactly.
func BF16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// F16ToF32 widens IEEE half bits exactly (NaN payloads kept), as llmdiff does.
func F16ToF32(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp, mant := uint32(h>>10)&0x1f, uint32(h)&0x3ff
	var u uint32
	switch {
	case exp == 0 && mant == 0:
		u = sign
	case exp == 0:
		e := -1
		for {
			e++
			mant <<= 1
			if mant&0x400 != 0 {
				break
			}
		}
		u = sign | uint32(127-15-e)<<23 | (mant&0x3ff)<<13
	case exp == 0x1f:
		u = sign | 0x7f800000 | mant<<13
	default:
		u = sign | (exp+112)<<23 | mant<<13
	}
	return math.Float32frombits(u)
}
