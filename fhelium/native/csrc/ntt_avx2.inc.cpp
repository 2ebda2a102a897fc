// The AVX2 negacyclic NTT rows (not compiled on its own: named .cpp only so that the package data
// pattern ships it). fhelium_native.cpp includes this file inside namespace avx2, which defines
//   FHELIUM_VECTOR                          the function attribute (avx2, fma)
//   to_double / to_integer                  exact conversions of integers below 2^52
//   reduce_once(x, bound)                   [0, 2 bound) -> [0, bound)
//   add_q_if_negative(r, q)                 [-q, q) -> [0, q)
// and uses RowTables, bitrev_table and kIfmaBlock from the enclosing file. Rows need every q < 2^50.
//
// The residues live as signed binary64 integers during the transform: 4 lanes of integer arithmetic
// that AVX2 has no 64-bit multiply for. A twiddle product y*w is exact as high + low (high = fl(y*w),
// low = fma(y, w, -high)); its quotient estimate e = RNE(y * fl(w * fl(1/q))) comes from one FMA
// against the constant 1.5 * 2^52 (the sum lands in [2^52, 2^53), where binary64 spacing is 1, so
// the one rounding is the rounding to an integer); for |y| <= 2^51 the estimate is within 1 of
// y*w/q (its factor carries two roundings, 2^-52 relative), so y*w - e*q, computed exactly by one
// more FMA from high and low, lies in (-q, q). That is 6 vector instructions per product with no
// correction at all. Sums and differences are left unreduced while a per-row plan (bounds tracked
// exactly from q, below) says the next products' inputs stay within 2^51; where they would not, the
// butterfly also reduces its sum to |x| <= q/2 + 1 (x - RNE(x * fl(1/q)) * q, 3 instructions).
// With the presets' 40-bit primes no stage of the forward reduces at all; 48-bit primes reduce every
// 7th stage, 50-bit ones every stage after the first. The outputs are fully reduced, so the bits
// equal every other level's.

constexpr double kRoundingConstant = 0x1.8p52;  // 1.5 * 2^52: x + this rounds x to an integer (|x| < 2^51)
constexpr u64 kProductInputBound = u64{1} << 51;  // |y| for mul_signed's estimate

struct Constants {
  __m256d q, q_inverse, round;
};

FHELIUM_VECTOR inline Constants constants_for(u64 q) {
  const double q_scalar = static_cast<double>(q);
  return {_mm256_set1_pd(q_scalar), _mm256_set1_pd(1.0 / q_scalar), _mm256_set1_pd(kRoundingConstant)};
}

// y*w - e*q with e = RNE(y * wq), in (-q, q), for integers |y| <= 2^51, w in [0, q), wq = fl(w fl(1/q))
FHELIUM_VECTOR inline __m256d mul_signed(__m256d y, __m256d w, __m256d wq, const Constants& c) {
  const __m256d high = _mm256_mul_pd(y, w);
  const __m256d low = _mm256_fmsub_pd(y, w, high);
  const __m256d e = _mm256_sub_pd(_mm256_fmadd_pd(y, wq, c.round), c.round);
  return _mm256_add_pd(_mm256_fnmadd_pd(e, c.q, high), low);
}

// x - RNE(x fl(1/q)) q: |result| <= q/2 + 1 for integers |x| < 2^53 (the estimate is off by at most
// |x| 2^-53 / q, the result an integer computed exactly by the FMA)
FHELIUM_VECTOR inline __m256d reduce_signed(__m256d x, const Constants& c) {
  const __m256d e = _mm256_sub_pd(_mm256_fmadd_pd(x, c.q_inverse, c.round), c.round);
  return _mm256_fnmadd_pd(e, c.q, x);
}

// signed |x| <= 2^51 + q -> [0, q)
FHELIUM_VECTOR inline __m256d reduce_fully(__m256d x, const Constants& c) {
  return add_q_if_negative(reduce_signed(x, c), c.q);
}

// The plans: which stages reduce their sums, from exact bounds on |value| (u64, all below 2^53).
// A product is below q (at most q - 1), a reduced sum at most q/2 + 1, an input below q.
struct Plan {
  bool reduce[32];
};

// Cooley-Tukey stage s (0 = the first, m = 2^s groups): x + v, x - v with |v| <= q - 1; the next
// stage's products need the bound within 2^51, so a stage reduces x first where that would fail
inline Plan forward_plan(u64 q, int logn) {
  Plan plan{};
  const u64 product = q - 1, reduced = q / 2 + 1;
  u64 bound = q - 1;
  for (int s = 0; s < logn; ++s) {
    plan.reduce[s] = bound + product > kProductInputBound;
    bound = (plan.reduce[s] ? reduced : bound) + product;
  }
  return plan;
}

