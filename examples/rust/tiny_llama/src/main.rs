//! A tiny Llama engine in Rust (std only), instrumented with the project's
//! Rust writer (docs/COOKBOOK.md). Reads an HF Llama checkpoint (config.json +
//! model.safetensors, float32 or bfloat16), runs a prompt and greedy decode
//! steps with a KV cache, and writes every intermediate under llm-dump/1's
//! canonical names:
//!
//!     cargo build --offline --release --manifest-path examples/rust/tiny_llama/Cargo.toml
//!     examples/rust/tiny_llama/target/release/tiny_llama tests/golden/llama-gqa --tokens 1,2,3,4,5 --decode 3 --out rs.safetensors
//!     build/llmdiff bisect --model tests/golden/llama-gqa rs.safetensors
//!
//! --bug rope-interleaved rotates adjacent pairs instead of HF's halves.
use std::collections::HashMap;
use std::path::Path;

use llmdump::{layer_name, step_name, Manifest, Writer};

fn die(msg: &str) -> ! {
    eprintln!("tiny_llama: {}", msg);
    std::process::exit(2)
}

/// Just enough JSON for config.json and a safetensors header.
#[derive(Debug, Clone)]
enum Json {
    Null,
    Bool,
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    fn parse(text: &str) -> Json {
        let b = text.as_bytes();
        let mut p = 0;
        let v = Json::value(b, &mut p);
        v
    }
    fn ws(b: &[u8], p: &mut usize) {
        while *p < b.len() && (b[*p] as char).is_ascii_whitespace() {
            *p += 1;
        }
    }
    fn value(b: &[u8], p: &mut usize) -> Json {
        Json::ws(b, p);
        match b.get(*p) {
            Some(b'{') => {
                *p += 1;
                let mut o = Vec::new();
                loop {
                    Json::ws(b, p);
                    if b[*p] == b'}' {
                        *p += 1;
                        return Json::Obj(o);
                    }
                    let k = match Json::value(b, p) {
                        Json::Str(s) => s,
                        _ => die("JSON: object key is not a string"),
                    };
                    Json::ws(b, p);
                    *p += 1; // ':'
                    o.push((k, Json::value(b, p)));
                    Json::ws(b, p);
                    if b[*p] == b',' {
                        *p += 1;
                    }
                }
            }
            Some(b'[') => {
                *p += 1;
                let mut a = Vec::new();
                loop {
                    Json::ws(b, p);
                    if b[*p] == b']' {
                        *p += 1;
                        return Json::Arr(a);
                    }
                    a.push(Json::value(b, p));
                    Json::ws(b, p);
                    if b[*p] == b',' {
                        *p += 1;
                    }
                }
            }
            Some(b'"') => {
                *p += 1;
                let mut s = String::new();
                while b[*p] != b'"' {
                    if b[*p] == b'\\' {
                        *p += 1;
                        match b[*p] {
                            b'n' => s.push('\n'),
                            b't' => s.push('\t'),
                            b'u' => {
                                let hex = std::str::from_utf8(&b[*p + 1..*p + 5]).unwrap_or("0");
                                s.push(char::from_u32(u32::from_str_radix(hex, 16).unwrap_or(0)).unwrap_or('?'));
                                *p += 4;
                            }
                            c => s.push(c as char),
                        }
                        *p += 1;
                    } else {
                        let start = *p;
                        while b[*p] != b'"' && b[*p] != b'\\' {
                            *p += 1;
                        }
                        s.push_str(std::str::from_utf8(&b[start..*p]).unwrap_or(""));
                    }
                }
                *p += 1;
                Json::Str(s)
            }
            Some(b't') => {
                *p += 4;
                Json::Bool
            }
            Some(b'f') => {
                *p += 5;
                Json::Bool
            }
            Some(b'n') => {
                *p += 4;
                Json::Null
            }
            Some(_) => {
                let start = *p;
                while *p < b.len() && (b[*p] == b'-' || b[*p] == b'+' || b[*p] == b'.' || b[*p] == b'e' || b[*p] == b'E' || b[*p].is_ascii_digit()) {
                    *p += 1;
                }
                Json::Num(std::str::from_utf8(&b[start..*p]).ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| die("JSON: bad number")))
            }
            None => die("JSON: unexpected end"),
        }
    }
    fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(o) => o.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    fn num(&self, key: &str, default: f64) -> f64 {
        match self.get(key) {
            Some(Json::Num(n)) => *n,
            _ => default,
        }
    }
}

