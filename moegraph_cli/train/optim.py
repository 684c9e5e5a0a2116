"""FlatAdamW: AdamW over one flat buffer per (dtype, device), one kernel launch per buffer.

At construction the parameters are packed: per (dtype, device) group one flat param buffer,
one flat grad buffer, and flat exp_avg / exp_avg_sq (zeros, in the param dtype as
torch.optim.AdamW keeps them). Each parameter is re-pointed at its slice
(`p.data = flat[off:off + n].view_as(p)`) and gets `p.grad` as the matching slice of the grad
buffer (an existing `.grad` is copied in; otherwise zeros). Slices start at multiples of
`ALIGN` elements so every view stays vector-aligned; the gaps are padding that no parameter
sees (zeros, updated elementwise with the rest and never read into a real element).

`step()` advances the step count on the device, forms the bias corrections there
(kernels/adamw.py `bias_correction_`), and launches one kernel per group (`adamw_step`).
Nothing syncs with the host and nothing is allocated, so the whole step can be captured in a
CUDA graph; lr is a device tensor (`set_lr` writes it in place) the kernel reads when it runs.

Gradients: `step()` only reads `.grad`. Nothing here zeroes it and there is no `zero_grad`:
the trainer's backward writes every gradient (grads.py sinks), so the next backward overwrites
it. A caller accumulating through autograd zeroes `group.grad` itself.

Every parameter is updated every step, whether or not its gradient was written (torch skips a
parameter whose `.grad` is None; here that is a zero gradient): pass trainable ones only.

Packing copies each parameter once, so the old storage and the flat buffer coexist until
the parameter is re-pointed (the param bytes twice, at peak, per group).

Paths (`impl`):
- "triton": kernels/adamw.py, one launch per group. fp32 groups follow torch.optim.AdamW's
  single-tensor formulas (bitwise torch's CPU path but for its MKL sqrt, see the kernel's
  docstring), bf16 / fp16 groups torch's fused CUDA formulas (bitwise fused torch 2.11 as
  measured on an H200). On CPU only under TRITON_INTERPRET=1, exact there in fp32.
- "reference": pure torch over the flat buffers with `_single_tensor_adam`'s op sequence and
  Python-double scalars, bitwise torch.optim.AdamW(foreach=False) on CPU in any dtype. It
  reads lr and step with .item(): free on CPU, a host sync on a GPU (not capturable there).
- "auto": the kernel on CUDA, else the reference (bf16 under the interpreter is garbage); a dtype the kernel
  does not take (fp64) gets the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moegraph_kernels.adamw import adamw_step, bias_correction_, interpreting

IMPLS = ("auto", "triton", "reference")
ALIGN = 64  # elements: 128 bytes of bf16, so each slice starts on a 128-byte boundary
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class FlatGroup:
    """The flat buffers of one (dtype, device) group; `offsets[i]` is where params[i] starts."""

    params: list[torch.Tensor]
    offsets: list[int]
    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    use_triton: bool = False

    def buffers(self) -> list[torch.Tensor]:
        return [self.param, self.grad, self.exp_avg, self.exp_avg_sq]


@dataclass
class _DeviceScalars:
    lr: torch.Tensor  # fp64 [1]
    step: torch.Tensor  # int64 [1]
    pow_consts: torch.Tensor  # fp64 [3]: beta1, beta2, 0.5
    pow_consts32: torch.Tensor  # fp32 [4]: beta1, beta2, then scratch
    bias: torch.Tensor  # fp64 [5]: the bias corrections (kernels/adamw.py)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class FlatAdamW:
    """AdamW (decoupled weight decay) over flat buffers; see the module docstring.

    Attributes: `params` (the packed parameters, in order), `groups` (a FlatGroup per
    (dtype, device), in order of first appearance), `lr` and `step_count` (fp64 [1] and int64
    [1] tensors on the first parameter's device; a group on another device has its own copies,
    which `set_lr` also writes)."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, impl: str = "auto"):
        if impl not in IMPLS:
            raise ValueError(f"FlatAdamW: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.impl = impl
        self.params: list[torch.Tensor] = []
        seen = set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"FlatAdamW: params[{i}] is a {type(p).__name__}, not a tensor "
                                f"(parameter groups are not supported)")
            if not p.requires_grad:
                raise ValueError(f"FlatAdamW: params[{i}] {list(p.shape)} does not require grad")
            if not p.is_floating_point():
                raise ValueError(f"FlatAdamW: params[{i}] {list(p.shape)} is {p.dtype}, "
                                 f"not floating point")
            if id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        if not self.params:
            raise ValueError("FlatAdamW: got an empty parameter list")

        by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in self.params:
            by_key.setdefault((p.dtype, p.device), []).append(p)
        self._scalars: dict[torch.device, _DeviceScalars] = {}
        self.groups: list[FlatGroup] = []
        with torch.no_grad():
            for (dtype, device), members in by_key.items():
                self.groups.append(self._pack(members, dtype, device))
                if device not in self._scalars:
                    self._scalars[device] = _DeviceScalars(
                        lr=torch.full((1,), float(lr), dtype=torch.float64, device=device),
                        step=torch.zeros(1, dtype=torch.int64, device=device),
                        pow_consts=torch.tensor([self.beta1, self.beta2, 0.5],
                                                dtype=torch.float64, device=device),
                        pow_consts32=torch.tensor([self.beta1, self.beta2, 0.0, 0.0],
                                                  dtype=torch.float32, device=device),
                        bias=torch.ones(5, dtype=torch.float64, device=device))
        first = self._scalars[self.params[0].device]
        self.lr, self.step_count = first.lr, first.step

    def _pack(self, members: list[torch.Tensor], dtype: torch.dtype,
              device: torch.device) -> FlatGroup:
        offsets, total = [], 0
        for p in members:
            offsets.append(total)
            total += _aligned(p.numel())
        flat = torch.zeros(total, dtype=dtype, device=device)
        flat_grad = torch.zeros(total, dtype=dtype, device=device)
        for p, off in zip(members, offsets):
            n = p.numel()
            flat[off:off + n].view_as(p).copy_(p)
            if p.grad is not None:
                flat_grad[off:off + n].view_as(p).copy_(p.grad)
            p.data = flat[off:off + n].view_as(p)
            p.grad = flat_grad[off:off + n].view_as(p)
        use_triton = self._use_triton(dtype, device)
        return FlatGroup(members, offsets, flat, flat_grad, torch.zeros_like(flat),
                         torch.zeros_like(flat), use_triton)

    def _use_triton(self, dtype: torch.dtype, device: torch.device) -> bool:
        on_kernel_device = device.type == "cuda" or interpreting()
        # auto: the kernel on CUDA only. Under the interpreter (the CPU test suite) a bf16
        # model would get garbage from it; tests ask for impl="triton" explicitly.
        if self.impl == "reference" or (self.impl == "auto" and device.type != "cuda"):
            return False
        if not on_kernel_device:
            raise ValueError("FlatAdamW: impl='triton' on CPU needs TRITON_INTERPRET=1")
        if dtype not in KERNEL_DTYPES:
            if self.impl == "triton":
                raise ValueError(f"FlatAdamW: the kernel takes bf16, fp16 or fp32 params, "
                                 f"got {dtype}")
            return False
        return True

    def set_lr(self, value: float | torch.Tensor) -> None:
        """Write lr in place on every device: a float is a fill, a device tensor a
        device-to-device copy; neither allocates or syncs, so a captured step sees it."""
        for s in self._scalars.values():
            if isinstance(value, torch.Tensor):
                s.lr.copy_(value.reshape(1))
            else:
                s.lr.fill_(float(value))

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile and load the update kernel for every group's dtype without changing any
        state: it runs on scratch buffers of ALIGN elements (the same specialisation as the
        real, ALIGN-multiple buffers) with this optimizer's device scalars. Before capturing
        a whole step, which must not compile or load modules inside the capture."""
        for group in self.groups:
            if not group.use_triton:
                continue
            s = self._scalars[group.param.device]
            bufs = [torch.zeros(ALIGN, dtype=group.param.dtype, device=group.param.device)
                    for _ in range(4)]
            bias = s.bias.clone()
            adamw_step(*bufs, s.lr, bias, self.beta1, self.beta2, self.eps, self.weight_decay)

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step over every group: step count and bias corrections on the device, then
        one kernel (or the reference ops) per group. Reads `.grad`, never writes it."""
        for s in self._scalars.values():
            s.step.add_(1)
            bias_correction_(s.step, s.pow_consts, s.pow_consts32, s.bias)
        for group in self.groups:
            s = self._scalars[group.param.device]
            if group.use_triton:
                adamw_step(group.param, group.grad, group.exp_avg, group.exp_avg_sq, s.lr,
                           s.bias, self.beta1, self.beta2, self.eps, self.weight_decay)
            else:
                self._reference_step(group, s)

    def _reference_step(self, group: FlatGroup, s: _DeviceScalars) -> None:
        """torch.optim.AdamW's `_single_tensor_adam` (decoupled, capturable=False) on the flat
        buffers, with its Python-double scalars: bitwise torch's, every op being elementwise."""
        lr, step = float(s.lr.item()), float(s.step.item())
        param, grad, exp_avg, exp_avg_sq = group.param, group.grad, group.exp_avg, group.exp_avg_sq
        if self.weight_decay != 0:
            param.mul_(1 - lr * self.weight_decay)
        exp_avg.lerp_(grad, 1 - self.beta1)
        exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        bias_correction1 = 1 - self.beta1 ** step
        bias_correction2 = 1 - self.beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)

    def state_bytes(self) -> int:
        """Bytes held for exp_avg, exp_avg_sq and the gradients (padding included)."""
        return sum(t.numel() * t.element_size()
                   for g in self.groups for t in (g.grad, g.exp_avg, g.exp_avg_sq))

    def flat_buffers(self) -> list[torch.Tensor]:
        """Every flat buffer: per group param, grad, exp_avg, exp_avg_sq."""
        return [t for g in self.groups for t in g.buffers()]
