# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check, in a fresh interpreter, that ``vllm`` is the series' in-tree form
installed at SITE, not the overlay: vLLM imports from SITE, ``kimi_linear``
parses as the series' ``KimiLinearDSAConfig`` with no plugin having run, no
``kimi_k3_dsa`` plugin comes from SITE and ``vllm._kimi_k3_C`` does.

    python tools/patch_series/check_in_tree.py SITE [--no-entry-point]

``--no-entry-point`` also requires that no installed distribution registers
the ``kimi_k3_dsa`` plugin (a whole environment, not just SITE).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from importlib.metadata import entry_points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site")
    parser.add_argument("--no-entry-point", action="store_true")
    args = parser.parse_args(argv)
    import vllm
    import vllm.models.kimi_k3.nvidia.dsa  # noqa: F401  (the series' modules load)
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    problems = []
    if not vllm.__file__.startswith(args.site):
        problems.append(f"vllm imports from {vllm.__file__}")
    if _CONFIG_REGISTRY["kimi_linear"].__name__ != "KimiLinearDSAConfig":
        problems.append("kimi_linear does not parse as KimiLinearDSAConfig")
    plugin = importlib.util.find_spec("vllm.plugins.kimi_k3_dsa")
    if plugin is not None and str(plugin.origin).startswith(args.site):
        problems.append(f"the plugin is importable from {plugin.origin}")
    extension = importlib.util.find_spec("vllm._kimi_k3_C")
    if extension is None or not str(extension.origin).startswith(args.site):
        problems.append(f"vllm._kimi_k3_C is not in {args.site}: {extension}")
    registered = [
        e for e in entry_points(group="vllm.general_plugins") if e.name == "kimi_k3_dsa"
    ]
    if args.no_entry_point and registered:
        problems.append(f"the kimi_k3_dsa plugin is registered: {registered}")
    if problems:
        print("not the in-tree form: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(f"in-tree vLLM {vllm.__version__} from {vllm.__file__}, {extension.origin}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
