"""``VLLM_CSV_CPU_ISA``: the CPU kernels' dispatch capped below what the CPU has (issue 45).

With ``avx2`` on an AVX-512 machine the kernels run their AVX2 paths and report what an AVX2-only
CPU reports (AVX2 and FMA; no AVX512-VNNI, no AMX, no SLEEF vector exp), so the int8 screen takes
its GEMM's AVX2 kernel (``csrc/cpu/int8_avx2.cpp``, compared with FBGEMM held to its AVX2 kernels
here by FBGEMM_ENABLE_INSTRUCTIONS=AVX2), the int4 screen its AVX2 kernel and
``unlisted_masses`` takes its reference, as on AMD Zen 2/3 or an older Xeon; the kernel tests then pass
bit for bit against their torch references, as they do uncapped. The cap is read once, when the
kernels load, so each case runs in a subprocess with the variable set. (About a minute and a half
on 2 loaded cores.)
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_csv.ops import build

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(build.load_ops() is None, reason="CPU kernels not built"),
    # (the hardware's answer: ATEN_CPU_CAPABILITY=avx2 would change get_cpu_capability's)
    pytest.mark.skipif(not getattr(torch.cpu, "_is_avx512_supported", lambda: False)(),
                       reason="this CPU has no AVX-512: the kernel tests run its AVX2 paths uncapped"),
]

# The kernel-against-reference tests (and the head end to end on the kernels), as CI runs them
# capped at AVX2: every CPU source's dispatched paths (select_cpu: block_max; csv_cpu: score_intervals;
# rows_cpu: interval_rows; gumbel: noise_candidates' chunks; live_cpu: row_stats, pack_live; nucleus: the
# cuts and top-p sums; topk: row_topk; bools: flat_nonzero), the int8 GEMM's AVX2 kernel (test_int8_vnni.py,
# against its reference and FBGEMM's AVX2 kernels) and the int8 screen on it (test_head_exact's heads); the
# int4 GEMM's AVX2 kernel and screen (test_int4_vnni.py); both screens on the AVX2 kernels with hidden
# states along their copies' residuals (test_audit_aligned.py).
KERNEL_TESTS = ["tests/test_step.py", "tests/test_select.py", "tests/test_rows.py", "tests/test_noise_candidates.py",
                "tests/test_live.py", "tests/test_row_topk.py", "tests/test_fakes.py", "tests/test_sampling_nucleus.py",
                "tests/test_ops.py", "tests/test_head_exact.py", "tests/test_int8_vnni.py", "tests/test_int4_vnni.py",
                "tests/test_audit_aligned.py"]
# (of test_ops.py its CPU kernels' tests, of test_sampling_nucleus.py its four kernel tests: the
# whole file takes a minute and a half more)
KERNEL_SELECT = "(not test_ops and not test_sampling_nucleus) or bool or nonzero or kernel_is_the_reference"

PROBE = """
import json
from vllm_csv.ops import build, int4_vnni, int8_vnni
from vllm_csv.screens import make_screen
import torch
w = torch.randn(4099, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
s = make_screen("auto", w, None)
print(json.dumps(dict(cap=build.isa_cap(), features={f: build.cpu_supports(f) for f in build.FEATURES},
                      screen=type(s).__name__, backend=getattr(s, "backend", None),
                      int8=int8_vnni.unavailable_reason(64, 4099), int4=int4_vnni.unavailable_reason())))
"""


def _env(isa: str | None) -> dict:
    """The environment of a subprocess capped at ``isa``; at ``avx2`` FBGEMM too is held to its
    AVX2 kernels (``vpmaddubsw``, whose int16 pair sums saturate: FBGEMM_ENABLE_INSTRUCTIONS), so
    the int8 screen runs what it runs on an AVX2 CPU."""
    env = {k: v for k, v in os.environ.items() if k not in (build.ISA_ENV, "FBGEMM_ENABLE_INSTRUCTIONS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if isa is not None:
        env[build.ISA_ENV] = isa
    if isa == "avx2":
        env["FBGEMM_ENABLE_INSTRUCTIONS"] = "AVX2"
    return env


def _probe(isa: str | None) -> dict:
    import json

    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=_env(isa),
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]) | {"log": r.stderr}


def test_avx2_cap_reports_an_avx2_cpu_and_the_int8_screen_takes_its_avx2_kernel():
    got = _probe("avx2")
    assert got["cap"] == "avx2"
    assert got["features"] == {f: f.startswith("avx2_") for f in build.FEATURES}, got["features"]
    assert got["screen"] == "FbgemmInt8Screen" and got["backend"] == "avx2", got
    assert got["int8"] is None and got["int4"] is None  # (their AVX2 kernels)


def test_avx512_cap_leaves_out_amx_only_and_auto_is_the_cpu():
    auto, capped = _probe(None), _probe("avx512")
    assert auto["cap"] == "auto" and capped["cap"] == "avx512"
    assert capped["features"] == auto["features"] | {"amx_int8": False}
    assert capped["backend"] in ("vnni", None) and auto["backend"] == (
        "vnni+amx" if auto["features"]["amx_int8"] else capped["backend"])


def test_an_unknown_value_is_auto_with_a_warning():
    got = _probe("avx1024")
    assert got["cap"] == "auto" and "'avx1024' is not one of" in got["log"]


def test_kernel_tests_pass_capped_at_avx2():
    """The kernel tests, bit for bit against their references as uncapped, on the AVX2 paths.
    The skip reasons show that the cap held in that process."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider",
                        "-k", KERNEL_SELECT, *KERNEL_TESTS], capture_output=True, text=True, timeout=900,
                       env=_env("avx2"), cwd=ROOT)
    tail = r.stdout[-4000:]
    assert r.returncode == 0, tail + r.stderr[-2000:]
    assert " passed" in tail and " failed" not in tail
    assert "int8 kernel unavailable" not in tail  # test_int8_vnni ran, on the AVX2 kernel
    assert "this CPU has no AMX-INT8" in tail  # (its AMX tests skipped: the cap held)
