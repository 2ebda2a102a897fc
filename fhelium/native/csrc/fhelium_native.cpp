// fhelium native kernels, registered as torch ops in the `fhelium` namespace.
//
// Negacyclic NTT over [..., rows, N] int64 residues (one prime per row, rows cycling through the
// primes of the table), bit-identical to the pure-torch reference in fhelium/engine/ntt.py:
// forward output entry t is the polynomial evaluated at psi^(2t+1) (natural order), fully
// reduced to [0, q); the inverse maps that back to coefficients in [0, q).
//
// Algorithm: Cooley-Tukey (forward, natural -> bit-reversed) and Gentleman-Sande (inverse,
// bit-reversed -> natural) with Harvey's lazy butterflies and Shoup-precomputed twiddles; the
// forward ends with a bit-reversing gather, the inverse starts with one; n^-1 is folded into the
// last inverse stage. Dispatch levels: 0 = scalar (unsigned __int128 Shoup products), 1 = AVX2 + FMA
// (4 lanes of residues held as binary64 integers, products exact through FMA; needs q < 2^50, else
// the row runs at the scalar level), 2 = AVX-512 DQ (the scalar level's 64-bit Shoup products in 8
// lanes: vpmullq for the low halves, four vpmuludq 32x32 partial products for the high half), 3 =
// AVX-512 IFMA52 (vpmadd52lo/hi; needs q < 2^50 so that lazy values < 4q fit 52 bits, else the row
// runs at the DQ level). The AVX-512 NTT rows are written once (ntt_avx512.inc.cpp) and compiled per
// level, the AVX2 rows in ntt_avx2.inc.cpp, all with per-function target attributes (no -march); the
// level is picked at run time from CPUID.
// Threads: at::parallel_for (torch's own intra-op pool), one row per task.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

namespace {

using u64 = uint64_t;
using u128 = unsigned __int128;

constexpr int64_t kLevelScalar = 0;
constexpr int64_t kLevelAvx2 = 1;
constexpr int64_t kLevelDq = 2;
constexpr int64_t kLevelIfma = 3;
constexpr u64 kIfmaModulusBound = u64{1} << 50;
// the AVX2 rows hold residues as binary64 integers: lazy values below 4q < 2^52
constexpr u64 kAvx2ModulusBound = u64{1} << 50;

// AVX2 with FMA (every AVX2 server CPU has both: Intel since Haswell, AMD since Zen)
bool cpu_has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}

bool cpu_has_dq() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  }();
  return has;
}

// the IFMA level also runs the DQ level's elementwise lanes
bool cpu_has_ifma() {
  static const bool has = [] {
    __builtin_cpu_init();
    return cpu_has_dq() && __builtin_cpu_supports("avx512ifma");
  }();
  return has;
}

int64_t best_level() {
  if (cpu_has_ifma()) return kLevelIfma;
  if (cpu_has_dq()) return kLevelDq;
  return cpu_has_avx2() ? kLevelAvx2 : kLevelScalar;
}

// the requested level, checked against the CPU
int64_t checked_level(int64_t level) {
  TORCH_CHECK(level == kLevelScalar || level == kLevelAvx2 || level == kLevelDq || level == kLevelIfma,
              "fhelium native: unknown dispatch level ", level);
  TORCH_CHECK(level != kLevelAvx2 || cpu_has_avx2(),
              "fhelium native: the AVX2 level was requested but this CPU lacks AVX2 and FMA");
  TORCH_CHECK(level != kLevelIfma || cpu_has_ifma(),
              "fhelium native: the IFMA level was requested but this CPU lacks AVX-512 IFMA");
  TORCH_CHECK(level != kLevelDq || cpu_has_dq(),
              "fhelium native: the DQ level was requested but this CPU lacks AVX-512 DQ");
  return level;
}

int log2_exact(int64_t n) {
  TORCH_CHECK(n >= 2 && (n & (n - 1)) == 0, "fhelium native NTT: ring degree must be a power of two >= 2, got ", n);
  return __builtin_ctzll(static_cast<u64>(n));
}

// bit-reversal permutation of [0, 2^logn), built once per logn
const uint32_t* bitrev_table(int logn) {
  static std::once_flag flags[32];
  static std::vector<uint32_t> tables[32];
  std::call_once(flags[logn], [logn] {
    const uint32_t n = uint32_t{1} << logn;
    std::vector<uint32_t>& table = tables[logn];
    table.resize(n);
    for (uint32_t k = 0; k < n; ++k) {
      uint32_t r = 0;
      for (int b = 0; b < logn; ++b) r |= ((k >> b) & 1u) << (logn - 1 - b);
      table[k] = r;
    }
  });
  return tables[logn].data();
}

inline u64 mul_mod_exact(u64 a, u64 b, u64 q) { return static_cast<u64>((static_cast<u128>(a) * b) % q); }

inline u64 pow_mod(u64 base, u64 exponent, u64 q) {
  u64 result = 1 % q;
  base %= q;
  while (exponent) {
    if (exponent & 1) result = mul_mod_exact(result, base, q);
    base = mul_mod_exact(base, base, q);
    exponent >>= 1;
  }
  return result;
}

inline u64 shoup(u64 w, u64 q) { return static_cast<u64>((static_cast<u128>(w) << 64) / q); }

// w*y mod q in [0, 2q) for any y < 2^64 (Shoup, 64-bit quotient estimate)
inline u64 mul_shoup_lazy(u64 y, u64 w, u64 w_shoup, u64 q) {
  const u64 estimate = static_cast<u64>((static_cast<u128>(y) * w_shoup) >> 64);
  return y * w - estimate * q;
}

// ------------------------------------------------------------------------------------ tables
// tables[r] is [4, N]:
//   0: psi^bitrev(k) for k >= 1 (forward twiddles);   [0] = psi^-bitrev(1) * n^-1 (last inverse stage)
//   1: Shoup(row 0)
//   2: psi^-bitrev(k) for k >= 1 (inverse twiddles);  [0] = n^-1
//   3: Shoup(row 2)
at::Tensor ntt_tables(const at::Tensor& moduli, const at::Tensor& roots, int64_t n) {
  TORCH_CHECK(moduli.dim() == 1 && roots.dim() == 1 && moduli.numel() == roots.numel(),
              "fhelium::ntt_tables: moduli and roots must be 1-D of equal length");
  const int logn = log2_exact(n);
  const at::Tensor q_cpu = moduli.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor psi_cpu = roots.to(at::kCPU, at::kLong).contiguous();
  const int64_t rows = q_cpu.numel();
  at::Tensor tables = at::empty({rows, 4, n}, q_cpu.options());
  const int64_t* q_data = q_cpu.data_ptr<int64_t>();
  const int64_t* psi_data = psi_cpu.data_ptr<int64_t>();
  u64* out = reinterpret_cast<u64*>(tables.data_ptr<int64_t>());
  const uint32_t* rev = bitrev_table(logn);
  for (int64_t r = 0; r < rows; ++r) {
    const u64 q = static_cast<u64>(q_data[r]);
    TORCH_CHECK(q_data[r] > 2 && q < (u64{1} << 62), "fhelium::ntt_tables: modulus out of range: ", q_data[r]);
    TORCH_CHECK((q - 1) % static_cast<u64>(2 * n) == 0, "fhelium::ntt_tables: q != 1 mod 2N: ", q_data[r]);
    const u64 psi = static_cast<u64>(psi_data[r]) % q;
    TORCH_CHECK(pow_mod(psi, static_cast<u64>(n), q) == q - 1, "fhelium::ntt_tables: not a primitive 2N-th root");
    std::vector<u64> powers(n);
    u64 p = 1;
    for (int64_t j = 0; j < n; ++j) {
      powers[j] = p;
      p = mul_mod_exact(p, psi, q);
    }
    u64* forward = out + r * 4 * n;
    u64* forward_shoup = forward + n;
    u64* inverse = forward + 2 * n;
    u64* inverse_shoup = forward + 3 * n;
    for (int64_t k = 1; k < n; ++k) {
      const u64 e = rev[k];
      forward[k] = powers[e];
      inverse[k] = e == 0 ? 1 : q - powers[n - e];  // psi^-e = -psi^(N-e)
      forward_shoup[k] = shoup(forward[k], q);
      inverse_shoup[k] = shoup(inverse[k], q);
    }
    const u64 n_inverse = pow_mod(static_cast<u64>(n) % q, q - 2, q);
    inverse[0] = n_inverse;
    inverse_shoup[0] = shoup(n_inverse, q);
    forward[0] = mul_mod_exact(inverse[1], n_inverse, q);
    forward_shoup[0] = shoup(forward[0], q);
  }
  return tables;
}

// ------------------------------------------------------------------------------------ scalar
struct RowTables {
  const u64* forward;
  const u64* forward_shoup;
  const u64* inverse;
  const u64* inverse_shoup;
  u64 q;
};

// a: natural-order coefficients in [0, q) (scratch, destroyed); out: natural-order evaluations
void forward_scalar(u64* a, u64* out, const RowTables& t, int logn) {
  const int64_t n = int64_t{1} << logn;
  const u64 q = t.q, two_q = 2 * q;
  int64_t half = n;
  for (int64_t m = 1; m < n; m <<= 1) {
    half >>= 1;
    for (int64_t i = 0; i < m; ++i) {
      const u64 w = t.forward[m + i], ws = t.forward_shoup[m + i];
      u64* x = a + 2 * i * half;
      u64* y = x + half;
      for (int64_t j = 0; j < half; ++j) {
        u64 u = x[j];
        u = u >= two_q ? u - two_q : u;
        const u64 v = mul_shoup_lazy(y[j], w, ws, q);
        x[j] = u + v;
        y[j] = u - v + two_q;
      }
    }
  }
  const uint32_t* rev = bitrev_table(logn);
  for (int64_t k = 0; k < n; ++k) {
    u64 v = a[rev[k]];
    v = v >= two_q ? v - two_q : v;
    out[k] = v >= q ? v - q : v;
  }
}

// in: natural-order evaluations in [0, q); a: scratch of n; out: coefficients in [0, q)
void inverse_scalar(const u64* in, u64* a, u64* out, const RowTables& t, int logn) {
  const int64_t n = int64_t{1} << logn;
  const u64 q = t.q, two_q = 2 * q;
  const uint32_t* rev = bitrev_table(logn);
  for (int64_t k = 0; k < n; ++k) a[k] = in[rev[k]];
  int64_t half = 1;
  for (int64_t m = n >> 1; m > 1; m >>= 1) {
    for (int64_t i = 0; i < m; ++i) {
      const u64 w = t.inverse[m + i], ws = t.inverse_shoup[m + i];
      u64* x = a + 2 * i * half;
      u64* y = x + half;
      for (int64_t j = 0; j < half; ++j) {
        const u64 u = x[j], v = y[j];
        const u64 sum = u + v;
        x[j] = sum >= two_q ? sum - two_q : sum;
        y[j] = mul_shoup_lazy(u - v + two_q, w, ws, q);
      }
    }
    half <<= 1;
  }
  // last stage (m = 1, half = n/2) with n^-1 folded in, then the final reduction
  const u64 ni = t.inverse[0], nis = t.inverse_shoup[0], wn = t.forward[0], wns = t.forward_shoup[0];
  const int64_t h = n >> 1;
  for (int64_t j = 0; j < h; ++j) {
    const u64 u = a[j], v = a[j + h];
    u64 x = mul_shoup_lazy(u + v, ni, nis, q);
    u64 y = mul_shoup_lazy(u - v + two_q, wn, wns, q);
    out[j] = x >= q ? x - q : x;
    out[j + h] = y >= q ? y - q : y;
  }
}

// ------------------------------------------------------------------------------------ IFMA52
#define FHELIUM_IFMA __attribute__((target("avx512f,avx512ifma")))

FHELIUM_IFMA inline __m512i ifma_mul_shoup_lazy(__m512i y, __m512i w, __m512i ws52, __m512i q, __m512i mask52) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i estimate = _mm512_madd52hi_epu64(zero, y, ws52);
  const __m512i product = _mm512_madd52lo_epu64(zero, y, w);
  const __m512i correction = _mm512_madd52lo_epu64(zero, estimate, q);
  return _mm512_and_si512(_mm512_sub_epi64(product, correction), mask52);
}

// x in [0, 2b) -> [0, b)
FHELIUM_IFMA inline __m512i ifma_reduce_once(__m512i x, __m512i bound) {
  return _mm512_min_epu64(x, _mm512_sub_epi64(x, bound));
}

// lane permutations for a butterfly stage with half-distance h in {1, 2, 4} on 16 elements
struct SmallStage {
  alignas(64) int64_t take_x[8];
  alignas(64) int64_t take_y[8];
  alignas(64) int64_t put_lo[8];
  alignas(64) int64_t put_hi[8];
  alignas(64) int64_t twiddle[8];
  explicit SmallStage(int h) {
    for (int l = 0; l < 8; ++l) {
      const int g = l / h, p = l % h;
      take_x[l] = g * 2 * h + p;
      take_y[l] = g * 2 * h + h + p;
      twiddle[l] = g;
    }
    for (int e = 0; e < 16; ++e) {
      const int g = e / (2 * h), p = e % (2 * h);
      const int64_t source = p < h ? g * h + p : 8 + g * h + p - h;
      (e < 8 ? put_lo[e] : put_hi[e - 8]) = source;
    }
  }
};

const SmallStage& small_stage(int h) {
  static const SmallStage s1(1), s2(2), s4(4);
  return h == 1 ? s1 : (h == 2 ? s2 : s4);
}

// Stages whose butterflies stay inside a block of this many residues (32 KiB, an L1's worth) run
// block by block, all of them on one block before the next: one pass to L2 per block instead of
// one per stage. The same butterflies, in another order: the same bits.
constexpr int64_t kIfmaBlock = 4096;

namespace ifma {
#define FHELIUM_VECTOR FHELIUM_IFMA
FHELIUM_IFMA inline __m512i mul_shoup_lazy_vector(__m512i y, __m512i w, __m512i ws52, __m512i q) {
  return ifma_mul_shoup_lazy(y, w, ws52, q, _mm512_set1_epi64((1LL << 52) - 1));
}
inline long long shoup_operand(u64 shoup_value) { return static_cast<long long>(shoup_value >> 12); }
FHELIUM_IFMA inline __m512i shoup_operands(__m512i shoup_values) { return _mm512_srli_epi64(shoup_values, 12); }
FHELIUM_IFMA inline __m512i reduce_once(__m512i x, __m512i bound) { return ifma_reduce_once(x, bound); }
#include "ntt_avx512.inc.cpp"
#undef FHELIUM_VECTOR
}  // namespace ifma

