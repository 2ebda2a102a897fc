"""The `fhelium` core dialect: references to launch-bound resources.

`fhelium.resource.ref` names a resource (a process group, a device) that the Backend binds at
link time. The IR never constructs a resource; it only says which symbol it needs and of what kind.
"""

from __future__ import annotations

from xdsl.dialects.builtin import StringAttr
from xdsl.ir import Attribute, Dialect
from xdsl.irdl import IRDLOperation, attr_def, irdl_op_definition, result_def, traits_def
from xdsl.traits import Pure


@irdl_op_definition
class ResourceRefOp(IRDLOperation):
    """Read the launch-bound resource `symbol` of `kind` (e.g. symbol "world", kind "process-group")."""

    name = "fhelium.resource.ref"

    symbol = attr_def(StringAttr)
    kind = attr_def(StringAttr)
    result = result_def()

    traits = traits_def(Pure())

    def __init__(self, symbol: str, kind: str, result_type: Attribute) -> None:
        super().__init__(
            attributes={"symbol": StringAttr(symbol), "kind": StringAttr(kind)},
            result_types=[result_type],
        )


FHElium = Dialect("fhelium", [ResourceRefOp], [])
