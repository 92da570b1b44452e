/* llmdump.h - single-header C99 writer of llm-dump/1 files (see docs/DUMP_FORMAT.md).
 *
 * Produces files byte-identical to llmdiff's own writer (dumps/formats/safetensors.cpp,
 * DumpWriter) for the same tensors added in the same order and the same manifest.
 *
 *   #define LLMDUMP_IMPLEMENTATION   // in exactly one C or C++ file
 *   #include "llmdump.h"
 *
 *   llmdump_manifest m = {0};
 *   m.producer = "myengine 1.2"; m.model = "llama-gqa"; m.config = config_json_text;
 *   m.scenario = "decode"; m.dtype = "bfloat16"; m.steps = 4;
 *   char err[512];
 *   llmdump_writer* w = llmdump_open("out.safetensors", &m, err, sizeof err);
 *   if (!w) { fprintf(stderr, "%s\n", err); exit(1); }
 *   char name[256];
 *   int64_t shape[2] = {T, D};
 *   llmdump_layer_name(name, sizeof name, 0, 3, "attn_norm");       // step0.layers.3.attn_norm
 *   if (llmdump_add(w, name, LLMDUMP_BF16, 2, shape, bf16_ptr, T * D * 2) != 0)
 *     fprintf(stderr, "%s\n", llmdump_error(w));
 *   if (llmdump_finish(w) != 0) fprintf(stderr, "%s\n", llmdump_error(w));
 *   llmdump_free(w);   // without a successful finish: removes the temporaries, no file appears
 *
 * Tensor bytes go to a temporary data file as they are added (nothing is held
 * in memory but the names and shapes). llmdump_finish writes header + data to
 * PATH.tmp.PID.N, fsyncs it and renames it onto PATH: a half-written file never
 * appears under PATH. Float inputs in F16/BF16 are widened exactly to F32 (the
 * spec stores every float tensor as F32); F32 and I64 are stored as given.
 * Data is host memory as-is: little-endian hosts only. POSIX (getpid, fsync).
 */
#ifndef LLMDUMP_H
#define LLMDUMP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LLMDUMP_F32 = 0, LLMDUMP_F16 = 1, LLMDUMP_BF16 = 2, LLMDUMP_I64 = 3 } llmdump_dtype;

typedef struct llmdump_manifest {
  const char* producer;  /* free text: program and versions */
  const char* model;     /* model directory name or id */
  const char* config;    /* the model's config.json text */
  const char* scenario;  /* "prefill", "decode", "chunked" or free text */
  const char* dtype;     /* compute dtype: "float32", "bfloat16", "float16" */
  int steps;             /* number of forward calls */
  size_t n_extra;        /* further string keys (a standard key given here is overridden) */
  const char* const* extra_keys;
  const char* const* extra_values;
} llmdump_manifest;

typedef struct llmdump_writer llmdump_writer;

/* Opens a writer for `path`. NULL on failure, with a message in err (if non-NULL). NULL
 * manifest strings are written as "". */
llmdump_writer* llmdump_open(const char* path, const llmdump_manifest* m, char* err, size_t err_size);
/* Adds one tensor. nbytes is the size of `data` in bytes (in the input dtype); it must
 * equal product(shape) * sizeof(dtype). Returns 0, or -1 with llmdump_error(w) set:
 * a rejected call (bad name, duplicate, size mismatch) leaves the writer usable. */
int llmdump_add(llmdump_writer* w, const char* name, llmdump_dtype dtype, int ndim, const int64_t* shape,
                const void* data, size_t nbytes);
int llmdump_add_f32(llmdump_writer* w, const char* name, int ndim, const int64_t* shape, const float* data);
int llmdump_add_i64(llmdump_writer* w, const char* name, int ndim, const int64_t* shape, const int64_t* data);
/* Writes the header and data, fsyncs and renames into place. 0 or -1 (llmdump_error). */
int llmdump_finish(llmdump_writer* w);
/* Frees the writer; an unfinished one leaves nothing behind (temporaries removed). */
void llmdump_free(llmdump_writer* w);
const char* llmdump_error(const llmdump_writer* w);

/* Canonical names; return what snprintf returns. */
int llmdump_step_name(char* buf, size_t size, int step, const char* site);             /* step{s}.{site} */
int llmdump_layer_name(char* buf, size_t size, int step, int layer, const char* site); /* step{s}.layers.{l}.{site} */
int llmdump_seq_name(char* buf, size_t size, int seq, const char* name);               /* seq{b}.{name} */