// Gentleman-Sande stage s (m = 2^s groups, run from s = logn - 1 down to 1; s = 0, the last, folds in
// n^-1): x + y and w (x - y), whose product needs 2 bound <= 2^51; a stage reduces its sum where the
// next stage's difference would exceed that
inline Plan inverse_plan(u64 q, int logn) {
  Plan plan{};
  const u64 product = q - 1;
  u64 bound = q - 1;
  for (int s = logn - 1; s >= 1; --s) {
    const u64 plain = std::max(2 * bound, product);
    plan.reduce[s] = 2 * plain > kProductInputBound;
    bound = plan.reduce[s] ? product : plain;
  }
  return plan;
}

// one butterfly on 4 lanes, in place: Cooley-Tukey when Forward ((x, y) -> (x + wy, x - wy)),
// Gentleman-Sande otherwise ((x, y) -> (x + y, w(x - y))); Reduce: the sum's x reduced (see above)
template <bool Forward, bool Reduce>
FHELIUM_VECTOR inline void butterfly(__m256d& x, __m256d& y, __m256d w, __m256d wq, const Constants& c) {
  if constexpr (Forward) {
    const __m256d u = Reduce ? reduce_signed(x, c) : x;
    const __m256d v = mul_signed(y, w, wq, c);
    x = _mm256_add_pd(u, v);
    y = _mm256_sub_pd(u, v);
  } else {
    const __m256d sum = _mm256_add_pd(x, y);
    y = mul_signed(_mm256_sub_pd(x, y), w, wq, c);
    x = Reduce ? reduce_signed(sum, c) : sum;
  }
}

// one stage (m groups at distance half) on the residues [begin, end), a multiple of 8 apart;
// Integers: the row still holds its u64 input (the forward's first stage converts as it goes)
template <bool Forward, bool Reduce, bool Integers = false>
FHELIUM_VECTOR inline void stage(double* a, const RowTables& t, int64_t m, int64_t half, int64_t begin, int64_t end,
                                 const Constants& c) {
  const u64* twiddles = Forward ? t.forward : t.inverse;
  const double q_inverse = 1.0 / static_cast<double>(t.q);
  if (half >= 4) {
    for (int64_t i = begin / (2 * half); i < end / (2 * half); ++i) {
      const double w_scalar = static_cast<double>(twiddles[m + i]);
      const __m256d w = _mm256_set1_pd(w_scalar);
      const __m256d wq = _mm256_set1_pd(w_scalar * q_inverse);
      double* x = a + 2 * i * half;
      double* y = x + half;
      for (int64_t j = 0; j < half; j += 4) {
        __m256d u, v;
        if constexpr (Integers) {
          u = load(x + j);
          v = load(y + j);
        } else {
          u = _mm256_loadu_pd(x + j);
          v = _mm256_loadu_pd(y + j);
        }
        butterfly<Forward, Reduce>(u, v, w, wq, c);
        _mm256_storeu_pd(x + j, u);
        _mm256_storeu_pd(y + j, v);
      }
    }
    return;
  }
  for (int64_t b = begin; b < end; b += 8) {
    const __m256d lo = _mm256_loadu_pd(a + b), hi = _mm256_loadu_pd(a + b + 4);
    const int64_t first = m + b / (2 * half);
    __m256d x, y, w;
    if (half == 2) {  // lo = [x0 x1 y0 y1] of group g, hi the same of group g + 1
      x = _mm256_permute2f128_pd(lo, hi, 0x20);
      y = _mm256_permute2f128_pd(lo, hi, 0x31);
      const __m128i pair = _mm_loadu_si128(reinterpret_cast<const __m128i*>(twiddles + first));
      w = to_double(_mm256_permute4x64_epi64(_mm256_castsi128_si256(pair), 0x50));  // [w0 w0 w1 w1]
    } else {  // lo = [x0 y0 x1 y1], hi = [x2 y2 x3 y3]: lanes hold groups g, g+2, g+1, g+3
      x = _mm256_unpacklo_pd(lo, hi);
      y = _mm256_unpackhi_pd(lo, hi);
      const __m256i four = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(twiddles + first));
      w = to_double(_mm256_permute4x64_epi64(four, 0xd8));  // [w0 w2 w1 w3]
    }
    butterfly<Forward, Reduce>(x, y, w, _mm256_mul_pd(w, c.q_inverse), c);
    if (half == 2) {
      _mm256_storeu_pd(a + b, _mm256_permute2f128_pd(x, y, 0x20));
      _mm256_storeu_pd(a + b + 4, _mm256_permute2f128_pd(x, y, 0x31));
    } else {
      _mm256_storeu_pd(a + b, _mm256_unpacklo_pd(x, y));
      _mm256_storeu_pd(a + b + 4, _mm256_unpackhi_pd(x, y));
    }
  }
}

