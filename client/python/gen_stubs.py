"""Generates the Python gRPC stubs of kvrecall.v1 from proto/ (never edited by hand).

protoc writes kvrecall/v1/kvrecall_pb2.py and kvrecall_pb2_grpc.py under OUT_DIR. The CMake
build runs it into kvrecall/_gen (git-ignored; kvrecall/__init__.py puts it on the package's
path, for a checkout), setup.py into the wheel's kvrecall/v1. It runs Debian's protoc with
grpc_python_plugin (protobuf-compiler, protobuf-compiler-grpc), or grpcio-tools' protoc when
that is importable and no protoc is found.

    python3 gen_stubs.py --out DIR [--protoc PROTOC] [--plugin GRPC_PYTHON_PLUGIN]
"""
import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
PROTO = "kvrecall/v1/kvrecall.proto"
OUTPUTS = ("kvrecall/v1/kvrecall_pb2.py", "kvrecall/v1/kvrecall_pb2_grpc.py")


def generate(out_dir, protoc=None, plugin=None):
    """Runs protoc on proto/kvrecall/v1/kvrecall.proto into `out_dir`; returns the paths
    written. RuntimeError when the .proto or a compiler is missing, or protoc fails."""
    if not os.path.exists(os.path.join(PROTO_ROOT, PROTO)):
        raise RuntimeError(f"{os.path.join(PROTO_ROOT, PROTO)} not found: the stubs are made from "
                           "a kvrecall checkout (client/python beside proto/)")
    os.makedirs(out_dir, exist_ok=True)
    protoc = protoc or shutil.which("protoc")
    plugin = plugin or shutil.which("grpc_python_plugin")
    if protoc and plugin:
        command = [protoc, f"--plugin=protoc-gen-grpc_python={plugin}"]
    else:
        try:
            import grpc_tools  # noqa: F401  (grpcio-tools bundles protoc and the plugin)
        except ImportError:
            raise RuntimeError("need protoc and grpc_python_plugin (Debian: protobuf-compiler "
                               "protobuf-compiler-grpc) or grpcio-tools") from None
        command = [sys.executable, "-m", "grpc_tools.protoc"]
    command += [f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
                os.path.join(PROTO_ROOT, PROTO)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr}")
    return [os.path.join(out_dir, o) for o in OUTPUTS]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--protoc")
    ap.add_argument("--plugin")
    a = ap.parse_args(argv)
    try:
        generate(a.out, a.protoc, a.plugin)
    except RuntimeError as e:
        print(f"gen_stubs.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