/* [T, H, Dh] (e.g. [T, H*Dh] as an engine holds it) -> [H, T, Dh], head-major. */
void llmdump_head_major_f32(const float* src, float* dst, int64_t T, int64_t H, int64_t Dh);
/* One sequence of a padded batch (docs/DUMP_FORMAT.md, "Several sequences":
 * padding stripped). `src` is the sequence's slice of the batched tensor, laid
 * out as [outer, n, inner] with n padded token (or key) rows: outer 1 for
 * [Tpad, X] tensors, H for head-major [H, Tpad, Dh] ones and caches. Copies
 * rows [first, first + count) of every outer block to dst [outer, count,
 * inner]: first = pad for a left-padded sequence, 0 for right padding. */
void llmdump_take_rows_f32(const float* src, float* dst, int64_t outer, int64_t n, int64_t inner, int64_t first,
                           int64_t count);
/* A paged KV pool gathered into one sequence's logical cache dst [heads, length, dh]:
 * position s lives in block block_table[s / block_size], slot s % block_size. The pool
 * is [blocks, block_size, heads, dh] (slot_major 1, vLLM-style blocks of token rows) or
 * [blocks, heads, block_size, dh] (slot_major 0). Returns 0, or -1 when a block id is
 * outside [0, blocks) or the table is too short for `length` (dst then incomplete). */
int llmdump_gather_paged_f32(const float* pool, int64_t blocks, int64_t block_size, int64_t heads, int64_t dh,
                             int slot_major, const int64_t* block_table, int64_t table_len, int64_t length,
                             float* dst);
/* Sequence i's rows of a packed batch (a serving engine's [rows, ...] tensor over every
 * sequence of one forward call), split by cu_seqlens [n + 1] (vLLM's query_start_loc,
 * FlashAttention's cu_seqlens_q): copies rows [cu[i], cu[i+1]) of src, each row_bytes
 * long, to dst. Rows from cu[n] on (padding) belong to no sequence. Returns the row
 * count, or -1 when cu_seqlens does not start at 0, decreases or ends past `rows`, or
 * i is outside [0, n). */
int64_t llmdump_split_rows(const void* src, size_t row_bytes, int64_t rows, const int64_t* cu_seqlens, int64_t n,
                           int64_t i, void* dst);
/* Numbering of a serving engine's forward calls (docs/DUMP_FORMAT.md, "Several
 * sequences"): each engine sequence id gets b = 0, 1, ... in the order it first
 * appears, each of its calls its own step, each call an iteration N. */
typedef struct {
  int64_t* ids;    /* engine sequence id of each b */
  int64_t* steps;  /* calls so far of each b */
  int64_t count, capacity;
  int64_t iterations; /* calls so far */
} llmdump_iterations;
void llmdump_iterations_init(llmdump_iterations* it);
void llmdump_iterations_free(llmdump_iterations* it);
/* b of an engine sequence id already seen, or -1. */
int64_t llmdump_iterations_seq(const llmdump_iterations* it, int64_t seq_id);
/* Numbers one forward call over n sequences (engine ids in row order, their token
 * counts): b[j] and step[j] of each, and, when w is not NULL, iter{N}.seqs,
 * iter{N}.seq_steps and iter{N}.num_tokens added to w. Returns 0, or -1 when an id
 * is there twice or memory runs out (nothing numbered), or when w refuses a tensor
 * (llmdump_error(w)). */
int llmdump_iterations_call(llmdump_iterations* it, llmdump_writer* w, const int64_t* seq_ids,
                            const int64_t* num_tokens, int64_t n, int64_t* b, int64_t* step);
/* Exact widening, bit-identical to llmdiff's conversions. */
float llmdump_bf16_to_f32(uint16_t h);
float llmdump_f16_to_f32(uint16_t h);
void llmdump_convert_to_f32(const void* src, llmdump_dtype dtype, size_t n, float* dst);

#ifdef __cplusplus
}
#endif
#endif /* LLMDUMP_H */

#ifdef LLMDUMP_IMPLEMENTATION
#ifndef LLMDUMP_IMPLEMENTATION_DONE
#define LLMDUMP_IMPLEMENTATION_DONE

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  char* name;
  llmdump_dtype stored; /* F32 or I64 */
  int ndim;
  int64_t* shape;
  uint64_t begin, end;
} llmdump__tensor;

struct llmdump_writer {
  char* path;
  char* data_tmp;
  char* final_tmp;
  FILE* data;
  uint64_t offset;
  int finished, broken;
  llmdump__tensor* tensors;
  size_t n, cap;
  size_t* table; /* open addressing hash of tensor index + 1 */
  size_t table_cap;
  char** meta_keys; /* sorted by bytes, unique */
  char** meta_values;
  size_t n_meta;
  char err[1024];
};

