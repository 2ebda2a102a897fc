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
// last inverse stage. Dispatch levels: 0 = scalar (unsigned __int128 Shoup products), 1 = AVX-512
// IFMA52 (vpmadd52lo/hi; needs q < 2^50 so that lazy values < 4q fit 52 bits). The IFMA code is
// compiled with per-function target attributes (no -march), picked at run time from CPUID.
// Threads: at::parallel_for (torch's own intra-op pool), one row per task.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

namespace {

using u64 = uint64_t;
using u128 = unsigned __int128;

constexpr int64_t kLevelScalar = 0;
constexpr int64_t kLevelIfma = 1;
constexpr u64 kIfmaModulusBound = u64{1} << 50;

bool cpu_has_ifma() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512ifma");
  }();
  return has;
}

int64_t best_level() { return cpu_has_ifma() ? kLevelIfma : kLevelScalar; }

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

FHELIUM_IFMA void forward_ifma(u64* a, u64* out, const RowTables& t, int logn) {
  const int64_t n = int64_t{1} << logn;
  const __m512i q = _mm512_set1_epi64(static_cast<long long>(t.q));
  const __m512i two_q = _mm512_set1_epi64(static_cast<long long>(2 * t.q));
  const __m512i mask52 = _mm512_set1_epi64((1LL << 52) - 1);
  int64_t half = n;
  for (int64_t m = 1; m < n; m <<= 1) {
    half >>= 1;
    if (half >= 8) {
      for (int64_t i = 0; i < m; ++i) {
        const __m512i w = _mm512_set1_epi64(static_cast<long long>(t.forward[m + i]));
        const __m512i ws = _mm512_set1_epi64(static_cast<long long>(t.forward_shoup[m + i] >> 12));
        u64* x = a + 2 * i * half;
        u64* y = x + half;
        for (int64_t j = 0; j < half; j += 8) {
          const __m512i u = ifma_reduce_once(_mm512_loadu_si512(x + j), two_q);
          const __m512i v = ifma_mul_shoup_lazy(_mm512_loadu_si512(y + j), w, ws, q, mask52);
          _mm512_storeu_si512(x + j, _mm512_add_epi64(u, v));
          _mm512_storeu_si512(y + j, _mm512_add_epi64(_mm512_sub_epi64(u, v), two_q));
        }
      }
    } else {
      const SmallStage& s = small_stage(static_cast<int>(half));
      const __m512i take_x = _mm512_load_si512(s.take_x), take_y = _mm512_load_si512(s.take_y);
      const __m512i put_lo = _mm512_load_si512(s.put_lo), put_hi = _mm512_load_si512(s.put_hi);
      const __m512i pick = _mm512_load_si512(s.twiddle);
      for (int64_t b = 0; b < n; b += 16) {
        const __m512i lo = _mm512_loadu_si512(a + b), hi = _mm512_loadu_si512(a + b + 8);
        const int64_t first = m + b / (2 * half);
        const __m512i w = _mm512_permutexvar_epi64(pick, _mm512_loadu_si512(t.forward + first));
        const __m512i ws = _mm512_srli_epi64(
            _mm512_permutexvar_epi64(pick, _mm512_loadu_si512(t.forward_shoup + first)), 12);
        const __m512i u = ifma_reduce_once(_mm512_permutex2var_epi64(lo, take_x, hi), two_q);
        const __m512i v = ifma_mul_shoup_lazy(_mm512_permutex2var_epi64(lo, take_y, hi), w, ws, q, mask52);
        const __m512i x = _mm512_add_epi64(u, v);
        const __m512i y = _mm512_add_epi64(_mm512_sub_epi64(u, v), two_q);
        _mm512_storeu_si512(a + b, _mm512_permutex2var_epi64(x, put_lo, y));
        _mm512_storeu_si512(a + b + 8, _mm512_permutex2var_epi64(x, put_hi, y));
      }
    }
  }
  const uint32_t* rev = bitrev_table(logn);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256i index = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rev + k));
    __m512i v = _mm512_i32gather_epi64(index, reinterpret_cast<const long long*>(a), 8);
    v = ifma_reduce_once(ifma_reduce_once(v, two_q), q);
    _mm512_storeu_si512(out + k, v);
  }
}

