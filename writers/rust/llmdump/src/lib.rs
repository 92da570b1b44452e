//! Writer of llm-dump/1 files (llmdiff's docs/DUMP_FORMAT.md): a safetensors file of
//! canonical intermediates plus a manifest. Files are byte-identical to llmdiff's own
//! writer for the same tensors added in the same order and the same manifest.
//!
//! Tensor bytes go to a temporary data file as they are added; `finish` writes
//! header + data to `PATH.tmp.PID.N`, fsyncs it and renames it onto `PATH`. A writer
//! dropped unfinished removes its temporaries: nothing half-written appears under
//! `PATH`. Float tensors are stored as F32 (the spec's rule): F16/BF16 input is
//! widened exactly. Standard library only.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicUsize, Ordering};

pub const FORMAT: &str = "llm-dump/1";

/// Element type of the data handed to `add`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
    I64,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I64 => "I64",
        }
    }
    pub fn size(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::I64 => 8,
        }
    }
}

/// The spec's manifest; `extra` keys are written too (a standard key there is overridden).
#[derive(Clone, Debug, Default)]
pub struct Manifest {
    pub producer: String,
    pub model: String,
    pub config: String,
    pub scenario: String,
    pub dtype: String,
    pub steps: i32,
    pub extra: BTreeMap<String, String>,
}

/// A rejected call (bad name, duplicate, shape/data mismatch) or an I/O failure.
#[derive(Debug)]
pub struct Error {
    pub path: String,
    pub tensor: Option<String>,
    pub msg: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.tensor {
            Some(t) => write!(f, "llmdump: {}: tensor '{}': {}", self.path, t, self.msg),
            None => write!(f, "llmdump: {}: {}", self.path, self.msg),
        }
    }
}
impl std::error::Error for Error {}

struct Tensor {
    name: String,
    stored: DType,
    shape: Vec<i64>,
    begin: u64,
    end: u64,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Streams one dump to disk.
pub struct Writer {
    path: String,
    data_tmp: String,
    final_tmp: String,
    data: Option<BufWriter<File>>,
    offset: u64,
    tensors: Vec<Tensor>,
    names: HashSet<String>,
    meta: BTreeMap<String, String>, // byte order, as std::map<std::string, ...>
    finished: bool,
    broken: bool,
}

fn shape_str(shape: &[i64]) -> String {
    let s: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", s.join(", "))
}

/// JSON string as nlohmann::json::dump() writes it (UTF-8 kept, control characters escaped).
fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

impl Writer {
    /// Opens a writer for `path`.
    pub fn create(path: &str, m: &Manifest) -> Result<Writer, Error> {
        let mut meta = m.extra.clone();
        for (k, v) in [
            ("format", FORMAT.to_string()),
            ("producer", m.producer.clone()),
            ("model", m.model.clone()),
            ("config", m.config.clone()),
            ("scenario", m.scenario.clone()),
            ("dtype", m.dtype.clone()),
            ("steps", m.steps.to_string()),
        ] {
            meta.insert(k.to_string(), v);
        }
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let stem = format!("{}.tmp.{}.{}", path, std::process::id(), n);
        let data_tmp = format!("{}.data", stem);
        let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&data_tmp).map_err(|e| Error {
            path: path.to_string(),
            tensor: None,
            msg: format!("cannot create temporary file: {}", e),
        })?;
        Ok(Writer {
            path: path.to_string(),
            data_tmp,
            final_tmp: stem,
            data: Some(BufWriter::with_capacity(1 << 20, f)),
            offset: 0,
            tensors: Vec::new(),
            names: HashSet::new(),
            meta,
            finished: false,
            broken: false,
        })
    }

    fn fail(&self, name: &str, msg: String) -> Error {
        Error { path: self.path.clone(), tensor: Some(name.to_string()), msg }
    }