typedef struct {
  char* p;
  size_t n, cap;
  int oom;
} llmdump__buf;

static void llmdump__put(llmdump__buf* b, const char* s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t c = b->cap ? b->cap : 256;
    char* q;
    while (c < b->n + n + 1) c *= 2;
    q = (char*)realloc(b->p, c);
    if (!q) { b->oom = 1; return; }
    b->p = q;
    b->cap = c;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = '\0';
}
static void llmdump__puts(llmdump__buf* b, const char* s) { llmdump__put(b, s, strlen(s)); }
static void llmdump__putu(llmdump__buf* b, uint64_t v) {
  char t[32];
  snprintf(t, sizeof t, "%llu", (unsigned long long)v);
  llmdump__puts(b, t);
}
static void llmdump__puti(llmdump__buf* b, int64_t v) {
  char t[32];
  snprintf(t, sizeof t, "%lld", (long long)v);
  llmdump__puts(b, t);
}
/* JSON string as nlohmann::json::dump() writes it (ensure_ascii off). */
static void llmdump__putjs(llmdump__buf* b, const char* s) {
  const unsigned char* p = (const unsigned char*)s;
  llmdump__put(b, "\"", 1);
  for (; *p; ++p) {
    char t[8];
    switch (*p) {
      case '"': llmdump__put(b, "\\\"", 2); break;
      case '\\': llmdump__put(b, "\\\\", 2); break;
      case '\b': llmdump__put(b, "\\b", 2); break;
      case '\f': llmdump__put(b, "\\f", 2); break;
      case '\n': llmdump__put(b, "\\n", 2); break;
      case '\r': llmdump__put(b, "\\r", 2); break;
      case '\t': llmdump__put(b, "\\t", 2); break;
      default:
        if (*p < 0x20) {
          snprintf(t, sizeof t, "\\u%04x", (unsigned)*p);
          llmdump__put(b, t, 6);
        } else {
          llmdump__put(b, (const char*)p, 1);
        }
    }
  }
  llmdump__put(b, "\"", 1);
}

/* Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF). */
static int llmdump__utf8(const char* s) {
  const unsigned char* p = (const unsigned char*)s;
  while (*p) {
    unsigned c = *p;
    int n;
    unsigned lo = 0x80, hi = 0xbf;
    if (c < 0x80) { ++p; continue; }
    if (c >= 0xc2 && c <= 0xdf) n = 1;
    else if (c == 0xe0) { n = 2; lo = 0xa0; }
    else if (c == 0xed) { n = 2; hi = 0x9f; }
    else if (c >= 0xe1 && c <= 0xef) n = 2;
    else if (c == 0xf0) { n = 3; lo = 0x90; }
    else if (c >= 0xf1 && c <= 0xf3) n = 3;
    else if (c == 0xf4) { n = 3; hi = 0x8f; }
    else return 0;
    ++p;
    if (*p < lo || *p > hi) return 0;
    ++p;
    while (--n > 0) {
      if (*p < 0x80 || *p > 0xbf) return 0;
      ++p;
    }
  }
  return 1;
}

static void llmdump__seterr(char* err, size_t size, const char* fmt, ...) {
  va_list ap;
  if (!err || !size) return;
  va_start(ap, fmt);
  vsnprintf(err, size, fmt, ap);
  va_end(ap);
}

static char* llmdump__strdup(const char* s) {
  size_t n = strlen(s) + 1;
  char* p = (char*)malloc(n);
  if (p) memcpy(p, s, n);
  return p;
}

static size_t llmdump__hash(const char* s) {
  size_t h = (size_t)1469598103934665603ull;
  while (*s) h = (h ^ (unsigned char)*s++) * (size_t)1099511628211ull;
  return h;
}

static long llmdump__find(const llmdump_writer* w, const char* name) {
  size_t i;
  if (!w->table_cap) return -1;
  for (i = llmdump__hash(name) & (w->table_cap - 1); w->table[i]; i = (i + 1) & (w->table_cap - 1))
    if (strcmp(w->tensors[w->table[i] - 1].name, name) == 0) return (long)(w->table[i] - 1);
  return -1;
}

