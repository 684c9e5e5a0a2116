"""A graphed scope's contract: what must hold on every call for a replay to be valid.

A CUDA graph replays fixed kernels on fixed addresses, so a call may replay only if its inputs
have the captured shapes, dtypes, strides, devices and requires_grad; the parameters are the
captured ones (same shape and dtype; their storage may move, then they are copied in); their
`.grad` buffers have not moved; the module's buffers and `graph_state()` tensors (e.g. rope
tables) are the captured ones (the backward graph accumulates into them); and the control
state is the same (module training mode, grad mode, autocast). Moving parameters (params.py)
are graph inputs: only their shapes and dtypes are checked, their addresses may change.
`check` returns None when the call may replay, else a one-line reason, which the scope records
as its fallback reason. `check_state` is every check but the inputs': it can run before a step
(a distributed session agrees on it across ranks before any rank acts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _autocast_state(device_type: str) -> tuple:
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # older torch: no device argument
        enabled = torch.is_autocast_enabled()
    if not enabled:
        return (False, None)
    try:
        return (True, torch.get_autocast_dtype(device_type))
    except (AttributeError, TypeError):
        return (True, torch.get_autocast_gpu_dtype())


def module_state(module: torch.nn.Module) -> tuple:
    """Non-parameter tensors a module's forward reads: its buffers and `graph_state()`."""
    extra = module.graph_state() if hasattr(module, "graph_state") else ()
    return tuple(module.buffers()) + tuple(extra)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple
    dtype: torch.dtype
    stride: tuple
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), t.dtype, tuple(t.stride()), t.device, t.requires_grad)

    def mismatch(self, t: torch.Tensor) -> str | None:
        for field, got in (("shape", tuple(t.shape)), ("dtype", t.dtype),
                           ("stride", tuple(t.stride())), ("device", t.device),
                           ("requires_grad", t.requires_grad)):
            want = getattr(self, field)
            if got != want:
                return f"{field} {_fmt(got)} != captured {_fmt(want)}"
        return None


def _fmt(v):
    return list(v) if isinstance(v, tuple) else v


@dataclass
class Contract:
    inputs: list[TensorSpec]
    param_shapes: list[tuple]
    param_dtypes: list[torch.dtype]
    grad_ptrs: list[int]
    training: bool
    grad_enabled: bool
    autocast: tuple
    state: tuple = ()  # the module's graph_state() tensors, kept alive and checked by address
    moving: list[tuple] = field(default_factory=list)  # (shape, dtype) of moving parameters

    @classmethod
    def capture(cls, module: torch.nn.Module, inputs: list[torch.Tensor],
                params: list[torch.nn.Parameter],
                moving: list[torch.Tensor] = ()) -> "Contract":
        device_type = inputs[0].device.type if inputs else "cuda"
        return cls(
            inputs=[TensorSpec.of(t) for t in inputs],
            param_shapes=[tuple(p.shape) for p in params],
            param_dtypes=[p.dtype for p in params],
            grad_ptrs=[p.grad.data_ptr() if p.grad is not None else 0 for p in params],
            training=module.training,
            grad_enabled=True,
            autocast=_autocast_state(device_type),
            state=module_state(module),
            moving=[(tuple(p.shape), p.dtype) for p in moving],
        )

    def check(self, module: torch.nn.Module, inputs: tuple, params: list,
              moving: list = ()) -> str | None:
        return (self._check_control(module) or self.check_inputs(inputs)
                or self._check_params(module, params, moving))

    def check_inputs(self, inputs: tuple) -> str | None:
        if len(inputs) != len(self.inputs):
            return f"{len(inputs)} inputs != captured {len(self.inputs)}"
        for i, (spec, t) in enumerate(zip(self.inputs, inputs)):
            if not isinstance(t, torch.Tensor):
                return f"input {i} is {type(t).__name__}, not a tensor"
            bad = spec.mismatch(t)
            if bad:
                return f"input {i} {bad}"
        return None

    def check_state(self, module: torch.nn.Module, params: list, moving: list = ()) -> str | None:
        return self._check_control(module) or self._check_params(module, params, moving)

    def _check_control(self, module: torch.nn.Module) -> str | None:
        if module.training != self.training:
            return f"training mode {module.training} != captured {self.training}"
        if torch.is_grad_enabled() != self.grad_enabled:
            return "grad mode disabled (captured with grad enabled)"
        device_type = self.inputs[0].device.type if self.inputs else "cuda"
        if _autocast_state(device_type) != self.autocast:
            return f"autocast {_autocast_state(device_type)} != captured {self.autocast}"
        return None

    def _check_params(self, module: torch.nn.Module, params: list, moving: list) -> str | None:
        state = module_state(module)
        if len(state) != len(self.state) or any(
                a.data_ptr() != b.data_ptr() for a, b in zip(state, self.state)):
            return "module state tensors (graph_state) moved since capture"
        for i, p in enumerate(params):
            if tuple(p.shape) != self.param_shapes[i] or p.dtype != self.param_dtypes[i]:
                return f"parameter {i} is {list(p.shape)} {p.dtype}, captured " \
                       f"{list(self.param_shapes[i])} {self.param_dtypes[i]}"
            g = p.grad
            if g is None or g.data_ptr() != self.grad_ptrs[i]:
                return f"parameter {i} .grad buffer moved (keep grads: " \
                       "zero_grad(set_to_none=False))"
        for i, p in enumerate(moving):
            if (tuple(p.shape), p.dtype) != self.moving[i]:
                return f"moving parameter {i} is {list(p.shape)} {p.dtype}, captured " \
                       f"{list(self.moving[i][0])} {self.moving[i][1]}"
        return None