// ------------------------------------------------------------------------------------ AVX-512 DQ
// No IFMA: the scalar level's 64-bit Shoup product in 8 lanes. The high half of y * Shoup(w) from
// four 32x32 -> 64 partial products (vpmuludq), the low halves with vpmullq (DQ), so every lazy value
// equals the scalar level's, for any q < 2^62.
#define FHELIUM_DQ __attribute__((target("avx512f,avx512dq")))

namespace dq {
#define FHELIUM_VECTOR FHELIUM_DQ
FHELIUM_DQ inline __m512i mul_high_64(__m512i a, __m512i b) {
  const __m512i low32 = _mm512_set1_epi64(0xffffffffLL);
  const __m512i a_high = _mm512_srli_epi64(a, 32), b_high = _mm512_srli_epi64(b, 32);
  const __m512i ll = _mm512_mul_epu32(a, b), lh = _mm512_mul_epu32(a, b_high);
  const __m512i hl = _mm512_mul_epu32(a_high, b), hh = _mm512_mul_epu32(a_high, b_high);
  const __m512i middle = _mm512_add_epi64(_mm512_add_epi64(_mm512_srli_epi64(ll, 32), _mm512_and_si512(lh, low32)),
                                          _mm512_and_si512(hl, low32));  // < 3 * 2^32
  return _mm512_add_epi64(_mm512_add_epi64(hh, _mm512_srli_epi64(lh, 32)),
                          _mm512_add_epi64(_mm512_srli_epi64(hl, 32), _mm512_srli_epi64(middle, 32)));
}
// mul_shoup_lazy lane by lane: y*w - floor(y*ws / 2^64)*q (mod 2^64), in [0, 2q) for any y
FHELIUM_DQ inline __m512i mul_shoup_lazy_vector(__m512i y, __m512i w, __m512i ws, __m512i q) {
  return _mm512_sub_epi64(_mm512_mullo_epi64(y, w), _mm512_mullo_epi64(mul_high_64(y, ws), q));
}
inline long long shoup_operand(u64 shoup_value) { return static_cast<long long>(shoup_value); }
FHELIUM_DQ inline __m512i shoup_operands(__m512i shoup_values) { return shoup_values; }
FHELIUM_DQ inline __m512i reduce_once(__m512i x, __m512i bound) {
  return _mm512_min_epu64(x, _mm512_sub_epi64(x, bound));
}
#include "ntt_avx512.inc.cpp"
#undef FHELIUM_VECTOR
}  // namespace dq

// ------------------------------------------------------------------------------------ AVX2 + FMA
// No 64-bit lane multiply at all (no vpmullq, and vpmuludq's 32x32 partial products make a 64-bit
// Shoup product ~30 instructions for 4 lanes): the residues are held as binary64 integers instead,
// every q < 2^50 so that lazy values stay below 4q < 2^52. A product y*w is exact as high + low with
// high = fl(y*w), low = fma(y, w, -high); the quotient estimate floor(y * fl(w/q)) is within 1 of
// y*w/q (y < 2q), so y*w - estimate*q, computed exactly by one more FMA, lies in [-q, 2q) and one
// correction makes it lazy. Every output is fully reduced, hence the same bits as the other levels.
#define FHELIUM_AVX2 __attribute__((target("avx2,fma")))

namespace avx2 {
#define FHELIUM_VECTOR FHELIUM_AVX2
// x in [0, 2^52) -> the same integer as binary64 (through the 2^52 bias: exact)
FHELIUM_AVX2 inline __m256d to_double(__m256i x) {
  const __m256i bias = _mm256_set1_epi64x(0x4330000000000000LL);
  return _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(x, bias)), _mm256_castsi256_pd(bias));
}
// an integer-valued binary64 in [0, 2^52) -> that integer
FHELIUM_AVX2 inline __m256i to_integer(__m256d x) {
  const __m256d bias = _mm256_set1_pd(0x1p52);
  return _mm256_xor_si256(_mm256_castpd_si256(_mm256_add_pd(x, bias)), _mm256_castpd_si256(bias));
}
// x in [0, 2 bound) -> [0, bound): x - bound unless that is negative (its sign bit picks x)
FHELIUM_AVX2 inline __m256d reduce_once(__m256d x, __m256d bound) {
  const __m256d d = _mm256_sub_pd(x, bound);
  return _mm256_blendv_pd(d, x, d);
}
// r in [-q, q) -> [0, q) (and [-q, 2q) -> [0, 2q))
FHELIUM_AVX2 inline __m256d add_q_if_negative(__m256d r, __m256d q) {
  return _mm256_blendv_pd(r, _mm256_add_pd(r, q), r);
}
// w*y mod q in [0, 2q) for y in [0, 2q), w in [0, q), wq = fl(fl(w) * fl(1/q)), q < 2^50: the estimate
// fl(y*wq) carries three roundings, so it is within 2q * 3 * 2^-53 < 1 of y*w/q and its floor e
// leaves y*w - e*q in [-q, 2q); high - e*q = (y*w - e*q) - low is an integer below 2^53, exact
FHELIUM_AVX2 inline __m256d mul_lazy(__m256d y, __m256d w, __m256d wq, __m256d q) {
  const __m256d high = _mm256_mul_pd(y, w);
  const __m256d low = _mm256_fmsub_pd(y, w, high);
  const __m256d e = _mm256_round_pd(_mm256_mul_pd(y, wq), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  return add_q_if_negative(_mm256_add_pd(_mm256_fnmadd_pd(e, q, high), low), q);
}
// mul_mod_one lane by lane for a, b in [0, q), q < 2^50 (q_inverse = fl(1/q)): the reference's
// binary64 estimate in the reference's order, then a*b - estimate*q exactly (high - estimate*q by FMA,
// plus the product's rounding error), then the reference's two corrections
FHELIUM_AVX2 inline __m256d mul_mod_exact_lanes(__m256d a, __m256d b, __m256d q, __m256d q_inverse) {
  const __m256d high = _mm256_mul_pd(a, b);
  const __m256d low = _mm256_fmsub_pd(a, b, high);
  const __m256d e = _mm256_round_pd(_mm256_mul_pd(high, q_inverse), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256d r = add_q_if_negative(_mm256_add_pd(_mm256_fnmadd_pd(e, q, high), low), q);
  return add_q_if_negative(_mm256_sub_pd(r, q), q);
}
// 4 residues (integers below 2^52) from memory as binary64, and back
FHELIUM_AVX2 inline __m256d load(const void* p) {
  return to_double(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
FHELIUM_AVX2 inline void store(void* p, __m256d v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_integer(v));
}
FHELIUM_AVX2 inline __m256i mul_mod_lanes(__m256i a, __m256i b, __m256d q, __m256d q_inverse) {
  return to_integer(mul_mod_exact_lanes(to_double(a), to_double(b), q, q_inverse));
}
#include "ntt_avx2.inc.cpp"
#undef FHELIUM_VECTOR
}  // namespace avx2

// ------------------------------------------------------------------------------------ ops
// one row at a resolved level (see resolve_level)
inline void forward_row(u64* scratch, u64* out, const RowTables& t, int logn, int64_t level) {
  if (level == kLevelIfma) ifma::forward(scratch, out, t, logn);
  else if (level == kLevelDq) dq::forward(scratch, out, t, logn);
  else if (level == kLevelAvx2) avx2::forward(scratch, out, t, logn);
  else forward_scalar(scratch, out, t, logn);
}

inline void inverse_row(const u64* in, u64* scratch, u64* out, const RowTables& t, int logn, int64_t level) {
  if (level == kLevelIfma) ifma::inverse(in, scratch, out, t, logn);
  else if (level == kLevelDq) dq::inverse(in, scratch, out, t, logn);
  else if (level == kLevelAvx2) avx2::inverse(in, scratch, out, t, logn);
  else inverse_scalar(in, scratch, out, t, logn);
}

// the level a row kernel runs: the vector levels need N >= 16 (16-element blocks); IFMA needs every
// q < 2^50 (lazy values below 4q in 52 bits) and otherwise runs the DQ level, which takes q < 2^62;
// AVX2 needs every q < 2^50 too (binary64 integers) and otherwise runs the scalar level
int64_t resolve_level(int64_t level, const at::Tensor& moduli, int logn) {
  checked_level(level);
  if (level == kLevelScalar || logn < 4) return kLevelScalar;
  if (level == kLevelIfma || level == kLevelAvx2) {
    const int64_t* q = moduli.data_ptr<int64_t>();
    for (int64_t i = 0; i < moduli.numel(); ++i) {
      if (level == kLevelIfma && static_cast<u64>(q[i]) >= kIfmaModulusBound) return kLevelDq;
      if (level == kLevelAvx2 && static_cast<u64>(q[i]) >= kAvx2ModulusBound) return kLevelScalar;
    }
  }
  return level;
}

void check_ntt_arguments(const at::Tensor& x, const at::Tensor& moduli, const at::Tensor& tables) {
  TORCH_CHECK(x.device().is_cpu() && moduli.device().is_cpu() && tables.device().is_cpu(),
              "fhelium native NTT: CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kLong && moduli.scalar_type() == at::kLong && tables.scalar_type() == at::kLong,
              "fhelium native NTT: int64 tensors expected");
  TORCH_CHECK(x.dim() >= 2, "fhelium native NTT: input must be [..., rows, N]");
  TORCH_CHECK(tables.dim() == 3 && tables.size(1) == 4 && tables.is_contiguous(),
              "fhelium native NTT: tables must be a contiguous [rows, 4, N] tensor from fhelium::ntt_tables");
  TORCH_CHECK(moduli.dim() == 1 && moduli.size(0) == tables.size(0) && moduli.is_contiguous(),
              "fhelium native NTT: moduli must be contiguous [rows] matching the tables");
  TORCH_CHECK(x.size(-2) == tables.size(0) && x.size(-1) == tables.size(2),
              "fhelium native NTT: input [..., ", x.size(-2), ", ", x.size(-1), "] does not match tables [",
              tables.size(0), ", 4, ", tables.size(2), "]");
}

at::Tensor ntt_run(const at::Tensor& x_in, const at::Tensor& moduli, const at::Tensor& tables, int64_t level,
                   bool inverse) {
  check_ntt_arguments(x_in, moduli, tables);
  const int64_t n = x_in.size(-1);
  const int logn = log2_exact(n);
  const int64_t primes = tables.size(0);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const int64_t rows = x.numel() / n;
  const int64_t chosen = resolve_level(level, moduli, logn);
  const u64* source = reinterpret_cast<const u64*>(x.data_ptr<int64_t>());
  u64* target = reinterpret_cast<u64*>(out.data_ptr<int64_t>());
  const u64* table = reinterpret_cast<const u64*>(tables.data_ptr<int64_t>());
  const int64_t* q_data = moduli.data_ptr<int64_t>();
  bitrev_table(logn);  // built before the threads start
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<u64> scratch(static_cast<size_t>(n) + 8);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t prime = row % primes;
      const u64* base = table + prime * 4 * n;
      const RowTables t{base, base + n, base + 2 * n, base + 3 * n, static_cast<u64>(q_data[prime])};
      const u64* in = source + row * n;
      u64* result = target + row * n;
      if (inverse) {
        inverse_row(in, scratch.data(), result, t, logn, chosen);
      } else {
        std::memcpy(scratch.data(), in, static_cast<size_t>(n) * sizeof(u64));
        forward_row(scratch.data(), result, t, logn, chosen);
      }
    }
  });
  return out;
}

at::Tensor ntt_forward(const at::Tensor& x, const at::Tensor& moduli, const at::Tensor& tables, int64_t level) {
  return ntt_run(x, moduli, tables, level, false);
}

at::Tensor ntt_inverse(const at::Tensor& x, const at::Tensor& moduli, const at::Tensor& tables, int64_t level) {
  return ntt_run(x, moduli, tables, level, true);
}

// (a*b [+ c]) mod q, elementwise with broadcasting; a, b, c in [0, q), q < 2^50 (as the reference:
// binary64 quotient estimate, exact wrapping remainder, corrections)
inline int64_t mul_mod_one(int64_t a, int64_t b, int64_t q) {
  const double q_inverse = 1.0 / static_cast<double>(q);
  const int64_t estimate = static_cast<int64_t>(static_cast<double>(a) * static_cast<double>(b) * q_inverse);
  int64_t r = static_cast<int64_t>(static_cast<u64>(a) * static_cast<u64>(b) - static_cast<u64>(estimate) * static_cast<u64>(q));
  r += (r >> 63) & q;
  r -= q;
  r += (r >> 63) & q;
  return r;
}

void check_elementwise(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong,
                "fhelium native elementwise ops: int64 CPU tensors expected");
  }
}

// Elementwise (a op b [op c]) mod q with broadcasting, the same formulas as the torch reference
// (fhelium/engine/modular.py), so the same bits for every input. Level IFMA runs 8 lanes at a time
// with AVX-512 (F + DQ: 64-bit multiplies and int64 <-> double conversions) where the inner loop
// is dense or broadcast; other strides take the scalar loop.
enum class Elementwise { Add, Sub, Mul, MulAdd };

template <Elementwise op>
inline int64_t elementwise_one(const int64_t* v, int64_t q) {
  if constexpr (op == Elementwise::Add) {
    int64_t r = static_cast<int64_t>(static_cast<u64>(v[0]) + static_cast<u64>(v[1]) - static_cast<u64>(q));
    return r + ((r >> 63) & q);
  } else if constexpr (op == Elementwise::Sub) {
    const int64_t r = static_cast<int64_t>(static_cast<u64>(v[0]) - static_cast<u64>(v[1]));
    return r + ((r >> 63) & q);
  } else if constexpr (op == Elementwise::Mul) {
    return mul_mod_one(v[0], v[1], q);
  } else {
    int64_t r = mul_mod_one(v[0], v[1], q) + v[2] - q;
    return r + ((r >> 63) & q);
  }
}

FHELIUM_DQ inline __m512i load_or_broadcast(const char* p, int64_t stride) {
  return stride == 0 ? _mm512_set1_epi64(*reinterpret_cast<const long long*>(p)) : _mm512_loadu_si512(p);
}

FHELIUM_DQ inline __m512i add_q_if_negative(__m512i r, __m512i q) {
  return _mm512_add_epi64(r, _mm512_and_si512(_mm512_srai_epi64(r, 63), q));
}

