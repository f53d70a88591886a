// The copy of one or more slow rows' sink and selected tokens from vLLM's pages into their compact
// slots (ALGORITHMS.md §1, "Slow step"), shared by torch.ops.speedsfi.gather_compact
// (gather_compact_cpu.cpp) and the fused slow step torch.ops.speedsfi.sfi_slow_rows (sfi_cpu.cpp).
// The callers check every block id and position before it runs.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu_vec.h"
#include "page_views.h"

namespace {

// K element i of token t in the page at k (vLLM's layout of that page)
template <typename T>
inline T k_at(const T* k, const PageViews& s, int64_t t, int64_t i) {
  switch (s.layout) {
    case LAYOUT_ROWS: return k[t * s.k_ts + i];
    case LAYOUT_VEC: return k[i * s.bs + t];
    default: return k[(t / 16) * 16 * s.d + (i / 2) * 32 + (t % 16) * 2 + i % 2];
  }
}

template <typename T>
inline T v_at(const T* v, const PageViews& s, int64_t t, int64_t i) {
  if (s.layout == LAYOUT_AMX) return v[(i / 16) * 16 * s.bs + (t / 2) * 32 + (i % 16) * 2 + t % 2];
  return v[t * s.v_ts + i];
}

// how many entries ahead of the copy the next block's pages are asked for (about a block of a run)
constexpr int64_t kGatherAhead = 16;

template <typename T>
void gather_rows(const T* kb, const T* vb, const PageViews& src, const int32_t* table, int64_t t_rs, T* cb,
                 int64_t c_sblock, int64_t c_shead, int64_t c_ts, int64_t cbs, const int32_t* ctab, int64_t ct_rs,
                 int32_t* clen, int64_t slots, int64_t cap, const int32_t* slot_idx, const int32_t* sel, int64_t sel_rs,
                 int64_t sel_hs, int64_t k, const int32_t* n_sel, const int32_t* seq_lens, const int32_t* offset,
                 const bool* mask, int64_t rows, int64_t hkv, int64_t n_sink) {
  const int64_t d = src.d, bs = src.bs;
  for (int64_t r = 0; r < rows; ++r) {           // in order: rows sharing a slot, the last one writes
    const int64_t slot = slot_idx[r];
    if (slot < 0 || slot >= slots || (mask != nullptr && !mask[r])) continue;
    const int64_t seq = seq_lens != nullptr ? seq_lens[r] : -1;
    if (seq_lens != nullptr && seq <= 0) continue;
    const int64_t ns = std::min<int64_t>(seq_lens != nullptr ? std::min<int64_t>(n_sink, seq) : n_sink, cap);
    const int64_t off = offset != nullptr ? std::clamp<int64_t>(offset[r], 0, cap - ns) : 0;
    const int64_t nsel = std::clamp<int64_t>(n_sel[r], 0, std::min<int64_t>(k, cap - ns - off));
    const int32_t* blocks = table + r * t_rs;
    const int32_t* dst_blocks = ctab + slot * ct_rs;
    for (int64_t h = 0; h < hkv; ++h) {
      const int32_t* hs = sel + r * sel_rs + h * sel_hs;
      const int64_t n_e = ns + nsel;
      int64_t fetched = -1;                      // the last block whose pages were prefetched
      for (int64_t e = 0; e < n_e; ++e) {
        if (e + kGatherAhead < n_e) {            // a selection is runs of neighbours: one block at a time
          const int64_t ahead = e + kGatherAhead < ns ? e + kGatherAhead : hs[e + kGatherAhead - ns];
          if (ahead >= 0 && ahead / bs != fetched && (seq_lens == nullptr || ahead < seq)) {
            fetched = ahead / bs;
            const int64_t page = static_cast<int64_t>(blocks[fetched]) * src.s_block + h * src.s_head;
            prefetch_bytes(kb + page, sizeof(T) * bs * d);
            prefetch_bytes(vb + page, sizeof(T) * bs * d);
          }
        }
        const int64_t pos = e < ns ? e : hs[e - ns];
        if (pos < 0 || (seq_lens != nullptr && pos >= seq)) continue;   // a caller error: left as it was
        const int64_t de = e < ns ? e : ns + off + (e - ns);
        T* dst = cb + static_cast<int64_t>(dst_blocks[de / cbs]) * c_sblock + h * c_shead + (de % cbs) * c_ts;
        const int64_t page = static_cast<int64_t>(blocks[pos / bs]) * src.s_block + h * src.s_head;
        const int64_t t = pos % bs;
        const T* k = kb + page;
        const T* v = vb + page;
        switch (src.layout) {                    // one loop per layout: the element loops vectorise
          case LAYOUT_ROWS:
            for (int64_t i = 0; i < d; ++i) dst[i] = k[t * src.k_ts + i];
            for (int64_t i = 0; i < d; ++i) dst[d + i] = v[t * src.v_ts + i];
            break;
          case LAYOUT_VEC:
            for (int64_t i = 0; i < d; ++i) dst[i] = k[i * bs + t];
            for (int64_t i = 0; i < d; ++i) dst[d + i] = v[t * src.v_ts + i];
            break;
          default:
            for (int64_t i = 0; i < d; ++i) dst[i] = k_at(k, src, t, i);
            for (int64_t i = 0; i < d; ++i) dst[d + i] = v_at(v, src, t, i);
        }
      }
    }
    clen[slot] = static_cast<int32_t>(ns + off + nsel);
  }
}

}  // namespace
