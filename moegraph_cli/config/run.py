"""The run and moe sections of a profile: batch, steps, dtype, graph scopes and pools; the
dispatch mode and expert backend."""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field

from ..io.documents import show
from .fields import BOUNDS, MAX_INT, check_int_sizes, invalid, is_int


# What recompute may do to one scope, per scope kind (models/common/recompute.py); the MoE
# scope's `keep` is less than none: its experts keep FC1's activation as well (a plan's choice
# where memory allows).
SCOPE_MODES = {"attn": ("none", "full"), "moe": ("none", "full", "fc1", "keep"),
               "mlp": ("none", "full")}
# run.recompute -> each layer's {scope kind: mode} (auto and none: nothing forced).
RECOMPUTE = {
    "auto": {}, "none": {},
    "attn": {"attn": "full"},
    "moe": {"moe": "full", "mlp": "full"},
    "full": {"attn": "full", "moe": "full", "mlp": "full"},
    "fc1": {"moe": "fc1"},
    "attn+fc1": {"attn": "full", "moe": "fc1"},
    "keep": {"moe": "keep"},
}


@dataclass
class RunConfig:
    batch: int = 2
    seq_len: int = 512
    steps: int = 10
    warmup: int = 3
    dtype: str = "bfloat16"
    seed: int = 0
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_accum: int = 1  # micro-batches of `batch` sequences per optimizer step
    scopes: list[str] = field(default_factory=lambda: ["attn", "moe"])
    pool: str = "shared"
    data: typing.Optional[str] = None  # a .pt / .bin file of token ids; None = synthetic
    device: str = "auto"
    # Activation recompute (models/common/recompute.py), on every layer: attn, moe or full
    # (both) re-run the scope's forward in its backward; fc1 re-runs only the MoE experts' FC1
    # (their largest saved tensor), attn+fc1 both of those; keep recomputes less than none: the
    # experts keep FC1's activation too. auto: none unless a plan chooses per layer
    # (`moegraph plan` keeps the activation where the budget leaves room and recomputes
    # where the budget needs it); none: never.
    recompute: str = "auto"
    # The lm head and loss in chunks of this many rows (models/common/loss_chunked.py): no
    # [tokens, vocab] logits are kept, one chunk's at a time; 0: the logits whole. auto: whole
    # unless a plan chooses chunks (`moegraph plan` does where the budget needs it, before
    # any recompute).
    loss_chunk: typing.Union[int, str] = "auto"
    # Settings graph capture refuses (fail closed at plan and capture time):
    fp8: bool = False
    pipeline_interleave: int = 1
    dynamic_shapes: bool = False

    def validate(self) -> "RunConfig":
        check_int_sizes(self, "run.")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise invalid("dtype", f"run.dtype {show(self.dtype)} must be bfloat16, float32 "
                          "or float16")
        for name in ("batch", "seq_len", "steps", "pipeline_interleave", "grad_accum",
                     "warmup", "lr", "weight_decay", "seed"):
            BOUNDS[f"run.{name}"].check(f"run.{name}", getattr(self, name), name)
        bad = [s for s in self.scopes if s not in ("attn", "moe", "step")]
        if bad:
            raise invalid("scopes", f"run.scopes: unknown scope {show(bad[0])}; choose from "
                          "attn, moe, step")
        if "step" in self.scopes and len(self.scopes) > 1:
            raise invalid("scopes", "run.scopes: step (the whole step as one graph) already "
                          "holds attn and moe; give it alone")
        if self.pool not in ("shared", "per_scope", "per_entry", "auto"):
            raise invalid("pool", f"run.pool {show(self.pool)} must be shared, per_scope, "
                          "per_entry or auto")
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise invalid("device", f"run.device {show(self.device)} must be auto, cpu, cuda "
                          "or cuda:N")
        if self.recompute not in RECOMPUTE:
            raise invalid("recompute", f"run.recompute {show(self.recompute)} must be one of "
                          + ", ".join(RECOMPUTE))
        if self.loss_chunk != "auto" and not (is_int(self.loss_chunk) and
                                              0 <= self.loss_chunk <= MAX_INT):
            raise invalid("loss_chunk", f"run.loss_chunk {show(self.loss_chunk)} must be auto, "
                          "0 (the logits whole) or a positive number of rows")
        if self.data is not None and not self.data.strip():
            raise invalid("data", "run.data is empty; give a .pt or .bin token file, or null "
                          "for synthetic batches")
        return self


@dataclass
class MoeConfig:
    mode: str = "dropless"  # dropless | capacity
    capacity_factor: float = 1.25
    backend: str = "auto"  # auto (permute_free on CUDA, reference on CPU) | reference | permute_free
    # Auxiliary-loss-free balancing (DeepSeek-V3's router bias): after each optimizer step
    # bias_e += rate * sign(mean load - load_e), on the device; 0: off.
    bias_update_rate: float = 0.0
    # Expert parallel (moe/ep.py): how tokens reach their experts' ranks. auto: the bounded
    # all-to-all where it moves fewer bytes than the all-gather; ep_capacity_factor (>= 1)
    # sizes its rows per peer over a balanced share (the default is measured there).
    ep_dispatch: str = "auto"  # auto | all_gather | all_to_all
    ep_capacity_factor: float = 2.0

    def validate(self) -> "MoeConfig":
        if self.mode not in ("dropless", "capacity"):
            raise invalid("mode", f"moe.mode {show(self.mode)} must be dropless or capacity")
        if self.capacity_factor <= 0:
            raise invalid("capacity_factor", f"moe.capacity_factor must be positive, got "
                          f"{self.capacity_factor}")
        if self.bias_update_rate < 0:
            raise invalid("bias_update_rate", f"moe.bias_update_rate must be >= 0, got "
                          f"{self.bias_update_rate}")
        if not math.isfinite(self.ep_capacity_factor) or self.ep_capacity_factor < 1:
            raise invalid("ep_capacity_factor", f"moe.ep_capacity_factor must be a finite "
                          f"number >= 1, got {self.ep_capacity_factor}")
        if self.ep_dispatch not in ("auto", "all_gather", "all_to_all"):
            raise invalid("ep_dispatch", f"moe.ep_dispatch {show(self.ep_dispatch)} must be "
                          "auto, all_gather or all_to_all")
        if self.backend not in ("auto", "reference", "permute_free"):
            raise invalid("backend", f"moe.backend {show(self.backend)} must be auto, reference "
                          "or permute_free")
        return self

    @property
    def capacity(self) -> float | None:
        """The capacity factor the expert functions take: None means dropless."""
        return self.capacity_factor if self.mode == "capacity" else None