static int llmdump__index(llmdump_writer* w, size_t idx) {
  size_t i;
  if ((w->n + 1) * 2 > w->table_cap) {
    size_t cap = w->table_cap ? w->table_cap * 2 : 64, k;
    size_t* t = (size_t*)calloc(cap, sizeof(size_t));
    if (!t) return -1;
    for (k = 0; k < w->table_cap; ++k) {
      if (!w->table[k]) continue;
      for (i = llmdump__hash(w->tensors[w->table[k] - 1].name) & (cap - 1); t[i]; i = (i + 1) & (cap - 1)) {}
      t[i] = w->table[k];
    }
    free(w->table);
    w->table = t;
    w->table_cap = cap;
  }
  for (i = llmdump__hash(w->tensors[idx].name) & (w->table_cap - 1); w->table[i]; i = (i + 1) & (w->table_cap - 1)) {}
  w->table[i] = idx + 1;
  return 0;
}

static int llmdump__set_meta(llmdump_writer* w, const char* key, const char* value) {
  size_t i, at;
  char *k, *v;
  if (!value) value = "";
  for (i = 0; i < w->n_meta; ++i) {
    int c = strcmp(w->meta_keys[i], key); /* strcmp compares as unsigned char: byte order */
    if (c == 0) {
      v = llmdump__strdup(value);
      if (!v) return -1;
      free(w->meta_values[i]);
      w->meta_values[i] = v;
      return 0;
    }
    if (c > 0) break;
  }
  at = i;
  k = llmdump__strdup(key);
  v = llmdump__strdup(value);
  {
    char** nk = (char**)realloc(w->meta_keys, (w->n_meta + 1) * sizeof(char*));
    char** nv;
    if (nk) w->meta_keys = nk;
    nv = (char**)realloc(w->meta_values, (w->n_meta + 1) * sizeof(char*));
    if (nv) w->meta_values = nv;
    if (!k || !v || !nk || !nv) { free(k); free(v); return -1; }
  }
  memmove(w->meta_keys + at + 1, w->meta_keys + at, (w->n_meta - at) * sizeof(char*));
  memmove(w->meta_values + at + 1, w->meta_values + at, (w->n_meta - at) * sizeof(char*));
  w->meta_keys[at] = k;
  w->meta_values[at] = v;
  w->n_meta++;
  return 0;
}

static char* llmdump__temp_name(const char* path, const char* tag) {
  static unsigned counter = 0;
  size_t n = strlen(path) + strlen(tag) + 64;
  char* p = (char*)malloc(n);
  if (p) snprintf(p, n, "%s.tmp.%ld.%u%s", path, (long)getpid(), counter++, tag);
  return p;
}

void llmdump_free(llmdump_writer* w) {
  size_t i;
  if (!w) return;
  if (w->data) fclose(w->data);
  if (w->data_tmp) remove(w->data_tmp);
  if (w->final_tmp) remove(w->final_tmp);
  for (i = 0; i < w->n; ++i) { free(w->tensors[i].name); free(w->tensors[i].shape); }
  for (i = 0; i < w->n_meta; ++i) { free(w->meta_keys[i]); free(w->meta_values[i]); }
  free(w->tensors);
  free(w->table);
  free(w->meta_keys);
  free(w->meta_values);
  free(w->data_tmp);
  free(w->final_tmp);
  free(w->path);
  free(w);
}

llmdump_writer* llmdump_open(const char* path, const llmdump_manifest* m, char* err, size_t err_size) {
  llmdump_writer* w;
  char steps[32];
  size_t i;
  if (!path || !*path) { llmdump__seterr(err, err_size, "llmdump: empty path"); return NULL; }
  if (!m) { llmdump__seterr(err, err_size, "llmdump: %s: no manifest", path); return NULL; }
  w = (llmdump_writer*)calloc(1, sizeof *w);
  if (!w || !(w->path = llmdump__strdup(path))) {
    free(w);
    llmdump__seterr(err, err_size, "llmdump: %s: out of memory", path);
    return NULL;
  }
  /* Manifest::to_map: extra keys first, the standard keys override them. */
  for (i = 0; i < m->n_extra; ++i) {
    const char* k = m->extra_keys[i];
    const char* v = m->extra_values[i];
    if (!k || !llmdump__utf8(k) || (v && !llmdump__utf8(v))) {
      llmdump__seterr(err, err_size, "llmdump: %s: metadata key or value is not valid UTF-8", path);
      llmdump_free(w);
      return NULL;
    }
    if (llmdump__set_meta(w, k, v)) goto oom;
  }
  {
    const char* keys[6] = {"producer", "model", "config", "scenario", "dtype", "format"};
    const char* vals[6];
    vals[0] = m->producer; vals[1] = m->model; vals[2] = m->config; vals[3] = m->scenario;
    vals[4] = m->dtype; vals[5] = "llm-dump/1";
    for (i = 0; i < 6; ++i) {
      if (vals[i] && !llmdump__utf8(vals[i])) {
        llmdump__seterr(err, err_size, "llmdump: %s: manifest '%s' is not valid UTF-8", path, keys[i]);
        llmdump_free(w);
        return NULL;
      }
      if (llmdump__set_meta(w, keys[i], vals[i])) goto oom;
    }
    snprintf(steps, sizeof steps, "%d", m->steps);
    if (llmdump__set_meta(w, "steps", steps)) goto oom;
  }
  w->data_tmp = llmdump__temp_name(path, ".data");
  if (!w->data_tmp) goto oom;
  w->data = fopen(w->data_tmp, "wb+");
  if (!w->data) {
    llmdump__seterr(err, err_size, "llmdump: %s: cannot create temporary file: %s", path, strerror(errno));
    free(w->data_tmp);
    w->data_tmp = NULL;
    llmdump_free(w);
    return NULL;
  }
  return w;
oom:
  llmdump__seterr(err, err_size, "llmdump: %s: out of memory", path);
  llmdump_free(w);
  return NULL;
}