struct Tensor {
    shape: Vec<usize>,
    v: Vec<f32>,
}

/// F32 and BF16 tensors of a safetensors file, as float32.
fn load_safetensors(path: &Path) -> HashMap<String, Tensor> {
    let raw = std::fs::read(path).unwrap_or_else(|e| die(&format!("{}: {}", path.display(), e)));
    let n = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
    let header = Json::parse(std::str::from_utf8(&raw[8..8 + n]).unwrap_or_else(|_| die("header is not UTF-8")));
    let mut out = HashMap::new();
    if let Json::Obj(entries) = header {
        for (name, e) in entries {
            if name == "__metadata__" {
                continue;
            }
            let shape: Vec<usize> = match e.get("shape") {
                Some(Json::Arr(a)) => a.iter().map(|x| if let Json::Num(n) = x { *n as usize } else { 0 }).collect(),
                _ => die(&format!("tensor {}: no shape", name)),
            };
            let (a, b) = match e.get("data_offsets") {
                Some(Json::Arr(o)) => match (&o[0], &o[1]) {
                    (Json::Num(a), Json::Num(b)) => (*a as usize, *b as usize),
                    _ => die("bad data_offsets"),
                },
                _ => die("no data_offsets"),
            };
            let bytes = &raw[8 + n + a..8 + n + b];
            let v: Vec<f32> = match e.get("dtype") {
                Some(Json::Str(d)) if d == "F32" => bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
                Some(Json::Str(d)) if d == "BF16" => {
                    bytes.chunks_exact(2).map(|c| llmdump::bf16_to_f32(u16::from_le_bytes(c.try_into().unwrap()))).collect()
                }
                other => die(&format!("tensor {}: dtype {:?} not supported", name, other)),
            };
            out.insert(name, Tensor { shape, v });
        }
    }
    out
}

/// y[T, out] = x[T, in] · W[out, in]ᵀ
fn matmul(x: &[f32], w: &Tensor, t_len: usize) -> Vec<f32> {
    let (out, inp) = (w.shape[0], w.shape[1]);
    let mut y = vec![0f32; t_len * out];
    for t in 0..t_len {
        for o in 0..out {
            let mut s = 0f32;
            for i in 0..inp {
                s += x[t * inp + i] * w.v[o * inp + i];
            }
            y[t * out + o] = s;
        }
    }
    y
}

fn rmsnorm(x: &[f32], w: &Tensor, t_len: usize, eps: f32) -> Vec<f32> {
    let d = w.shape[0];
    let mut y = vec![0f32; x.len()];
    for t in 0..t_len {
        let ss: f32 = x[t * d..(t + 1) * d].iter().map(|v| v * v).sum();
        let r = 1.0 / (ss / d as f32 + eps).sqrt();
        for i in 0..d {
            y[t * d + i] = x[t * d + i] * r * w.v[i];
        }
    }
    y
}

struct Engine {
    config_text: String,
    d: usize,
    f: usize,
    l: usize,
    hq: usize,
    hkv: usize,
    dh: usize,
    v: usize,
    eps: f32,
    theta: f64,
    rope_bug: bool,
    w: HashMap<String, Tensor>,
    k_cache: Vec<Vec<f32>>, // per layer [Hkv, S, Dh]
    v_cache: Vec<Vec<f32>>,
    s: usize,
}