FHELIUM_DQ inline __m512i mul_mod_vector(__m512i a, __m512i b, __m512i q) {
  // mul_mod_one lane by lane: the same binary64 operations in the same order, then exact corrections
  const __m512d q_inverse = _mm512_div_pd(_mm512_set1_pd(1.0), _mm512_cvtepi64_pd(q));
  const __m512d product = _mm512_mul_pd(_mm512_cvtepi64_pd(a), _mm512_cvtepi64_pd(b));
  const __m512i estimate = _mm512_cvttpd_epi64(_mm512_mul_pd(product, q_inverse));
  __m512i r = _mm512_sub_epi64(_mm512_mullo_epi64(a, b), _mm512_mullo_epi64(estimate, q));
  r = add_q_if_negative(r, q);
  return add_q_if_negative(_mm512_sub_epi64(r, q), q);
}

// one chunk's operands for the vector loops: out, a, b, c (MulAdd only: inputs == 4) and q (last), with
// their byte strides; `suited` is false where a stride does not suit them (8-byte steps, or 0 for a
// broadcast input)
struct VectorLanes {
  char* out;
  const char* a;
  const char* b;
  const char* c;
  const char* pq;
  int64_t sa, sb, sc, sq;
};

struct VectorOperands {
  bool suited;
  VectorLanes lanes;
};

inline VectorOperands vector_operands(char** data, const int64_t* strides, int inputs) {
  for (int t = 0; t <= inputs; ++t) {
    if (strides[t] != 8 && (t == 0 || strides[t] != 0)) return {false, {}};
  }
  return {true,
          {data[0], data[1], data[2], inputs == 4 ? data[3] : nullptr, data[inputs], strides[1], strides[2],
           inputs == 4 ? strides[3] : 0, strides[inputs]}};
}

// count elements with byte strides; returns how many it handled (a multiple of 8), 0 if the strides
// do not suit the vector loop
template <Elementwise op>
FHELIUM_DQ int64_t elementwise_vector(char** data, const int64_t* strides, int64_t count, int inputs) {
  const VectorOperands o = vector_operands(data, strides, inputs);
  if (!o.suited) return 0;
  const auto [out, a, b, c, pq, sa, sb, sc, sq] = o.lanes;
  const int64_t vectors = count / 8 * 8;
  for (int64_t k = 0; k < vectors; k += 8) {
    const __m512i q = load_or_broadcast(pq + k * sq, sq);
    const __m512i va = load_or_broadcast(a + k * sa, sa);
    const __m512i vb = load_or_broadcast(b + k * sb, sb);
    __m512i r;
    if constexpr (op == Elementwise::Add) {
      r = add_q_if_negative(_mm512_sub_epi64(_mm512_add_epi64(va, vb), q), q);
    } else if constexpr (op == Elementwise::Sub) {
      r = add_q_if_negative(_mm512_sub_epi64(va, vb), q);
    } else if constexpr (op == Elementwise::Mul) {
      r = mul_mod_vector(va, vb, q);
    } else {
      const __m512i vc = load_or_broadcast(c + k * sc, sc);
      r = add_q_if_negative(_mm512_sub_epi64(_mm512_add_epi64(mul_mod_vector(va, vb, q), vc), q), q);
    }
    _mm512_storeu_si512(out + k * 8, r);
  }
  return vectors;
}

// elements [from, to) by the scalar formula
template <Elementwise op>
inline void elementwise_span(char** data, const int64_t* strides, int64_t from, int64_t to, int inputs) {
  int64_t v[3] = {0, 0, 0};
  for (int64_t i = from; i < to; ++i) {
    for (int t = 0; t < inputs - 1; ++t) v[t] = *reinterpret_cast<const int64_t*>(data[t + 1] + i * strides[t + 1]);
    const int64_t q = *reinterpret_cast<const int64_t*>(data[inputs] + i * strides[inputs]);
    *reinterpret_cast<int64_t*>(data[0] + i * strides[0]) = elementwise_one<op>(v, q);
  }
}

FHELIUM_AVX2 inline __m256i load_or_broadcast_avx2(const char* p, int64_t stride) {
  return stride == 0 ? _mm256_set1_epi64x(*reinterpret_cast<const long long*>(p))
                     : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

FHELIUM_AVX2 inline __m256i add_q_if_negative_avx2(__m256i r, __m256i q) {
  return _mm256_add_epi64(r, _mm256_and_si256(_mm256_cmpgt_epi64(_mm256_setzero_si256(), r), q));
}

// elementwise_vector in 4 AVX2 lanes: add and sub are the reference's integer formulas; the products
// run in binary64 lanes (avx2::mul_mod_lanes) where a, b < q < 2^50 (the reference's contract, under
// which its result is the unique residue), else those 4 elements take the scalar formula
template <Elementwise op>
FHELIUM_AVX2 int64_t elementwise_avx2(char** data, const int64_t* strides, int64_t count, int inputs) {
  const VectorOperands o = vector_operands(data, strides, inputs);
  if (!o.suited) return 0;
  const auto [out, a, b, c, pq, sa, sb, sc, sq] = o.lanes;
  const int64_t vectors = count / 4 * 4;
  constexpr bool product = op == Elementwise::Mul || op == Elementwise::MulAdd;
  const __m256i outside = _mm256_set1_epi64x(~static_cast<long long>(kAvx2ModulusBound - 1));
  __m256d q_double = _mm256_setzero_pd(), q_inverse = _mm256_setzero_pd();
  if (product && sq == 0) {
    q_double = avx2::to_double(_mm256_andnot_si256(outside, _mm256_set1_epi64x(*reinterpret_cast<const long long*>(pq))));
    q_inverse = _mm256_div_pd(_mm256_set1_pd(1.0), q_double);
  }
  for (int64_t k = 0; k < vectors; k += 4) {
    const __m256i q = load_or_broadcast_avx2(pq + k * sq, sq);
    const __m256i va = load_or_broadcast_avx2(a + k * sa, sa);
    const __m256i vb = load_or_broadcast_avx2(b + k * sb, sb);
    __m256i r;
    if constexpr (op == Elementwise::Add) {
      r = add_q_if_negative_avx2(_mm256_sub_epi64(_mm256_add_epi64(va, vb), q), q);
    } else if constexpr (op == Elementwise::Sub) {
      r = add_q_if_negative_avx2(_mm256_sub_epi64(va, vb), q);
    } else {
      const __m256i below_q = _mm256_and_si256(_mm256_cmpgt_epi64(q, va), _mm256_cmpgt_epi64(q, vb));
      if (!_mm256_testz_si256(_mm256_or_si256(_mm256_or_si256(va, vb), q), outside) ||
          _mm256_movemask_pd(_mm256_castsi256_pd(below_q)) != 0xf) {
        elementwise_span<op>(data, strides, k, k + 4, inputs);
        continue;
      }
      if (sq != 0) {
        q_double = avx2::to_double(q);
        q_inverse = _mm256_div_pd(_mm256_set1_pd(1.0), q_double);
      }
      r = avx2::mul_mod_lanes(va, vb, q_double, q_inverse);
      if constexpr (op == Elementwise::MulAdd) {
        const __m256i vc = load_or_broadcast_avx2(c + k * sc, sc);
        r = add_q_if_negative_avx2(_mm256_sub_epi64(_mm256_add_epi64(r, vc), q), q);
      }
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k * 8), r);
  }
  return vectors;
}

// kind: kLevelScalar, kLevelAvx2 or kLevelDq (the DQ lanes, at the DQ and IFMA levels)
template <Elementwise op>
void elementwise_loop(at::TensorIterator& iter, int inputs, int64_t kind) {
  iter.for_each([inputs, kind](char** data, const int64_t* strides, int64_t count) {
    int64_t done = 0;
    if (kind == kLevelDq) done = elementwise_vector<op>(data, strides, count, inputs);
    else if (kind == kLevelAvx2) done = elementwise_avx2<op>(data, strides, count, inputs);
    elementwise_span<op>(data, strides, done, count, inputs);
  });
}

// the elementwise ops and the tensor product: 8 AVX-512 DQ lanes at the DQ and IFMA levels, 4 AVX2
// lanes at the AVX2 level
int64_t vector_kind(int64_t level) {
  checked_level(level);
  return level == kLevelIfma ? kLevelDq : level;
}

template <Elementwise op>
at::Tensor elementwise(std::initializer_list<const at::Tensor*> operands, int64_t level) {
  for (const at::Tensor* t : operands) check_elementwise({t});
  at::Tensor out;
  at::TensorIteratorConfig config;
  config.add_output(out);
  for (const at::Tensor* t : operands) config.add_const_input(*t);
  at::TensorIterator iter = config.build();
  elementwise_loop<op>(iter, static_cast<int>(operands.size()), vector_kind(level));
  return iter.output();
}

template <Elementwise op>
void elementwise_(at::Tensor& a, std::initializer_list<const at::Tensor*> rest, int64_t level) {
  check_elementwise({&a});
  for (const at::Tensor* t : rest) check_elementwise({t});
  at::TensorIteratorConfig config;
  config.add_output(a).add_const_input(a).resize_outputs(false);
  for (const at::Tensor* t : rest) config.add_const_input(*t);
  at::TensorIterator iter = config.build();
  elementwise_loop<op>(iter, static_cast<int>(rest.size()) + 1, vector_kind(level));
}

at::Tensor mul_mod(const at::Tensor& a, const at::Tensor& b, const at::Tensor& q, int64_t level) {
  return elementwise<Elementwise::Mul>({&a, &b, &q}, level);
}

at::Tensor mul_add_mod(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const at::Tensor& q,
                       int64_t level) {
  return elementwise<Elementwise::MulAdd>({&a, &b, &c, &q}, level);
}

at::Tensor add_mod(const at::Tensor& a, const at::Tensor& b, const at::Tensor& q, int64_t level) {
  return elementwise<Elementwise::Add>({&a, &b, &q}, level);
}

at::Tensor sub_mod(const at::Tensor& a, const at::Tensor& b, const at::Tensor& q, int64_t level) {
  return elementwise<Elementwise::Sub>({&a, &b, &q}, level);
}

void add_mod_(at::Tensor& a, const at::Tensor& b, const at::Tensor& q, int64_t level) {
  elementwise_<Elementwise::Add>(a, {&b, &q}, level);
}

void sub_mod_(at::Tensor& a, const at::Tensor& b, const at::Tensor& q, int64_t level) {
  elementwise_<Elementwise::Sub>(a, {&b, &q}, level);
}

// ------------------------------------------------------------------------------------ projection
// The sum checks' random projection (fhelium/multiparty/sumcheck.py `project`): out[l, n] =
// Σ_r w[r, l]·x[r, l, n] mod q_l from x [R, L, N] and w [R, L] (both in [0, q_l)), exact. The products are
// summed in 128 bits and reduced once every `chunk` rows (as many as the accumulator holds without
// overflow for any 64-bit x: 2^14 rows for 50-bit primes), so a residue costs one 64x64 product and a 128-bit add instead
// of a modular product. One task per limb and block of coefficients (at::parallel_for).
// The projection, and with `in_range` whether every x[r, l, n] lies in [0, q_l) (one more compare per
// residue of the pass that reads it anyway: the sum checks' range check costs no pass of its own).
at::Tensor project_rows_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q, bool* in_range) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kLong && w.scalar_type() == at::kLong &&
                  q.scalar_type() == at::kLong,
              "project_rows: x [R, L, N], w [R, L] and q [L] must be int64");
  const int64_t rows = x.size(0), limbs = x.size(1), n = x.size(2);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == limbs && q.dim() == 1 && q.size(0) == limbs,
              "project_rows: w must be [R, L] and q [L] for x [R, L, N]");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), qc = q.contiguous();
  at::Tensor out = at::empty({limbs, n}, x.options());
  const u64* xs = reinterpret_cast<const u64*>(xc.data_ptr<int64_t>());
  const u64* ws = reinterpret_cast<const u64*>(wc.data_ptr<int64_t>());
  const int64_t* qs = qc.data_ptr<int64_t>();
  u64* os = reinterpret_cast<u64*>(out.data_ptr<int64_t>());
  for (int64_t l = 0; l < limbs; ++l) TORCH_CHECK(qs[l] > 1, "project_rows: every modulus must exceed 1");
  constexpr int64_t kBlock = 512;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::atomic<bool> all_in_range{true};
  at::parallel_for(0, limbs * blocks, 1, [&](int64_t begin, int64_t end) {
    u128 acc[kBlock];
    bool over = false;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t l = task / blocks, from = (task % blocks) * kBlock, to = std::min(n, from + kBlock);
      const u64 q_l = static_cast<u64>(qs[l]);
      // a product's bound for any 64-bit x (residues are < q_l, but an input out of range must not wrap)
      const u128 largest = static_cast<u128>(~u64{0}) * (q_l - 1);
      const u128 room = ~u128{0} / largest;  // products the accumulator holds
      const int64_t chunk = static_cast<int64_t>(std::min<u128>(room, u128{1} << 30));
      for (int64_t k = 0; k < to - from; ++k) acc[k] = 0;
      int64_t since = 0;
      for (int64_t r = 0; r < rows;) {
        if (since + 4 > chunk) {  // fold the sums back below q before they could overflow
          for (int64_t k = 0; k < to - from; ++k) acc[k] %= q_l;
          since = 1;  // each folded sum is < q_l <= one product's bound
        }
        if (r + 4 <= rows && chunk >= 5) {  // four rows per pass over the accumulators
          const u64 w0 = ws[r * limbs + l], w1 = ws[(r + 1) * limbs + l];
          const u64 w2 = ws[(r + 2) * limbs + l], w3 = ws[(r + 3) * limbs + l];
          const u64* x0 = xs + (r * limbs + l) * n + from;
          const u64* x1 = x0 + limbs * n;
          const u64* x2 = x1 + limbs * n;
          const u64* x3 = x2 + limbs * n;
          u64 high = 0;
          for (int64_t k = 0; k < to - from; ++k) {
            acc[k] += static_cast<u128>(x0[k]) * w0 + static_cast<u128>(x1[k]) * w1;
            acc[k] += static_cast<u128>(x2[k]) * w2 + static_cast<u128>(x3[k]) * w3;
            high = std::max(high, std::max(std::max(x0[k], x1[k]), std::max(x2[k], x3[k])));
          }
          over |= high >= q_l;
          r += 4;
          since += 4;
        } else {
          const u64 weight = ws[r * limbs + l];
          const u64* row = xs + (r * limbs + l) * n + from;
          u64 high = 0;
          for (int64_t k = 0; k < to - from; ++k) {
            acc[k] += static_cast<u128>(row[k]) * weight;
            high = std::max(high, row[k]);
          }
          over |= high >= q_l;
          r += 1;
          since += 1;
        }
      }
      for (int64_t k = 0; k < to - from; ++k) os[l * n + from + k] = static_cast<u64>(acc[k] % q_l);
    }
    if (over) all_in_range.store(false, std::memory_order_relaxed);
  });
  if (in_range != nullptr) *in_range = all_in_range.load();
  return out;
}

