"""Build hook: generates the gRPC stubs from the repository's proto/.

The stubs (tqkv/v1/kvcache_pb2.py, kvcache_pb2_grpc.py) are written into the
build tree, not the source tree, by grpc_tools.protoc, which pip installs into
the isolated build environment (pyproject.toml's build-system.requires).

Where the proto comes from, first match wins:
  1. $TQKV_PROTO_DIR (a folder holding tqkv/v1/kvcache.proto);
  2. ./proto (an sdist: `sdist` below copies it in);
  3. ../../proto (this folder inside the tqkv repository; pip builds local
     directories in place, so the path is reachable).
"""
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PROTO = Path("tqkv") / "v1" / "kvcache.proto"


def proto_root() -> Path:
    candidates = []
    if os.environ.get("TQKV_PROTO_DIR"):
        candidates.append(Path(os.environ["TQKV_PROTO_DIR"]))
    candidates += [HERE / "proto", HERE.parent.parent / "proto"]
    for root in candidates:
        if (root / PROTO).is_file():
            return root
    raise RuntimeError(
        "cannot find %s under any of %s; set TQKV_PROTO_DIR to the tqkv repository's proto/"
        % (PROTO, ", ".join(str(c) for c in candidates)))


def generated_versions():
    """(grpcio, protobuf) versions the generated code will require at run time."""
    try:
        from importlib.metadata import version
        return version("grpcio-tools"), version("protobuf")
    except Exception:  # metadata look-up only: fall back to the floor
        return "1.51", "3.21"


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        from grpc_tools import protoc
        import grpc_tools

        root = proto_root()
        out = Path(self.build_lib)
        (out / "tqkv" / "v1").mkdir(parents=True, exist_ok=True)
        include = Path(grpc_tools.__file__).parent / "_proto"
        args = ["grpc_tools.protoc", "-I%s" % root, "-I%s" % include,
                "--python_out=%s" % out, "--grpc_python_out=%s" % out, "--pyi_out=%s" % out,
                str(root / PROTO)]
        if protoc.main(args) != 0:
            raise RuntimeError("grpc_tools.protoc failed on %s" % (root / PROTO))
        init = out / "tqkv" / "v1" / "__init__.py"
        init.write_text('"""Generated from proto/tqkv/v1/kvcache.proto at build time."""\n')


class SdistWithProto(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        target = Path(base_dir) / "proto" / PROTO
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(proto_root() / PROTO, target)


def major_minor(v: str) -> str:
    return ".".join(v.split(".")[:2])


grpc_version, protobuf_version = generated_versions()
setup(
    install_requires=[
        "numpy>=1.21",
        "grpcio>=%s" % major_minor(grpc_version),
        "protobuf>=%s,<%d" % (major_minor(protobuf_version), int(protobuf_version.split(".")[0]) + 1),
    ],
    # tqkv[hf]: tqkv.hf, attention served for Hugging Face transformers
    # (tested with torch 2.15.0 and transformers 5.25.0: scripts/python_env.sh).
    extras_require={"hf": ["torch>=2.4", "transformers>=5.25,<6"]},
    cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProto},
)
