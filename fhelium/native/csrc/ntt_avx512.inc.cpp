// The AVX-512 negacyclic NTT rows, written once for the two vector levels (not compiled on its own:
// named .cpp only so that the package data pattern ships it). fhelium_native.cpp
// includes this file twice, each time inside a namespace that defines, for its level:
//   FHELIUM_VECTOR                    the function attribute (the level's target features)
//   mul_shoup_lazy_vector(y, w, ws, q) w*y mod q in [0, 2q), ws = shoup_operand(Shoup(w))
//   shoup_operand(u64) / shoup_operands(__m512i)  Shoup(w) as that multiply wants it
//   reduce_once(x, bound)             [0, 2 bound) -> [0, bound)
// and uses RowTables, SmallStage/small_stage and kIfmaBlock from the enclosing file. The butterflies
// are Harvey's (lazy values below 4q), so every level gives the same fully reduced outputs.

// one butterfly on 8 lanes, in place: Cooley-Tukey when Forward ((x, y) -> (x + wy, x - wy), x taken
// below 2q first), Gentleman-Sande otherwise ((x, y) -> (x + y below 2q, w(x - y)))
template <bool Forward>
FHELIUM_VECTOR inline void butterfly(__m512i& x, __m512i& y, __m512i w, __m512i ws, __m512i q,
                                     __m512i two_q) {
  if constexpr (Forward) {
    const __m512i u = reduce_once(x, two_q);
    const __m512i v = mul_shoup_lazy_vector(y, w, ws, q);
    x = _mm512_add_epi64(u, v);
    y = _mm512_add_epi64(_mm512_sub_epi64(u, v), two_q);
  } else {
    const __m512i u = x, v = y;
    x = reduce_once(_mm512_add_epi64(u, v), two_q);
    y = mul_shoup_lazy_vector(_mm512_add_epi64(_mm512_sub_epi64(u, v), two_q), w, ws, q);
  }
}

// one stage (m groups at distance half) on the residues [begin, end): Cooley-Tukey with the forward
// twiddles when Forward, Gentleman-Sande with the inverse ones otherwise
template <bool Forward>
FHELIUM_VECTOR inline void stage(u64* a, const RowTables& t, int64_t m, int64_t half, int64_t begin,
                                 int64_t end, __m512i q, __m512i two_q) {
  const u64* twiddles = Forward ? t.forward : t.inverse;
  const u64* twiddles_shoup = Forward ? t.forward_shoup : t.inverse_shoup;
  if (half >= 8) {
    for (int64_t i = begin / (2 * half); i < end / (2 * half); ++i) {
      const __m512i w = _mm512_set1_epi64(static_cast<long long>(twiddles[m + i]));
      const __m512i ws = _mm512_set1_epi64(shoup_operand(twiddles_shoup[m + i]));
      u64* x = a + 2 * i * half;
      u64* y = x + half;
      for (int64_t j = 0; j < half; j += 8) {
        __m512i u = _mm512_loadu_si512(x + j), v = _mm512_loadu_si512(y + j);
        butterfly<Forward>(u, v, w, ws, q, two_q);
        _mm512_storeu_si512(x + j, u);
        _mm512_storeu_si512(y + j, v);
      }
    }
    return;
  }
  const SmallStage& s = small_stage(static_cast<int>(half));
  const __m512i take_x = _mm512_load_si512(s.take_x), take_y = _mm512_load_si512(s.take_y);
  const __m512i put_lo = _mm512_load_si512(s.put_lo), put_hi = _mm512_load_si512(s.put_hi);
  const __m512i pick = _mm512_load_si512(s.twiddle);
  for (int64_t b = begin; b < end; b += 16) {
    const __m512i lo = _mm512_loadu_si512(a + b), hi = _mm512_loadu_si512(a + b + 8);
    const int64_t first = m + b / (2 * half);
    const __m512i w = _mm512_permutexvar_epi64(pick, _mm512_loadu_si512(twiddles + first));
    const __m512i ws = shoup_operands(_mm512_permutexvar_epi64(pick, _mm512_loadu_si512(twiddles_shoup + first)));
    __m512i x = _mm512_permutex2var_epi64(lo, take_x, hi), y = _mm512_permutex2var_epi64(lo, take_y, hi);
    butterfly<Forward>(x, y, w, ws, q, two_q);
    _mm512_storeu_si512(a + b, _mm512_permutex2var_epi64(x, put_lo, y));
    _mm512_storeu_si512(a + b + 8, _mm512_permutex2var_epi64(x, put_hi, y));
  }
}