impl Engine {
    fn new(dir: &Path) -> Engine {
        let config_text = std::fs::read_to_string(dir.join("config.json")).unwrap_or_else(|e| die(&format!("config.json: {}", e)));
        let c = Json::parse(&config_text);
        let d = c.num("hidden_size", 0.0) as usize;
        let hq = c.num("num_attention_heads", 0.0) as usize;
        let l = c.num("num_hidden_layers", 0.0) as usize;
        Engine {
            d,
            f: c.num("intermediate_size", 0.0) as usize,
            l,
            hq,
            hkv: c.num("num_key_value_heads", hq as f64) as usize,
            dh: c.num("head_dim", (d / hq) as f64) as usize,
            v: c.num("vocab_size", 0.0) as usize,
            eps: c.num("rms_norm_eps", 1e-6) as f32,
            theta: c.num("rope_theta", 10000.0),
            rope_bug: false,
            w: load_safetensors(&dir.join("model.safetensors")),
            k_cache: vec![Vec::new(); l],
            v_cache: vec![Vec::new(); l],
            s: 0,
            config_text,
        }
    }

    fn w(&self, name: &str) -> &Tensor {
        self.w.get(name).unwrap_or_else(|| die(&format!("model.safetensors: missing tensor {}", name)))
    }

    /// [T, H*Dh] rows -> RoPE'd head-major [H, T, Dh] at positions P..P+T-1.
    fn rope(&self, x: &[f32], t_len: usize, h_n: usize, p: usize) -> Vec<f32> {
        let (dh, half) = (self.dh, self.dh / 2);
        let mut out = vec![0f32; h_n * t_len * dh];
        for h in 0..h_n {
            for t in 0..t_len {
                let src = &x[t * h_n * dh + h * dh..];
                let dst = &mut out[(h * t_len + t) * dh..];
                for i in 0..half {
                    let inv_freq = (1.0 / self.theta.powf((2 * i) as f64 / dh as f64)) as f32;
                    let f = ((p + t) as f32 * inv_freq) as f64;
                    let (c, s) = (f.cos() as f32, f.sin() as f32);
                    let (a, b) = if self.rope_bug { (2 * i, 2 * i + 1) } else { (i, i + half) }; // the bug: adjacent pairs
                    dst[a] = src[a] * c - src[b] * s;
                    dst[b] = src[b] * c + src[a] * s;
                }
            }
        }
        out
    }

    /// cache [Hkv, S, Dh] + x [Hkv, T, Dh] -> [Hkv, S+T, Dh].
    fn append(&self, cache: &[f32], x: &[f32], t_len: usize) -> Vec<f32> {
        let (s, dh) = (self.s, self.dh);
        let mut grown = vec![0f32; self.hkv * (s + t_len) * dh];
        for h in 0..self.hkv {
            grown[h * (s + t_len) * dh..h * (s + t_len) * dh + s * dh].copy_from_slice(&cache[h * s * dh..(h + 1) * s * dh]);
            grown[(h * (s + t_len) + s) * dh..(h + 1) * (s + t_len) * dh].copy_from_slice(&x[h * t_len * dh..(h + 1) * t_len * dh]);
        }
        grown
    }

