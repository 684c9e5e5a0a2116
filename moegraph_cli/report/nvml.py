"""NVML sampler: device memory used and GPU utilisation, sampled on a background thread.

    with NvmlSampler(torch_device_index) as nv:
        nv.mark("eager"); ...; nv.mark("graph"); ...
    nv.timeline(), nv.summary()

The context manager always stops the thread and calls nvmlShutdown, even when the body
raises. Where NVML cannot be used (no driver library, a container without it, no such
device), the timeline stays empty and `note` says why; nothing else changes.
NVML reports the memory used on the whole device (every process, the CUDA context included),
so it sits above torch's reserved bytes by the context's few hundred MiB.
"""

from __future__ import annotations

import os
import threading
import time


class NvmlSampler:
    def __init__(self, device_index: int = 0, interval_s: float = 0.025):
        self.device_index = device_index
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int]] = []  # (seconds, used bytes, util %)
        self.marks: list[tuple[float, str]] = []
        self.note: str | None = None
        self._nvml = None
        self._handle = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._t0 = time.perf_counter()

    # -- context manager ------------------------------------------------------------------
    def __enter__(self) -> "NvmlSampler":
        self._t0 = time.perf_counter()
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = _handle(pynvml, self.device_index)
            self._sample()  # fail here, not on the thread, if the device cannot be read
        except Exception as e:  # noqa: BLE001 - NVML is optional: degrade to no timeline
            self.note = f"NVML unavailable ({type(e).__name__}: {e}); no memory timeline"
            self._shutdown()
            return self
        self._thread = threading.Thread(target=self._run, name="moegraph-nvml", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        try:
            if self._thread is not None:
                self._thread.join(timeout=5.0)
        finally:
            self._thread = None
            self._shutdown()

    def _shutdown(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down a half-initialised NVML
                pass
            self._nvml = None
            self._handle = None

    # -- sampling -------------------------------------------------------------------------
    def _sample(self) -> None:
        mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        self.samples.append((time.perf_counter() - self._t0, int(mem.used), int(util.gpu)))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception as e:  # noqa: BLE001 - keep what was sampled, say why it stopped
                self.note = f"NVML sampling stopped ({type(e).__name__}: {e})"
                return

    def mark(self, label: str) -> None:
        """Start of a phase (eager, capture, graph, ...), on the timeline's clock."""
        self.marks.append((time.perf_counter() - self._t0, label))

    # -- results --------------------------------------------------------------------------
    def timeline(self) -> dict:
        return {"t_s": [s[0] for s in self.samples], "used_bytes": [s[1] for s in self.samples],
                "util_pct": [s[2] for s in self.samples],
                "marks": [{"t_s": t, "phase": p} for t, p in self.marks]}

    def phases(self) -> list[tuple[str, float, float]]:
        """(phase, start s, end s) from the marks; the last runs to the last sample."""
        end = self.samples[-1][0] if self.samples else (self.marks[-1][0] if self.marks else 0)
        out = []
        for i, (t, label) in enumerate(self.marks):
            stop = self.marks[i + 1][0] if i + 1 < len(self.marks) else max(end, t)
            out.append((label, t, stop))
        return out

    def summary(self) -> dict:
        out = {"samples": len(self.samples), "interval_ms": self.interval_s * 1e3,
               "note": self.note, "phases": {}}
        if self.samples:
            out["max_used_bytes"] = max(s[1] for s in self.samples)
            out["mean_util_pct"] = sum(s[2] for s in self.samples) / len(self.samples)
        for label, start, stop in self.phases():
            inside = [s for s in self.samples if start <= s[0] < stop]
            if inside:
                out["phases"][label] = {
                    "seconds": stop - start, "max_used_bytes": max(s[1] for s in inside),
                    "mean_util_pct": sum(s[2] for s in inside) / len(inside)}
        return out


def _handle(pynvml, device_index: int):
    """NVML's handle for torch's device index (NVML ignores CUDA_VISIBLE_DEVICES)."""
    try:
        import torch
        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device_index))
    except Exception:  # noqa: BLE001 - older torch, or no torch CUDA: map by hand below
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if device_index < len(ids):
            ident = ids[device_index]
            if ident.isdigit():
                return pynvml.nvmlDeviceGetHandleByIndex(int(ident))
            return pynvml.nvmlDeviceGetHandleByUUID(ident)
    return pynvml.nvmlDeviceGetHandleByIndex(device_index)