template <bool Forward>
FHELIUM_VECTOR inline void stage_planned(double* a, const RowTables& t, int64_t m, int64_t half, int64_t begin,
                                         int64_t end, const Constants& c, bool reduce) {
  if (reduce) stage<Forward, true>(a, t, m, half, begin, end, c);
  else stage<Forward, false>(a, t, m, half, begin, end, c);
}

inline int stage_index(int64_t m) { return __builtin_ctzll(static_cast<unsigned long long>(m)); }

template <bool Forward>
FHELIUM_VECTOR inline void butterfly_planned(__m256d& x, __m256d& y, __m256d w, __m256d wq, const Constants& c,
                                             bool reduce) {
  if (reduce) butterfly<Forward, true>(x, y, w, wq, c);
  else butterfly<Forward, false>(x, y, w, wq, c);
}

// The three stages at distances 4, 2 and 1 in one pass over 16 residues at a time, in registers
// (the forward's last three, the inverse's first three, in the same order as stage by stage: the same
// bits). v0..v3 = a[b..b+16); at distance 2 the lanes hold [x x | x x] of groups g, g+1 against their
// [y y | y y]; at distance 1, after one more unpack, [x0 x1 x2 x3] of four consecutive groups, so that
// stage's twiddles load in order.
template <bool Forward>
FHELIUM_VECTOR inline void last_three_stages(double* a, const RowTables& t, int64_t n, int64_t begin, int64_t end,
                                             const Constants& c, const Plan& plan, int logn) {
  const u64* twiddles = Forward ? t.forward : t.inverse;
  const int64_t m4 = n >> 3, m2 = n >> 2, m1 = n >> 1;
  const bool reduce4 = plan.reduce[logn - 3], reduce2 = plan.reduce[logn - 2], reduce1 = plan.reduce[logn - 1];
  const double q_inverse = 1.0 / static_cast<double>(t.q);
  for (int64_t b = begin; b < end; b += 16) {
    __m256d v0 = _mm256_loadu_pd(a + b), v1 = _mm256_loadu_pd(a + b + 4);
    __m256d v2 = _mm256_loadu_pd(a + b + 8), v3 = _mm256_loadu_pd(a + b + 12);
    const __m256d w1 = to_double(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(twiddles + m1 + b / 2)));
    const __m256d w1b = to_double(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(twiddles + m1 + b / 2 + 4)));
    const __m256d four = to_double(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(twiddles + m2 + b / 4)));
    const __m256d w2 = _mm256_permute4x64_pd(four, 0x50), w2b = _mm256_permute4x64_pd(four, 0xfa);  // [w0 w0 w1 w1], [w2 w2 w3 w3]
    const double w4_scalar = static_cast<double>(twiddles[m4 + b / 8]);
    const double w4b_scalar = static_cast<double>(twiddles[m4 + b / 8 + 1]);
    const __m256d w4 = _mm256_set1_pd(w4_scalar), w4q = _mm256_set1_pd(w4_scalar * q_inverse);
    const __m256d w4b = _mm256_set1_pd(w4b_scalar), w4bq = _mm256_set1_pd(w4b_scalar * q_inverse);
    if constexpr (Forward) {
      butterfly_planned<true>(v0, v1, w4, w4q, c, reduce4);
      butterfly_planned<true>(v2, v3, w4b, w4bq, c, reduce4);
    }
    // distance 2: X = [e0 e1 e4 e5], Y = [e2 e3 e6 e7] of each half
    __m256d x0 = _mm256_permute2f128_pd(v0, v1, 0x20), y0 = _mm256_permute2f128_pd(v0, v1, 0x31);
    __m256d x1 = _mm256_permute2f128_pd(v2, v3, 0x20), y1 = _mm256_permute2f128_pd(v2, v3, 0x31);
    if constexpr (Forward) {
      butterfly_planned<true>(x0, y0, w2, _mm256_mul_pd(w2, c.q_inverse), c, reduce2);
      butterfly_planned<true>(x1, y1, w2b, _mm256_mul_pd(w2b, c.q_inverse), c, reduce2);
    }
    // distance 1: x = [e0 e2 e4 e6], y = [e1 e3 e5 e7]
    __m256d p0 = _mm256_unpacklo_pd(x0, y0), q0 = _mm256_unpackhi_pd(x0, y0);
    __m256d p1 = _mm256_unpacklo_pd(x1, y1), q1 = _mm256_unpackhi_pd(x1, y1);
    butterfly_planned<Forward>(p0, q0, w1, _mm256_mul_pd(w1, c.q_inverse), c, reduce1);
    butterfly_planned<Forward>(p1, q1, w1b, _mm256_mul_pd(w1b, c.q_inverse), c, reduce1);
    x0 = _mm256_unpacklo_pd(p0, q0);
    y0 = _mm256_unpackhi_pd(p0, q0);
    x1 = _mm256_unpacklo_pd(p1, q1);
    y1 = _mm256_unpackhi_pd(p1, q1);
    if constexpr (!Forward) {
      butterfly_planned<false>(x0, y0, w2, _mm256_mul_pd(w2, c.q_inverse), c, reduce2);
      butterfly_planned<false>(x1, y1, w2b, _mm256_mul_pd(w2b, c.q_inverse), c, reduce2);
    }
    v0 = _mm256_permute2f128_pd(x0, y0, 0x20);
    v1 = _mm256_permute2f128_pd(x0, y0, 0x31);
    v2 = _mm256_permute2f128_pd(x1, y1, 0x20);
    v3 = _mm256_permute2f128_pd(x1, y1, 0x31);
    if constexpr (!Forward) {
      butterfly_planned<false>(v0, v1, w4, w4q, c, reduce4);
      butterfly_planned<false>(v2, v3, w4b, w4bq, c, reduce4);
    }
    _mm256_storeu_pd(a + b, v0);
    _mm256_storeu_pd(a + b + 4, v1);
    _mm256_storeu_pd(a + b + 8, v2);
    _mm256_storeu_pd(a + b + 12, v3);
  }
}

