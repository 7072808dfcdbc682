"""Regenerate the Python gRPC/protobuf modules from protos/.

    python scripts/gen_protos.py          # rewrite specdec/v1/*_pb2*.py(i)
    python scripts/gen_protos.py --check  # exit 1 if the committed files are stale

protos/specdec/v1/x.proto becomes specdec/v1/x_pb2.py, x_pb2.pyi and x_pb2_grpc.py (the include
path is protos/, so generated imports read `from specdec.v1 import x_pb2`). Output depends only on
the .proto files and the grpcio-tools version: protoc runs on relative paths from a fixed cwd over
a sorted file list, so the committed files can be compared byte for byte.
"""
from __future__ import annotations

import argparse
import difflib
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[str]:
    return sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into out_dir; return the generated files relative to out_dir."""
    import os

    import grpc_tools
    from grpc_tools import protoc

    protos = proto_files()
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        "-I.",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    cwd = os.getcwd()
    os.chdir(PROTO_ROOT)  # relative paths keep absolute directories out of the output
    try:
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def committed_files() -> list[Path]:
    """Generated-looking files currently in the tree, for the packages that protos/ owns."""
    found: set[Path] = set()
    for proto in proto_files():
        pkg_dir = REPO / Path(proto).parent
        if pkg_dir.is_dir():
            found.update(p.relative_to(REPO) for p in pkg_dir.iterdir() if p.name.endswith(GENERATED_SUFFIXES))
    return sorted(found)


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        problems: list[str] = []
        for rel in fresh:
            new = (Path(tmp) / rel).read_text()
            target = REPO / rel
            old = target.read_text() if target.exists() else None
            if old is None:
                problems.append(f"missing: {rel}")
            elif old != new:
                diff = difflib.unified_diff(old.splitlines(), new.splitlines(), f"committed/{rel}", f"fresh/{rel}",
                                            lineterm="", n=1)
                problems.append(f"stale: {rel}\n" + "\n".join(list(diff)[:40]))
        for rel in sorted(set(committed_files()) - set(fresh)):
            problems.append(f"orphaned (no .proto generates it): {rel}")
    if problems:
        print("generated protobuf code is out of date; run `python scripts/gen_protos.py`", file=sys.stderr)
        print("(a difference only in version headers means a different grpcio-tools version)", file=sys.stderr)
        print("\n".join(problems), file=sys.stderr)
        return 1
    print(f"generated code is up to date ({len(fresh)} files)")
    return 0


def write() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        for rel in sorted(set(committed_files()) - set(fresh)):
            (REPO / rel).unlink()
            print(f"removed {rel}")
        for rel in fresh:
            dest = REPO / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / rel, dest)
            print(f"wrote {rel}")
    # Generated packages need an __init__.py to be importable as regular packages.
    for rel in fresh:
        init = REPO / rel.parent / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated protobuf/gRPC modules (see scripts/gen_protos.py)."""\n')
            print(f"wrote {init.relative_to(REPO)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if the committed files are stale")
    args = parser.parse_args(argv)
    return check() if args.check else write()


if __name__ == "__main__":
    sys.exit(main())
