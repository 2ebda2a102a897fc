// Rank-local Program: each rank adds its input ciphertext once per index of its own interval
// [rank * chunk, (rank + 1) * chunk), then all ranks sum their partial results.
// With P ranks and chunk c, the decrypted output is P * c * x.
builtin.module {
  func.func @main(%x : !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>, %chunk : index) -> !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}> {
    %g = "fhelium.resource.ref"() {symbol = "world", kind = "process-group"} : () -> !fhelium_dist.group
    %r = "fhelium_dist.rank"(%g) : (!fhelium_dist.group) -> index
    %lo = arith.muli %r, %chunk : index
    %hi = arith.addi %lo, %chunk : index
    %c1 = arith.constant 1 : index
    %zero = "fhelium_ckks.subtract"(%x, %x) : (!fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>, !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>) -> !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>
    %acc = scf.for %i = %lo to %hi step %c1 iter_args(%a = %zero) -> (!fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>) {
      %s = "fhelium_ckks.add"(%a, %x) : (!fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>, !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>) -> !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>
      scf.yield %s : !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>
    }
    %sum = "fhelium_dist.all_reduce_add_ciphertext"(%acc, %g) : (!fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>, !fhelium_dist.group) -> !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>
    func.return %sum : !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>
  }
}
