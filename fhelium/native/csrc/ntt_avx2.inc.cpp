// The AVX2 negacyclic NTT rows (not compiled on its own: named .cpp only so that the package data
// pattern ships it). fhelium_native.cpp includes this file inside namespace avx2, which defines
//   FHELIUM_VECTOR                          the function attribute (avx2, fma)
//   to_double / to_integer                  exact conversions of integers below 2^52
//   reduce_once(x, bound)                   [0, 2 bound) -> [0, bound)
//   mul_lazy(y, w, wq, q)                   w*y mod q in [0, 2q) for y in [0, 2q), wq = fl(fl(w) fl(1/q))
// and uses RowTables, bitrev_table and kIfmaBlock from the enclosing file. Rows need every q < 2^50.
//
// The residues live as binary64 integers during the transform (every value stays below 4q < 2^52,
// so adds and subtracts are exact and the products are exact through FMA): 4 lanes of 52-bit
// integer arithmetic that AVX2 has no integer multiply for. The butterflies are Harvey's (lazy
// values below 4q), the outputs fully reduced, so the bits equal every other level's.

// one butterfly on 4 lanes, in place: Cooley-Tukey when Forward ((x, y) -> (x + wy, x - wy)),
// Gentleman-Sande otherwise ((x, y) -> (x + y below 2q, w(x - y))); x, y below 4q
template <bool Forward>
FHELIUM_VECTOR inline void butterfly(__m256d& x, __m256d& y, __m256d w, __m256d wq, __m256d q, __m256d two_q) {
  if constexpr (Forward) {
    const __m256d u = reduce_once(x, two_q);
    const __m256d v = mul_lazy(reduce_once(y, two_q), w, wq, q);
    x = _mm256_add_pd(u, v);
    y = _mm256_sub_pd(_mm256_add_pd(u, two_q), v);
  } else {
    const __m256d u = x, v = y;
    x = reduce_once(_mm256_add_pd(u, v), two_q);
    y = mul_lazy(reduce_once(_mm256_sub_pd(_mm256_add_pd(u, two_q), v), two_q), w, wq, q);
  }
}