at::Tensor project_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q) {
  return project_rows_into(x, w, q, nullptr);
}

// (the projection, a 0-dim bool tensor: every residue of x in [0, q_l))
std::tuple<at::Tensor, at::Tensor> project_rows_checked(const at::Tensor& x, const at::Tensor& w,
                                                        const at::Tensor& q) {
  bool in_range = true;
  at::Tensor projection = project_rows_into(x, w, q, &in_range);
  return {projection, at::scalar_tensor(in_range, at::kBool)};
}

// ------------------------------------------------------------------------------------ RNS kernels
// Coarse-grained CKKS steps (one call per multi-limb polynomial or batch), exact, so bit-identical
// to the torch reference's compositions in fhelium/engine/engine.py: the hybrid key switch
// (decompose -> digit NTTs -> inner product with the key -> ModDown) and the division by a dropped
// prime with rounding (rescale, ModDown). Row primitives come in a scalar and an IFMA version.

// an uninitialised u64 work buffer (torch's allocator; no zero fill)
struct Buffer {
  at::Tensor storage;
  u64* pointer = nullptr;
  Buffer() = default;
  explicit Buffer(int64_t count)
      : storage(at::empty({count}, at::kLong)), pointer(reinterpret_cast<u64*>(storage.data_ptr<int64_t>())) {}
  u64* data() const { return pointer; }
};

inline RowTables row_tables(const u64* table, const int64_t* q, int64_t prime, int64_t n) {
  const u64* base = table + prime * 4 * n;
  return RowTables{base, base + n, base + 2 * n, base + 3 * n, static_cast<u64>(q[prime])};
}


// Lifting a centered residue of q_src to q_dst: c > q_src/2 stands for c - q_src; adding
// K - q_src, K = q_dst*ceil(q_src/q_dst), keeps it non-negative and below q_src + q_dst.
struct Lift {
  u64 half_src, offset, q, one_shoup;
  Lift(u64 q_src, u64 q_dst)
      : half_src(q_src / 2),
        offset(q_dst * ((q_src + q_dst - 1) / q_dst) - q_src),
        q(q_dst),
        one_shoup(shoup(1, q_dst)) {}
};

void lift_row_scalar(const u64* c, u64* out, int64_t n, const Lift& l) {
  for (int64_t k = 0; k < n; ++k) {
    const u64 y = c[k] + (c[k] > l.half_src ? l.offset : 0);
    const u64 r = y - static_cast<u64>((static_cast<u128>(y) * l.one_shoup) >> 64) * l.q;  // [0, 2q)
    out[k] = r >= l.q ? r - l.q : r;
  }
}

// out = ((x - c) mod q) * w mod q, x and c in [0, q)
void sub_mul_row_scalar(const u64* x, const u64* c, u64* out, int64_t n, u64 q, u64 w, u64 ws) {
  for (int64_t k = 0; k < n; ++k) {
    const u64 r = mul_shoup_lazy(x[k] - c[k] + q, w, ws, q);
    out[k] = r >= q ? r - q : r;
  }
}

// acc[0..n) += d*k0, acc[n..2n) += d*k1 (mod q), each term reduced (binary64 estimate, exact)
void mac_scalar(u64* acc, const u64* d, const u64* k0, const u64* k1, int64_t n, u64 q, bool first) {
  const int64_t qs = static_cast<int64_t>(q);
  for (int64_t k = 0; k < n; ++k) {
    const u64 m0 = static_cast<u64>(mul_mod_one(static_cast<int64_t>(d[k]), static_cast<int64_t>(k0[k]), qs));
    const u64 m1 = static_cast<u64>(mul_mod_one(static_cast<int64_t>(d[k]), static_cast<int64_t>(k1[k]), qs));
    if (first) {
      acc[k] = m0;
      acc[n + k] = m1;
    } else {
      const u64 s0 = acc[k] + m0, s1 = acc[n + k] + m1;
      acc[k] = s0 >= q ? s0 - q : s0;
      acc[n + k] = s1 >= q ? s1 - q : s1;
    }
  }
}

FHELIUM_IFMA void lift_row_ifma(const u64* c, u64* out, int64_t n, const Lift& l) {
  const __m512i half = _mm512_set1_epi64(static_cast<long long>(l.half_src));
  const __m512i offset = _mm512_set1_epi64(static_cast<long long>(l.offset));
  const __m512i q = _mm512_set1_epi64(static_cast<long long>(l.q));
  const __m512i one = _mm512_set1_epi64(1);
  const __m512i one_shoup = _mm512_set1_epi64(static_cast<long long>(l.one_shoup >> 12));
  const __m512i mask52 = _mm512_set1_epi64((1LL << 52) - 1);
  for (int64_t k = 0; k < n; k += 8) {
    const __m512i v = _mm512_loadu_si512(c + k);
    const __m512i y = _mm512_mask_add_epi64(v, _mm512_cmpgt_epu64_mask(v, half), v, offset);
    _mm512_storeu_si512(out + k, ifma_reduce_once(ifma_mul_shoup_lazy(y, one, one_shoup, q, mask52), q));
  }
}

FHELIUM_IFMA void sub_mul_row_ifma(const u64* x, const u64* c, u64* out, int64_t n, u64 q_, u64 w_, u64 ws_) {
  const __m512i q = _mm512_set1_epi64(static_cast<long long>(q_));
  const __m512i w = _mm512_set1_epi64(static_cast<long long>(w_));
  const __m512i ws = _mm512_set1_epi64(static_cast<long long>(ws_ >> 12));
  const __m512i mask52 = _mm512_set1_epi64((1LL << 52) - 1);
  for (int64_t k = 0; k < n; k += 8) {
    const __m512i d = _mm512_add_epi64(_mm512_sub_epi64(_mm512_loadu_si512(x + k), _mm512_loadu_si512(c + k)), q);
    _mm512_storeu_si512(out + k, ifma_reduce_once(ifma_mul_shoup_lazy(d, w, ws, q, mask52), q));
  }
}

// unreduced 104-bit products summed as (lo52, hi52) halves: acc = [lo0 | hi0 | lo1 | hi1], n each
FHELIUM_IFMA void mac_ifma(u64* acc, const u64* d, const u64* k0, const u64* k1, int64_t n, bool first) {
  u64 *lo0 = acc, *hi0 = acc + n, *lo1 = acc + 2 * n, *hi1 = acc + 3 * n;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t k = 0; k < n; k += 8) {
    const __m512i dv = _mm512_loadu_si512(d + k);
    const __m512i a = _mm512_loadu_si512(k0 + k), b = _mm512_loadu_si512(k1 + k);
    _mm512_storeu_si512(lo0 + k, _mm512_madd52lo_epu64(first ? zero : _mm512_loadu_si512(lo0 + k), dv, a));
    _mm512_storeu_si512(hi0 + k, _mm512_madd52hi_epu64(first ? zero : _mm512_loadu_si512(hi0 + k), dv, a));
    _mm512_storeu_si512(lo1 + k, _mm512_madd52lo_epu64(first ? zero : _mm512_loadu_si512(lo1 + k), dv, b));
    _mm512_storeu_si512(hi1 + k, _mm512_madd52hi_epu64(first ? zero : _mm512_loadu_si512(hi1 + k), dv, b));
  }
}

// (hi * 2^52 + lo) mod q for the sums of at most 15 products (hi + carry < 2^52)
FHELIUM_IFMA void mac_finish_ifma(const u64* lo, const u64* hi, u64* out, int64_t n, u64 q_) {
  const u64 c52 = static_cast<u64>((u128{1} << 52) % q_);
  const __m512i q = _mm512_set1_epi64(static_cast<long long>(q_));
  const __m512i two_q = _mm512_set1_epi64(static_cast<long long>(2 * q_));
  const __m512i c = _mm512_set1_epi64(static_cast<long long>(c52));
  const __m512i cs = _mm512_set1_epi64(static_cast<long long>(shoup(c52, q_) >> 12));
  const __m512i one = _mm512_set1_epi64(1);
  const __m512i one_shoup = _mm512_set1_epi64(static_cast<long long>(shoup(1, q_) >> 12));
  const __m512i mask52 = _mm512_set1_epi64((1LL << 52) - 1);
  for (int64_t k = 0; k < n; k += 8) {
    const __m512i l = _mm512_loadu_si512(lo + k);
    const __m512i h = _mm512_add_epi64(_mm512_loadu_si512(hi + k), _mm512_srli_epi64(l, 52));
    __m512i s = _mm512_add_epi64(ifma_mul_shoup_lazy(h, c, cs, q, mask52),
                                 ifma_mul_shoup_lazy(_mm512_and_si512(l, mask52), one, one_shoup, q, mask52));
    s = ifma_reduce_once(ifma_reduce_once(s, two_q), q);
    _mm512_storeu_si512(out + k, s);
  }
}

FHELIUM_DQ void lift_row_dq(const u64* c, u64* out, int64_t n, const Lift& l) {
  const __m512i half = _mm512_set1_epi64(static_cast<long long>(l.half_src));
  const __m512i offset = _mm512_set1_epi64(static_cast<long long>(l.offset));
  const __m512i q = _mm512_set1_epi64(static_cast<long long>(l.q));
  const __m512i one = _mm512_set1_epi64(1);
  const __m512i one_shoup = _mm512_set1_epi64(static_cast<long long>(l.one_shoup));
  for (int64_t k = 0; k < n; k += 8) {
    const __m512i v = _mm512_loadu_si512(c + k);
    const __m512i y = _mm512_mask_add_epi64(v, _mm512_cmpgt_epu64_mask(v, half), v, offset);
    _mm512_storeu_si512(out + k, dq::reduce_once(dq::mul_shoup_lazy_vector(y, one, one_shoup, q), q));
  }
}

FHELIUM_DQ void sub_mul_row_dq(const u64* x, const u64* c, u64* out, int64_t n, u64 q_, u64 w_, u64 ws_) {
  const __m512i q = _mm512_set1_epi64(static_cast<long long>(q_));
  const __m512i w = _mm512_set1_epi64(static_cast<long long>(w_));
  const __m512i ws = _mm512_set1_epi64(static_cast<long long>(ws_));
  for (int64_t k = 0; k < n; k += 8) {
    const __m512i d = _mm512_add_epi64(_mm512_sub_epi64(_mm512_loadu_si512(x + k), _mm512_loadu_si512(c + k)), q);
    _mm512_storeu_si512(out + k, dq::reduce_once(dq::mul_shoup_lazy_vector(d, w, ws, q), q));
  }
}

// mac_scalar in 8 lanes (the same binary64 estimate and corrections, lane by lane)
FHELIUM_DQ void mac_dq(u64* acc, const u64* d, const u64* k0, const u64* k1, int64_t n, u64 q_, bool first) {
  const __m512i q = _mm512_set1_epi64(static_cast<long long>(q_));
  for (int64_t k = 0; k < n; k += 8) {
    const __m512i dv = _mm512_loadu_si512(d + k);
    const __m512i m0 = mul_mod_vector(dv, _mm512_loadu_si512(k0 + k), q);
    const __m512i m1 = mul_mod_vector(dv, _mm512_loadu_si512(k1 + k), q);
    if (first) {
      _mm512_storeu_si512(acc + k, m0);
      _mm512_storeu_si512(acc + n + k, m1);
    } else {
      _mm512_storeu_si512(acc + k, dq::reduce_once(_mm512_add_epi64(_mm512_loadu_si512(acc + k), m0), q));
      _mm512_storeu_si512(acc + n + k, dq::reduce_once(_mm512_add_epi64(_mm512_loadu_si512(acc + n + k), m1), q));
    }
  }
}

// The AVX2 rows (all primes below 2^50, see resolve_level): the residues as binary64 integers.
// lift_row: y = c (+ offset) < q_src + q < 2^51; floor(y * fl(1/q)) is within 1 of y/q, so y - e*q
// (exact by FMA) lies in [-q, 2q) and two corrections make it the residue
FHELIUM_AVX2 void lift_row_avx2(const u64* c, u64* out, int64_t n, const Lift& l) {
  const __m256i half = _mm256_set1_epi64x(static_cast<long long>(l.half_src));
  const __m256i offset = _mm256_set1_epi64x(static_cast<long long>(l.offset));
  const double q_scalar = static_cast<double>(l.q);
  const __m256d q = _mm256_set1_pd(q_scalar), q_inverse = _mm256_set1_pd(1.0 / q_scalar);
  for (int64_t k = 0; k < n; k += 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + k));
    const __m256i y = _mm256_add_epi64(v, _mm256_and_si256(_mm256_cmpgt_epi64(v, half), offset));
    const __m256d yd = avx2::to_double(y);
    const __m256d e = _mm256_round_pd(_mm256_mul_pd(yd, q_inverse), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256d r = avx2::add_q_if_negative(_mm256_fnmadd_pd(e, q, yd), q);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), avx2::to_integer(avx2::reduce_once(r, q)));
  }
}

// ((x - c) mod q) * w mod q: the difference x - c + q in (0, 2q), one lazy product, one reduction
FHELIUM_AVX2 void sub_mul_row_avx2(const u64* x, const u64* c, u64* out, int64_t n, u64 q_, u64 w_) {
  const double q_scalar = static_cast<double>(q_), w_scalar = static_cast<double>(w_);
  const __m256d q = _mm256_set1_pd(q_scalar), w = _mm256_set1_pd(w_scalar);
  const __m256d wq = _mm256_set1_pd(w_scalar * (1.0 / q_scalar));
  const __m256i qi = _mm256_set1_epi64x(static_cast<long long>(q_));
  for (int64_t k = 0; k < n; k += 4) {
    const __m256i d = _mm256_add_epi64(_mm256_sub_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)),
                                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + k))),
                                       qi);
    const __m256d r = avx2::reduce_once(avx2::mul_lazy(avx2::to_double(d), w, wq, q), q);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), avx2::to_integer(r));
  }
}

