// Shared by the CPU build's compiled passes (sfi_cpu.cpp, two_segment_cpu.cpp): fp32 math on
// bf16 / fp32 elements in GCC's vector extensions (16 lanes: AVX-512, or two AVX2 halves), exp and
// log as branch-free polynomials, per-thread scratch, and CPU_ATTN's amx page packing unpacked.
// Everything has internal linkage (an unnamed namespace): each translation unit keeps its own copy.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float from_bits(int32_t i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int32_t to_bits(float f) { int32_t i; std::memcpy(&i, &f, 4); return i; }

// exp(x): 0 below -103.97 (and for -inf), clamped above 88.38 (never reached: arguments are <= 0).
inline float vexp(float x) {
  const float lo = -103.972084045410f, hi = 88.3762626647949f;
  float xc = x < lo ? lo : (x > hi ? hi : x);
  float k = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  float y = p * r * r + r + 1.0f;
  int32_t ki = static_cast<int32_t>(k);
  int32_t k1 = ki >> 1, k2 = ki - k1;          // 2^k in two factors: no exponent overflow
  float res = y * from_bits((k1 + 127) << 23) * from_bits((k2 + 127) << 23);
  return x < lo ? 0.0f : res;
}

// log(x): -inf at 0, +inf at +inf, NaN below 0 or at NaN; subnormals scaled first.
inline float vlog(float x) {
  bool sub = x < 1.17549435e-38f;
  float xs = sub ? x * 8388608.0f : x;                   // 2^23
  int32_t ix = to_bits(xs);
  float e = static_cast<float>(((ix >> 23) & 0xff) - 126) - (sub ? 23.0f : 0.0f);
  float m = from_bits((ix & 0x007fffff) | 0x3f000000);   // [0.5, 1)
  bool low = m < 0.707106781186547524f;
  e = low ? e - 1.0f : e;
  float f = low ? m + m - 1.0f : m - 1.0f;
  float z = f * f;
  float y = 7.0376836292E-2f;
  y = y * f - 1.1514610310E-1f;
  y = y * f + 1.1676998740E-1f;
  y = y * f - 1.2420140846E-1f;
  y = y * f + 1.4249322787E-1f;
  y = y * f - 1.6668057665E-1f;
  y = y * f + 2.0000714765E-1f;
  y = y * f - 2.4999993993E-1f;
  y = y * f + 3.3333331174E-1f;
  y = y * f * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  float res = f + y + 0.693359375f * e;
  res = x == 0.0f ? kNegInf : res;
  res = x == std::numeric_limits<float>::infinity() ? x : res;
  return (x < 0.0f || x != x) ? std::numeric_limits<float>::quiet_NaN() : res;
}

inline float load(const uint16_t* p) { return from_bits(static_cast<int32_t>(*p) << 16); }   // bf16
inline float load(const float* p) { return *p; }

// Reductions in vector registers (GCC's vector extensions): without -ffast-math the compiler keeps
// a float sum or maximum in its serial order, one element at a time. The order here is fixed too
// (16 partial results, then the tail), so results do not depend on the machine.
typedef float v16f __attribute__((vector_size(64)));
constexpr int kLanes = 16;

inline v16f load16(const float* p) { v16f f; std::memcpy(&f, p, sizeof(f)); return f; }

inline float hsum(v16f v) { float t[kLanes]; std::memcpy(t, &v, sizeof(t)); float s = 0.0f; for (float x : t) s += x; return s; }