const char* llmdump_error(const llmdump_writer* w) { return w ? w->err : "llmdump: no writer"; }

static const char* llmdump__dtype_name(llmdump_dtype t) {
  switch (t) {
    case LLMDUMP_F32: return "F32";
    case LLMDUMP_F16: return "F16";
    case LLMDUMP_BF16: return "BF16";
    case LLMDUMP_I64: return "I64";
  }
  return "?";
}

static void llmdump__shape_str(char* buf, size_t size, int ndim, const int64_t* shape) {
  size_t at = 0;
  int i;
  at += (size_t)snprintf(buf, size, "[");
  for (i = 0; i < ndim && at < size; ++i)
    at += (size_t)snprintf(buf + at, size - at, "%s%lld", i ? ", " : "", (long long)shape[i]);
  if (at < size) snprintf(buf + at, size - at, "]");
}

float llmdump_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

float llmdump_f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
  float f;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {
      int e = -1;
      do { ++e; mant <<= 1; } while ((mant & 0x400) == 0);
      u = sign | (uint32_t)(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | mant << 13;
  } else {
    u = sign | (exp + 112) << 23 | mant << 13;
  }
  memcpy(&f, &u, 4);
  return f;
}

void llmdump_convert_to_f32(const void* src, llmdump_dtype dtype, size_t n, float* dst) {
  const unsigned char* p = (const unsigned char*)src;
  size_t i;
  uint16_t v;
  int64_t q;
  for (i = 0; i < n; ++i) {
    switch (dtype) {
      case LLMDUMP_F32: memcpy(dst + i, p + 4 * i, 4); break;
      case LLMDUMP_BF16: memcpy(&v, p + 2 * i, 2); dst[i] = llmdump_bf16_to_f32(v); break;
      case LLMDUMP_F16: memcpy(&v, p + 2 * i, 2); dst[i] = llmdump_f16_to_f32(v); break;
      case LLMDUMP_I64: memcpy(&q, p + 8 * i, 8); dst[i] = (float)q; break;
    }
  }
}

