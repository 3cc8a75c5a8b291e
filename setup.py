"""Build hook: generate the control plane's gRPC stubs from ``protos/``.

The ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` modules are never
committed: they are made here, by grpcio-tools, every time the package is
built or installed (editable installs too), so they always match the
protobuf runtime installed next to them.  ``protoc`` runs with ``-Iprotos``
and the proto tree mirrors the package path, so the generated imports are
absolute (``from paramserver.control.v1 import coordinator_pb2``).
Everything else about the package lives in setup.cfg.
"""

import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"


def generate_stubs() -> None:
    from grpc_tools import protoc  # a build requirement (pyproject.toml)
    import grpc_tools

    includes = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    for proto in sorted(PROTO_ROOT.rglob("*.proto")):
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{includes}",
                f"--python_out={ROOT}", f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}",
                str(proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildPyWithStubs(build_py):
    def run(self):
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