// mac_scalar in 4 binary64 lanes (each product the reference's residue, then a reduced sum)
FHELIUM_AVX2 void mac_avx2(u64* acc, const u64* d, const u64* k0, const u64* k1, int64_t n, u64 q_, bool first) {
  const double q_scalar = static_cast<double>(q_);
  const __m256d q = _mm256_set1_pd(q_scalar), q_inverse = _mm256_set1_pd(1.0 / q_scalar);
  for (int64_t k = 0; k < n; k += 4) {
    const __m256d dv = avx2::load(d + k), a = avx2::load(k0 + k), b = avx2::load(k1 + k);
    __m256d m0 = avx2::mul_mod_exact_lanes(dv, a, q, q_inverse), m1 = avx2::mul_mod_exact_lanes(dv, b, q, q_inverse);
    if (!first) {
      m0 = avx2::reduce_once(_mm256_add_pd(avx2::load(acc + k), m0), q);
      m1 = avx2::reduce_once(_mm256_add_pd(avx2::load(acc + n + k), m1), q);
    }
    avx2::store(acc + k, m0);
    avx2::store(acc + n + k, m1);
  }
}

constexpr int64_t kIfmaMacDigits = 15;
constexpr int64_t kKeySwitchChunkResidues = int64_t{1} << 18;

inline void lift_row(const u64* c, u64* out, int64_t n, const Lift& l, int64_t level) {
  if (level == kLevelIfma) lift_row_ifma(c, out, n, l);
  else if (level == kLevelDq) lift_row_dq(c, out, n, l);
  else if (level == kLevelAvx2) lift_row_avx2(c, out, n, l);
  else lift_row_scalar(c, out, n, l);
}

inline void sub_mul_row(const u64* x, const u64* c, u64* out, int64_t n, u64 q, u64 w, u64 ws, int64_t level) {
  if (level == kLevelIfma) sub_mul_row_ifma(x, c, out, n, q, w, ws);
  else if (level == kLevelDq) sub_mul_row_dq(x, c, out, n, q, w, ws);
  else if (level == kLevelAvx2) sub_mul_row_avx2(x, c, out, n, q, w);
  else sub_mul_row_scalar(x, c, out, n, q, w, ws);
}

// The residue in [0, q) of |x| < 2^62 (q in (2^28, 2^62)): the truncated binary64 quotient x·(1/q) is within
// 1 + 2^-18 of x/q, so x - estimate·q lies in (-q, 2q) and two conditional corrections finish it
// (no rounding call: the baseline x86-64 build has no SSE4.1 round instruction, so nearbyint is a libm call).
inline int64_t signed_residue(int64_t x, int64_t q, double inverse) {
  const int64_t estimate = static_cast<int64_t>(static_cast<double>(x) * inverse);
  int64_t r = x - estimate * q;
  r += (r >> 63) & q;
  r -= q;
  r += (r >> 63) & q;
  return r;
}

// ModDown's addend step, one row: s[k] = s[k] - P·t mod q with t = a[k] (+ (m[k] mod q)·f mod q);
// a in [0, q) or null, m signed with |m| < 2^62 or null (signed_residue's estimate), f and p_res in [0, q)
void fold_addend_row_scalar(u64* s, const int64_t* a, const int64_t* m, int64_t n, int64_t q, int64_t f,
                            int64_t p_res) {
  const double inverse = 1.0 / static_cast<double>(q);
  for (int64_t k = 0; k < n; ++k) {
    int64_t t = a ? a[k] : 0;
    if (m) {
      t += mul_mod_one(signed_residue(m[k], q, inverse), f, q) - q;
      t += (t >> 63) & q;
    }
    int64_t v = static_cast<int64_t>(s[k]) - mul_mod_one(t, p_res, q);
    v += (v >> 63) & q;
    s[k] = static_cast<u64>(v);
  }
}

FHELIUM_DQ void fold_addend_row_dq(u64* s, const int64_t* a, const int64_t* m, int64_t n, int64_t q_, int64_t f_,
                                   int64_t p_res_) {
  const __m512i q = _mm512_set1_epi64(q_), f = _mm512_set1_epi64(f_), p_res = _mm512_set1_epi64(p_res_);
  const __m512d inverse = _mm512_set1_pd(1.0 / static_cast<double>(q_));
  for (int64_t k = 0; k < n; k += 8) {
    __m512i t = a ? _mm512_loadu_si512(a + k) : _mm512_setzero_si512();
    if (m) {
      const __m512i x = _mm512_loadu_si512(m + k);
      const __m512i e = _mm512_cvttpd_epi64(_mm512_mul_pd(_mm512_cvtepi64_pd(x), inverse));
      __m512i r = add_q_if_negative(_mm512_sub_epi64(x, _mm512_mullo_epi64(e, q)), q);
      r = add_q_if_negative(_mm512_sub_epi64(r, q), q);
      t = add_q_if_negative(_mm512_sub_epi64(_mm512_add_epi64(t, mul_mod_vector(r, f, q)), q), q);
    }
    const __m512i v = _mm512_sub_epi64(_mm512_loadu_si512(s + k), mul_mod_vector(t, p_res, q));
    _mm512_storeu_si512(s + k, add_q_if_negative(v, q));
  }
}

inline void fold_addend_row(u64* s, const int64_t* a, const int64_t* m, int64_t n, int64_t q, int64_t f, int64_t p_res,
                            int64_t level) {
  // the AVX2 level runs the scalar row (the signed residues of wide values need int64 <-> binary64)
  if (level == kLevelScalar || level == kLevelAvx2) fold_addend_row_scalar(s, a, m, n, q, f, p_res);
  else fold_addend_row_dq(s, a, m, n, q, f, p_res);
}

void check_rns_arguments(const char* name, const at::Tensor& x, const at::Tensor& moduli, const at::Tensor& tables) {
  TORCH_CHECK(x.device().is_cpu() && moduli.device().is_cpu() && tables.device().is_cpu(), name, ": CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kLong && moduli.scalar_type() == at::kLong && tables.scalar_type() == at::kLong,
              name, ": int64 tensors expected");
  TORCH_CHECK(tables.dim() == 3 && tables.size(1) == 4 && tables.is_contiguous(), name,
              ": tables must be a contiguous [rows, 4, N] tensor from fhelium::ntt_tables");
  TORCH_CHECK(moduli.dim() == 1 && moduli.size(0) == tables.size(0) && moduli.is_contiguous(), name,
              ": moduli must be contiguous [rows] matching the tables");
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) == tables.size(2), name, ": input must be [..., rows, N] with N = ",
              tables.size(2));
}

// x [..., R, N] -> [..., R-1, N]: round(x / q_drop) over the other primes, dropping row `drop`
// (0: rescale, R-1: ModDown). ntt: x is (and the result stays) in the NTT domain.
at::Tensor divide_round(const at::Tensor& x_in, const at::Tensor& moduli, const at::Tensor& tables, int64_t drop,
                        bool ntt, int64_t level) {
  check_rns_arguments("fhelium::divide_round", x_in, moduli, tables);
  const int64_t rows = x_in.size(-2), n = x_in.size(-1);
  TORCH_CHECK(rows == moduli.size(0) && rows >= 2, "fhelium::divide_round: [..., rows, N] must have rows = ",
              moduli.size(0), " >= 2");
  TORCH_CHECK(drop >= 0 && drop < rows, "fhelium::divide_round: drop out of range");
  const int logn = log2_exact(n);
  const int64_t chosen = resolve_level(level, moduli, logn);
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[shape.size() - 2] = rows - 1;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t batch = x.numel() / (rows * n);
  if (batch == 0) return out;
  const u64* source = reinterpret_cast<const u64*>(x.data_ptr<int64_t>());
  u64* target = reinterpret_cast<u64*>(out.data_ptr<int64_t>());
  const u64* table = reinterpret_cast<const u64*>(tables.data_ptr<int64_t>());
  const int64_t* q = moduli.data_ptr<int64_t>();
  const u64 q_drop = static_cast<u64>(q[drop]);
  std::vector<u64> inverse(rows), inverse_shoup(rows);
  std::vector<Lift> lifts;
  for (int64_t i = 0; i < rows; ++i) {
    const u64 qi = static_cast<u64>(q[i]);
    inverse[i] = i == drop ? 0 : pow_mod(q_drop % qi, qi - 2, qi);
    inverse_shoup[i] = i == drop ? 0 : shoup(inverse[i], qi);
    lifts.emplace_back(q_drop, qi);
  }
  bitrev_table(logn);
  Buffer dropped(batch * n);
  const RowTables drop_tables = row_tables(table, q, drop, n);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<u64> scratch(static_cast<size_t>(n) + 8);
    for (int64_t b = begin; b < end; ++b) {
      const u64* row = source + (b * rows + drop) * n;
      if (ntt) inverse_row(row, scratch.data(), dropped.data() + b * n, drop_tables, logn, chosen);
      else std::memcpy(dropped.data() + b * n, row, static_cast<size_t>(n) * sizeof(u64));
    }
  });
  at::parallel_for(0, batch * (rows - 1), 1, [&](int64_t begin, int64_t end) {
    std::vector<u64> scratch(static_cast<size_t>(n) + 8), correction(static_cast<size_t>(n) + 8);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (rows - 1), k = task % (rows - 1), i = k < drop ? k : k + 1;
      const u64 qi = static_cast<u64>(q[i]);
      lift_row(dropped.data() + b * n, scratch.data(), n, lifts[i], chosen);
      if (ntt) forward_row(scratch.data(), correction.data(), row_tables(table, q, i, n), logn, chosen);
      else std::memcpy(correction.data(), scratch.data(), static_cast<size_t>(n) * sizeof(u64));
      sub_mul_row(source + (b * rows + i) * n, correction.data(), target + (b * (rows - 1) + k) * n, n, qi, inverse[i],
                  inverse_shoup[i], chosen);
    }
  });
  return out;
}

