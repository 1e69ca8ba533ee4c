// Paged attention on CPU for query rows that each attend their own context, read in place from the paged KV
// cache through a block table (no gathered copy of the context): one new token per sequence (decode), or a
// prompt's rows each as a decode row of its own (the "batch-invariant" backend).
//
// Algorithm: Flash-Decoding's online softmax (Dao, Haziza, Massa, Sizov, "Flash-Decoding for
// long-context inference", 2023; FlashAttention-2's inner loop) as in vLLM's CPU paged attention
// (csrc/cpu/attention.cpp, paged_attention_v1): one work item per (rows, kv head) folds the context block by
// block into a running max, a running sum of exponentials and an unnormalised output (attention_fold.h).
// Grouped-query attention: the item computes all num_heads / num_kv_heads query heads of its group
// together, so each K/V row is read once per group and never repeated per query head; an item of a
// prompt's rows (rows()) also shares each block among up to rows_per_item consecutive rows, which read it
// from L1 instead of L2 (the K/V of one kv head over 512 tokens is 256 KB). Every row folds exactly the
// tiles it would alone, so the grouping changes no result. AVX2/FMA over head_dim (a scalar path where
// AVX2 is missing); the items are dealt over torch's intra-op threads. Contexts longer than 512 tokens are
// also split into parts whose states are merged at the end (Flash-Decoding's split-K; see kPartTokens).
// float32 throughout.
#include "torch_ext.h"
#include "kernel_abi.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_fold.h"

namespace {


constexpr int64_t kMaxRows = 8;  // rows per item at most (rows_per_item)

// One work item: kv heads [h0, h0 + nh) of R query rows of one sequence (block table `table`), row r over
// context positions [lo, hi[r]), block by block: a block's K/V rows are read once for all R rows, and each
// row folds exactly the tiles it would alone (the block's share of [lo, hi[r])). q[r] / out[r]: row r's
// first query head (out nullptr: a context split, the caller keeps the state for combine()).
// noipa: one compiled copy for every caller (an inlined or cloned copy could contract its float operations
// differently, and then a row's result would depend on the path that folded it).
__attribute__((noipa)) void attend(State& st, const Layout& L, int64_t R, const float* const* q, const float* kc,
                                   const float* vc, const int32_t* table, int64_t lo, const int64_t* hi, int64_t h0,
                                   int64_t nh, float scale, float* const* out) {
  const int64_t d = L.head_dim, per = nh * L.group;
  int64_t end = lo;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < per * d; ++i) st.q[r * per * d + i] = q[r][i] * scale;
    end = std::max(end, hi[r]);
  }
  st.reset();
  for (int64_t pos = lo; pos < end;) {
    const int64_t blk = table[pos / L.block_size], off = pos % L.block_size;
    const int64_t n = std::min(L.block_size - off, end - pos);
    const int64_t base = blk * L.block_stride + off * L.token_stride;
    const int64_t next = pos + n;
    if (next < end)
      prefetch_tile(L, kc, vc, table[next / L.block_size] * L.block_stride, std::min(L.block_size, end - next), h0, nh);
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t r = 0; r < R; ++r)
        if (hi[r] > pos)
          fold_tile(st, L, (r * nh + h) * L.group, kc + base + (h0 + h) * d, vc + base + (h0 + h) * d,
                    std::min(n, hi[r] - pos));
    pos += n;
  }
  if (out == nullptr) return;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < per; ++j) {
      const float inv = 1.f / st.l[r * per + j];
      for (int64_t i = 0; i < d; ++i) out[r][j * d + i] = st.acc[(r * per + j) * d + i] * inv;
    }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bt,
                  const at::Tensor& lens) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes(),
                    "need q [B, H, D] and k/v caches [num_blocks, block_size, KH, D] of equal shape");
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
                    "q, k_cache and v_cache must be float32");
  TORCH_CHECK_VALUE(bt.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
                    "block_tables and seq_lens must be int32");
  TORCH_CHECK_VALUE(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && bt.is_contiguous() &&
                    lens.is_contiguous(), "all inputs must be contiguous");
  TORCH_CHECK_VALUE(q.device().is_cpu() && k.device().is_cpu(), "inputs must be CPU tensors");
  TORCH_CHECK_VALUE(q.size(2) == k.size(3), "q head_dim ", q.size(2), " != cache head_dim ", k.size(3));
  TORCH_CHECK_VALUE(q.size(1) % k.size(2) == 0, "num_heads ", q.size(1), " not a multiple of num_kv_heads ", k.size(2));
  TORCH_CHECK_VALUE(bt.dim() == 2 && lens.dim() == 1 && lens.size(0) == q.size(0),
                    "need block_tables [S, max_blocks] and seq_lens [B] for B = ", q.size(0));
}

