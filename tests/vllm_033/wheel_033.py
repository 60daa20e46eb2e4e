"""The vLLM 0.33.0 wheel: found (``VLLM_033_WHEEL``, or the cache) or fetched once (``pip
download --no-deps``, 336 MB, into :data:`CACHE`), and its Python files unpacked, the compiled ones
left out. Shared by ``tests/test_vllm033.py`` and ``scripts/check_vllm033.sh``:

    python tests/vllm_033/wheel_033.py [DEST]    # fetched if need be, unpacked into DEST; prints its path
"""

import glob
import os
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-csv" / "vllm-0.33.0"
COMPILED = (".so", ".cubin", ".fatbin")


def find_or_fetch(timeout: float = 600) -> Path:
    """The wheel's path; fetched into :data:`CACHE` if neither given nor cached (raises
    ``subprocess.CalledProcessError`` / ``TimeoutExpired`` where pip cannot fetch it)."""
    given = os.environ.get("VLLM_033_WHEEL")
    if given:
        return Path(given)
    cached = sorted(glob.glob(str(CACHE / "vllm-0.33.0-*.whl")))
    if not cached:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "vllm==0.33.0", "-d", str(CACHE)],
                       check=True, capture_output=True, text=True, timeout=timeout)
        cached = sorted(glob.glob(str(CACHE / "vllm-0.33.0-*.whl")))
    return Path(cached[0])


def unpack(wheel: Path, dest: Path) -> None:
    """The wheel's files but the compiled ones, into ``dest`` (``vllm/`` then imports from there)."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest, [n for n in z.namelist() if not n.endswith(COMPILED)])


if __name__ == "__main__":
    try:
        wheel = find_or_fetch()
    except subprocess.CalledProcessError as e:
        sys.exit(f"pip could not fetch vllm==0.33.0:\n{e.stderr}")
    if len(sys.argv) > 1:
        unpack(wheel, Path(sys.argv[1]))
    print(wheel)