// Hybrid key switching with one digit per Q prime and one special prime P (the last of `moduli`).
// x: [..., L, N] NTT residues over moduli[0..L) (the polynomial to switch), or lifted: the
// decomposed digits [L, ..., L+1, N] (digit j's centered coefficients lifted to every prime, NTT).
// key: [digits, 2, key rows, N]; digit j uses key[key_digits[j]], prime i uses row key_rows[i].
// Returns [2, ..., L, N]: ModDown(sum_j digit_j * key_j) in the NTT domain over moduli[0..L).
at::Tensor key_switch_run(const at::Tensor* x_in, const at::Tensor* lifted_in, const at::Tensor& key_in,
                          const at::Tensor& key_digits, const at::Tensor& key_rows, const at::Tensor& moduli,
                          const at::Tensor& tables, int64_t level) {
  const at::Tensor& shape_source = x_in ? *x_in : *lifted_in;
  check_rns_arguments("fhelium::key_switch", shape_source, moduli, tables);
  const int64_t qp = moduli.size(0), limbs = qp - 1, n = tables.size(2);
  TORCH_CHECK(limbs >= 1, "fhelium::key_switch: moduli must hold the Q primes and P");
  TORCH_CHECK(key_in.device().is_cpu() && key_in.scalar_type() == at::kLong && key_in.dim() == 4 &&
                  key_in.size(1) == 2 && key_in.size(3) == n,
              "fhelium::key_switch: key must be int64 [digits, 2, rows, N]");
  const at::Tensor digits_index = key_digits.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor rows_index = key_rows.to(at::kCPU, at::kLong).contiguous();
  TORCH_CHECK(digits_index.numel() == limbs && rows_index.numel() == qp,
              "fhelium::key_switch: key_digits needs one entry per Q prime, key_rows one per Q prime and P");
  const int64_t* digit_of = digits_index.data_ptr<int64_t>();
  const int64_t* row_of = rows_index.data_ptr<int64_t>();
  for (int64_t j = 0; j < limbs; ++j) {
    TORCH_CHECK(digit_of[j] >= 0 && digit_of[j] < key_in.size(0), "fhelium::key_switch: key digit out of range");
  }
  for (int64_t i = 0; i < qp; ++i) {
    TORCH_CHECK(row_of[i] >= 0 && row_of[i] < key_in.size(2), "fhelium::key_switch: key row out of range");
  }
  std::vector<int64_t> batch_shape;
  at::Tensor x, lifted;
  if (x_in) {
    TORCH_CHECK(x_in->size(-2) == limbs, "fhelium::key_switch: x must be [..., ", limbs, ", N]");
    x = x_in->contiguous();
    batch_shape.assign(x.sizes().begin(), x.sizes().end() - 2);
  } else {
    TORCH_CHECK(lifted_in->dim() >= 3 && lifted_in->size(0) == limbs && lifted_in->size(-2) == qp,
                "fhelium::key_switch_lifted: lifted must be [", limbs, ", ..., ", qp, ", N]");
    lifted = lifted_in->contiguous();
    batch_shape.assign(lifted.sizes().begin() + 1, lifted.sizes().end() - 2);
  }
  int64_t batch = 1;
  for (int64_t s : batch_shape) batch *= s;
  std::vector<int64_t> out_shape{2};
  out_shape.insert(out_shape.end(), batch_shape.begin(), batch_shape.end());
  out_shape.push_back(limbs);
  out_shape.push_back(n);
  at::Tensor out = at::empty(out_shape, moduli.options());
  if (batch == 0) return out;
  const at::Tensor key = key_in.stride(3) == 1 ? key_in : key_in.contiguous();
  const int logn = log2_exact(n);
  const int64_t chosen = resolve_level(level, moduli, logn);
  const bool ifma_mac = chosen == kLevelIfma && limbs <= kIfmaMacDigits;
  const int64_t* q = moduli.data_ptr<int64_t>();
  const u64* table = reinterpret_cast<const u64*>(tables.data_ptr<int64_t>());
  const u64* key_data = reinterpret_cast<const u64*>(key.data_ptr<int64_t>());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), ks2 = key.stride(2);
  bitrev_table(logn);
  const u64 p = static_cast<u64>(q[limbs]);
  std::vector<u64> p_inverse(limbs), p_inverse_shoup(limbs);
  std::vector<Lift> p_lifts;
  for (int64_t i = 0; i < limbs; ++i) {
    const u64 qi = static_cast<u64>(q[i]);
    p_inverse[i] = pow_mod(p % qi, qi - 2, qi);
    p_inverse_shoup[i] = shoup(p_inverse[i], qi);
    p_lifts.emplace_back(p, qi);
  }
  // ciphertexts go through the four phases a few at a time (work buffers about an L2's worth)
  const int64_t chunk = std::max<int64_t>(1, kKeySwitchChunkResidues / (qp * n));
  const u64* x_data = x_in ? reinterpret_cast<const u64*>(x.data_ptr<int64_t>()) : nullptr;
  const u64* lifted_data = x_in ? nullptr : reinterpret_cast<const u64*>(lifted.data_ptr<int64_t>());
  u64* target = reinterpret_cast<u64*>(out.data_ptr<int64_t>());
  const RowTables tp = row_tables(table, q, limbs, n);
  const int64_t most = std::min(chunk, batch);
  Buffer coefficients(x_in ? most * limbs * n : 0), accumulated(2 * most * qp * n), p_rows(2 * most * n);
  for (int64_t first = 0; first < batch; first += chunk) {
    const int64_t count = std::min(chunk, batch - first);
    // 1. the digits' coefficients (not needed when the lifted digits are given)
    if (x_in) {
      at::parallel_for(0, count * limbs, 1, [&](int64_t begin, int64_t end) {
        std::vector<u64> scratch(static_cast<size_t>(n) + 8);
        for (int64_t task = begin; task < end; ++task) {
          inverse_row(x_data + (first * limbs + task) * n, scratch.data(), coefficients.data() + task * n,
                      row_tables(table, q, task % limbs, n), logn, chosen);
        }
      });
    }
    // 2. per (ciphertext, prime): sum over digits of NTT(lift(digit)) * key, both components;
    // accumulated is [2, count, qp, N]
    at::parallel_for(0, count * qp, 1, [&](int64_t begin, int64_t end) {
      std::vector<u64> scratch(static_cast<size_t>(n) + 8), digit(static_cast<size_t>(n) + 8);
      std::vector<u64> acc(static_cast<size_t>(4 * n));
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / qp, i = task % qp;
        const u64 qi = static_cast<u64>(q[i]);
        const RowTables ti = row_tables(table, q, i, n);
        for (int64_t j = 0; j < limbs; ++j) {
          const u64* row;
          if (!x_in) {
            row = lifted_data + ((j * batch + first + b) * qp + i) * n;
          } else if (i == j) {
            row = x_data + ((first + b) * limbs + j) * n;  // NTT(INTT(x_j)) = x_j: digit j at prime j
          } else {
            lift_row(coefficients.data() + (b * limbs + j) * n, scratch.data(), n, Lift(static_cast<u64>(q[j]), qi),
                     chosen);
            forward_row(scratch.data(), digit.data(), ti, logn, chosen);
            row = digit.data();
          }
          const u64* k0 = key_data + digit_of[j] * ks0 + row_of[i] * ks2;
          if (ifma_mac) mac_ifma(acc.data(), row, k0, k0 + ks1, n, j == 0);
          else if (chosen == kLevelDq || chosen == kLevelIfma) mac_dq(acc.data(), row, k0, k0 + ks1, n, qi, j == 0);
          else if (chosen == kLevelAvx2) mac_avx2(acc.data(), row, k0, k0 + ks1, n, qi, j == 0);
          else mac_scalar(acc.data(), row, k0, k0 + ks1, n, qi, j == 0);
        }
        u64* result0 = accumulated.data() + (b * qp + i) * n;
        u64* result1 = accumulated.data() + ((count + b) * qp + i) * n;
        if (ifma_mac) {
          mac_finish_ifma(acc.data(), acc.data() + n, result0, n, qi);
          mac_finish_ifma(acc.data() + 2 * n, acc.data() + 3 * n, result1, n, qi);
        } else {
          std::memcpy(result0, acc.data(), static_cast<size_t>(n) * sizeof(u64));
          std::memcpy(result1, acc.data() + n, static_cast<size_t>(n) * sizeof(u64));
        }
      }
    });
    // 3. ModDown: the P rows to coefficients, then (acc_i - NTT(lift(P row))) * P^-1 mod q_i
    at::parallel_for(0, 2 * count, 1, [&](int64_t begin, int64_t end) {
      std::vector<u64> scratch(static_cast<size_t>(n) + 8);
      for (int64_t task = begin; task < end; ++task) {
        inverse_row(accumulated.data() + (task * qp + limbs) * n, scratch.data(), p_rows.data() + task * n, tp, logn,
                    chosen);
      }
    });
    at::parallel_for(0, 2 * count * limbs, 1, [&](int64_t begin, int64_t end) {
      std::vector<u64> scratch(static_cast<size_t>(n) + 8), correction(static_cast<size_t>(n) + 8);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t cb = task / limbs, i = task % limbs, c = cb / count, b = cb % count;
        lift_row(p_rows.data() + cb * n, scratch.data(), n, p_lifts[i], chosen);
        forward_row(scratch.data(), correction.data(), row_tables(table, q, i, n), logn, chosen);
        sub_mul_row(accumulated.data() + (cb * qp + i) * n, correction.data(),
                    target + ((c * batch + first + b) * limbs + i) * n, n, static_cast<u64>(q[i]), p_inverse[i],
                    p_inverse_shoup[i], chosen);
      }
    });
  }
  return out;
}

at::Tensor key_switch(const at::Tensor& x, const at::Tensor& key, const at::Tensor& key_digits,
                      const at::Tensor& key_rows, const at::Tensor& moduli, const at::Tensor& tables, int64_t level) {
  return key_switch_run(&x, nullptr, key, key_digits, key_rows, moduli, tables, level);
}

at::Tensor key_switch_lifted(const at::Tensor& lifted, const at::Tensor& key, const at::Tensor& key_digits,
                             const at::Tensor& key_rows, const at::Tensor& moduli, const at::Tensor& tables,
                             int64_t level) {
  return key_switch_run(nullptr, &lifted, key, key_digits, key_rows, moduli, tables, level);
}

// the digits of x [..., L, N] (NTT over moduli[0..L)) lifted to every prime of moduli: [L, ..., L+1, N]
at::Tensor decompose(const at::Tensor& x_in, const at::Tensor& moduli, const at::Tensor& tables, int64_t level) {
  check_rns_arguments("fhelium::decompose", x_in, moduli, tables);
  const int64_t qp = moduli.size(0), limbs = qp - 1, n = tables.size(2);
  TORCH_CHECK(limbs >= 1 && x_in.size(-2) == limbs, "fhelium::decompose: x must be [..., ", limbs, ", N]");
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape{limbs};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end() - 2);
  shape.push_back(qp);
  shape.push_back(n);
  at::Tensor out = at::empty(shape, x.options());
  const int64_t batch = x.numel() / (limbs * n);
  if (batch == 0) return out;
  const int logn = log2_exact(n);
  const int64_t chosen = resolve_level(level, moduli, logn);
  const int64_t* q = moduli.data_ptr<int64_t>();
  const u64* table = reinterpret_cast<const u64*>(tables.data_ptr<int64_t>());
  const u64* x_data = reinterpret_cast<const u64*>(x.data_ptr<int64_t>());
  u64* target = reinterpret_cast<u64*>(out.data_ptr<int64_t>());
  bitrev_table(logn);
  Buffer coefficients(batch * limbs * n);
  at::parallel_for(0, batch * limbs, 1, [&](int64_t begin, int64_t end) {
    std::vector<u64> scratch(static_cast<size_t>(n) + 8);
    for (int64_t task = begin; task < end; ++task) {
      inverse_row(x_data + task * n, scratch.data(), coefficients.data() + task * n, row_tables(table, q, task % limbs, n),
                  logn, chosen);
    }
  });
  at::parallel_for(0, limbs * batch * qp, 1, [&](int64_t begin, int64_t end) {
    std::vector<u64> scratch(static_cast<size_t>(n) + 8);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j = task / (batch * qp), b = (task / qp) % batch, i = task % qp;
      u64* result = target + task * n;
      if (i == j) {
        std::memcpy(result, x_data + (b * limbs + j) * n, static_cast<size_t>(n) * sizeof(u64));
        continue;
      }
      lift_row(coefficients.data() + (b * limbs + j) * n, scratch.data(), n, Lift(static_cast<u64>(q[j]), static_cast<u64>(q[i])),
               chosen);
      forward_row(scratch.data(), result, row_tables(table, q, i, n), logn, chosen);
    }
  });
  return out;
}

// ModDown with the extra terms of public-key encryption (engine._mod_down): values [..., L+1, N]
// NTT over moduli (Q primes, then P) -> round((values + divided) / P) + addend over the Q primes,
// NTT domain. addend: coefficient-domain residues [..., L, N] (folded in as -P*addend before the
// division); divided: small signed coefficient-domain integers [..., 1, N], |divided| < P.
// message (with message_factors f [R, L]): R rows of signed coefficient-domain integers [..., R, N],
// |message| < 2^62, added to the addend as sum_r (message_r mod q_i)·f_ri mod q_i, so a message encoded
// at a low scale and multiplied up (fhelium.multiparty's 2^44·2^44), and wide noise (factor 1), need no
// residue tensor of their own; the residues are unique, so the result equals the reference's (reduce,
// multiply, add, then as above).
at::Tensor mod_down(const at::Tensor& values_in, const std::optional<at::Tensor>& addend_in,
                    const std::optional<at::Tensor>& divided_in, const at::Tensor& moduli, const at::Tensor& tables,
                    int64_t level, const std::optional<at::Tensor>& message_in,
                    const std::optional<at::Tensor>& factors_in) {
  check_rns_arguments("fhelium::mod_down", values_in, moduli, tables);
  const int64_t qp = moduli.size(0), limbs = qp - 1, n = tables.size(2);
  TORCH_CHECK(limbs >= 1 && values_in.size(-2) == qp, "fhelium::mod_down: values must be [..., ", qp, ", N]");
  const at::Tensor values = values_in.contiguous();
  std::vector<int64_t> shape(values.sizes().begin(), values.sizes().end());
  shape[shape.size() - 2] = limbs;
  const int64_t batch = values.numel() / (qp * n);
  at::Tensor addend, divided;
  // addend and message: like values, or like values[0] (then they go into the first component only,
  // as encryption's c0; the rows of the flattened batch below addend_batch)
  const std::vector<int64_t> first_shape(shape.begin() + 1, shape.end());
  int64_t addend_batch = 0;
  if (addend_in.has_value()) {
    const bool whole = addend_in->sizes() == at::IntArrayRef(shape);
    TORCH_CHECK((whole || (values.dim() > 2 && addend_in->sizes() == at::IntArrayRef(first_shape))) &&
                    addend_in->scalar_type() == at::kLong && addend_in->device().is_cpu(),
                "fhelium::mod_down: addend must be int64 [..., ", limbs, ", N] like values or values[0]");
    addend = addend_in->contiguous();
    addend_batch = addend.numel() / (limbs * n);
  }
  if (divided_in.has_value()) {
    std::vector<int64_t> one_row(shape);
    one_row[one_row.size() - 2] = 1;
    TORCH_CHECK(divided_in->sizes() == at::IntArrayRef(one_row) && divided_in->scalar_type() == at::kLong &&
                    divided_in->device().is_cpu(),
                "fhelium::mod_down: divided must be int64 [..., 1, N] like values");
    divided = divided_in->contiguous();
  }
  at::Tensor message, factors;
  TORCH_CHECK(message_in.has_value() == factors_in.has_value(),
              "fhelium::mod_down: message and message_factors go together");
  int64_t message_rows = 0;
  if (message_in.has_value()) {
    TORCH_CHECK(message_in->dim() >= 2, "fhelium::mod_down: message must be int64 [..., R, N]");
    message_rows = message_in->size(-2);
    std::vector<int64_t> rows_shape(shape);
    rows_shape[rows_shape.size() - 2] = message_rows;
    const std::vector<int64_t> rows_shape_first(rows_shape.begin() + 1, rows_shape.end());
    const bool whole = message_in->sizes() == at::IntArrayRef(rows_shape);
    TORCH_CHECK(addend.defined(), "fhelium::mod_down: a message needs the addend it is added to");
    TORCH_CHECK(message_rows >= 1 &&
                    (whole ? addend_batch == batch
                           : values.dim() > 2 && message_in->sizes() == at::IntArrayRef(rows_shape_first) &&
                                 addend_batch * values.size(0) == batch) &&
                    message_in->scalar_type() == at::kLong && message_in->device().is_cpu(),
                "fhelium::mod_down: message must be int64 [..., R, N] covering the addend's rows");
    TORCH_CHECK(factors_in->dim() == 2 && factors_in->size(0) == message_rows && factors_in->size(1) == limbs &&
                    factors_in->scalar_type() == at::kLong && factors_in->device().is_cpu(),
                "fhelium::mod_down: message_factors must be int64 [R, ", limbs, "]");
    message = message_in->contiguous();
    factors = factors_in->contiguous();
    const int64_t* q_check = moduli.data_ptr<int64_t>();
    const int64_t* f_check = factors.data_ptr<int64_t>();
    for (int64_t i = 0; i < limbs; ++i) {
      TORCH_CHECK(q_check[i] > (int64_t{1} << 28), "fhelium::mod_down: a message needs moduli above 2^28");
      for (int64_t r = 0; r < message_rows; ++r) {
        const int64_t f = f_check[r * limbs + i];
        TORCH_CHECK(f >= 0 && f < q_check[i], "fhelium::mod_down: message_factors must lie in [0, q)");
      }
    }
  }
  at::Tensor out = at::empty(shape, values.options());
  if (batch == 0) return out;
  const int logn = log2_exact(n);
  const int64_t chosen = resolve_level(level, moduli, logn);
  const int64_t* q = moduli.data_ptr<int64_t>();
  const u64* table = reinterpret_cast<const u64*>(tables.data_ptr<int64_t>());
  const u64* source = reinterpret_cast<const u64*>(values.data_ptr<int64_t>());
  const int64_t* addend_data = addend.defined() ? addend.data_ptr<int64_t>() : nullptr;
  const int64_t* divided_data = divided.defined() ? divided.data_ptr<int64_t>() : nullptr;
  const int64_t* message_data = message.defined() ? message.data_ptr<int64_t>() : nullptr;
  const int64_t* factor_data = factors.defined() ? factors.data_ptr<int64_t>() : nullptr;
  u64* target = reinterpret_cast<u64*>(out.data_ptr<int64_t>());
  const int64_t p = q[limbs];
  std::atomic<bool> out_of_range{false};
  std::vector<u64> p_inverse(limbs), p_inverse_shoup(limbs);
  std::vector<int64_t> p_residue(limbs);
  std::vector<Lift> lifts;
  for (int64_t i = 0; i < limbs; ++i) {
    const u64 qi = static_cast<u64>(q[i]);
    p_residue[i] = static_cast<int64_t>(static_cast<u64>(p) % qi);
    p_inverse[i] = pow_mod(static_cast<u64>(p_residue[i]), qi - 2, qi);
    p_inverse_shoup[i] = shoup(p_inverse[i], qi);
    lifts.emplace_back(static_cast<u64>(p), qi);
  }
  bitrev_table(logn);
  Buffer p_rows(batch * n);
  const RowTables tp = row_tables(table, q, limbs, n);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<u64> scratch(static_cast<size_t>(n) + 8);
    for (int64_t b = begin; b < end; ++b) {
      u64* row = p_rows.data() + b * n;
      inverse_row(source + (b * qp + limbs) * n, scratch.data(), row, tp, logn, chosen);
      if (divided_data) {
        const int64_t* d = divided_data + b * n;
        for (int64_t k = 0; k < n; ++k) {  // [-P, 2P) -> [0, P)
          int64_t v = static_cast<int64_t>(row[k]) + d[k];
          v += (v >> 63) & p;
          v -= p;
          v += (v >> 63) & p;
          row[k] = static_cast<u64>(v);
        }
      }
    }
  });
  at::parallel_for(0, batch * limbs, 1, [&](int64_t begin, int64_t end) {
    std::vector<u64> scratch(static_cast<size_t>(n) + 8), correction(static_cast<size_t>(n) + 8);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / limbs, i = task % limbs;
      const int64_t qi = q[i];
      lift_row(p_rows.data() + b * n, scratch.data(), n, lifts[i], chosen);
      if (divided_data) {
        const int64_t* d = divided_data + b * n;
        for (int64_t k = 0; k < n; ++k) {
          int64_t r = d[k];
          if (r >= qi || r < -qi) r %= qi;  // small errors skip the division
          r += (r >> 63) & qi;              // remainder(divided, q_i)
          int64_t v = static_cast<int64_t>(scratch[k]) - r;
          v += (v >> 63) & qi;
          scratch[k] = static_cast<u64>(v);
        }
      }
      if (addend_data && b < addend_batch) {  // (b, i) is task for the addend [addend_batch, limbs, N]
        const int64_t* m = message_data ? message_data + b * message_rows * n : nullptr;
        if (m && i == 0) {
          bool outside = false;
          for (int64_t k = 0; k < n * message_rows; ++k) {
            outside |= static_cast<u64>(m[k]) + (u64{1} << 62) >= (u64{1} << 63);
          }
          if (outside) out_of_range.store(true, std::memory_order_relaxed);
        }
        // s - P·(a + Σ_r m_r·f_r) as successive subtractions: the same residue (it is unique)
        fold_addend_row(scratch.data(), addend_data + task * n, m, n, qi, m ? factor_data[i] : 0, p_residue[i],
                        chosen);
        for (int64_t r = 1; r < message_rows; ++r) {
          fold_addend_row(scratch.data(), nullptr, m + r * n, n, qi, factor_data[r * limbs + i], p_residue[i], chosen);
        }
      }
      forward_row(scratch.data(), correction.data(), row_tables(table, q, i, n), logn, chosen);
      sub_mul_row(source + (b * qp + i) * n, correction.data(), target + task * n, n, static_cast<u64>(qi),
                  p_inverse[i], p_inverse_shoup[i], chosen);
    }
  });
  TORCH_CHECK(!out_of_range.load(), "fhelium::mod_down: |message| must be below 2^62");
  return out;
}