FHELIUM_VECTOR void forward(u64* a, u64* out, const RowTables& t, int logn) {
  const int64_t n = int64_t{1} << logn;
  const __m512i q = _mm512_set1_epi64(static_cast<long long>(t.q));
  const __m512i two_q = _mm512_set1_epi64(static_cast<long long>(2 * t.q));
  const int64_t block = n < kIfmaBlock ? n : kIfmaBlock;
  int64_t m = 1, half = n >> 1;
  for (; 2 * half > block; m <<= 1, half >>= 1) stage<true>(a, t, m, half, 0, n, q, two_q);
  for (int64_t begin = 0; begin < n; begin += block) {
    for (int64_t mm = m, hh = half; mm < n; mm <<= 1, hh >>= 1) {
      stage<true>(a, t, mm, hh, begin, begin + block, q, two_q);
    }
  }
  const uint32_t* rev = bitrev_table(logn);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256i index = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rev + k));
    __m512i v = _mm512_i32gather_epi64(index, reinterpret_cast<const long long*>(a), 8);
    v = reduce_once(reduce_once(v, two_q), q);
    _mm512_storeu_si512(out + k, v);
  }
}

FHELIUM_VECTOR void inverse(const u64* in, u64* a, u64* out, const RowTables& t, int logn) {
  const int64_t n = int64_t{1} << logn;
  const __m512i q = _mm512_set1_epi64(static_cast<long long>(t.q));
  const __m512i two_q = _mm512_set1_epi64(static_cast<long long>(2 * t.q));
  const uint32_t* rev = bitrev_table(logn);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256i index = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rev + k));
    _mm512_storeu_si512(a + k, _mm512_i32gather_epi64(index, reinterpret_cast<const long long*>(in), 8));
  }
  const int64_t block = n < kIfmaBlock ? n : kIfmaBlock;
  for (int64_t begin = 0; begin < n; begin += block) {
    for (int64_t mm = n >> 1, hh = 1; mm > 1 && 2 * hh <= block; mm >>= 1, hh <<= 1) {
      stage<false>(a, t, mm, hh, begin, begin + block, q, two_q);
    }
  }
  int64_t m = n >> 1, half = 1;
  while (m > 1 && 2 * half <= block) {
    m >>= 1;
    half <<= 1;
  }
  for (; m > 1; m >>= 1, half <<= 1) stage<false>(a, t, m, half, 0, n, q, two_q);
  const __m512i ni = _mm512_set1_epi64(static_cast<long long>(t.inverse[0]));
  const __m512i nis = _mm512_set1_epi64(shoup_operand(t.inverse_shoup[0]));
  const __m512i wn = _mm512_set1_epi64(static_cast<long long>(t.forward[0]));
  const __m512i wns = _mm512_set1_epi64(shoup_operand(t.forward_shoup[0]));
  const int64_t h = n >> 1;
  for (int64_t j = 0; j < h; j += 8) {
    const __m512i u = _mm512_loadu_si512(a + j), v = _mm512_loadu_si512(a + j + h);
    const __m512i x = mul_shoup_lazy_vector(_mm512_add_epi64(u, v), ni, nis, q);
    const __m512i y = mul_shoup_lazy_vector(_mm512_add_epi64(_mm512_sub_epi64(u, v), two_q), wn, wns, q);
    _mm512_storeu_si512(out + j, reduce_once(x, q));
    _mm512_storeu_si512(out + j + h, reduce_once(y, q));
  }
}
