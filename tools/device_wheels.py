"""Download into .whl/ the wheels the GPU machine's image lacks, small enough to carry.

The device image has torch, CUDA and Triton but not nixl, cattrs, trio, quart-trio, hypercorn,
pyzmq, llguidance or py-spy. The device tool carries at most 64 MiB, and `nixl_cu13` also holds
`nixl_ep_cu13/` (expert-parallel torch extensions, unused here): it is removed from the wheel
and from its RECORD, which leaves about 38 MiB in all.

    python tools/device_wheels.py            # then carry [".whl"] (.whl is git-excluded)
"""

from __future__ import annotations

import glob
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEELS = (
    "nixl==1.5.1 nixl-cu13==1.5.1 pyzmq==27.3.0 trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 "
    "quart==0.22.0 quart-trio==0.12.0 hypercorn==0.18.0 flask==3.1.3 blinker==1.9.0 "
    "itsdangerous==2.2.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0 wsproto==1.3.2 "
    "pytest-trio==0.8.0 werkzeug==3.1.9 h11==0.16.0 cattrs==26.2.1 attrs==26.1.0 "
    "typing_extensions==4.16.0 llguidance==1.9.1 py-spy==0.4.3"
).split()
PLATFORMS = (
    "manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 "
    "manylinux2014_x86_64 manylinux_2_5_x86_64"
).split()
UNUSED = "nixl_ep_cu13/"


def download(target: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", *platforms,
               "-d", str(target), *WHEELS]  # fmt: skip
    subprocess.run(command, check=True)


def strip_unused(wheel: Path) -> None:
    """Rewrite `wheel` without the UNUSED package (files and RECORD lines)."""
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(shutil.move(str(wheel), tmp))
        with zipfile.ZipFile(full) as src, zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename.startswith(UNUSED):
                    continue
                data = src.read(info)
                if info.filename.endswith("dist-info/RECORD"):
                    kept = (
                        ln for ln in data.splitlines(True) if not ln.startswith(UNUSED.encode())
                    )
                    data = b"".join(kept)
                dst.writestr(info, data)


def main() -> int:
    target = Path(".whl")
    target.mkdir(exist_ok=True)
    download(target)
    for wheel in glob.glob(str(target / "nixl_cu13-*.whl")):
        strip_unused(Path(wheel))
    total = sum(p.stat().st_size for p in target.iterdir())
    print(f"{target}: {total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