    /// Adds one tensor from raw little-endian bytes of `dtype`; `data.len()` must be
    /// product(shape) * dtype size. A rejected call leaves the writer usable.
    pub fn add(&mut self, name: &str, dtype: DType, shape: &[i64], data: &[u8]) -> Result<(), Error> {
        if self.finished {
            return Err(self.fail(name, "added after finish()".into()));
        }
        if self.broken || self.data.is_none() {
            return Err(self.fail(name, "added to a failed writer".into()));
        }
        if name.is_empty() || name == "__metadata__" {
            return Err(self.fail(name, "invalid tensor name".into()));
        }
        if self.names.contains(name) {
            return Err(self.fail(name, "duplicate tensor name".into()));
        }
        let mut count: u64 = 1;
        for &d in shape {
            if d < 0 {
                return Err(self.fail(name, format!("negative dimension in shape {}", shape_str(shape))));
            }
            count = match count.checked_mul(d as u64).filter(|c| c.checked_mul(8).is_some()) {
                Some(c) => c,
                None => return Err(self.fail(name, format!("shape {} overflows", shape_str(shape)))),
            };
        }
        let expected = count * dtype.size() as u64;
        if expected != data.len() as u64 {
            return Err(self.fail(
                name,
                format!(
                    "byte count {} does not match shape {} of {} (expected {})",
                    data.len(),
                    shape_str(shape),
                    dtype.name(),
                    expected
                ),
            ));
        }
        let stored = if dtype == DType::I64 { DType::I64 } else { DType::F32 };
        let out = self.data.as_mut().unwrap();
        let res = match dtype {
            DType::F32 | DType::I64 => out.write_all(data),
            DType::F16 | DType::BF16 => {
                let mut r = Ok(());
                for c in data.chunks_exact(2) {
                    let h = u16::from_le_bytes([c[0], c[1]]);
                    let f = if dtype == DType::BF16 { bf16_to_f32(h) } else { f16_to_f32(h) };
                    r = out.write_all(&f.to_le_bytes());
                    if r.is_err() {
                        break;
                    }
                }
                r
            }
        };
        if let Err(e) = res {
            self.broken = true;
            return Err(self.fail(name, format!("write failed: {}", e)));
        }
        let n = count * stored.size() as u64;
        self.tensors.push(Tensor { name: name.to_string(), stored, shape: shape.to_vec(), begin: self.offset, end: self.offset + n });
        self.names.insert(name.to_string());
        self.offset += n;
        Ok(())
    }

    fn check_count(&self, name: &str, dtype: DType, shape: &[i64], n: usize) -> Result<(), Error> {
        if shape.iter().any(|&d| d < 0) {
            return Ok(()); // add reports it
        }
        let c = shape.iter().fold(1u128, |a, &d| a * d as u128);
        if c != n as u128 {
            return Err(self.fail(name, format!("{} values do not match shape {} of {} (expected {})", n, shape_str(shape), dtype.name(), c)));
        }
        Ok(())
    }

    /// Adds a float32 tensor; `data.len()` must be product(shape).
    pub fn add_f32(&mut self, name: &str, shape: &[i64], data: &[f32]) -> Result<(), Error> {
        self.check_count(name, DType::F32, shape, data.len())?;
        let b: Vec<u8> = data.iter().flat_map(|f| f.to_le_bytes()).collect();
        self.add(name, DType::F32, shape, &b)
    }

    /// Adds an int64 tensor; `data.len()` must be product(shape).
    pub fn add_i64(&mut self, name: &str, shape: &[i64], data: &[i64]) -> Result<(), Error> {
        self.check_count(name, DType::I64, shape, data.len())?;
        let b: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add(name, DType::I64, shape, &b)
    }

    /// Adds F16 or BF16 bits (widened to F32); `bits.len()` must be product(shape).
    pub fn add_half(&mut self, name: &str, dtype: DType, shape: &[i64], bits: &[u16]) -> Result<(), Error> {
        if dtype != DType::F16 && dtype != DType::BF16 {
            return Err(self.fail(name, format!("add_half needs F16 or BF16, got {}", dtype.name())));
        }
        self.check_count(name, dtype, shape, bits.len())?;
        let b: Vec<u8> = bits.iter().flat_map(|h| h.to_le_bytes()).collect();
        self.add(name, dtype, shape, &b)
    }

    /// The header text (padded to 8 bytes) as llmdiff writes it.
    pub fn header(&self) -> String {
        let mut s = String::from("{");
        let mut first = true;
        if !self.meta.is_empty() {
            s.push_str("\"__metadata__\":{");
            for (i, (k, v)) in self.meta.iter().enumerate() {
                if i > 0 {
                    s.push(',');
                }
                json_string(&mut s, k);
                s.push(':');
                json_string(&mut s, v);
            }
            s.push('}');
            first = false;
        }
        for t in &self.tensors {
            if !first {
                s.push(',');
            }
            first = false;
            json_string(&mut s, &t.name);
            let dims: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
            s.push_str(&format!(
                ":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                t.stored.name(),
                dims.join(","),
                t.begin,
                t.end
            ));
        }
        s.push('}');
        while s.len() % 8 != 0 {
            s.push(' ');
        }
        s
    }