// [v0 v1 v2 v3] (rows) -> its transpose
FHELIUM_VECTOR inline void transpose(__m256d& v0, __m256d& v1, __m256d& v2, __m256d& v3) {
  const __m256d t0 = _mm256_unpacklo_pd(v0, v1), t1 = _mm256_unpackhi_pd(v0, v1);
  const __m256d t2 = _mm256_unpacklo_pd(v2, v3), t3 = _mm256_unpackhi_pd(v2, v3);
  v0 = _mm256_permute2f128_pd(t0, t2, 0x20);
  v1 = _mm256_permute2f128_pd(t1, t3, 0x20);
  v2 = _mm256_permute2f128_pd(t0, t2, 0x31);
  v3 = _mm256_permute2f128_pd(t1, t3, 0x31);
}

// The bit-reversal permutation without gathers: with n = 4 * quarter, rev(Q * quarter + r) =
// 4 rev'(r) + rev2(Q) (rev' over log2(quarter) bits), so the quarters' entries r..r+3, as rows in the
// order Q = 0, 2, 1, 3, transposed, are the destination's 4 contiguous entries at 4 rev'(r + s).
// out[k] = a[rev(k)] for the forward's end (a: signed binary64 values, |a| <= 2^51 + q; out: reduced)
FHELIUM_VECTOR inline void bit_reverse_out(const double* a, u64* out, int logn, const Constants& c) {
  const int64_t quarter = (int64_t{1} << logn) >> 2;
  const uint32_t* rev = bitrev_table(logn - 2);
  for (int64_t r = 0; r < quarter; r += 4) {
    __m256d v0 = _mm256_loadu_pd(a + r), v1 = _mm256_loadu_pd(a + 2 * quarter + r);
    __m256d v2 = _mm256_loadu_pd(a + quarter + r), v3 = _mm256_loadu_pd(a + 3 * quarter + r);
    v0 = reduce_fully(v0, c);
    v1 = reduce_fully(v1, c);
    v2 = reduce_fully(v2, c);
    v3 = reduce_fully(v3, c);
    transpose(v0, v1, v2, v3);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4 * int64_t{rev[r]}), to_integer(v0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4 * int64_t{rev[r + 1]}), to_integer(v1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4 * int64_t{rev[r + 2]}), to_integer(v2));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4 * int64_t{rev[r + 3]}), to_integer(v3));
  }
}

