"""Generate the Python gRPC stubs in services/m27/v1 (m27.v1) from proto/m27/v1.

Run by `task proto`. With --out DIR it writes there instead, which the drift test uses
to check that the committed stubs match the .proto files.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = PROTO_ROOT / "m27" / "v1"
DEFAULT_OUT = ROOT / "services" / "m27" / "v1"
INIT_TEXT = '"""Generated gRPC/protobuf code for m27.v1 — do not edit; run `task proto`."""\n'


def _plugin(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(found).exists():
        raise SystemExit(f"{name} not found: install the dev extra (pip install -e '.[dev]')")
    return found


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for every .proto under proto/m27/v1 into out_dir; return the files."""
    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--python_out={tmp}", f"--grpc_python_out={tmp}",
            f"--mypy_out={tmp}", f"--mypy_grpc_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in protos],
        ]
        subprocess.run(cmd, check=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("*_pb2*"):
            old.unlink()
        written = []
        for src in sorted((Path(tmp) / "m27" / "v1").iterdir()):
            dst = out_dir / src.name
            shutil.copyfile(src, dst)
            written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text(INIT_TEXT)
    written.append(init)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out.parent) if args.out == DEFAULT_OUT else path)


if __name__ == "__main__":
    main()
