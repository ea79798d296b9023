"""Versions and environment: ``python -m curvature.info``.

Prints the versions of curvature, Python, PyTorch (with CUDA and its devices), NumPy,
the platform and CPU count, and which optional peers and extras are installed (from the
installed distributions' metadata: nothing heavy is imported). Paste its output into bug
reports. :func:`collect` returns the same as a dict (used by ``benchmarks/run_all.py``).
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any, Dict, Optional

# distribution name -> what it is to curvature
OPTIONAL = {
    "backpack-for-pytorch": "peer (benchmarks)",
    "curvlinops-for-pytorch": "peer (benchmarks, cross-checks)",
    "opacus": "peer (benchmarks)",
    "asdfghjkl": "peer (benchmarks)",
    "nngeometry": "peer (benchmarks)",
    "torchjd": "peer (benchmarks)",
    "scikit-learn": "demo data (digits)",
    "matplotlib": "demo figures",
    "tqdm": "progress bars",
    "pytest": "tests",
    "mkdocs": "docs",
}


def version_of(dist: str) -> Optional[str]:
    """The installed version of distribution ``dist``, or ``None``."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _curvature_version() -> str:
    from . import __version__

    return __version__


def collect() -> Dict[str, Any]:
    """Versions, machine and optional packages as a JSON-serializable dict."""
    import numpy
    import torch

    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "curvature": _curvature_version(),
        "curvature_path": os.path.dirname(os.path.abspath(__file__)),
        "curvature_dist": version_of("torch-curvature"),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "cuda_devices": devices,
        "mps_available": bool(
            getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()
        ),
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "optional": {dist: version_of(dist) for dist in OPTIONAL},
    }


def format_info(info: Optional[Dict[str, Any]] = None) -> str:
    """:func:`collect`'s dict as aligned text lines."""
    i = info if info is not None else collect()
    if i["cuda_available"]:
        cuda = f"yes (CUDA {i['cuda_version']}): " + ", ".join(i["cuda_devices"])
    else:
        cuda = "no" + (f" (torch built with CUDA {i['cuda_version']})" if i["cuda_version"] else "")
    cpus = f"{i['cpu']}, {i['cpu_count']} CPUs"
    if i["cpu_affinity"] is not None and i["cpu_affinity"] != i["cpu_count"]:
        cpus += f" ({i['cpu_affinity']} usable)"
    rows = [
        ("curvature", f"{i['curvature']} ({i['curvature_path']})"),
        ("torch-curvature", i["curvature_dist"] or "not installed (running from a checkout)"),
        ("python", f"{i['python']} ({i['python_implementation']}, {i['executable']})"),
        ("torch", f"{i['torch']}, {i['torch_threads']} threads"),
        ("cuda", cuda),
        ("numpy", i["numpy"]),
        ("platform", i["platform"]),
        ("cpu", cpus),
    ]
    if i["mps_available"]:
        rows.append(("mps", "yes"))
    width = max(len(k) for k in list(OPTIONAL) + [r[0] for r in rows])
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("")
    lines.append("optional packages:")
    for dist, what in OPTIONAL.items():
        v = i["optional"].get(dist)
        lines.append(f"{dist:<{width}}  {v or 'not installed':<14}  {what}")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> Dict[str, Any]:
    """Print the versions (``--json``: as JSON) and return them."""
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="python -m curvature.info", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return info


if __name__ == "__main__":
    main()