    fn write_final(&mut self) -> io::Result<()> {
        let header = self.header();
        let mut data = self.data.take().unwrap().into_inner().map_err(|e| e.into_error())?;
        let out = File::create(&self.final_tmp)?;
        let mut bw = BufWriter::with_capacity(1 << 20, out);
        bw.write_all(&(header.len() as u64).to_le_bytes())?;
        bw.write_all(header.as_bytes())?;
        data.seek(SeekFrom::Start(0))?;
        let copied = io::copy(&mut (&mut data).take(self.offset), &mut bw)?;
        if copied != self.offset {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "temporary data file is short"));
        }
        let out = bw.into_inner().map_err(|e| e.into_error())?;
        out.sync_all()?;
        drop(out);
        fs::rename(&self.final_tmp, &self.path)
    }

    /// Writes header and data, fsyncs and renames onto the final path.
    pub fn finish(&mut self) -> Result<(), Error> {
        if self.finished {
            return Ok(());
        }
        if self.broken || self.data.is_none() {
            return Err(Error { path: self.path.clone(), tensor: None, msg: "cannot finish a failed writer".into() });
        }
        if let Err(e) = self.write_final() {
            self.broken = true;
            let _ = fs::remove_file(&self.final_tmp);
            return Err(Error { path: self.path.clone(), tensor: None, msg: format!("cannot write: {}", e) });
        }
        let _ = fs::remove_file(&self.data_tmp);
        self.finished = true;
        Ok(())
    }
}

impl Drop for Writer {
    /// An unfinished writer leaves nothing behind.
    fn drop(&mut self) {
        self.data = None;
        if !self.finished {
            let _ = fs::remove_file(&self.final_tmp);
        }
        let _ = fs::remove_file(&self.data_tmp);
    }
}

/// "step{step}.{site}"
pub fn step_name(step: usize, site: &str) -> String {
    format!("step{}.{}", step, site)
}
/// "step{step}.layers.{layer}.{site}"
pub fn layer_name(step: usize, layer: usize, site: &str) -> String {
    format!("step{}.layers.{}.{}", step, layer, site)
}
/// "seq{seq}.{name}" (several-sequence dumps)
pub fn seq_name(seq: usize, name: &str) -> String {
    format!("seq{}.{}", seq, name)
}

/// [T, H, Dh] (e.g. [T, H*Dh]) -> [H, T, Dh].
pub fn head_major<T: Copy + Default>(src: &[T], t: usize, h: usize, dh: usize) -> Vec<T> {
    let mut dst = vec![T::default(); src.len()];
    for hh in 0..h {
        for tt in 0..t {
            dst[(hh * t + tt) * dh..(hh * t + tt + 1) * dh].copy_from_slice(&src[(tt * h + hh) * dh..(tt * h + hh + 1) * dh]);
        }
    }
    dst
}

/// One sequence of a padded batch without its padding: `src` is the
/// sequence's slice laid out as [outer, n, inner] with n padded token (or key)
/// rows (outer 1 for [Tpad, X], H for head-major [H, Tpad, Dh] and caches);
/// returns rows [first, first + count) of every outer block, [outer, count,
/// inner]. first = the left padding, 0 for right padding.
pub fn take_rows<T: Copy>(src: &[T], outer: usize, n: usize, inner: usize, first: usize, count: usize) -> Vec<T> {
    let mut dst = Vec::with_capacity(outer * count * inner);
    for o in 0..outer {
        dst.extend_from_slice(&src[(o * n + first) * inner..(o * n + first + count) * inner]);
    }
    dst
}

/// A packed batch (a serving engine's [rows, inner] tensor over every sequence
/// of one forward call) split per sequence by cu_seqlens [n + 1] (vLLM's
/// query_start_loc, FlashAttention's cu_seqlens_q): sequence i's rows are
/// [cu[i], cu[i+1]), slices of src. Rows from cu[n] on (padding) belong to
/// none. Err when cu_seqlens does not start at 0, decreases or ends past the rows.
pub fn split_rows<'a, T>(src: &'a [T], inner: usize, cu_seqlens: &[i64]) -> Result<Vec<&'a [T]>, String> {
    let rows = if inner > 0 { src.len() / inner } else { 0 };
    if cu_seqlens.first() != Some(&0) || *cu_seqlens.last().unwrap() > rows as i64 {
        return Err(format!("split_rows: cu_seqlens {:?} must start at 0 and end at most at the {} rows", cu_seqlens, rows));
    }
    let mut out = Vec::with_capacity(cu_seqlens.len() - 1);
    for (i, w) in cu_seqlens.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(format!("split_rows: cu_seqlens {:?} decreases at {}", cu_seqlens, i + 1));
        }
        out.push(&src[w[0] as usize * inner..w[1] as usize * inner]);
    }
    Ok(out)
}