float sum_v(const float* x, int64_t n) {
  v16f acc = v16f{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load16(x + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += x[i];
  return s;
}

float dot_v(const float* a, const float* b, int64_t n) {
  v16f acc = v16f{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load16(a + i) * load16(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

float max_v(const float* x, int64_t n) {                     // NaN entries are skipped
  v16f m = v16f{} + kNegInf;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) { const v16f v = load16(x + i); m = v > m ? v : m; }
  float t[kLanes];
  std::memcpy(t, &m, sizeof(t));
  float r = kNegInf;
  for (float v : t) r = v > r ? v : r;
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

inline uint16_t to_bf16(float f) {                    // round to nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);   // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float* scratch_floats(int64_t n) {                            // per thread, grown as needed
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}


typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

inline v16f load16(const uint16_t* p) {
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  v16i i = __builtin_convertvector(h, v16i) << 16;
  v16f f;
  std::memcpy(&f, &i, sizeof(f));
  return f;
}

// The machine's register width, for element-wise work whose lanes never mix (accumulators of
// weighted sums of rows): results do not depend on it. On AVX2 GCC keeps arrays of 16-lane vectors
// in memory (a load and a store around every multiply-add, 5-10x slower); vectors of the register
// width stay in registers.
#if defined(__AVX512F__)
constexpr int kRegLanes = 16;
constexpr int kAccRegs = 16;                                 // accumulators held at once (of 32)
#else
constexpr int kRegLanes = 8;
constexpr int kAccRegs = 8;                                  // of 16
#endif
typedef float vrf __attribute__((vector_size(kRegLanes * 4)));
typedef int32_t vri __attribute__((vector_size(kRegLanes * 4)));
typedef uint16_t vrh __attribute__((vector_size(kRegLanes * 2)));

inline vrf load_r(const float* p) { vrf f; std::memcpy(&f, p, sizeof(f)); return f; }
inline vrf load_r(const uint16_t* p) {                       // bf16
  vrh h;
  std::memcpy(&h, p, sizeof(h));
  vri i = __builtin_convertvector(h, vri) << 16;
  vrf f;
  std::memcpy(&f, &i, sizeof(f));
  return f;
}
inline void store_r(float* p, vrf v) { std::memcpy(p, &v, sizeof(v)); }

// vexp() on a register of lanes, the same operations (the same values: GCC vectorises no loop that
// calls the scalar form, whose floor and exponent bits it keeps scalar, 10x slower)
inline vrf vexp_r(vrf x) {
  const float lo = -103.972084045410f, hi = 88.3762626647949f;
  const vrf xc = x < lo ? vrf{} + lo : (x > hi ? vrf{} + hi : x);
  const vrf y0 = xc * 1.44269504088896341f + 0.5f;
  const vrf tr = __builtin_convertvector(__builtin_convertvector(y0, vri), vrf);
  const vrf k = tr > y0 ? tr - 1.0f : tr;                        // floor
  vrf r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  vrf p = vrf{} + 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  const vrf y = p * r * r + r + 1.0f;
  const vri ki = __builtin_convertvector(k, vri);
  const vri k1 = ki >> 1, k2 = ki - k1;
  const vri b1 = (k1 + 127) << 23, b2 = (k2 + 127) << 23;
  vrf f1, f2;
  std::memcpy(&f1, &b1, sizeof(f1));
  std::memcpy(&f2, &b2, sizeof(f2));
  const vrf res = y * f1 * f2;
  return x < lo ? vrf{} : res;
}

// y[i] = exp(x[i] - m) over [0, n) (y may be x)
inline void exp_shifted(const float* x, float m, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kRegLanes <= n; i += kRegLanes) store_r(y + i, vexp_r(load_r(x + i) - m));
  for (; i < n; ++i) y[i] = vexp(x[i] - m);
}

// The elements of vLLM's fp8 KV caches (torch.float8_e4m3fn, torch.float8_e5m2; CPU_ATTN packs them
// as it packs bf16, one byte an element), widened exactly: the bits move into an fp32 (its
// subnormals included) and a power of two rebiases the exponent (e4m3: 7 -> 127, e5m2: 15 -> 127).
// The codes a saturating write never stores map as torch maps them: e4m3's NaN, e5m2's inf and NaN.
struct fp8e4m3 { uint8_t bits; };
struct fp8e5m2 { uint8_t bits; };

inline float load(const fp8e4m3* p) {
  const int32_t b = p->bits;
  if ((b & 0x7f) == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  return from_bits(((b & 0x80) << 24) | ((b & 0x7f) << 20)) * 0x1p120f;
}
inline float load(const fp8e5m2* p) {
  const int32_t b = p->bits;
  if ((b & 0x7c) == 0x7c)
    return (b & 3) ? std::numeric_limits<float>::quiet_NaN()
                   : ((b & 0x80) ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity());
  return from_bits(((b & 0x80) << 24) | ((b & 0x7f) << 21)) * 0x1p112f;
}

template <typename V, typename I>
inline V widen_fp8_bits(I b, bool e5m2) {
  const I bits = e5m2 ? (((b & 0x80) << 24) | ((b & 0x7f) << 21)) : (((b & 0x80) << 24) | ((b & 0x7f) << 20));
  V f;
  std::memcpy(&f, &bits, sizeof(f));
  f *= e5m2 ? 0x1p112f : 0x1p120f;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  if (e5m2) {
    const I special = (b & 0x7c) == 0x7c;
    const V inf_s = (b & 0x80) ? V{} - inf : V{} + inf;
    return special ? ((b & 3) ? V{} + nan : inf_s) : f;
  }
  return (b & 0x7f) == 0x7f ? V{} + nan : f;
}

#if defined(__F16C__)
// The same values through the hardware's fp16 conversion: e5m2 is the upper byte of an fp16 (inf and
// NaN included); e4m3 moved into fp16's fields is the value / 256, its subnormals included. The bit
// path above multiplies fp32 subnormals (e4m3's smallest values), which x86 does in microcode: with
// it the fp8 passes ran 3-5x slower than over bf16 pages.
inline vrf half_r_to_float(vrh h) {
  vrf r;
#if defined(__AVX512F__)
  __m256i x;
  std::memcpy(&x, &h, sizeof(x));
  const __m512 f = _mm512_cvtph_ps(x);
#else
  __m128i x;
  std::memcpy(&x, &h, sizeof(x));
  const __m256 f = _mm256_cvtph_ps(x);
#endif
  std::memcpy(&r, &f, sizeof(r));
  return r;
}

// 16 lanes as 16 / kRegLanes conversions at the register width
inline v16f half16_to_float(v16h h) {
  v16f r;
  for (int c = 0; c < 16 / kRegLanes; ++c) {
    vrh part;
    std::memcpy(&part, reinterpret_cast<const char*>(&h) + c * sizeof(vrh), sizeof(vrh));
    const vrf f = half_r_to_float(part);
    std::memcpy(reinterpret_cast<char*>(&r) + c * sizeof(vrf), &f, sizeof(vrf));
  }
  return r;
}

// b: the fp8 bytes, one per lane of H (uint16 lanes); the conversion stays in 16-bit lanes.
template <typename V, typename H, V (*ToFloat)(H), typename B>
inline V widen_fp8(B b, bool e5m2) {
  const H w = __builtin_convertvector(b, H);
  if (e5m2) return ToFloat(w << 8);
  const H mag = (w & 0x7f) << 7, sign = (w & 0x80) << 8;
  return ToFloat(sign | ((w & 0x7f) == 0x7f ? H{} + 0x7e00 : mag)) * 256.0f;     // 0x7e00: fp16's NaN
}
#endif

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
// By table where the CPU permutes bytes (AVX-512 VBMI): both formats widen exactly to fp32 values whose
// low 16 bits are 0, so the value of a code is the two high bytes of its fp32, looked up by the code's
// 7 magnitude bits in two 128-byte tables (one vpermi2b each), its sign bit or-ed in: five instructions
// for 16 codes where the fp16 route above takes about eleven, which bounded the fp8 passes (over fp8
// pages they read half the bytes of bf16 and ran no faster).
#define SPEEDSFI_FP8_TABLES 1

// The fp32 bits of the fp8 code with magnitude bits m (0 <= m < 128; torch's float8_e4m3fn, or e5m2)
constexpr uint32_t fp8_magnitude_bits(uint32_t m, bool e5m2) {
  const uint32_t mant_bits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
  const uint32_t e = m >> mant_bits, mant = m & ((1u << mant_bits) - 1);
  if (e5m2 && e == 31) return mant == 0 ? 0x7F800000u : 0x7FC00000u;         // inf, NaN
  if (!e5m2 && m == 0x7F) return 0x7FC00000u;                                 // NaN
  if (e == 0) {                                                               // 0 and subnormals
    if (mant == 0) return 0;
    uint32_t top = 0;
    while ((mant >> (top + 1)) != 0) ++top;
    // mant * 2^(1 - bias - mant_bits): the leading bit at 2^(top + 1 - bias - mant_bits)
    return ((top + 1 + 127 - bias - mant_bits) << 23) | ((mant - (1u << top)) << (23 - top));
  }
  return ((e + 127 - bias) << 23) | (mant << (23 - mant_bits));
}

struct Fp8Tables {
  alignas(64) uint8_t hi[128];                                                 // byte 3 of the fp32
  alignas(64) uint8_t lo[128];                                                 // byte 2
};

constexpr Fp8Tables make_fp8_tables(bool e5m2) {
  Fp8Tables t{};
  for (uint32_t m = 0; m < 128; ++m) {
    t.hi[m] = static_cast<uint8_t>(fp8_magnitude_bits(m, e5m2) >> 24);
    t.lo[m] = static_cast<uint8_t>(fp8_magnitude_bits(m, e5m2) >> 16);
  }
  return t;
}

inline constexpr Fp8Tables kE4m3Tables = make_fp8_tables(false);
inline constexpr Fp8Tables kE5m2Tables = make_fp8_tables(true);

// the 16 codes at p as 16 fp32 lanes
template <bool E5M2>
inline __m512 widen_fp8_16(const void* p) {
  const Fp8Tables& t = E5M2 ? kE5m2Tables : kE4m3Tables;
  alignas(64) static constexpr uint8_t kSpread[64] = {
      0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7,
      8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11, 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14,
      15, 15, 15, 15};
  const __m512i codes = _mm512_castsi128_si512(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  const __m512i each = _mm512_permutexvar_epi8(_mm512_load_si512(kSpread), codes);   // code i in dword i
  const __m512i lo = _mm512_maskz_permutex2var_epi8(0x4444444444444444ull, _mm512_load_si512(t.lo), each,
                                                    _mm512_load_si512(t.lo + 64));
  const __m512i hi = _mm512_maskz_permutex2var_epi8(0x8888888888888888ull, _mm512_load_si512(t.hi), each,
                                                    _mm512_load_si512(t.hi + 64));
  const __m512i sign = _mm512_and_si512(each, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(lo, hi, sign, 0xFE));          // lo | hi | sign
}
#endif

typedef uint8_t vrb __attribute__((vector_size(kRegLanes)));
typedef uint8_t v16b __attribute__((vector_size(16)));

template <typename F>
constexpr bool kFp8 = std::is_same_v<F, fp8e4m3> || std::is_same_v<F, fp8e5m2>;

template <typename F>
  requires kFp8<F>
inline vrf load_r(const F* p) {
#if defined(SPEEDSFI_FP8_TABLES)
  static_assert(sizeof(vrf) == sizeof(__m512));
  const __m512 w = widen_fp8_16<std::is_same_v<F, fp8e5m2>>(p);
  vrf f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
#else
  vrb b;
  std::memcpy(&b, p, sizeof(b));
#if defined(__F16C__)
  return widen_fp8<vrf, vrh, half_r_to_float>(b, std::is_same_v<F, fp8e5m2>);
#else
  return widen_fp8_bits<vrf, vri>(__builtin_convertvector(b, vri), std::is_same_v<F, fp8e5m2>);
#endif
#endif
}

template <typename F>
  requires kFp8<F>
inline v16f load16(const F* p) {
#if defined(SPEEDSFI_FP8_TABLES)
  static_assert(sizeof(v16f) == sizeof(__m512));
  const __m512 w = widen_fp8_16<std::is_same_v<F, fp8e5m2>>(p);
  v16f f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
#else
  v16b b;
  std::memcpy(&b, p, sizeof(b));
#if defined(__F16C__)
  return widen_fp8<v16f, v16h, half16_to_float>(b, std::is_same_v<F, fp8e5m2>);
#else
  return widen_fp8_bits<v16f, v16i>(__builtin_convertvector(b, v16i), std::is_same_v<F, fp8e5m2>);
#endif
#endif
}

// Asks for the n bytes at p ahead of the pass that reads them: the next KV-cache block's page. Blocks
// lie anywhere in the cache, so the hardware's stream prefetch stops at the end of each page.
inline void prefetch_bytes(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(c + o, 0, 3);
}

constexpr int pow2_floor(int x) { int p = 1; while (p * 2 <= x) p *= 2; return p; }

// acc[g * D + i] += sum_t w[g * ws + t] * v_t[i] for t < n (value t: D elements at v + t * ts), in
// the order of t for every element. D: a multiple of 16. D is walked in chunks whose G accumulators
// fit in registers; a chunk re-reads the n rows, which the first chunk brought into L1.
template <typename T, int G, int D>
inline void accumulate_weighted(const T* v, int64_t ts, int64_t n, const float* w, int64_t ws, float* acc) {
  constexpr int C = pow2_floor(std::min(D / kRegLanes, std::max(1, kAccRegs / G)));
  static_assert(D % (C * kRegLanes) == 0, "head size not a multiple of the chunk");
  for (int j = 0; j < D; j += C * kRegLanes) {
    vrf a[G][C];
    for (int gg = 0; gg < G; ++gg)
      for (int c = 0; c < C; ++c) a[gg][c] = load_r(acc + gg * D + j + c * kRegLanes);
    for (int64_t t = 0; t < n; ++t) {
      vrf x[C];
      for (int c = 0; c < C; ++c) x[c] = load_r(v + t * ts + j + c * kRegLanes);
      for (int gg = 0; gg < G; ++gg) {
        const float wt = w[gg * ws + t];
        for (int c = 0; c < C; ++c) a[gg][c] += wt * x[c];
      }
    }
    for (int gg = 0; gg < G; ++gg)
      for (int c = 0; c < C; ++c) store_r(acc + gg * D + j + c * kRegLanes, a[gg][c]);
  }
}

// One page of K^T (dimension i of token t at kt + i * bs + t), the 16 tokens [t0, t0 + 16):
// sc[g * 16 + t] = q_g . k_t and, with NORMS, nr[t] = k_t . k_t, each summed over i in order (lanes
// are tokens: the same sums whatever the register width). q: [G, d].
constexpr int kTokVecs = 16 / kRegLanes;

template <typename T, int G, bool NORMS>
inline void score_cols16(const T* kt, int bs, int d, int64_t t0, const float* q, float* sc, float* nr) {
  vrf a[G][kTokVecs], n2[kTokVecs];
  for (int c = 0; c < kTokVecs; ++c) {
    n2[c] = vrf{};
    for (int gg = 0; gg < G; ++gg) a[gg][c] = vrf{};
  }
  for (int i = 0; i < d; ++i) {
    vrf k[kTokVecs];
    for (int c = 0; c < kTokVecs; ++c) k[c] = load_r(kt + static_cast<int64_t>(i) * bs + t0 + c * kRegLanes);
    if constexpr (NORMS)
      for (int c = 0; c < kTokVecs; ++c) n2[c] += k[c] * k[c];
    for (int gg = 0; gg < G; ++gg) {
      const float qv = q[gg * d + i];
      for (int c = 0; c < kTokVecs; ++c) a[gg][c] += qv * k[c];
    }
  }
  for (int gg = 0; gg < G; ++gg)
    for (int c = 0; c < kTokVecs; ++c) store_r(sc + gg * 16 + c * kRegLanes, a[gg][c]);
  if constexpr (NORMS)
    for (int c = 0; c < kTokVecs; ++c) store_r(nr + c * kRegLanes, n2[c]);
}

// CPU_ATTN's amx packing (VNNI pairs for its tile multiplies) of one page, unpacked into the vec
// packing the passes above read. K: element (t, i) at (t / 16) * 16D + (i / 2) * 32 + (t % 16) * 2
// + i % 2 -> K^T [D, bs]. V: element (t, i) at (i / 16) * 16bs + (t / 2) * 32 + (i % 16) * 2 + t % 2
// -> [bs, D]. A page is a few KB: unpacked in cache, next to the pass that reads it.
// r0[j] = src[2j], r1[j] = src[2j + 1] for j < 16: one run of VNNI pairs split into its two rows
template <typename T>
inline void split_pairs16(const T* src, T* r0, T* r1) {
  for (int j = 0; j < 16; ++j) {
    r0[j] = src[2 * j];
    r1[j] = src[2 * j + 1];
  }
}

template <typename T>
void unpack_amx_k(const T* page, int bs, int d, T* kt) {
  for (int t0 = 0; t0 < bs; t0 += 16)
    for (int i2 = 0; i2 < d / 2; ++i2) {
      T* r0 = kt + static_cast<int64_t>(2 * i2) * bs + t0;          // dims 2 i2 and 2 i2 + 1
      split_pairs16(page + static_cast<int64_t>(t0) * d + i2 * 32, r0, r0 + bs);
    }
}

template <typename T>
void unpack_amx_v(const T* page, int bs, int d, T* v) {
  for (int i0 = 0; i0 < d; i0 += 16)
    for (int t2 = 0; t2 < bs / 2; ++t2) {
      T* r0 = v + static_cast<int64_t>(2 * t2) * d + i0;            // tokens 2 t2 and 2 t2 + 1
      split_pairs16(page + static_cast<int64_t>(i0) * bs + t2 * 32, r0, r0 + d);
    }
}

template <typename T>
T* scratch_of(int64_t n) {                                    // per thread and type, grown as needed
  thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

}  // namespace