FHELIUM_IFMA void inverse_ifma(const u64* in, u64* a, u64* out, const RowTables& t, int logn) {
  const int64_t n = int64_t{1} << logn;
  const __m512i q = _mm512_set1_epi64(static_cast<long long>(t.q));
  const __m512i two_q = _mm512_set1_epi64(static_cast<long long>(2 * t.q));
  const __m512i mask52 = _mm512_set1_epi64((1LL << 52) - 1);
  const uint32_t* rev = bitrev_table(logn);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256i index = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rev + k));
    _mm512_storeu_si512(a + k, _mm512_i32gather_epi64(index, reinterpret_cast<const long long*>(in), 8));
  }
  int64_t half = 1;
  for (int64_t m = n >> 1; m > 1; m >>= 1) {
    if (half >= 8) {
      for (int64_t i = 0; i < m; ++i) {
        const __m512i w = _mm512_set1_epi64(static_cast<long long>(t.inverse[m + i]));
        const __m512i ws = _mm512_set1_epi64(static_cast<long long>(t.inverse_shoup[m + i] >> 12));
        u64* x = a + 2 * i * half;
        u64* y = x + half;
        for (int64_t j = 0; j < half; j += 8) {
          const __m512i u = _mm512_loadu_si512(x + j), v = _mm512_loadu_si512(y + j);
          _mm512_storeu_si512(x + j, ifma_reduce_once(_mm512_add_epi64(u, v), two_q));
          const __m512i d = _mm512_add_epi64(_mm512_sub_epi64(u, v), two_q);
          _mm512_storeu_si512(y + j, ifma_mul_shoup_lazy(d, w, ws, q, mask52));
        }
      }
    } else {
      const SmallStage& s = small_stage(static_cast<int>(half));
      const __m512i take_x = _mm512_load_si512(s.take_x), take_y = _mm512_load_si512(s.take_y);
      const __m512i put_lo = _mm512_load_si512(s.put_lo), put_hi = _mm512_load_si512(s.put_hi);
      const __m512i pick = _mm512_load_si512(s.twiddle);
      for (int64_t b = 0; b < n; b += 16) {
        const __m512i lo = _mm512_loadu_si512(a + b), hi = _mm512_loadu_si512(a + b + 8);
        const int64_t first = m + b / (2 * half);
        const __m512i w = _mm512_permutexvar_epi64(pick, _mm512_loadu_si512(t.inverse + first));
        const __m512i ws = _mm512_srli_epi64(
            _mm512_permutexvar_epi64(pick, _mm512_loadu_si512(t.inverse_shoup + first)), 12);
        const __m512i u = _mm512_permutex2var_epi64(lo, take_x, hi);
        const __m512i v = _mm512_permutex2var_epi64(lo, take_y, hi);
        const __m512i x = ifma_reduce_once(_mm512_add_epi64(u, v), two_q);
        const __m512i y = ifma_mul_shoup_lazy(_mm512_add_epi64(_mm512_sub_epi64(u, v), two_q), w, ws, q, mask52);
        _mm512_storeu_si512(a + b, _mm512_permutex2var_epi64(x, put_lo, y));
        _mm512_storeu_si512(a + b + 8, _mm512_permutex2var_epi64(x, put_hi, y));
      }
    }
    half <<= 1;
  }
  const __m512i ni = _mm512_set1_epi64(static_cast<long long>(t.inverse[0]));
  const __m512i nis = _mm512_set1_epi64(static_cast<long long>(t.inverse_shoup[0] >> 12));
  const __m512i wn = _mm512_set1_epi64(static_cast<long long>(t.forward[0]));
  const __m512i wns = _mm512_set1_epi64(static_cast<long long>(t.forward_shoup[0] >> 12));
  const int64_t h = n >> 1;
  for (int64_t j = 0; j < h; j += 8) {
    const __m512i u = _mm512_loadu_si512(a + j), v = _mm512_loadu_si512(a + j + h);
    const __m512i x = ifma_mul_shoup_lazy(_mm512_add_epi64(u, v), ni, nis, q, mask52);
    const __m512i y = ifma_mul_shoup_lazy(_mm512_add_epi64(_mm512_sub_epi64(u, v), two_q), wn, wns, q, mask52);
    _mm512_storeu_si512(out + j, ifma_reduce_once(x, q));
    _mm512_storeu_si512(out + j + h, ifma_reduce_once(y, q));
  }
}

