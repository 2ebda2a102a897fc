// Rank-local Program of examples/encrypted_mean.py: every rank passes its batch of encrypted
// updates, and all ranks receive the per-limb modular sum over the world.
// The bound "world" resource decides the road: a torch process group (transport a) or the
// flodld relays (transport b, the tunnel-friendly CPU path).
builtin.module {
  func.func @main(%update : !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>) -> !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}> {
    %world = "fhelium.resource.ref"() {symbol = "world", kind = "process-group"} : () -> !fhelium_dist.group
    %sum = "fhelium_dist.all_reduce_add_ciphertext"(%update, %world) : (!fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>, !fhelium_dist.group) -> !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>
    func.return %sum : !fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>
  }
}