// Sampling to NTT: small signed integers x [..., N] (|x| < every q) -> NTT(x mod q_r) [..., rows, N],
// the residue taken as the engine's _small_to_rns does (x + (q if x < 0)), fused into the NTT's copy.
// wide: any int64 |x| < 2^62 (signed_residue); the residue in [0, q) is unique, so this equals the
// reference's (fhelium.multiparty.protocol.reduce_signed, then the NTT)
at::Tensor residue_ntt(const at::Tensor& x_in, const at::Tensor& moduli, const at::Tensor& tables, int64_t level,
                       bool wide) {
  const char* name = wide ? "fhelium::signed_ntt" : "fhelium::small_ntt";
  TORCH_CHECK(x_in.dim() >= 1, name, ": x must be [..., N]");
  check_rns_arguments(name, x_in.unsqueeze(-2), moduli, tables);
  const int64_t rows = moduli.size(0), n = tables.size(2);
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(rows);
  shape.push_back(n);
  at::Tensor out = at::empty(shape, x.options());
  const int64_t batch = x.numel() / n;
  if (batch == 0 || rows == 0) return out;
  const int logn = log2_exact(n);
  const int64_t chosen = resolve_level(level, moduli, logn);
  const int64_t* q = moduli.data_ptr<int64_t>();
  const u64* table = reinterpret_cast<const u64*>(tables.data_ptr<int64_t>());
  const int64_t* source = x.data_ptr<int64_t>();
  u64* target = reinterpret_cast<u64*>(out.data_ptr<int64_t>());
  bitrev_table(logn);
  if (wide) {
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(q[r] > (int64_t{1} << 28), name, ": every modulus must exceed 2^28 (the quotient estimate)");
    }
  }
  std::atomic<bool> out_of_range{false};
  at::parallel_for(0, batch * rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<u64> scratch(static_cast<size_t>(n) + 8);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / rows, r = task % rows, qr = q[r];
      const int64_t* v = source + b * n;
      if (wide) {
        const double inverse = 1.0 / static_cast<double>(qr);
        bool outside = false;
        for (int64_t k = 0; k < n; ++k) outside |= static_cast<u64>(v[k]) + (u64{1} << 62) >= (u64{1} << 63);
        if (outside) out_of_range.store(true, std::memory_order_relaxed);
        for (int64_t k = 0; k < n; ++k) scratch[k] = static_cast<u64>(signed_residue(v[k], qr, inverse));
      } else {
        for (int64_t k = 0; k < n; ++k) scratch[k] = static_cast<u64>(v[k] + ((v[k] >> 63) & qr));
      }
      forward_row(scratch.data(), target + task * n, row_tables(table, q, r, n), logn, chosen);
    }
  });
  TORCH_CHECK(!out_of_range.load(), name, ": |x| must be below 2^62");
  return out;
}

at::Tensor small_ntt(const at::Tensor& x, const at::Tensor& moduli, const at::Tensor& tables, int64_t level) {
  return residue_ntt(x, moduli, tables, level, false);
}

at::Tensor signed_ntt(const at::Tensor& x, const at::Tensor& moduli, const at::Tensor& tables, int64_t level) {
  return residue_ntt(x, moduli, tables, level, true);
}

// out[..., t] = x[..., index[t]] (x.index_select(-1, index)): the Galois automorphisms in the NTT domain
at::Tensor permute_last(const at::Tensor& x_in, const at::Tensor& index_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kLong && x_in.dim() >= 1,
              "fhelium::permute_last: int64 CPU tensor [..., N] expected");
  TORCH_CHECK(index_in.dim() == 1 && index_in.scalar_type() == at::kLong,
              "fhelium::permute_last: index must be an int64 vector");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor index = index_in.to(at::kCPU).contiguous();
  const int64_t n = x.size(-1), m = index.numel();
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t t = 0; t < m; ++t) {
    TORCH_CHECK(idx[t] >= 0 && idx[t] < n, "fhelium::permute_last: index out of range: ", idx[t]);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = m;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  if (rows == 0 || m == 0) return out;
  const int64_t* source = x.data_ptr<int64_t>();
  int64_t* target = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t* in = source + r * n;
      int64_t* o = target + r * m;
      for (int64_t t = 0; t < m; ++t) o[t] = in[idx[t]];
    }
  });
  return out;
}

// The ciphertext tensor product in the NTT domain: a, b [2, ..., L, N] -> [3, ..., L, N] =
// (a0 b0, a0 b1 + a1 b0, a1 b1) mod q (row r of each component uses moduli[r % L]); exact, so the
// same residues as the engine's Karatsuba form.
FHELIUM_DQ void tensor_product_row_vector(const int64_t* a0, const int64_t* a1, const int64_t* b0,
                                                const int64_t* b1, int64_t* d0, int64_t* d1, int64_t* d2, int64_t n,
                                                int64_t q_) {
  const __m512i q = _mm512_set1_epi64(q_);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m512i x0 = _mm512_loadu_si512(a0 + k), x1 = _mm512_loadu_si512(a1 + k);
    const __m512i y0 = _mm512_loadu_si512(b0 + k), y1 = _mm512_loadu_si512(b1 + k);
    _mm512_storeu_si512(d0 + k, mul_mod_vector(x0, y0, q));
    _mm512_storeu_si512(d2 + k, mul_mod_vector(x1, y1, q));
    const __m512i cross = _mm512_add_epi64(mul_mod_vector(x0, y1, q), mul_mod_vector(x1, y0, q));
    _mm512_storeu_si512(d1 + k, add_q_if_negative(_mm512_sub_epi64(cross, q), q));
  }
  for (; k < n; ++k) {
    d0[k] = mul_mod_one(a0[k], b0[k], q_);
    d2[k] = mul_mod_one(a1[k], b1[k], q_);
    const int64_t cross = mul_mod_one(a0[k], b1[k], q_) + mul_mod_one(a1[k], b0[k], q_) - q_;
    d1[k] = cross + ((cross >> 63) & q_);
  }
}

FHELIUM_AVX2 void tensor_product_row_avx2(const int64_t* a0, const int64_t* a1, const int64_t* b0, const int64_t* b1,
                                          int64_t* d0, int64_t* d1, int64_t* d2, int64_t n, int64_t q_) {
  const double q_scalar = static_cast<double>(q_);
  const __m256d q = _mm256_set1_pd(q_scalar), q_inverse = _mm256_set1_pd(1.0 / q_scalar);
  using avx2::load;
  using avx2::store;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const __m256d x0 = load(a0 + k), x1 = load(a1 + k), y0 = load(b0 + k), y1 = load(b1 + k);
    store(d0 + k, avx2::mul_mod_exact_lanes(x0, y0, q, q_inverse));
    store(d2 + k, avx2::mul_mod_exact_lanes(x1, y1, q, q_inverse));
    const __m256d cross = _mm256_add_pd(avx2::mul_mod_exact_lanes(x0, y1, q, q_inverse),
                                        avx2::mul_mod_exact_lanes(x1, y0, q, q_inverse));
    store(d1 + k, avx2::reduce_once(cross, q));
  }
  for (; k < n; ++k) {
    d0[k] = mul_mod_one(a0[k], b0[k], q_);
    d2[k] = mul_mod_one(a1[k], b1[k], q_);
    const int64_t cross = mul_mod_one(a0[k], b1[k], q_) + mul_mod_one(a1[k], b0[k], q_) - q_;
    d1[k] = cross + ((cross >> 63) & q_);
  }
}

void tensor_product_row_scalar(const int64_t* a0, const int64_t* a1, const int64_t* b0, const int64_t* b1, int64_t* d0,
                               int64_t* d1, int64_t* d2, int64_t n, int64_t q) {
  for (int64_t k = 0; k < n; ++k) {
    d0[k] = mul_mod_one(a0[k], b0[k], q);
    d2[k] = mul_mod_one(a1[k], b1[k], q);
    const int64_t cross = mul_mod_one(a0[k], b1[k], q) + mul_mod_one(a1[k], b0[k], q) - q;
    d1[k] = cross + ((cross >> 63) & q);
  }
}

at::Tensor tensor_product(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& moduli, int64_t level) {
  TORCH_CHECK(a_in.device().is_cpu() && b_in.device().is_cpu() && moduli.device().is_cpu() &&
                  a_in.scalar_type() == at::kLong && b_in.scalar_type() == at::kLong && moduli.scalar_type() == at::kLong,
              "fhelium::tensor_product: int64 CPU tensors expected");
  TORCH_CHECK(a_in.sizes() == b_in.sizes() && a_in.dim() >= 3 && a_in.size(0) == 2,
              "fhelium::tensor_product: a and b must both be [2, ..., L, N]");
  TORCH_CHECK(moduli.dim() == 1 && moduli.size(0) == a_in.size(-2), "fhelium::tensor_product: moduli must be [L]");
  const int64_t kind = vector_kind(level);
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous(), q = moduli.contiguous();
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
  shape[0] = 3;
  at::Tensor out = at::empty(shape, a.options());
  const int64_t n = a.size(-1), limbs = a.size(-2);
  const int64_t component = a.numel() / 2, rows = n == 0 ? 0 : component / n;
  if (rows == 0) return out;
  const int64_t *pa = a.data_ptr<int64_t>(), *pb = b.data_ptr<int64_t>(), *pq = q.data_ptr<int64_t>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t off = r * n, qr = pq[r % limbs];
      if (kind == kLevelAvx2 && static_cast<u64>(qr) < kAvx2ModulusBound) {
        tensor_product_row_avx2(pa + off, pa + component + off, pb + off, pb + component + off, po + off,
                                po + component + off, po + 2 * component + off, n, qr);
      } else if (kind == kLevelDq) {
        tensor_product_row_vector(pa + off, pa + component + off, pb + off, pb + component + off, po + off,
                                  po + component + off, po + 2 * component + off, n, qr);
      } else {
        tensor_product_row_scalar(pa + off, pa + component + off, pb + off, pb + component + off, po + off,
                                  po + component + off, po + 2 * component + off, n, qr);
      }
    }
  });
  return out;
}

// Flooding noise for threshold decryption (fhelium/multiparty/noise.py is the reference): Box-Muller
// on 53-bit uniforms from 63-bit keystream words, log/sin/cos by the reference's fixed polynomials in
// separately rounded binary64 operations, in the reference's order (the build uses -ffp-contract=off,
// so no multiply-add is fused), so every output bit equals the reference's. The polynomial
// coefficients and constants come from Python (``constants``), never retyped here.
constexpr int kLogTerms = 12, kSinTerms = 9, kCosTerms = 9;
constexpr int kNoiseConstants = 4 + kLogTerms + kSinTerms + kCosTerms;

struct NoiseConstants {
  double ln2_hi, ln2_lo, sqrt2, half_pi;
  double log_c[kLogTerms], sin_c[kSinTerms], cos_c[kCosTerms];
  double high_sigma, low_sigma;
  int64_t shift;
};

inline double bits_to_double(u64 b) { double d; std::memcpy(&d, &b, 8); return d; }
inline u64 double_to_bits(double d) { u64 b; std::memcpy(&b, &d, 8); return b; }