int llmdump_add(llmdump_writer* w, const char* name, llmdump_dtype dtype, int ndim, const int64_t* shape,
                const void* data, size_t nbytes) {
  uint64_t count = 1, expected, out_bytes;
  size_t in_size, i;
  llmdump__tensor t;
  char sh[256];
  if (!w) return -1;
  if (!name) name = "";
  if (w->finished) {
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: tensor '%s' added after finish()", w->path, name);
    return -1;
  }
  if (w->broken) {
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: tensor '%s' added after a write error", w->path, name);
    return -1;
  }
  if (!*name || strcmp(name, "__metadata__") == 0 || !llmdump__utf8(name)) {
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: tensor '%s': invalid tensor name", w->path, name);
    return -1;
  }
  if ((int)dtype < 0 || (int)dtype > 3) {
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: tensor '%s': unknown dtype %d", w->path, name, (int)dtype);
    return -1;
  }
  if (llmdump__find(w, name) >= 0) {
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: tensor '%s': duplicate tensor name", w->path, name);
    return -1;
  }
  if (ndim < 0 || (ndim > 0 && !shape)) {
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: tensor '%s': invalid rank %d", w->path, name, ndim);
    return -1;
  }
  llmdump__shape_str(sh, sizeof sh, ndim, shape);
  for (i = 0; i < (size_t)ndim; ++i) {
    if (shape[i] < 0) {
      llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: tensor '%s': negative dimension in shape %s", w->path,
                      name, sh);
      return -1;
    }
    if (shape[i] != 0 && count > UINT64_MAX / (uint64_t)shape[i]) {
      llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: tensor '%s': shape %s overflows", w->path, name, sh);
      return -1;
    }
    count *= (uint64_t)shape[i];
  }
  in_size = (dtype == LLMDUMP_F16 || dtype == LLMDUMP_BF16) ? 2 : (dtype == LLMDUMP_F32 ? 4 : 8);
  if (count > UINT64_MAX / 8 || (expected = count * in_size) != (uint64_t)nbytes) {
    llmdump__seterr(w->err, sizeof w->err,
                    "llmdump: %s: tensor '%s': byte count %llu does not match shape %s of %s (expected %llu)",
                    w->path, name, (unsigned long long)nbytes, sh, llmdump__dtype_name(dtype),
                    (unsigned long long)(count <= UINT64_MAX / 8 ? count * in_size : 0));
    return -1;
  }
  if (nbytes && !data) {
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: tensor '%s': null data", w->path, name);
    return -1;
  }
  t.stored = dtype == LLMDUMP_I64 ? LLMDUMP_I64 : LLMDUMP_F32;
  out_bytes = count * (t.stored == LLMDUMP_I64 ? 8 : 4);
  t.name = llmdump__strdup(name);
  t.ndim = ndim;
  t.shape = (int64_t*)malloc((size_t)(ndim ? ndim : 1) * sizeof(int64_t));
  if (!t.name || !t.shape) {
    free(t.name);
    free(t.shape);
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: out of memory", w->path);
    return -1;
  }
  if (ndim) memcpy(t.shape, shape, (size_t)ndim * sizeof(int64_t));
  if (w->n == w->cap) {
    size_t cap = w->cap ? w->cap * 2 : 64;
    llmdump__tensor* nt = (llmdump__tensor*)realloc(w->tensors, cap * sizeof *nt);
    if (!nt) {
      free(t.name);
      free(t.shape);
      llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: out of memory", w->path);
      return -1;
    }
    w->tensors = nt;
    w->cap = cap;
  }
  /* The data goes out first: a failed write marks the writer broken. */
  if (dtype == LLMDUMP_F32 || dtype == LLMDUMP_I64) {
    if (nbytes && fwrite(data, 1, nbytes, w->data) != nbytes) goto write_failed;
  } else {
    float chunk[4096];
    size_t done = 0, n;
    while (done < count) {
      n = (size_t)(count - done < 4096 ? count - done : 4096);
      llmdump_convert_to_f32((const unsigned char*)data + done * 2, dtype, n, chunk);
      if (fwrite(chunk, 4, n, w->data) != n) goto write_failed;
      done += n;
    }
  }
  t.begin = w->offset;
  t.end = w->offset + out_bytes;
  w->offset += out_bytes;
  w->tensors[w->n] = t;
  if (llmdump__index(w, w->n)) {
    w->broken = 1;
    w->n++;
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: out of memory", w->path);
    return -1;
  }
  w->n++;
  return 0;
write_failed:
  llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: write failed for tensor '%s': %s", w->path, name,
                  strerror(errno));
  free(t.name);
  free(t.shape);
  w->broken = 1;
  return -1;
}

int llmdump_add_f32(llmdump_writer* w, const char* name, int ndim, const int64_t* shape, const float* data) {
  uint64_t count = 1;
  int i;
  for (i = 0; i < ndim && shape; ++i) count *= (uint64_t)(shape[i] < 0 ? 0 : shape[i]);
  for (i = 0; i < ndim && shape; ++i)
    if (shape[i] < 0) count = (uint64_t)-1 / 4; /* let llmdump_add report the negative dimension */
  return llmdump_add(w, name, LLMDUMP_F32, ndim, shape, data, (size_t)(count * 4));
}

int llmdump_add_i64(llmdump_writer* w, const char* name, int ndim, const int64_t* shape, const int64_t* data) {
  uint64_t count = 1;
  int i;
  for (i = 0; i < ndim && shape; ++i) count *= (uint64_t)(shape[i] < 0 ? 0 : shape[i]);
  for (i = 0; i < ndim && shape; ++i)
    if (shape[i] < 0) count = (uint64_t)-1 / 8;
  return llmdump_add(w, name, LLMDUMP_I64, ndim, shape, data, (size_t)(count * 8));
}

