"""Where and on what a benchmark ran: one place for the machine, versions and commit that every
JSON under ``benchmarks/results/`` records."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch


def machine(device: str = "cpu") -> dict:
    """Where a benchmark ran: CPU and its flags, threads, torch and vLLM versions, the commit,
    the load average at the start."""
    cpu, flags = platform.processor(), []
    if Path("/proc/cpuinfo").exists():
        lines = open("/proc/cpuinfo").read().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)
        have = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
        flags = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in have]
    out = {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "quantized_engine": torch.backends.quantized.engine,
           "device": device, "commit": commit(), "loadavg_start": os.getloadavg(),
           "note": "shared machine: other sessions may have been running"}
    cap = os.environ.get("VLLM_CSV_CPU_ISA", "auto")
    if cap != "auto":  # the kernels' instruction sets capped (docs/kernels.md): an emulation, not this CPU's
        out["isa_cap"] = cap
    try:
        import vllm

        out["vllm"] = vllm.__version__
    except ImportError:
        pass
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    return out


def commit() -> str:
    """The checked-out commit (short), ``-dirty`` with uncommitted changes to tracked files (the
    results themselves, ``benchmarks/results/``, not counted: a run that records them would make
    the next one dirty)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"
