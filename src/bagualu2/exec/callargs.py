"""What a trace reads from the arguments and outputs of a mapped module's call: which tensors it returns, which
tensors hide in tuples and dicts of its arguments, which argument holds state of its own (a KV cache: re-running
the call is refused), and whether a seeded op really draws random numbers."""

from __future__ import annotations

import enum
import types
from typing import Any

import torch


PLAIN_TYPES = (int, float, bool, str, bytes, type(None), type(Ellipsis), slice, torch.dtype, torch.device,
               torch.Size, torch.Tensor, enum.Enum, type, types.FunctionType, types.BuiltinFunctionType,
               types.MethodType, torch.nn.Module)


def stateful_type(value: Any) -> str | None:
    """The type name of an argument a re-run could find changed or change (an object with state of its own, such as
    a KV cache), else None: values, tensors, modules, functions and containers of them are not."""
    if isinstance(value, PLAIN_TYPES):
        return None
    if isinstance(value, (tuple, list)):
        return next((found for item in value if (found := stateful_type(item)) is not None), None)
    if isinstance(value, dict):
        return next((found for item in value.values() if (found := stateful_type(item)) is not None), None)
    if type(value).__name__ == "ProcessGroup":  # torch.distributed's: what a collective runs on
        return None
    return type(value).__name__


def nested_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside tuples, lists and dicts of an argument (position embeddings come as ``(cos, sin)``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in nested_tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in nested_tensors(item)]
    return []


def draws_random(func, args: tuple, kwargs: dict) -> bool:
    """Does this call of a seeded op draw random numbers? Not when its dropout probability is 0 or it is told
    it is not training (attention kernels and ``native_dropout`` take a probability even without dropout)."""
    values = {argument.name: argument.default_value for argument in func._schema.arguments
              if argument.has_default_value()}  # an argument left at its default is not in the call
    values.update(kwargs)
    for argument, value in zip(func._schema.arguments, args):
        values[argument.name] = value
    if values.get("train", True) is False:
        return False
    for name in ("dropout_p", "p"):
        if name in values and isinstance(values[name], (int, float)) and values[name] == 0:
            return False
    return True


def tensors_of(output: Any) -> tuple[torch.Tensor, ...]:
    """The tensors a module returns that count as its outputs: the output itself, or the items of a tuple."""
    if isinstance(output, torch.Tensor):
        return (output,)
    if isinstance(output, tuple):
        return tuple(o for o in output if isinstance(o, torch.Tensor))
    return ()