// a[k] = in[rev(k)] as binary64 for the inverse's start (in: residues below 2^52)
FHELIUM_VECTOR inline void bit_reverse_in(const u64* in, double* a, int logn) {
  const int64_t quarter = (int64_t{1} << logn) >> 2;
  const uint32_t* rev = bitrev_table(logn - 2);
  for (int64_t r = 0; r < quarter; r += 4) {
    __m256d v0 = load(in + r), v1 = load(in + 2 * quarter + r), v2 = load(in + quarter + r), v3 = load(in + 3 * quarter + r);
    transpose(v0, v1, v2, v3);
    _mm256_storeu_pd(a + 4 * int64_t{rev[r]}, v0);
    _mm256_storeu_pd(a + 4 * int64_t{rev[r + 1]}, v1);
    _mm256_storeu_pd(a + 4 * int64_t{rev[r + 2]}, v2);
    _mm256_storeu_pd(a + 4 * int64_t{rev[r + 3]}, v3);
  }
}

// a: natural-order coefficients in [0, q) (scratch, destroyed); out: natural-order evaluations
FHELIUM_VECTOR void forward(u64* a_integers, u64* out, const RowTables& t, int logn) {
  const int64_t n = int64_t{1} << logn;
  double* a = reinterpret_cast<double*>(a_integers);
  const Constants c = constants_for(t.q);
  const Plan plan = forward_plan(t.q, logn);
  // the first stage (m = 1, half = n/2 >= 8) converts the integers as it reads them (and never reduces)
  stage<true, false, true>(a, t, 1, n >> 1, 0, n, c);
  const int64_t block = n < kIfmaBlock ? n : kIfmaBlock;
  int64_t m = 2, half = n >> 2;
  for (; 2 * half > block; m <<= 1, half >>= 1) stage_planned<true>(a, t, m, half, 0, n, c, plan.reduce[stage_index(m)]);
  for (int64_t begin = 0; begin < n; begin += block) {
    for (int64_t mm = m, hh = half; hh >= 8; mm <<= 1, hh >>= 1) {
      stage_planned<true>(a, t, mm, hh, begin, begin + block, c, plan.reduce[stage_index(mm)]);
    }
    last_three_stages<true>(a, t, n, begin, begin + block, c, plan, logn);
  }
  bit_reverse_out(a, out, logn, c);
}

// in: natural-order evaluations in [0, q); a: scratch of n; out: coefficients in [0, q)
FHELIUM_VECTOR void inverse(const u64* in, u64* a_integers, u64* out, const RowTables& t, int logn) {
  const int64_t n = int64_t{1} << logn;
  double* a = reinterpret_cast<double*>(a_integers);
  const Constants c = constants_for(t.q);
  const Plan plan = inverse_plan(t.q, logn);
  const double q_inverse = 1.0 / static_cast<double>(t.q);
  bit_reverse_in(in, a, logn);
  const int64_t block = n < kIfmaBlock ? n : kIfmaBlock;
  for (int64_t begin = 0; begin < n; begin += block) {
    last_three_stages<false>(a, t, n, begin, begin + block, c, plan, logn);
    for (int64_t mm = n >> 4, hh = 8; mm > 1 && 2 * hh <= block; mm >>= 1, hh <<= 1) {
      stage_planned<false>(a, t, mm, hh, begin, begin + block, c, plan.reduce[stage_index(mm)]);
    }
  }
  int64_t m = n >> 1, half = 1;
  while (m > 1 && 2 * half <= block) {
    m >>= 1;
    half <<= 1;
  }
  for (; m > 1; m >>= 1, half <<= 1) stage_planned<false>(a, t, m, half, 0, n, c, plan.reduce[stage_index(m)]);
  // last stage (m = 1, half = n/2) with n^-1 folded in, then the final reduction (products in (-q, q))
  const double ni_scalar = static_cast<double>(t.inverse[0]), wn_scalar = static_cast<double>(t.forward[0]);
  const __m256d ni = _mm256_set1_pd(ni_scalar), niq = _mm256_set1_pd(ni_scalar * q_inverse);
  const __m256d wn = _mm256_set1_pd(wn_scalar), wnq = _mm256_set1_pd(wn_scalar * q_inverse);
  const int64_t h = n >> 1;
  for (int64_t j = 0; j < h; j += 4) {
    const __m256d u = _mm256_loadu_pd(a + j), v = _mm256_loadu_pd(a + j + h);
    const __m256d x = mul_signed(_mm256_add_pd(u, v), ni, niq, c);
    const __m256d y = mul_signed(_mm256_sub_pd(u, v), wn, wnq, c);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), to_integer(add_q_if_negative(x, c.q)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j + h), to_integer(add_q_if_negative(y, c.q)));
  }
}
