// Byte identity with llmdiff's writer on golden dumps (LLMDUMP_PAIRS =
// "golden,expected,..." set by CTest; expected = writers/tests/llmdump_rewrite.cpp's
// output), widening, helpers, atomicity, malformed calls.
use llmdump::*;
use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;

// A minimal JSON reader for safetensors headers (objects keep their order).
#[derive(Debug)]
enum J {
    S(String),
    N(u64),
    A(Vec<J>),
    O(Vec<(String, J)>),
}
struct P<'a> {
    b: &'a [u8],
    i: usize,
}
impl<'a> P<'a> {
    fn ws(&mut self) {
        while self.i < self.b.len() && (self.b[self.i] as char).is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn hex4(&mut self) -> u32 {
        let s = std::str::from_utf8(&self.b[self.i..self.i + 4]).unwrap();
        self.i += 4;
        u32::from_str_radix(s, 16).unwrap()
    }
    fn string(&mut self) -> String {
        self.i += 1; // "
        let mut out: Vec<u8> = Vec::new();
        loop {
            let c = self.b[self.i];
            self.i += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let e = self.b[self.i];
                    self.i += 1;
                    let ch = match e {
                        b'n' => '\n',
                        b't' => '\t',
                        b'r' => '\r',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'u' => {
                            let mut u = self.hex4();
                            if (0xd800..0xdc00).contains(&u) {
                                self.i += 2;
                                let lo = self.hex4();
                                u = 0x10000 + ((u - 0xd800) << 10) + (lo - 0xdc00);
                            }
                            char::from_u32(u).unwrap()
                        }
                        other => other as char,
                    };
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
                _ => out.push(c),
            }
        }
        String::from_utf8(out).unwrap()
    }
    fn value(&mut self) -> J {
        self.ws();
        match self.b[self.i] {
            b'"' => J::S(self.string()),
            b'[' => {
                self.i += 1;
                let mut v = Vec::new();
                loop {
                    self.ws();
                    if self.b[self.i] == b']' {
                        self.i += 1;
                        break;
                    }
                    v.push(self.value());
                    self.ws();
                    if self.b[self.i] == b',' {
                        self.i += 1;
                    }
                }
                J::A(v)
            }
            b'{' => {
                self.i += 1;
                let mut v = Vec::new();
                loop {
                    self.ws();
                    if self.b[self.i] == b'}' {
                        self.i += 1;
                        break;
                    }
                    let k = self.string();
                    self.ws();
                    self.i += 1; // :
                    let val = self.value();
                    v.push((k, val));
                    self.ws();
                    if self.b[self.i] == b',' {
                        self.i += 1;
                    }
                }
                J::O(v)
            }
            _ => {
                let s = self.i;
                while self.i < self.b.len() && self.b[self.i].is_ascii_digit() {
                    self.i += 1;
                }
                J::N(std::str::from_utf8(&self.b[s..self.i]).unwrap().parse().unwrap())
            }
        }
    }
}

struct Entry {
    name: String,
    dtype: String,
    shape: Vec<i64>,
    data: Vec<u8>,
}

fn read_safetensors(path: &str) -> (BTreeMap<String, String>, Vec<Entry>) {
    let raw = fs::read(path).unwrap();
    let n = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
    let data = &raw[8 + n..];
    let mut p = P { b: &raw[8..8 + n], i: 0 };
    let mut meta = BTreeMap::new();
    let mut out = Vec::new();
    if let J::O(items) = p.value() {
        for (k, v) in items {
            let fields = match v {
                J::O(f) => f,
                _ => panic!("bad entry"),
            };
            if k == "__metadata__" {
                for (mk, mv) in fields {
                    if let J::S(s) = mv {
                        meta.insert(mk, s);
                    }
                }
                continue;
            }
            let (mut dtype, mut shape, mut off) = (String::new(), vec![], (0usize, 0usize));
            for (fk, fv) in fields {
                match (fk.as_str(), fv) {
                    ("dtype", J::S(s)) => dtype = s,
                    ("shape", J::A(a)) => shape = a.iter().map(|x| if let J::N(n) = x { *n as i64 } else { panic!() }).collect(),
                    ("data_offsets", J::A(a)) => {
                        if let (J::N(b), J::N(e)) = (&a[0], &a[1]) {
                            off = (*b as usize, *e as usize)
                        }
                    }
                    _ => {}
                }
            }
            out.push(Entry { name: k, dtype, shape, data: data[off.0..off.1].to_vec() });
        }
    }
    (meta, out)
}