int llmdump_finish(llmdump_writer* w) {
  llmdump__buf b = {0, 0, 0, 0};
  size_t i;
  int k, first = 1;
  unsigned char len[8];
  uint64_t left;
  FILE* out;
  char buf[65536];
  if (!w) return -1;
  if (w->finished) return 0;
  if (w->broken) {
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: cannot finish after a write error", w->path);
    return -1;
  }
  /* The header, byte for byte as nlohmann::ordered_json::dump() writes it. */
  llmdump__put(&b, "{", 1);
  if (w->n_meta) {
    llmdump__puts(&b, "\"__metadata__\":{");
    for (i = 0; i < w->n_meta; ++i) {
      if (i) llmdump__put(&b, ",", 1);
      llmdump__putjs(&b, w->meta_keys[i]);
      llmdump__put(&b, ":", 1);
      llmdump__putjs(&b, w->meta_values[i]);
    }
    llmdump__put(&b, "}", 1);
    first = 0;
  }
  for (i = 0; i < w->n; ++i) {
    const llmdump__tensor* t = &w->tensors[i];
    if (!first) llmdump__put(&b, ",", 1);
    first = 0;
    llmdump__putjs(&b, t->name);
    llmdump__puts(&b, ":{\"dtype\":\"");
    llmdump__puts(&b, llmdump__dtype_name(t->stored));
    llmdump__puts(&b, "\",\"shape\":[");
    for (k = 0; k < t->ndim; ++k) {
      if (k) llmdump__put(&b, ",", 1);
      llmdump__puti(&b, t->shape[k]);
    }
    llmdump__puts(&b, "],\"data_offsets\":[");
    llmdump__putu(&b, t->begin);
    llmdump__put(&b, ",", 1);
    llmdump__putu(&b, t->end);
    llmdump__puts(&b, "]}");
  }
  llmdump__put(&b, "}", 1);
  while (!b.oom && b.n % 8) llmdump__put(&b, " ", 1);
  if (b.oom) {
    free(b.p);
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: out of memory", w->path);
    return -1;
  }
  if (!w->final_tmp && !(w->final_tmp = llmdump__temp_name(w->path, ""))) {
    free(b.p);
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: out of memory", w->path);
    return -1;
  }
  out = fopen(w->final_tmp, "wb");
  if (!out) {
    free(b.p);
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: cannot create a temporary file: %s", w->path,
                    strerror(errno));
    return -1;
  }
  for (k = 0; k < 8; ++k) len[k] = (unsigned char)((uint64_t)b.n >> (8 * k));
  if (fwrite(len, 1, 8, out) != 8 || fwrite(b.p, 1, b.n, out) != b.n) goto io;
  free(b.p);
  b.p = NULL;
  if (fflush(w->data) != 0 || fseek(w->data, 0, SEEK_SET) != 0) goto io;
  for (left = w->offset; left > 0;) {
    size_t n = fread(buf, 1, (size_t)(left < sizeof buf ? left : sizeof buf), w->data);
    if (n == 0 || fwrite(buf, 1, n, out) != n) goto io;
    left -= n;
  }
  if (fflush(out) != 0 || fsync(fileno(out)) != 0) goto io;
  if (fclose(out) != 0) {
    out = NULL;
    goto io;
  }
  out = NULL;
  if (rename(w->final_tmp, w->path) != 0) {
    llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: cannot rename the temporary file into place: %s",
                    w->path, strerror(errno));
    remove(w->final_tmp);
    return -1;
  }
  free(w->final_tmp);
  w->final_tmp = NULL;
  fclose(w->data);
  w->data = NULL;
  remove(w->data_tmp);
  w->finished = 1;
  return 0;
io:
  llmdump__seterr(w->err, sizeof w->err, "llmdump: %s: cannot write: %s", w->path, strerror(errno));
  free(b.p);
  if (out) fclose(out);
  remove(w->final_tmp);
  return -1;
}

int llmdump_step_name(char* buf, size_t size, int step, const char* site) {
  return snprintf(buf, size, "step%d.%s", step, site);
}
int llmdump_layer_name(char* buf, size_t size, int step, int layer, const char* site) {
  return snprintf(buf, size, "step%d.layers.%d.%s", step, layer, site);
}
int llmdump_seq_name(char* buf, size_t size, int seq, const char* name) {
  return snprintf(buf, size, "seq%d.%s", seq, name);
}

void llmdump_head_major_f32(const float* src, float* dst, int64_t T, int64_t H, int64_t Dh) {
  int64_t t, h;
  for (h = 0; h < H; ++h)
    for (t = 0; t < T; ++t)
      memcpy(dst + (h * T + t) * Dh, src + (t * H + h) * Dh, (size_t)Dh * sizeof(float));
}