// one stage (m groups at distance half) on the residues [begin, end), a multiple of 8 apart
template <bool Forward>
FHELIUM_VECTOR inline void stage(double* a, const RowTables& t, int64_t m, int64_t half, int64_t begin, int64_t end,
                                 __m256d q, __m256d two_q, double q_inverse) {
  const u64* twiddles = Forward ? t.forward : t.inverse;
  const __m256d q_inverse_vector = _mm256_set1_pd(q_inverse);
  if (half >= 4) {
    for (int64_t i = begin / (2 * half); i < end / (2 * half); ++i) {
      const double w_scalar = static_cast<double>(twiddles[m + i]);
      const __m256d w = _mm256_set1_pd(w_scalar);
      const __m256d wq = _mm256_set1_pd(w_scalar * q_inverse);
      double* x = a + 2 * i * half;
      double* y = x + half;
      for (int64_t j = 0; j < half; j += 4) {
        __m256d u = _mm256_loadu_pd(x + j), v = _mm256_loadu_pd(y + j);
        butterfly<Forward>(u, v, w, wq, q, two_q);
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
    butterfly<Forward>(x, y, w, _mm256_mul_pd(w, q_inverse_vector), q, two_q);
    if (half == 2) {
      _mm256_storeu_pd(a + b, _mm256_permute2f128_pd(x, y, 0x20));
      _mm256_storeu_pd(a + b + 4, _mm256_permute2f128_pd(x, y, 0x31));
    } else {
      _mm256_storeu_pd(a + b, _mm256_unpacklo_pd(x, y));
      _mm256_storeu_pd(a + b + 4, _mm256_unpackhi_pd(x, y));
    }
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
// out[k] = a[rev(k)] for the forward's end (a: binary64 values below 4q; out: reduced residues)
FHELIUM_VECTOR inline void bit_reverse_out(const double* a, u64* out, int logn, __m256d q, __m256d two_q) {
  const int64_t quarter = (int64_t{1} << logn) >> 2;
  const uint32_t* rev = bitrev_table(logn - 2);
  for (int64_t r = 0; r < quarter; r += 4) {
    __m256d v0 = _mm256_loadu_pd(a + r), v1 = _mm256_loadu_pd(a + 2 * quarter + r);
    __m256d v2 = _mm256_loadu_pd(a + quarter + r), v3 = _mm256_loadu_pd(a + 3 * quarter + r);
    v0 = reduce_once(reduce_once(v0, two_q), q);
    v1 = reduce_once(reduce_once(v1, two_q), q);
    v2 = reduce_once(reduce_once(v2, two_q), q);
    v3 = reduce_once(reduce_once(v3, two_q), q);
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

// a: natural-order coefficients below 2^52 (scratch, destroyed); out: natural-order evaluations
FHELIUM_VECTOR void forward(u64* a_integers, u64* out, const RowTables& t, int logn) {
  const int64_t n = int64_t{1} << logn;
  double* a = reinterpret_cast<double*>(a_integers);
  for (int64_t k = 0; k < n; k += 4) {
    _mm256_storeu_pd(a + k, to_double(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a_integers + k))));
  }
  const double q_scalar = static_cast<double>(t.q), q_inverse = 1.0 / q_scalar;
  const __m256d q = _mm256_set1_pd(q_scalar), two_q = _mm256_set1_pd(2.0 * q_scalar);
  const int64_t block = n < kIfmaBlock ? n : kIfmaBlock;
  int64_t m = 1, half = n >> 1;
  for (; 2 * half > block; m <<= 1, half >>= 1) stage<true>(a, t, m, half, 0, n, q, two_q, q_inverse);
  for (int64_t begin = 0; begin < n; begin += block) {
    for (int64_t mm = m, hh = half; mm < n; mm <<= 1, hh >>= 1) {
      stage<true>(a, t, mm, hh, begin, begin + block, q, two_q, q_inverse);
    }
  }
  bit_reverse_out(a, out, logn, q, two_q);
}

// in: natural-order evaluations in [0, q); a: scratch of n; out: coefficients in [0, q)
FHELIUM_VECTOR void inverse(const u64* in, u64* a_integers, u64* out, const RowTables& t, int logn) {
  const int64_t n = int64_t{1} << logn;
  double* a = reinterpret_cast<double*>(a_integers);
  const double q_scalar = static_cast<double>(t.q), q_inverse = 1.0 / q_scalar;
  const __m256d q = _mm256_set1_pd(q_scalar), two_q = _mm256_set1_pd(2.0 * q_scalar);
  bit_reverse_in(in, a, logn);
  const int64_t block = n < kIfmaBlock ? n : kIfmaBlock;
  for (int64_t begin = 0; begin < n; begin += block) {
    for (int64_t mm = n >> 1, hh = 1; mm > 1 && 2 * hh <= block; mm >>= 1, hh <<= 1) {
      stage<false>(a, t, mm, hh, begin, begin + block, q, two_q, q_inverse);
    }
  }
  int64_t m = n >> 1, half = 1;
  while (m > 1 && 2 * half <= block) {
    m >>= 1;
    half <<= 1;
  }
  for (; m > 1; m >>= 1, half <<= 1) stage<false>(a, t, m, half, 0, n, q, two_q, q_inverse);
  // last stage (m = 1, half = n/2) with n^-1 folded in, then the final reduction
  const double ni_scalar = static_cast<double>(t.inverse[0]), wn_scalar = static_cast<double>(t.forward[0]);
  const __m256d ni = _mm256_set1_pd(ni_scalar), niq = _mm256_set1_pd(ni_scalar * q_inverse);
  const __m256d wn = _mm256_set1_pd(wn_scalar), wnq = _mm256_set1_pd(wn_scalar * q_inverse);
  const int64_t h = n >> 1;
  for (int64_t j = 0; j < h; j += 4) {
    const __m256d u = _mm256_loadu_pd(a + j), v = _mm256_loadu_pd(a + j + h);
    const __m256d x = mul_lazy(reduce_once(_mm256_add_pd(u, v), two_q), ni, niq, q);
    const __m256d y = mul_lazy(reduce_once(_mm256_sub_pd(_mm256_add_pd(u, two_q), v), two_q), wn, wnq, q);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), to_integer(reduce_once(x, q)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j + h), to_integer(reduce_once(y, q)));
  }
}