    fn forward(&mut self, tokens: &[i64], step: usize, dump: &mut Writer) -> Vec<f32> {
        let (t_len, p) = (tokens.len(), self.s);
        let st = p + t_len;
        let (d, dh, hq, hkv) = (self.d, self.dh, self.hq, self.hkv);
        let sh = |xs: &[usize]| xs.iter().map(|&x| x as i64).collect::<Vec<i64>>();
        let rec = |dump: &mut Writer, site: &str, shape: &[usize], v: &[f32]| {
            dump.add_f32(&step_name(step, site), &sh(shape), v).unwrap_or_else(|e| die(&e.to_string()))
        };
        let rec_l = |dump: &mut Writer, l: usize, site: &str, shape: &[usize], v: &[f32]| {
            dump.add_f32(&layer_name(step, l, site), &sh(shape), v).unwrap_or_else(|e| die(&e.to_string()))
        };
        let positions: Vec<i64> = (p..st).map(|x| x as i64).collect();
        dump.add_i64(&step_name(step, "tokens"), &[t_len as i64], tokens).unwrap_or_else(|e| die(&e.to_string()));
        dump.add_i64(&step_name(step, "positions"), &[t_len as i64], &positions).unwrap_or_else(|e| die(&e.to_string()));
        let mut x = vec![0f32; t_len * d];
        {
            let emb = self.w("model.embed_tokens.weight");
            for (t, &tok) in tokens.iter().enumerate() {
                x[t * d..(t + 1) * d].copy_from_slice(&emb.v[tok as usize * d..(tok as usize + 1) * d]);
            }
        }
        rec(dump, "embed", &[t_len, d], &x);
        for l in 0..self.l {
            let pre = format!("model.layers.{}.", l);
            let h = rmsnorm(&x, self.w(&(pre.clone() + "input_layernorm.weight")), t_len, self.eps);
            rec_l(dump, l, "attn_norm", &[t_len, d], &h);
            let q = matmul(&h, self.w(&(pre.clone() + "self_attn.q_proj.weight")), t_len);
            let k = matmul(&h, self.w(&(pre.clone() + "self_attn.k_proj.weight")), t_len);
            let v = matmul(&h, self.w(&(pre.clone() + "self_attn.v_proj.weight")), t_len);
            rec_l(dump, l, "attn.q", &[t_len, hq * dh], &q);
            rec_l(dump, l, "attn.k", &[t_len, hkv * dh], &k);
            rec_l(dump, l, "attn.v", &[t_len, hkv * dh], &v);
            let (q_rope, k_rope) = (self.rope(&q, t_len, hq, p), self.rope(&k, t_len, hkv, p));
            rec_l(dump, l, "attn.q_rope", &[hq, t_len, dh], &q_rope);
            rec_l(dump, l, "attn.k_rope", &[hkv, t_len, dh], &k_rope);
            self.k_cache[l] = self.append(&self.k_cache[l], &k_rope, t_len);
            self.v_cache[l] = self.append(&self.v_cache[l], &llmdump::head_major(&v, t_len, hkv, dh), t_len);
            rec_l(dump, l, "attn.k_cache", &[hkv, st, dh], &self.k_cache[l]);
            rec_l(dump, l, "attn.v_cache", &[hkv, st, dh], &self.v_cache[l]);
            // Query head h reads kv head h / (Hq / Hkv); causal over positions.
            let mut scores = vec![0f32; hq * t_len * st];
            let mut probs = vec![0f32; hq * t_len * st];
            let mut ctx = vec![0f32; t_len * hq * dh];
            let scale = (1.0 / (dh as f64).sqrt()) as f32;
            for h in 0..hq {
                let kv = h / (hq / hkv);
                for t in 0..t_len {
                    let row = (h * t_len + t) * st;
                    let mut mx = f32::NEG_INFINITY;
                    for s in 0..st {
                        let mut dot = 0f32;
                        for e in 0..dh {
                            dot += q_rope[(h * t_len + t) * dh + e] * self.k_cache[l][(kv * st + s) * dh + e];
                        }
                        scores[row + s] = dot * scale;
                        if s <= p + t && scores[row + s] > mx {
                            mx = scores[row + s];
                        }
                    }
                    let mut sum = 0f32;
                    for s in 0..=p + t {
                        probs[row + s] = (scores[row + s] - mx).exp();
                        sum += probs[row + s];
                    }
                    for s in 0..=p + t {
                        probs[row + s] /= sum;
                        for e in 0..dh {
                            ctx[t * hq * dh + h * dh + e] += probs[row + s] * self.v_cache[l][(kv * st + s) * dh + e];
                        }
                    }
                }
            }
            rec_l(dump, l, "attn.scores", &[hq, t_len, st], &scores);
            rec_l(dump, l, "attn.probs", &[hq, t_len, st], &probs);
            rec_l(dump, l, "attn.ctx", &[t_len, hq * dh], &ctx);
            let out = matmul(&ctx, self.w(&(pre.clone() + "self_attn.o_proj.weight")), t_len);
            rec_l(dump, l, "attn.out", &[t_len, d], &out);
            x.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
            rec_l(dump, l, "attn_residual", &[t_len, d], &x);
            let h = rmsnorm(&x, self.w(&(pre.clone() + "post_attention_layernorm.weight")), t_len, self.eps);
            rec_l(dump, l, "mlp_norm", &[t_len, d], &h);
            let gate = matmul(&h, self.w(&(pre.clone() + "mlp.gate_proj.weight")), t_len);
            let up = matmul(&h, self.w(&(pre.clone() + "mlp.up_proj.weight")), t_len);
            let act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let down = matmul(&act, self.w(&(pre.clone() + "mlp.down_proj.weight")), t_len);
            rec_l(dump, l, "mlp.gate", &[t_len, self.f], &gate);
            rec_l(dump, l, "mlp.up", &[t_len, self.f], &up);
            rec_l(dump, l, "mlp.act", &[t_len, self.f], &act);
            rec_l(dump, l, "mlp.down", &[t_len, d], &down);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
            rec_l(dump, l, "out", &[t_len, d], &x);
        }
        self.s = st;
        let h = rmsnorm(&x, self.w("model.norm.weight"), t_len, self.eps);
        rec(dump, "final_norm", &[t_len, d], &h);
        let head = if self.w.contains_key("lm_head.weight") { "lm_head.weight" } else { "model.embed_tokens.weight" };
        let logits = matmul(&h, self.w(head), t_len);
        rec(dump, "logits", &[t_len, self.v], &logits);
        let last = logits[(t_len - 1) * self.v..].to_vec();
        rec(dump, "next_logits", &[self.v], &last);
        last
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut model, mut tokens_arg, mut out, mut bug, mut decode) = (None, None, None, None, 0usize);
    let mut i = 0;
    while i < args.len() {
        let value = |i: usize| args.get(i + 1).cloned().unwrap_or_else(|| die(&format!("{} needs a value", args[i])));
        match args[i].as_str() {
            "--tokens" => { tokens_arg = Some(value(i)); i += 1; }
            "--decode" => { decode = value(i).parse().unwrap_or_else(|_| die("--decode: a number")); i += 1; }
            "--out" => { out = Some(value(i)); i += 1; }
            "--bug" => { bug = Some(value(i)); i += 1; }
            a if model.is_none() => model = Some(a.to_string()),
            a => die(&format!("unexpected argument {}", a)),
        }
        i += 1;
    }
    let (model, tokens_arg, out) = match (model, tokens_arg, out) {
        (Some(m), Some(t), Some(o)) => (m, t, o),
        _ => die("usage: tiny_llama MODEL_DIR --tokens 1,2,3 [--decode N] --out DUMP [--bug rope-interleaved]"),
    };
    let mut e = Engine::new(Path::new(&model));
    match bug.as_deref() {
        None => {}
        Some("rope-interleaved") => e.rope_bug = true,
        Some(b) => die(&format!("unknown bug {}", b)),
    }
    let mut tokens: Vec<i64> = tokens_arg.split(',').map(|s| s.trim().parse().unwrap_or_else(|_| die("--tokens: numbers"))).collect();
    let name = Path::new(&model).file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let m = Manifest {
        producer: "tiny_llama (Rust)".into(),
        model: name,
        config: e.config_text.clone(),
        scenario: if decode > 0 { "decode".into() } else { "prefill".into() },
        dtype: "float32".into(),
        steps: 1 + decode as i32,
        extra: Default::default(),
    };
    let mut dump = Writer::create(&out, &m).unwrap_or_else(|err| die(&err.to_string()));
    let mut generated = Vec::new();
    for step in 0..=decode {
        let logits = e.forward(&tokens, step, &mut dump);
        let best = logits.iter().enumerate().fold(0, |b, (k, v)| if *v > logits[b] { k } else { b });
        generated.push(best as i64);
        tokens = vec![best as i64];
    }
    dump.add_i64("generated", &[generated.len() as i64], &generated).unwrap_or_else(|err| die(&err.to_string()));
    dump.finish().unwrap_or_else(|err| die(&err.to_string()));
    println!("{}: {} forward calls, generated {:?}", out, 1 + decode, generated);
}