void llmdump_take_rows_f32(const float* src, float* dst, int64_t outer, int64_t n, int64_t inner, int64_t first,
                           int64_t count) {
  int64_t o;
  for (o = 0; o < outer; ++o)
    memcpy(dst + o * count * inner, src + (o * n + first) * inner, (size_t)(count * inner) * sizeof(float));
}

int64_t llmdump_split_rows(const void* src, size_t row_bytes, int64_t rows, const int64_t* cu_seqlens, int64_t n,
                           int64_t i, void* dst) {
  int64_t j;
  if (n < 0 || i < 0 || i >= n || cu_seqlens[0] != 0 || cu_seqlens[n] > rows) return -1;
  for (j = 0; j < n; ++j)
    if (cu_seqlens[j + 1] < cu_seqlens[j]) return -1;
  memcpy(dst, (const char*)src + (size_t)cu_seqlens[i] * row_bytes,
         (size_t)(cu_seqlens[i + 1] - cu_seqlens[i]) * row_bytes);
  return cu_seqlens[i + 1] - cu_seqlens[i];
}

void llmdump_iterations_init(llmdump_iterations* it) { memset(it, 0, sizeof *it); }

void llmdump_iterations_free(llmdump_iterations* it) {
  free(it->ids);
  free(it->steps);
  llmdump_iterations_init(it);
}

int64_t llmdump_iterations_seq(const llmdump_iterations* it, int64_t seq_id) {
  int64_t b;
  for (b = 0; b < it->count; ++b)
    if (it->ids[b] == seq_id) return b;
  return -1;
}

int llmdump_iterations_call(llmdump_iterations* it, llmdump_writer* w, const int64_t* seq_ids,
                            const int64_t* num_tokens, int64_t n, int64_t* b, int64_t* step) {
  int64_t j, k, added = 0;
  char name[64];
  for (j = 0; j < n; ++j) {
    for (k = 0; k < j; ++k)
      if (seq_ids[k] == seq_ids[j]) return -1;
    if (llmdump_iterations_seq(it, seq_ids[j]) < 0) ++added;
  }
  if (it->count + added > it->capacity) {
    const int64_t cap = (it->count + added) * 2;
    int64_t* ids = (int64_t*)realloc(it->ids, (size_t)cap * sizeof(int64_t));
    int64_t* steps;
    if (!ids) return -1;
    it->ids = ids;
    steps = (int64_t*)realloc(it->steps, (size_t)cap * sizeof(int64_t));
    if (!steps) return -1;
    it->steps = steps;
    it->capacity = cap;
  }
  for (j = 0; j < n; ++j) {
    int64_t s = llmdump_iterations_seq(it, seq_ids[j]);
    if (s < 0) {
      s = it->count++;
      it->ids[s] = seq_ids[j];
      it->steps[s] = 0;
    }
    b[j] = s;
    step[j] = it->steps[s]++;
  }
  if (w) {
    const int64_t shape[1] = {n};
    snprintf(name, sizeof name, "iter%lld.seqs", (long long)it->iterations);
    if (llmdump_add_i64(w, name, 1, shape, b)) return -1;
    snprintf(name, sizeof name, "iter%lld.seq_steps", (long long)it->iterations);
    if (llmdump_add_i64(w, name, 1, shape, step)) return -1;
    snprintf(name, sizeof name, "iter%lld.num_tokens", (long long)it->iterations);
    if (llmdump_add_i64(w, name, 1, shape, num_tokens)) return -1;
  }
  it->iterations++;
  return 0;
}

int llmdump_gather_paged_f32(const float* pool, int64_t blocks, int64_t block_size, int64_t heads, int64_t dh,
                             int slot_major, const int64_t* block_table, int64_t table_len, int64_t length,
                             float* dst) {
  int64_t s, h;
  if (block_size <= 0 || length > table_len * block_size) return -1;
  for (s = 0; s < length; ++s) {
    const int64_t b = block_table[s / block_size], slot = s % block_size;
    if (b < 0 || b >= blocks) return -1;
    for (h = 0; h < heads; ++h) {
      const int64_t at = slot_major ? ((b * block_size + slot) * heads + h) * dh : ((b * heads + h) * block_size + slot) * dh;
      memcpy(dst + (h * length + s) * dh, pool + at, (size_t)dh * sizeof(float));
    }
  }
  return 0;
}

#ifdef __cplusplus
}
#endif
#endif /* LLMDUMP_IMPLEMENTATION_DONE */
#endif /* LLMDUMP_IMPLEMENTATION */