fn work_dir(tag: &str) -> PathBuf {
    let base = std::env::var("LLMDUMP_WORK").map(PathBuf::from).unwrap_or_else(|_| std::env::temp_dir().join("llmdump-rust-test"));
    let d = base.join(format!("{}-{}", tag, std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn golden_byte_identity() {
    let pairs = match std::env::var("LLMDUMP_PAIRS") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            eprintln!("LLMDUMP_PAIRS not set (run through CTest): skipped");
            return;
        }
    };
    let p: Vec<&str> = pairs.split(',').collect();
    assert!(p.len() % 2 == 0, "LLMDUMP_PAIRS has an odd count");
    let dir = work_dir("golden");
    for (i, pair) in p.chunks(2).enumerate() {
        let (meta, tensors) = read_safetensors(pair[0]);
        let std_keys = ["format", "producer", "model", "config", "scenario", "dtype", "steps"];
        let get = |k: &str| meta.get(k).cloned().unwrap_or_default();
        let m = Manifest {
            producer: get("producer"),
            model: get("model"),
            config: get("config"),
            scenario: get("scenario"),
            dtype: get("dtype"),
            steps: get("steps").parse().unwrap_or(0),
            extra: meta.iter().filter(|(k, _)| !std_keys.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect(),
        };
        let out = dir.join(format!("rust{}.safetensors", i));
        let mut w = Writer::create(out.to_str().unwrap(), &m).unwrap();
        for e in &tensors {
            let dt = match e.dtype.as_str() {
                "F32" => DType::F32,
                "F16" => DType::F16,
                "BF16" => DType::BF16,
                "I64" => DType::I64,
                d => panic!("{}: unsupported dtype {}", e.name, d),
            };
            w.add(&e.name, dt, &e.shape, &e.data).unwrap();
        }
        w.finish().unwrap();
        let got = fs::read(&out).unwrap();
        let want = fs::read(pair[1]).unwrap();
        assert!(got == want, "{}: output {:?} ({} bytes) differs from llmdiff's rewrite {} ({} bytes)", pair[0], out, got.len(), pair[1], want.len());
    }
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn widening() {
    for h in 0..=u16::MAX {
        assert_eq!(bf16_to_f32(h).to_bits(), (h as u32) << 16);
        let f = f16_to_f32(h);
        let (exp, mant) = ((h >> 10) & 0x1f, (h & 0x3ff) as u32);
        let neg = h >> 15 == 1;
        if exp == 0x1f {
            assert_eq!(f.to_bits() & 0x7fff_ffff, 0x7f80_0000 | mant << 13, "f16 {:#x}", h);
        } else {
            let mag = if exp == 0 { mant as f64 * 2f64.powi(-24) } else { (1.0 + mant as f64 / 1024.0) * 2f64.powi(exp as i32 - 15) };
            assert_eq!(f as f64, if neg { -mag } else { mag }, "f16 {:#x}", h);
            assert_eq!(f.is_sign_negative(), neg);
        }
    }
}

#[test]
fn helpers_and_header() {
    assert_eq!(layer_name(2, 7, "attn.q_rope"), "step2.layers.7.attn.q_rope");
    assert_eq!(step_name(0, "logits"), "step0.logits");
    assert_eq!(seq_name(1, "generated"), "seq1.generated");
    let src: Vec<f32> = (0..12).map(|i| i as f32).collect();
    assert_eq!(head_major(&src, 2, 3, 2), vec![0., 1., 6., 7., 2., 3., 8., 9., 4., 5., 10., 11.]);
    let dir = work_dir("header");
    let mut extra = BTreeMap::new();
    extra.insert("dtype".to_string(), "overridden".to_string());
    extra.insert("AAA".to_string(), "x".to_string());
    let m = Manifest { producer: "a\"b\\c\n\u{1}\u{7f}/é".into(), steps: 3, extra, ..Default::default() };
    let mut w = Writer::create(dir.join("x.safetensors").to_str().unwrap(), &m).unwrap();
    w.add_f32("s", &[], &[1.0]).unwrap();
    let want = "{\"__metadata__\":{\"AAA\":\"x\",\"config\":\"\",\"dtype\":\"\",\"format\":\"llm-dump/1\",\"model\":\"\",\"producer\":\"a\\\"b\\\\c\\n\\u0001\u{7f}/é\",\"scenario\":\"\",\"steps\":\"3\"},\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}";
    assert_eq!(w.header().trim_end(), want);
    assert_eq!(w.header().len() % 8, 0);
}

#[test]
fn malformed() {
    let dir = work_dir("malformed");
    let path = dir.join("m.safetensors");
    let mut w = Writer::create(path.to_str().unwrap(), &Manifest::default()).unwrap();
    let e = w.add("x", DType::F32, &[2, 3], &[0u8; 20]).unwrap_err().to_string();
    assert!(e.contains("tensor 'x': byte count 20 does not match shape [2, 3] of F32 (expected 24)"), "{}", e);
    let e = w.add_f32("y", &[2, 3], &[0.0; 5]).unwrap_err().to_string();
    assert!(e.contains("5 values do not match shape [2, 3]"), "{}", e);
    w.add_f32("x", &[2, 3], &[0.0; 6]).expect("writer unusable after a rejected call");
    assert!(w.add_f32("x", &[1], &[0.0]).unwrap_err().to_string().contains("duplicate"));
    assert!(w.add("n", DType::F32, &[-1], &[]).is_err());
    assert!(w.add_f32("__metadata__", &[1], &[0.0]).is_err());
    drop(w);
    assert!(!path.exists(), "dropped writer left a file");
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 0, "dropped writer left temporaries");
}

#[test]
fn atomic() {
    if let Ok(p) = std::env::var("LLMDUMP_CRASH_PATH") {
        let mut w = Writer::create(&p, &Manifest::default()).unwrap();
        w.add_f32("a", &[3], &[1.0, 2.0, 3.0]).unwrap();
        std::process::abort();
    }
    let dir = work_dir("atomic");
    let path = dir.join("dump.safetensors");
    let ps = path.to_str().unwrap();
    // A panic mid-way (the writer is dropped while unwinding) leaves nothing.
    let r = std::panic::catch_unwind(|| {
        let mut w = Writer::create(ps, &Manifest::default()).unwrap();
        w.add_f32("a", &[3], &[1.0, 2.0, 3.0]).unwrap();
        panic!("engine crashed");
    });
    assert!(r.is_err());
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 0, "panic left files");
    // A process killed mid-way never leaves a file at the final path.
    let st = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "atomic", "--test-threads=1"])
        .env("LLMDUMP_CRASH_PATH", ps)
        .stderr(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!st.success());
    assert!(!path.exists(), "aborted writer left a file at the final path");
    fs::write(&path, "old").unwrap();
    let mut w = Writer::create(ps, &Manifest::default()).unwrap();
    w.add_f32("a", &[3], &[1.0, 2.0, 3.0]).unwrap();
    assert_eq!(fs::read(&path).unwrap(), b"old");
    w.finish().unwrap();
    let (meta, ts) = read_safetensors(ps);
    assert_eq!(meta["format"], FORMAT);
    assert_eq!(ts.len(), 1);
    assert!(w.add_f32("late", &[], &[1.0]).is_err());
}

