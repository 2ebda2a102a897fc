"""fhelium.distributed: PyTorch distributed, plus collectives that understand fhelium values.

Process groups, backends, rank identity, point-to-point and ordinary tensor collectives are
PyTorch's own functions, re-exported unchanged (same signatures, mutation, groups and
``Work`` handles). The typed names (``broadcast_ciphertext``, ``all_reduce_ciphertext``, ...)
carry value metadata or apply CKKS modular arithmetic; they are synchronous, take
``src``/``dst`` as *global* ranks, and order sequences by *group* rank.
See docs/distributed.md.
"""

from __future__ import annotations

import torch.distributed as _dist
from torch.distributed import (
    Backend,
    GroupMember,
    P2POp,
    ProcessGroup,
    ReduceOp,
    Work,
    all_gather,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_object_list,
    destroy_process_group,
    gather,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    irecv,
    is_available,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
)

# The typed collectives: each is defined once in its module and exported once here.
from fhelium.distributed._ciphertext_reduction import (
    CiphertextAdder,
    ReductionTrace,
    ResidueModuliAdder,
    all_reduce_ciphertext,
    reduce_ciphertext,
)
from fhelium.distributed._collective_common import CollectiveArgumentError, CollectiveFailure
from fhelium.distributed._limb_collectives import gather_ciphertext_limbs, scatter_ciphertext_limbs
from fhelium.distributed._state import init, local_device, local_rank, shutdown
from fhelium.distributed._transfer import TRANSFER_PROTOCOL_VERSION, DescriptorError
from fhelium.distributed._value_collectives import (
    all_gather_ciphertexts,
    all_gather_compressed_plaintexts,
    all_gather_plaintexts,
    broadcast_ciphertext,
    broadcast_compressed_plaintext,
    broadcast_key,
    broadcast_plaintext,
    gather_ciphertexts,
    scatter_ciphertexts,
)

# torch 2.13 has both spellings; older releases only the *_into_tensor / *_tensor names.
all_gather_single = getattr(_dist, "all_gather_single", _dist.all_gather_into_tensor)
reduce_scatter_single = getattr(_dist, "reduce_scatter_single", _dist.reduce_scatter_tensor)

__all__ = [
    "TRANSFER_PROTOCOL_VERSION",
    "Backend",
    "CiphertextAdder",
    "CollectiveArgumentError",
    "CollectiveFailure",
    "DescriptorError",
    "GroupMember",
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "ReductionTrace",
    "ResidueModuliAdder",
    "Work",
    "all_gather",
    "all_gather_ciphertexts",
    "all_gather_compressed_plaintexts",
    "all_gather_object",
    "all_gather_plaintexts",
    "all_gather_single",
    "all_reduce",
    "all_reduce_ciphertext",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_ciphertext",
    "broadcast_compressed_plaintext",
    "broadcast_key",
    "broadcast_object_list",
    "broadcast_plaintext",
    "destroy_process_group",
    "gather",
    "gather_ciphertext_limbs",
    "gather_ciphertexts",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init",
    "init_process_group",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "local_device",
    "local_rank",
    "new_group",
    "recv",
    "reduce",
    "reduce_ciphertext",
    "reduce_scatter",
    "reduce_scatter_single",
    "scatter",
    "scatter_ciphertext_limbs",
    "scatter_ciphertexts",
    "send",
    "shutdown",
]
