"""The bridge between flodld and fhelium: encrypted aggregation across the ranks of a flodld run.

The one package that imports both (tests/test_layers.py: flodld and fhelium never import each
other, and neither imports this package). Its modules, from the bottom up:

- `errors`: the refusals (`AggregationError` and its kinds), each naming what differed and the fix;
- `transport`: the `Transport` protocol, its capped JSON control records, and transport (a), the
  torch process group (`ProcessGroupTransport`);
- `relay`: transport (b) through flodld's relays: `RelayGroup` (the `world` resource, a modular
  all-reduce through this host's relay), `RelayCiphertextAllReduce` (the Backend implementation of
  ``fhelium_dist.all_reduce_add_ciphertext`` that sums through it), `RelayTransport` and
  `RelayShareChannel` (the threshold protocol's share exchange);
- `aggregation`: the single-key workload (`aggregate_mean`) and its Program
  (`encrypted_mean.mlir`, linked by `link_program`);
- `threshold`: the workload with no key holder (`aggregate_mean_threshold`, fhelium.multiparty);
- `cli`: the encrypted mean's command line (examples/encrypted_mean.py).

Import what you need from its module (`from flodld_fhelium.relay import RelayTransport`): importing
the package itself loads nothing, so a worker role can start without torch.
"""

from __future__ import annotations

__all__: list[str] = []