/// Numbers a serving engine's forward calls as the format does
/// (docs/DUMP_FORMAT.md, "Several sequences"): each engine sequence id gets
/// b = 0, 1, ... in the order it first appears, each of its calls its own
/// step, each call an iteration N.
#[derive(Default)]
pub struct Iterations {
    index: BTreeMap<i64, usize>,
    steps: Vec<usize>,
    /// Forward calls so far.
    pub count: usize,
}

impl Iterations {
    pub fn new() -> Iterations {
        Iterations::default()
    }

    /// b of an engine sequence id already seen.
    pub fn seq(&self, id: i64) -> Option<usize> {
        self.index.get(&id).copied()
    }

    /// Numbers one forward call over the engine's sequence ids (row order) and
    /// their token counts: (b, step) of each; with a writer, adds
    /// iter{N}.seqs, iter{N}.seq_steps and iter{N}.num_tokens to it. Err when
    /// an id is there twice or the counts do not match the ids (nothing
    /// numbered), or when the writer refuses a tensor.
    pub fn call(&mut self, w: Option<&mut Writer>, seq_ids: &[i64], num_tokens: &[i64]) -> Result<Vec<(usize, usize)>, String> {
        if seq_ids.len() != num_tokens.len() {
            return Err(format!("Iterations: call {} has {} sequence ids but {} token counts", self.count, seq_ids.len(), num_tokens.len()));
        }
        for (j, id) in seq_ids.iter().enumerate() {
            if seq_ids[..j].contains(id) {
                return Err(format!("Iterations: call {} has sequence id {} twice", self.count, id));
            }
        }
        let mut members = Vec::with_capacity(seq_ids.len());
        for id in seq_ids {
            let b = match self.index.get(id) {
                Some(&b) => b,
                None => {
                    self.steps.push(0);
                    self.index.insert(*id, self.steps.len() - 1);
                    self.steps.len() - 1
                }
            };
            members.push((b, self.steps[b]));
            self.steps[b] += 1;
        }
        let n = self.count;
        self.count += 1;
        if let Some(w) = w {
            let shape = [seq_ids.len() as i64];
            let seqs: Vec<i64> = members.iter().map(|m| m.0 as i64).collect();
            let steps: Vec<i64> = members.iter().map(|m| m.1 as i64).collect();
            for (what, data) in [("seqs", &seqs[..]), ("seq_steps", &steps[..]), ("num_tokens", num_tokens)] {
                w.add_i64(&format!("iter{}.{}", n, what), &shape, data).map_err(|e| e.to_string())?;
            }
        }
        Ok(members)
    }
}

/// A paged KV pool as one sequence's logical cache [heads, length, dh]:
/// position s lives in block block_table[s / block_size], slot s % block_size.
/// The pool is [blocks, block_size, heads, dh] (slot_major) or
/// [blocks, heads, block_size, dh]. Err for a block id outside the pool or a
/// table too short for `length`.
#[allow(clippy::too_many_arguments)]
pub fn gather_paged(pool: &[f32], blocks: usize, block_size: usize, heads: usize, dh: usize, slot_major: bool,
                    block_table: &[i64], length: usize) -> Result<Vec<f32>, String> {
    if block_size == 0 || length > block_table.len() * block_size {
        return Err(format!("gather_paged: {} positions need more than {} blocks of {}", length, block_table.len(), block_size));
    }
    let mut dst = vec![0f32; heads * length * dh];
    for s in 0..length {
        let (b, slot) = (block_table[s / block_size], s % block_size);
        if b < 0 || b as usize >= blocks {
            return Err(format!("gather_paged: block {} is outside the pool of {}", b, blocks));
        }
        let b = b as usize;
        for h in 0..heads {
            let at = if slot_major { ((b * block_size + slot) * heads + h) * dh } else { ((b * heads + h) * block_size + slot) * dh };
            dst[(h * length + s) * dh..(h * length + s + 1) * dh].copy_from_slice(&pool[at..at + dh]);
        }
    }
    Ok(dst)
}

/// bfloat16 bits -> f32, exact.
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// IEEE half bits -> f32, exact (NaN payloads kept), as llmdiff converts.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let mut mant = (h & 0x3ff) as u32;
    let u = if exp == 0 {
        if mant == 0 {
            sign
        } else {
            let mut e: i32 = -1;
            loop {
                e += 1;
                mant <<= 1;
                if mant & 0x400 != 0 {
                    break;
                }
            }
            sign | ((127 - 15 - e) as u32) << 23 | (mant & 0x3ff) << 13
        }
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | mant << 13
    } else {
        sign | (exp + 112) << 23 | mant << 13
    };
    f32::from_bits(u)
}
