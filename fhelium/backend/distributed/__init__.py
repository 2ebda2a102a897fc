"""Process-group resources and collective implementations for the `fhelium_dist` dialect."""

from __future__ import annotations

from fhelium.backend.distributed.operations import (
    TorchBroadcastImplementation,
    TorchCiphertextAddAllReduceImplementation,
    TorchGenericAllReduceImplementation,
    TorchProcessGroupQueryImplementation,
    collective_fold,
    distributed_operation_contributions,
)
from fhelium.backend.distributed.resources import (
    DEFAULT_GROUP_SYMBOL,
    PROCESS_GROUP_RESOURCE_KIND,
    ProcessGroupExecutionResource,
    bind_process_group,
)

__all__ = [
    "DEFAULT_GROUP_SYMBOL",
    "PROCESS_GROUP_RESOURCE_KIND",
    "ProcessGroupExecutionResource",
    "TorchBroadcastImplementation",
    "TorchCiphertextAddAllReduceImplementation",
    "TorchGenericAllReduceImplementation",
    "TorchProcessGroupQueryImplementation",
    "bind_process_group",
    "collective_fold",
    "distributed_operation_contributions",
]