inline int64_t smudging_one(int64_t w1, int64_t w2, const NoiseConstants& c) {
  const double u1 = (static_cast<double>(w1 >> 10) + 0.5) * 0x1p-53;
  const double u2 = (static_cast<double>(w2 >> 10) + 0.5) * 0x1p-53;
  // log u1
  const u64 bits = double_to_bits(u1);
  const int64_t exponent = static_cast<int64_t>(bits >> 52) - 1023;
  double m = bits_to_double((bits & ((u64{1} << 52) - 1)) | (u64{1023} << 52));
  const bool big = m > c.sqrt2;
  m = big ? m * 0.5 : m;
  const double e = static_cast<double>(exponent + (big ? 1 : 0));
  const double s = (m - 1.0) / (m + 1.0);
  const double z = s * s;
  double p = c.log_c[0];
  for (int k = 1; k < kLogTerms; ++k) p = p * z + c.log_c[k];
  const double tail = (s * 2.0) * p + e * c.ln2_lo;
  const double log_u = e * c.ln2_hi + tail;
  const double radius = std::sqrt(log_u * -2.0);
  // sin, cos of 2 pi u2
  const double t4 = u2 * 4.0;
  const double quadrant = std::floor(t4);
  const double g = t4 - quadrant;
  const bool flip = g > 0.5;
  const double x = (flip ? 1.0 - g : g) * c.half_pi;
  const double x2 = x * x;
  double ps = c.sin_c[0];
  for (int k = 1; k < kSinTerms; ++k) ps = ps * x2 + c.sin_c[k];
  double pc = c.cos_c[0];
  for (int k = 1; k < kCosTerms; ++k) pc = pc * x2 + c.cos_c[k];
  const double sin_x = (x * x2) * ps + x;
  const double cos_x = x2 * pc + 1.0;
  const double sin_phi = flip ? cos_x : sin_x;
  const double cos_phi = flip ? sin_x : cos_x;
  const int64_t q = static_cast<int64_t>(quadrant);
  const bool odd = (q & 1) != 0;
  double sine = odd ? cos_phi : sin_phi;
  double cosine = odd ? sin_phi : cos_phi;
  sine = q >= 2 ? -sine : sine;
  cosine = (q == 1 || q == 2) ? -cosine : cosine;
  const int64_t high = static_cast<int64_t>(std::nearbyint((cosine * radius) * c.high_sigma));
  const int64_t low = static_cast<int64_t>(std::nearbyint((sine * radius) * c.low_sigma));
  // two's complement wrap-around like the reference's int64 shift and add (never reached by the presets)
  return static_cast<int64_t>((static_cast<u64>(high) << c.shift) + static_cast<u64>(low));
}

void smudging_span_scalar(const int64_t* w, int64_t count, int64_t begin, int64_t end, int64_t* out,
                          const NoiseConstants& c) {
  for (int64_t i = begin; i < end; ++i) out[i] = smudging_one(w[i], w[count + i], c);
}

// 8 lanes of AVX-512 (F + DQ): smudging_one's operations lane by lane, in its order (each intrinsic is
// one correctly rounded binary64 operation; selects are blends, negation flips the sign bit)
FHELIUM_DQ inline __m512d horner_vector(__m512d z, const double* coefficients, int terms) {
  __m512d p = _mm512_set1_pd(coefficients[0]);
  for (int k = 1; k < terms; ++k) p = _mm512_add_pd(_mm512_mul_pd(p, z), _mm512_set1_pd(coefficients[k]));
  return p;
}

FHELIUM_DQ inline __m512i smudging_vector(__m512i w1, __m512i w2, const NoiseConstants& c) {
  const __m512d half = _mm512_set1_pd(0.5), one = _mm512_set1_pd(1.0), unit = _mm512_set1_pd(0x1p-53);
  const __m512d u1 = _mm512_mul_pd(_mm512_add_pd(_mm512_cvtepi64_pd(_mm512_srli_epi64(w1, 10)), half), unit);
  const __m512d u2 = _mm512_mul_pd(_mm512_add_pd(_mm512_cvtepi64_pd(_mm512_srli_epi64(w2, 10)), half), unit);
  // log u1
  const __m512i bits = _mm512_castpd_si512(u1);
  __m512i exponent = _mm512_sub_epi64(_mm512_srli_epi64(bits, 52), _mm512_set1_epi64(1023));
  __m512d m = _mm512_castsi512_pd(_mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi64((int64_t{1} << 52) - 1)),
                                                  _mm512_set1_epi64(int64_t{1023} << 52)));
  const __mmask8 big = _mm512_cmp_pd_mask(m, _mm512_set1_pd(c.sqrt2), _CMP_GT_OQ);
  m = _mm512_mask_mul_pd(m, big, m, half);
  exponent = _mm512_mask_add_epi64(exponent, big, exponent, _mm512_set1_epi64(1));
  const __m512d e = _mm512_cvtepi64_pd(exponent);
  const __m512d s = _mm512_div_pd(_mm512_sub_pd(m, one), _mm512_add_pd(m, one));
  const __m512d p = horner_vector(_mm512_mul_pd(s, s), c.log_c, kLogTerms);
  const __m512d tail = _mm512_add_pd(_mm512_mul_pd(_mm512_mul_pd(s, _mm512_set1_pd(2.0)), p),
                                     _mm512_mul_pd(e, _mm512_set1_pd(c.ln2_lo)));
  const __m512d log_u = _mm512_add_pd(_mm512_mul_pd(e, _mm512_set1_pd(c.ln2_hi)), tail);
  const __m512d radius = _mm512_sqrt_pd(_mm512_mul_pd(log_u, _mm512_set1_pd(-2.0)));
  // sin, cos of 2 pi u2
  const __m512d t4 = _mm512_mul_pd(u2, _mm512_set1_pd(4.0));
  const __m512d quadrant = _mm512_roundscale_pd(t4, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512d g = _mm512_sub_pd(t4, quadrant);
  const __mmask8 flip = _mm512_cmp_pd_mask(g, half, _CMP_GT_OQ);
  const __m512d x = _mm512_mul_pd(_mm512_mask_blend_pd(flip, g, _mm512_sub_pd(one, g)), _mm512_set1_pd(c.half_pi));
  const __m512d x2 = _mm512_mul_pd(x, x);
  const __m512d sin_x = _mm512_add_pd(_mm512_mul_pd(_mm512_mul_pd(x, x2), horner_vector(x2, c.sin_c, kSinTerms)), x);
  const __m512d cos_x = _mm512_add_pd(_mm512_mul_pd(x2, horner_vector(x2, c.cos_c, kCosTerms)), one);
  const __m512d sin_phi = _mm512_mask_blend_pd(flip, sin_x, cos_x);
  const __m512d cos_phi = _mm512_mask_blend_pd(flip, cos_x, sin_x);
  const __m512i q = _mm512_cvttpd_epi64(quadrant);
  const __mmask8 odd = _mm512_test_epi64_mask(q, _mm512_set1_epi64(1));
  const __m512d sign = _mm512_castsi512_pd(_mm512_set1_epi64(static_cast<int64_t>(u64{1} << 63)));
  __m512d sine = _mm512_mask_blend_pd(odd, sin_phi, cos_phi);
  __m512d cosine = _mm512_mask_blend_pd(odd, cos_phi, sin_phi);
  const __mmask8 negate_sine = _mm512_cmp_epi64_mask(q, _mm512_set1_epi64(2), _MM_CMPINT_NLT);
  const __mmask8 negate_cosine = _mm512_cmpeq_epi64_mask(q, _mm512_set1_epi64(1)) |
                                 _mm512_cmpeq_epi64_mask(q, _mm512_set1_epi64(2));
  sine = _mm512_mask_xor_pd(sine, negate_sine, sine, sign);
  cosine = _mm512_mask_xor_pd(cosine, negate_cosine, cosine, sign);
  const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i high = _mm512_cvttpd_epi64(_mm512_roundscale_pd(
      _mm512_mul_pd(_mm512_mul_pd(cosine, radius), _mm512_set1_pd(c.high_sigma)), rounding));
  const __m512i low = _mm512_cvttpd_epi64(_mm512_roundscale_pd(
      _mm512_mul_pd(_mm512_mul_pd(sine, radius), _mm512_set1_pd(c.low_sigma)), rounding));
  return _mm512_add_epi64(_mm512_sll_epi64(high, _mm_cvtsi64_si128(c.shift)), low);
}

FHELIUM_DQ void smudging_span_vector(const int64_t* w, int64_t count, int64_t begin, int64_t end, int64_t* out,
                                     const NoiseConstants& c) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m512i w1 = _mm512_loadu_si512(w + i);
    const __m512i w2 = _mm512_loadu_si512(w + count + i);
    _mm512_storeu_si512(out + i, smudging_vector(w1, w2, c));
  }
  smudging_span_scalar(w, count, i, end, out, c);
}

at::Tensor smudging_noise(const at::Tensor& words_in, const at::Tensor& constants_in, int64_t shift,
                          double high_sigma, double low_sigma, int64_t level) {
  TORCH_CHECK(words_in.device().is_cpu() && words_in.scalar_type() == at::kLong && words_in.dim() == 1 &&
                  words_in.numel() % 2 == 0,
              "fhelium::smudging_noise: an even number of int64 CPU words expected");
  TORCH_CHECK(constants_in.scalar_type() == at::kDouble && constants_in.numel() == kNoiseConstants,
              "fhelium::smudging_noise: ", kNoiseConstants, " float64 constants expected");
  TORCH_CHECK(shift >= 0 && shift < 40, "fhelium::smudging_noise: shift must be in [0, 40)");
  // the AVX-512 lanes at the DQ and IFMA levels; the AVX2 level runs the scalar loop
  const bool vector = checked_level(level) == kLevelDq || level == kLevelIfma;
  const at::Tensor words = words_in.contiguous();
  const at::Tensor constants = constants_in.to(at::kCPU).contiguous();
  const double* k = constants.data_ptr<double>();
  NoiseConstants c;
  c.ln2_hi = k[0];
  c.ln2_lo = k[1];
  c.sqrt2 = k[2];
  c.half_pi = k[3];
  std::memcpy(c.log_c, k + 4, sizeof(c.log_c));
  std::memcpy(c.sin_c, k + 4 + kLogTerms, sizeof(c.sin_c));
  std::memcpy(c.cos_c, k + 4 + kLogTerms + kSinTerms, sizeof(c.cos_c));
  c.high_sigma = high_sigma;
  c.low_sigma = low_sigma;
  c.shift = shift;
  const int64_t count = words.numel() / 2;
  at::Tensor out = at::empty({count}, words.options());
  const int64_t* w = words.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, count, 8192, [&](int64_t begin, int64_t end) {
    if (vector) {
      smudging_span_vector(w, count, begin, end, o, c);
    } else {
      smudging_span_scalar(w, count, begin, end, o, c);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(fhelium, m) {
  m.def("best_level() -> int", &best_level);
  m.def("ntt_tables(Tensor moduli, Tensor roots, int n) -> Tensor");
  m.def("ntt_forward(Tensor x, Tensor moduli, Tensor tables, int level) -> Tensor");
  m.def("ntt_inverse(Tensor x, Tensor moduli, Tensor tables, int level) -> Tensor");
  m.def("mul_mod(Tensor a, Tensor b, Tensor q, int level=0) -> Tensor");
  m.def("mul_add_mod(Tensor a, Tensor b, Tensor c, Tensor q, int level=0) -> Tensor");
  m.def("add_mod(Tensor a, Tensor b, Tensor q, int level=0) -> Tensor");
  m.def("sub_mod(Tensor a, Tensor b, Tensor q, int level=0) -> Tensor");
  m.def("add_mod_(Tensor(a!) a, Tensor b, Tensor q, int level=0) -> ()");
  m.def("sub_mod_(Tensor(a!) a, Tensor b, Tensor q, int level=0) -> ()");
  m.def("divide_round(Tensor x, Tensor moduli, Tensor tables, int drop, bool ntt, int level) -> Tensor");
  m.def("mod_down(Tensor values, Tensor? addend, Tensor? divided, Tensor moduli, Tensor tables, int level, Tensor? message=None, Tensor? message_factors=None) -> Tensor");
  m.def("small_ntt(Tensor x, Tensor moduli, Tensor tables, int level) -> Tensor");
  m.def("signed_ntt(Tensor x, Tensor moduli, Tensor tables, int level) -> Tensor");
  m.def("permute_last(Tensor x, Tensor index) -> Tensor");
  m.def("tensor_product(Tensor a, Tensor b, Tensor moduli, int level) -> Tensor");
  m.def("decompose(Tensor x, Tensor moduli, Tensor tables, int level) -> Tensor");
  m.def("key_switch(Tensor x, Tensor key, Tensor key_digits, Tensor key_rows, Tensor moduli, Tensor tables, int level) -> Tensor");
  m.def("smudging_noise(Tensor words, Tensor constants, int shift, float high_sigma, float low_sigma, int level) -> Tensor");
  m.def("key_switch_lifted(Tensor lifted, Tensor key, Tensor key_digits, Tensor key_rows, Tensor moduli, Tensor tables, int level) -> Tensor");
  m.def("project_rows(Tensor x, Tensor w, Tensor q) -> Tensor");
  m.def("project_rows_checked(Tensor x, Tensor w, Tensor q) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fhelium, CPU, m) {
  m.impl("ntt_tables", &ntt_tables);
  m.impl("ntt_forward", &ntt_forward);
  m.impl("ntt_inverse", &ntt_inverse);
  m.impl("mul_mod", &mul_mod);
  m.impl("mul_add_mod", &mul_add_mod);
  m.impl("add_mod", &add_mod);
  m.impl("sub_mod", &sub_mod);
  m.impl("add_mod_", &add_mod_);
  m.impl("sub_mod_", &sub_mod_);
  m.impl("divide_round", &divide_round);
  m.impl("decompose", &decompose);
  m.impl("tensor_product", &tensor_product);
  m.impl("permute_last", &permute_last);
  m.impl("small_ntt", &small_ntt);
  m.impl("signed_ntt", &signed_ntt);
  m.impl("mod_down", &mod_down);
  m.impl("key_switch", &key_switch);
  m.impl("key_switch_lifted", &key_switch_lifted);
  m.impl("smudging_noise", &smudging_noise);
  m.impl("project_rows", &project_rows);
  m.impl("project_rows_checked", &project_rows_checked);
}