// Every row's length in [1, max_blocks * block_size] and its table's used block ids in [0, num_blocks);
// row b's block table is row seq[b] of bt (seq nullptr: row b; then bt has a row per query row).
void check_tables(const at::Tensor& bt, const int32_t* seq, const at::Tensor& lens, int64_t block_size,
                  int64_t num_blocks) {
  const int32_t* n = lens.data_ptr<int32_t>();
  const int64_t max_blocks = bt.size(1), rows = lens.size(0);
  TORCH_CHECK_VALUE(seq != nullptr || bt.size(0) == rows, "need block_tables [B, max_blocks] for B = ", rows);
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t s = seq == nullptr ? b : seq[b];
    TORCH_CHECK_VALUE(s >= 0 && s < bt.size(0), "seq_of_row[", b, "] = ", s, " outside [0, ", bt.size(0), ")");
    TORCH_CHECK_VALUE(n[b] >= 1 && n[b] <= max_blocks * block_size, "seq_lens[", b, "] = ", n[b],
                      " outside [1, ", max_blocks * block_size, "]");
    const int32_t* t = bt.data_ptr<int32_t>() + s * max_blocks;
    for (int64_t i = 0; i < (n[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK_VALUE(t[i] >= 0 && t[i] < num_blocks, "block_tables[", s, ", ", i, "] = ", t[i], " outside [0, ",
                        num_blocks, ")");
  }
}

// The attention of rows b (each its own context of lens[b] tokens through block table seq[b], or b when seq
// is nullptr; the last min(lens[b], window) tokens when window > 0), items of up to rows_per_item consecutive
// rows of one sequence (one row per item with a window: the rows' windows start at different positions).
at::Tensor run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& block_tables,
               const int32_t* seq, const at::Tensor& seq_lens, double scale, int64_t window, int64_t heads_per_item,
               int64_t rows_per_item) {
  check_inputs(q, k_cache, v_cache, block_tables, seq_lens);
  const int64_t kh = k_cache.size(2), d = k_cache.size(3), bs = k_cache.size(1), B = q.size(0);
#ifdef PDC_AVX2
  TORCH_CHECK_VALUE(d % 8 == 0, "head_dim must be a multiple of 8, got ", d);
#endif
  check_tables(block_tables, seq, seq_lens, bs, k_cache.size(0));
  const int64_t nh = heads_per_item;
  TORCH_CHECK_VALUE(nh >= 1 && kh % nh == 0, "heads_per_item ", nh, " must divide num_kv_heads ", kh);
  TORCH_CHECK_VALUE(rows_per_item >= 1 && rows_per_item <= kMaxRows, "rows_per_item ", rows_per_item,
                    " outside [1, ", kMaxRows, "]");
  const Layout L{bs, kh, d, q.size(1) / kh, q.size(1), bs * kh * d, kh * d};
  auto out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int32_t *bt = block_tables.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t max_blocks = block_tables.size(1), groups = kh / nh, per = nh * L.group;
  auto table_of = [&](int64_t b) { return seq == nullptr ? b : static_cast<int64_t>(seq[b]); };
  // chunks: runs of up to rows_per_item consecutive rows of one sequence, [first[c], first[c + 1])
  std::vector<int64_t> first;
  for (int64_t b = 0; b < B; ++b)
    if (b == 0 || window > 0 || table_of(b) != table_of(b - 1) || b - first.back() == rows_per_item)
      first.push_back(b);
  const int64_t chunks = static_cast<int64_t>(first.size());
  first.push_back(B);
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b)
    max_len = std::max<int64_t>(max_len, window > 0 ? std::min<int64_t>(lens[b], window) : lens[b]);
  const int64_t splits = (max_len + kPartTokens - 1) / kPartTokens;  // parts of the longest context
  // per (row, kv-head group, part): m and l per query head, acc per query head (only when some context has
  // several parts)
  std::vector<float> pm(splits > 1 ? B * groups * splits * per : 0), pl(pm.size()), pacc(pm.size() * d);
  auto first_row = [&](int64_t b, int64_t h0) { return (b * L.num_heads + h0 * L.group) * d; };
  // One task: chunk c's rows, kv-head group g, context part `part`.
  auto work = [&](State& st, int64_t c, int64_t g, int64_t part) {
    const float* qr[kMaxRows];
    float* outr[kMaxRows];
    int64_t hi[kMaxRows];
    const int64_t b0 = first[c], R = first[c + 1] - b0, h0 = g * nh;
    // one start for the chunk: 0, or (a window, one row) the window's first position
    const int64_t start = window > 0 ? std::max<int64_t>(lens[b0] - window, 0) : 0;
    const int64_t lo = start + part * kPartTokens;  // part p: kPartTokens from start on (may be empty)
    for (int64_t r = 0; r < R; ++r) {
      qr[r] = qp + first_row(b0 + r, h0);
      outr[r] = splits == 1 ? op + first_row(b0 + r, h0) : nullptr;
      hi[r] = std::max<int64_t>(lo, splits == 1 ? lens[b0 + r] : std::min<int64_t>(lens[b0 + r], lo + kPartTokens));
    }
    attend(st, L, R, qr, kc, vc, bt + table_of(b0) * max_blocks, lo, hi, h0, nh, static_cast<float>(scale),
           splits == 1 ? outr : nullptr);
    if (splits == 1) return;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = (((b0 + r) * groups + g) * splits + part) * per;
      for (int64_t j = 0; j < per; ++j) {
        pm[at + j] = st.m[r * per + j];
        pl[at + j] = hi[r] > lo ? st.l[r * per + j] : 0.f;
      }
      std::copy(st.acc.begin() + r * per * d, st.acc.begin() + (r + 1) * per * d, pacc.begin() + at * d);
    }
  };
  const int64_t tasks = chunks * groups * splits;
  if (seq == nullptr) {  // decode: (sequence, kv-head group, part) in contiguous ranges per thread
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      State st(L, per);
      for (int64_t task = begin; task < end; ++task)
        work(st, task / (groups * splits), task / splits % groups, task % splits);
    });
  } else {
    // A prompt's rows: tasks in part-major order (part, kv-head group, chunk), dealt to the threads in turn
    // (task i to thread i % nt): a thread's consecutive tasks read the same part of the same kv head (256 KB
    // at most for SmolLM2's heads: it stays in L2), and each thread gets every nt-th chunk of a range along
    // which lengths grow, about the same work. (Measured at 2048 rows: 15% less time than contiguous
    // ranges; in decode, contiguous ranges were 3% faster at batch 32.) The order changes no arithmetic.
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
    at::parallel_for(0, nt, 1, [&](int64_t tid0, int64_t tid1) {
      State st(L, rows_per_item * per);
      for (int64_t tid = tid0; tid < tid1; ++tid)
        for (int64_t task = tid; task < tasks; task += nt)
          work(st, task % chunks, task % (chunks * groups) / chunks, task / (chunks * groups));
    });
  }
  if (splits > 1)
    at::parallel_for(0, B * groups, 64, [&](int64_t begin, int64_t end) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t at = unit * splits * per;
        combine(pm.data() + at, pl.data() + at, pacc.data() + at * d, splits, per, d,
                op + first_row(unit / groups, (unit % groups) * nh));
      }
    });
  return out;
}

}  // namespace