// The batch helpers on a golden cache: left padding stripped back, a paged
// pool (scattered blocks, both layouts) gathered back.
#[test]
fn batch_helpers() {
    let pairs = match std::env::var("LLMDUMP_PAIRS") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            eprintln!("LLMDUMP_PAIRS not set (run through CTest): skipped");
            return;
        }
    };
    let golden = pairs.split(',').next().unwrap().to_string();
    let (_, tensors) = read_safetensors(&golden);
    let kc = tensors.iter().filter(|e| e.name.ends_with(".layers.0.attn.k_cache")).last().expect("a k_cache");
    let (h, s, dh) = (kc.shape[0] as usize, kc.shape[1] as usize, kc.shape[2] as usize);
    let want: Vec<f32> = kc.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(kc.dtype, "F32");
    let pad = 3;
    let mut padded = vec![-9f32; h * (s + pad) * dh];
    for hh in 0..h {
        padded[(hh * (s + pad) + pad) * dh..(hh * (s + pad) + pad + s) * dh].copy_from_slice(&want[hh * s * dh..(hh + 1) * s * dh]);
    }
    assert_eq!(take_rows(&padded, h, s + pad, dh, pad, s), want, "take_rows does not strip the left padding");
    let (bs, blocks) = (2usize, 9usize);
    let used = (s + bs - 1) / bs;
    let table: Vec<i64> = (0..used).map(|b| ((b * 5 + 3) % blocks) as i64).collect();
    for slot_major in [true, false] {
        let mut pool = vec![5f32; blocks * bs * h * dh];
        for p in 0..s {
            for hh in 0..h {
                let (b, slot) = (table[p / bs] as usize, p % bs);
                let at = if slot_major { ((b * bs + slot) * h + hh) * dh } else { ((b * h + hh) * bs + slot) * dh };
                pool[at..at + dh].copy_from_slice(&want[(hh * s + p) * dh..(hh * s + p + 1) * dh]);
            }
        }
        assert_eq!(gather_paged(&pool, blocks, bs, h, dh, slot_major, &table, s).unwrap(), want);
        let mut bad = table.clone();
        bad[0] = blocks as i64;
        assert!(gather_paged(&pool, blocks, bs, h, dh, slot_major, &bad, s).is_err());
        assert!(gather_paged(&pool, blocks, bs, h, dh, slot_major, &table[..used - 1], s).is_err());
    }
}

