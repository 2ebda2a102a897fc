"""Link a Program to implementations and resources, then run it on one rank.

Linking *prepares* the host control flow once: each block becomes a list of steps with its
implementation and resources already resolved, so an unsupported operation or a missing resource
fails at link time, not half-way through a collective. The same prepared blocks back direct
`ProgramExecutable.run` calls, compiled callables (`as_callable`), and region callables handed to
region-owning implementations such as the generic all-reduce.

Supported: scalar `arith`, one-block `scf.for`/`scf.if`, `fhelium.resource.ref`, and any operation
with a registered tensor implementation (inside those regions too). Arbitrary CFGs are not.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import IndexType, IntegerType, UnrealizedConversionCastOp
from xdsl.ir import Block, Operation, Region, SSAValue

from fhelium.backend._boundary import from_payload, to_payload
from fhelium.backend._scalar import as_scalar, constant_value, evaluate, is_scalar_arith
from fhelium.backend.implementation import (
    ImplementationError,
    OperationImplementation,
    OperationImplementationRegistry,
    OperationInvocation,
    RegionOperationImplementation,
)
from fhelium.backend.resources import BoundResource, ResourceBindings, ResourceRequirement
from fhelium.ir import Program, is_terminator
from fhelium.ir.dialects import core

Env = ChainMap[SSAValue, Any]


class ExecutionError(RuntimeError):
    """The Program cannot be prepared or failed while running."""


def _single_block(owner: Operation, region: Region) -> Block:
    blocks = list(region.blocks)
    if len(blocks) != 1:
        raise ExecutionError(
            f"{owner.name}: structured operation regions require one block; arbitrary control-flow "
            f"graphs are not supported (got {len(blocks)} blocks)"
        )
    return blocks[0]


@dataclass
class PreparedBlock:
    """A block whose operations have been turned into steps; `run` returns the yielded values."""

    block: Block
    steps: list[Callable[[Env], None]]
    returned: tuple[SSAValue, ...]

    def run(self, parent: Env, arguments: Sequence[Any]) -> tuple[Any, ...]:
        if len(arguments) != len(self.block.args):
            raise ExecutionError(
                f"block expects {len(self.block.args)} arguments, got {len(arguments)}"
            )
        env: Env = parent.new_child(dict(zip(self.block.args, arguments, strict=True)))
        for step in self.steps:
            step(env)
        return tuple(env[value] for value in self.returned)


def _store_results(op: Operation, env: Env, values: Sequence[Any]) -> None:
    if len(values) != len(op.results):
        raise ExecutionError(f"{op.name} produced {len(values)} values for {len(op.results)} results")
    for result, value in zip(op.results, values, strict=True):
        if isinstance(result.type, IndexType | IntegerType) and isinstance(value, torch.Tensor):
            value = as_scalar(op.name, value)
        env[result] = value


class _Preparer:
    """Turns blocks into steps against one registry and one set of bindings."""

    def __init__(self, registry: OperationImplementationRegistry, bindings: ResourceBindings) -> None:
        self.registry = registry
        self.bindings = bindings

    def block(self, block: Block) -> PreparedBlock:
        steps: list[Callable[[Env], None]] = []
        returned: tuple[SSAValue, ...] = ()
        for op in block.ops:
            if is_terminator(op):
                returned = tuple(op.operands)
                continue
            steps.append(self.operation(op))
        return PreparedBlock(block, steps, returned)

    def operation(self, op: Operation) -> Callable[[Env], None]:
        if isinstance(op, core.ResourceRefOp):
            bound = self.bindings.resolve(ResourceRequirement(op.symbol.data, op.kind.data))
            return lambda env: env.__setitem__(op.result, bound)
        if isinstance(op, arith.ConstantOp):
            constant = constant_value(op)
            return lambda env: env.__setitem__(op.result, constant)
        if is_scalar_arith(op):
            return lambda env: env.__setitem__(op.results[0], evaluate(op, [env[v] for v in op.operands]))
        if isinstance(op, UnrealizedConversionCastOp):
            return lambda env: _store_results(op, env, [env[v] for v in op.operands])
        if isinstance(op, scf.ForOp):
            return self._for(op)
        if isinstance(op, scf.IfOp):
            return self._if(op)
        return self._dispatch(op)

    def _for(self, op: scf.ForOp) -> Callable[[Env], None]:
        body = self.block(_single_block(op, op.body))

        def step(env: Env) -> None:
            lower = int(as_scalar(op.name, env[op.lb]))
            upper = int(as_scalar(op.name, env[op.ub]))
            stride = int(as_scalar(op.name, env[op.step]))
            if stride <= 0:
                raise ExecutionError(f"scf.for step must be positive, got {stride}")
            carried = tuple(env[v] for v in op.iter_args)
            for index in range(lower, upper, stride):
                carried = body.run(env, (index, *carried))
            _store_results(op, env, carried)

        return step

    def _if(self, op: scf.IfOp) -> Callable[[Env], None]:
        then_block = self.block(_single_block(op, op.true_region))
        else_block = self.block(_single_block(op, op.false_region)) if op.false_region.blocks else None

        def step(env: Env) -> None:
            condition = as_scalar(op.name, env[op.cond])
            if condition:
                _store_results(op, env, then_block.run(env, ()))
            elif else_block is not None:
                _store_results(op, env, else_block.run(env, ()))
            elif op.results:
                raise ExecutionError("scf.if with results needs an else region")

        return step

    def _dispatch(self, op: Operation) -> Callable[[Env], None]:
        try:
            implementation = self.registry.resolve(op)
        except ImplementationError as error:
            raise ExecutionError(str(error)) from error
        invocation = OperationInvocation.of(op)
        required = self.bindings.resolve_all(implementation.resource_requirements(invocation))
        regions = tuple(self.block(_single_block(op, region)) for region in op.regions)
        if regions and not isinstance(implementation, RegionOperationImplementation):
            raise ExecutionError(
                f"{op.name} owns regions but implementation {implementation.name!r} cannot execute them"
            )

        def step(env: Env) -> None:
            tensors: list[torch.Tensor] = []
            resources: list[BoundResource] = []
            for operand in op.operands:
                value = env[operand]
                if isinstance(value, BoundResource):
                    resources.append(value)
                elif isinstance(value, torch.Tensor):
                    tensors.append(value)
                elif isinstance(value, bool | int | float):
                    tensors.append(torch.tensor(value))
                else:
                    raise ExecutionError(f"{op.name}: operand of type {type(value).__name__} is not a tensor")
            resources.extend(required)
            if regions:
                assert isinstance(implementation, RegionOperationImplementation)
                callables = tuple(_region_callable(prepared, env) for prepared in regions)
                outputs = implementation.execute_regions(
                    invocation, tuple(tensors), tuple(resources), callables
                )
            else:
                assert isinstance(implementation, OperationImplementation)
                outputs = implementation.execute(invocation, tuple(tensors), tuple(resources))
            _store_results(op, env, outputs)

        return step


def _region_callable(prepared: PreparedBlock, env: Env) -> Callable[..., tuple[torch.Tensor, ...]]:
    """A region as a function of its block arguments, seeing the enclosing SSA values."""

    def call(*arguments: object) -> tuple[torch.Tensor, ...]:
        return prepared.run(env, arguments)

    return call


class ProgramExecutable:
    """One function of a Program, linked and ready to run on this rank."""

    def __init__(self, program: Program, function: func.FuncOp, body: PreparedBlock) -> None:
        self.program = program
        self.function = function
        self._body = body
        self._argument_types = tuple(function.function_type.inputs.data)
        self._result_types = tuple(function.function_type.outputs.data)

    def run(self, *inputs: object) -> tuple[Any, ...]:
        """Execute with public values (Ciphertext, tensors, ints); returns public values."""
        if len(inputs) != len(self._argument_types):
            raise ExecutionError(
                f"@{self.function.sym_name.data} takes {len(self._argument_types)} arguments, got "
                f"{len(inputs)}"
            )
        payloads = [
            to_payload(f"argument {index}", declared, value)
            for index, (declared, value) in enumerate(zip(self._argument_types, inputs, strict=True))
        ]
        outputs = self._body.run(ChainMap(), payloads)
        if len(outputs) != len(self._result_types):
            raise ExecutionError(
                f"@{self.function.sym_name.data} returned {len(outputs)} values; "
                f"its signature declares {len(self._result_types)}"
            )
        typed_inputs = list(zip(self._argument_types, inputs, strict=True))
        return tuple(
            from_payload(f"result {index}", declared, value, typed_inputs)
            for index, (declared, value) in enumerate(zip(self._result_types, outputs, strict=True))
        )

    def run_payloads(self, *payloads: object) -> tuple[Any, ...]:
        """Execute on raw payloads (tensors, scalars, BoundResources); no boundary adaptation."""
        return self._body.run(ChainMap(), payloads)

    def as_callable(self) -> Callable[..., tuple[Any, ...]]:
        """A plain function running this executable (the same prepared control flow)."""

        def compiled(*inputs: object) -> tuple[Any, ...]:
            return self.run(*inputs)

        compiled.__name__ = self.function.sym_name.data
        return compiled


class OperationBackend:
    """A registry of implementations plus the resources this launch provides."""

    def __init__(
        self,
        registry: OperationImplementationRegistry,
        resources: ResourceBindings | Iterable[BoundResource] = (),
    ) -> None:
        self.registry = registry
        self.resources = resources if isinstance(resources, ResourceBindings) else ResourceBindings(resources)

    def link(
        self,
        program: Program,
        *,
        function: str | None = None,
        resources: ResourceBindings | Iterable[BoundResource] = (),
    ) -> ProgramExecutable:
        """Prepare `function` of `program`; `resources` override same-named launch bindings."""
        extra = resources if isinstance(resources, ResourceBindings) else ResourceBindings(resources)
        bindings = self.resources.overlay(extra)
        program.verify()
        function_op = program.function(function)
        block = _single_block(function_op, function_op.body)
        prepared = _Preparer(self.registry, bindings).block(block)
        return ProgramExecutable(program, function_op, prepared)