// out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b over sequence b's last min(seq_lens[b], window)
// context tokens (all of them when window <= 0), K_b/V_b read from kv head h / (H / KH) through
// block_tables[b]. heads_per_item: kv heads per work item (a divisor of KH). Shapes: q [B, H, D];
// caches [num_blocks, block_size, KH, D]; block_tables [B, max_blocks] int32; seq_lens [B] int32
// (tokens, >= 1). Returns [B, H, D] float32.
// Raises ValueError on dtypes, shapes, non-contiguous inputs, head_dim % 8 != 0 on AVX2, a
// heads_per_item not dividing KH, or lengths / block ids out of range.
at::Tensor decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                  int64_t heads_per_item) {
  return run(q, k_cache, v_cache, block_tables, nullptr, seq_lens, scale, window, heads_per_item, 1);
}

// decode() for query rows of several sequences: row b attends the first seq_lens[b] tokens (its position
// + 1) of sequence seq_of_row[b], through block_tables[seq_of_row[b]]; consecutive rows of one sequence
// share work items of up to rows_per_item rows (1..8). Row b's output equals decode()'s for that row as
// a one-row batch (the same folds). Shapes: q [T, H, D]; block_tables [S, max_blocks] int32; seq_of_row,
// seq_lens [T] int32. Returns [T, H, D] float32. Raises ValueError as decode(), and for a seq_of_row entry
// outside [0, S) or a rows_per_item outside [1, 8].
at::Tensor rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_of_row, const at::Tensor& seq_lens, double scale,
                int64_t window, int64_t rows_per_item) {
  TORCH_CHECK_VALUE(seq_of_row.scalar_type() == at::kInt && seq_of_row.dim() == 1 && seq_of_row.is_contiguous() &&
                    seq_of_row.size(0) == q.size(0), "need seq_of_row [T] int32, contiguous, for T = ", q.size(0));
  return run(q, k_cache, v_cache, block_tables, seq_of_row.data_ptr<int32_t>(), seq_lens, scale, window, 1,
             rows_per_item);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("decode_abi") =  // decode_step.cpp
      pdc_abi::abi_capsule(pdc_abi::kPagedDecode, &decode);
  m.def("decode", &decode, "Paged decode attention (float32, CPU; see the source's comment)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window"), py::arg("heads_per_item") = 1,
        py::call_guard<py::gil_scoped_release>());
  m.def("rows", &rows, "Paged attention of query rows of sequences, each row as a decode row (float32, CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_of_row"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("window"), py::arg("rows_per_item") = 4,
        py::call_guard<py::gil_scoped_release>());
}