// ------------------------------------------------------------------------------------ ops
int64_t resolve_level(int64_t level, const at::Tensor& moduli, int logn) {
  TORCH_CHECK(level == kLevelScalar || level == kLevelIfma, "fhelium native: unknown dispatch level ", level);
  if (level == kLevelIfma) {
    TORCH_CHECK(cpu_has_ifma(), "fhelium native: the IFMA level was requested but this CPU lacks AVX-512 IFMA");
    if (logn < 4) return kLevelScalar;  // the 16-element blocks need N >= 16
    const int64_t* q = moduli.data_ptr<int64_t>();
    for (int64_t i = 0; i < moduli.numel(); ++i) {
      if (static_cast<u64>(q[i]) >= kIfmaModulusBound) return kLevelScalar;
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
        if (chosen == kLevelIfma) inverse_ifma(in, scratch.data(), result, t, logn);
        else inverse_scalar(in, scratch.data(), result, t, logn);
      } else {
        std::memcpy(scratch.data(), in, static_cast<size_t>(n) * sizeof(u64));
        if (chosen == kLevelIfma) forward_ifma(scratch.data(), result, t, logn);
        else forward_scalar(scratch.data(), result, t, logn);
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
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong, "fhelium native mul_mod: int64 CPU tensors expected");
  }
}

at::Tensor mul_mod(const at::Tensor& a, const at::Tensor& b, const at::Tensor& q) {
  check_elementwise({&a, &b, &q});
  at::Tensor out;
  at::TensorIterator iter =
      at::TensorIteratorConfig().add_output(out).add_const_input(a).add_const_input(b).add_const_input(q).build();
  iter.for_each([](char** data, const int64_t* strides, int64_t count) {
    char *out = data[0], *pa = data[1], *pb = data[2], *pq = data[3];
    for (int64_t i = 0; i < count; ++i) {
      *reinterpret_cast<int64_t*>(out) = mul_mod_one(*reinterpret_cast<const int64_t*>(pa),
                                                     *reinterpret_cast<const int64_t*>(pb),
                                                     *reinterpret_cast<const int64_t*>(pq));
      out += strides[0]; pa += strides[1]; pb += strides[2]; pq += strides[3];
    }
  });
  return iter.output();
}

at::Tensor mul_add_mod(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const at::Tensor& q) {
  check_elementwise({&a, &b, &c, &q});
  at::Tensor out;
  at::TensorIterator iter = at::TensorIteratorConfig()
                                .add_output(out)
                                .add_const_input(a)
                                .add_const_input(b)
                                .add_const_input(c)
                                .add_const_input(q)
                                .build();
  iter.for_each([](char** data, const int64_t* strides, int64_t count) {
    char *out = data[0], *pa = data[1], *pb = data[2], *pc = data[3], *pq = data[4];
    for (int64_t i = 0; i < count; ++i) {
      const int64_t q = *reinterpret_cast<const int64_t*>(pq);
      int64_t r = mul_mod_one(*reinterpret_cast<const int64_t*>(pa), *reinterpret_cast<const int64_t*>(pb), q) +
                  *reinterpret_cast<const int64_t*>(pc) - q;
      r += (r >> 63) & q;
      *reinterpret_cast<int64_t*>(out) = r;
      out += strides[0]; pa += strides[1]; pb += strides[2]; pc += strides[3]; pq += strides[4];
    }
  });
  return iter.output();
}

}  // namespace

TORCH_LIBRARY(fhelium, m) {
  m.def("best_level() -> int", &best_level);
  m.def("ntt_tables(Tensor moduli, Tensor roots, int n) -> Tensor");
  m.def("ntt_forward(Tensor x, Tensor moduli, Tensor tables, int level) -> Tensor");
  m.def("ntt_inverse(Tensor x, Tensor moduli, Tensor tables, int level) -> Tensor");
  m.def("mul_mod(Tensor a, Tensor b, Tensor q) -> Tensor");
  m.def("mul_add_mod(Tensor a, Tensor b, Tensor c, Tensor q) -> Tensor");
}

TORCH_LIBRARY_IMPL(fhelium, CPU, m) {
  m.impl("ntt_tables", &ntt_tables);
  m.impl("ntt_forward", &ntt_forward);
  m.impl("ntt_inverse", &ntt_inverse);
  m.impl("mul_mod", &mul_mod);
  m.impl("mul_add_mod", &mul_add_mod);
}