// The per-sequence helpers on HF's golden batch (batch.safetensors beside the
// first golden dump): each iteration's embed rows packed as a serving engine
// holds them (two padding rows after them) and split back; the iterations
// numbered from engine ids are HF's iter{N} tensors.
#[test]
fn packed_helpers() {
    let pairs = match std::env::var("LLMDUMP_PAIRS") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            eprintln!("LLMDUMP_PAIRS not set (run through CTest): skipped");
            return;
        }
    };
    let first = PathBuf::from(pairs.split(',').next().unwrap());
    let (_, tensors) = read_safetensors(first.with_file_name("batch.safetensors").to_str().unwrap());
    let golden: BTreeMap<String, &Entry> = tensors.iter().map(|e| (e.name.clone(), e)).collect();
    let ints = |e: &Entry| -> Vec<i64> { e.data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect() };
    let path = work_dir("packed").join("iterations.safetensors");
    let mut w = Writer::create(path.to_str().unwrap(), &Manifest::default()).unwrap();
    let mut it = Iterations::new();
    let mut n_iter = 0;
    while let Some(e) = golden.get(&format!("iter{}.seqs", n_iter)) {
        let pre = format!("iter{}.", n_iter);
        let (seqs, steps, tokens) = (ints(e), ints(golden[&(pre.clone() + "seq_steps")]), ints(golden[&(pre.clone() + "num_tokens")]));
        let (mut packed, mut cu, mut ids, mut want) = (Vec::new(), vec![0i64], Vec::new(), Vec::new());
        let mut d = 0;
        for j in 0..seqs.len() {
            let emb = golden[&format!("seq{}.step{}.embed", seqs[j], steps[j])];
            d = emb.shape[1] as usize;
            let rows: Vec<f32> = emb.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            packed.extend_from_slice(&rows);
            want.push(rows);
            cu.push(cu.last().unwrap() + emb.shape[0]);
            ids.push(1000 - 7 * seqs[j]);
        }
        packed.extend(std::iter::repeat(0f32).take(2 * d));
        let got = split_rows(&packed, d, &cu).unwrap();
        assert!(got.iter().zip(&want).all(|(g, w)| *g == &w[..]) && got.len() == want.len(), "split_rows does not give back {}'s members", pre);
        let members = it.call(Some(&mut w), &ids, &tokens).unwrap();
        for (j, m) in members.iter().enumerate() {
            assert_eq!((m.0 as i64, m.1 as i64), (seqs[j], steps[j]), "{} member {}", pre, j);
        }
        n_iter += 1;
    }
    assert!(n_iter >= 2, "the golden batch has {} iterations", n_iter);
    for cu in [[1i64, 2, 3], [0, 3, 2], [0, 2, 9]] {
        assert!(split_rows(&[0f32; 8], 1, &cu).is_err(), "split_rows accepted cu_seqlens {:?}", cu);
    }
    assert!(it.call(None, &[5, 5], &[1, 1]).is_err(), "Iterations accepted an id twice");
    w.finish().unwrap();
    let (_, written) = read_safetensors(path.to_str().unwrap());
    assert_eq!(written.len(), 3 * n_iter);
    for e in &written {
        let g = golden[&e.name];
        assert!(e.data == g.data && e.shape == g.shape, "written {} differs from the golden's", e.name);
    }
}
