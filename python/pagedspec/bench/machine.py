"""Where a benchmark runs and where it writes: the device and its description (GPU via NVML, CPU
model and threads), shared by every benchmark module (none of them imports another's runner)."""
from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path

import torch

import pagedspec


def device_info(device: torch.device) -> dict:
    """What the numbers were measured on: GPU name, clocks, memory and driver via NVML; CPU model
    and thread count otherwise."""
    info = {"device": str(device), "torch": torch.__version__, "pagedspec": pagedspec.build_info()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1))
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            info.update(
                driver=pynvml.nvmlSystemGetDriverVersion(),
                sm_clock_mhz=pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                max_sm_clock_mhz=pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
                mem_clock_mhz=pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
                power_limit_w=pynvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000,
            )
        except Exception as exc:  # NVML missing or not permitted: keep what torch told us
            info["nvml_error"] = str(exc)
    else:
        model = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        info.update(name=model, cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads())
    return info


def resolve_device(choice: str) -> torch.device:
    """``"auto"`` (CUDA when pagedspec can use it), ``"cpu"`` or ``"cuda"`` (the current GPU)."""
    if choice == "auto":
        choice = "cuda" if pagedspec.build_info()["cuda_available"] else "cpu"
    if choice == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(choice)


def default_out_dir(device: torch.device) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("bench/results") if Path("bench").is_dir() else Path("pagedspec-bench-results")
    return base / f"{device.type}-{stamp}"
