"""Build hooks: generate the control plane's gRPC stubs from ``protos/``; build the dynamic tables' C kernel.

The ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` modules are never
committed: they are made here, by grpcio-tools, every time the package is
built or installed (editable installs too), so they always match the
protobuf runtime installed next to them.  ``protoc`` runs with ``-Iprotos``
and the proto tree mirrors the package path, so the generated imports are
absolute (``from paramserver.control.v1 import coordinator_pb2``).

The dynamic tables' C kernel (``paramserver/shards/server/dynamic/kernel.c``)
is compiled here too, where a C compiler is: a baseline build and, on
x86-64, an AVX2 build, as the extension files ``_kernel_baseline`` and
``_kernel_avx2`` beside it (in the source tree for an editable install),
which ``native.py`` loads with ctypes.  They are optional: where the
compiler is missing or fails, the install goes on without them, and
``native.py`` builds the kernel on first use instead (or the tables use
their torch path).  Everything else about the package lives in setup.cfg.
"""

import hashlib
import platform
import pathlib

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"
#: The kernel's source, relative to this file (setuptools wants relative paths), and its package.
KERNEL_SOURCE = "paramserver/shards/server/dynamic/kernel.c"
KERNEL_PACKAGE = "paramserver.shards.server.dynamic"


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


def kernel_extensions() -> list:
    """The kernel's builds, named as ``native.INSTALLED_MODULES`` and flagged as ``native.BUILD_FLAGS`` say,
    each carrying the digest of its source (``native.source_digest``), so that a build of an older kernel.c is
    never loaded."""
    digest = hashlib.sha256((ROOT / KERNEL_SOURCE).read_bytes()).hexdigest()[:16]
    builds = {"_kernel_baseline": []}
    if platform.machine().lower() in ("x86_64", "amd64"):
        builds["_kernel_avx2"] = ["-mavx2"]
    return [Extension(f"{KERNEL_PACKAGE}.{name}", [KERNEL_SOURCE], extra_compile_args=["-O2", *flags],
                      define_macros=[("PARAMSERVER_KERNEL_DIGEST", f'"{digest}"')], optional=True)
            for name, flags in builds.items()]


class OptionalBuildExt(build_ext):
    """``build_ext`` that never fails the install: a kernel that cannot be built here is left out (with a
    warning), and is built on first use instead where a compiler turns up."""

    def run(self):
        try:
            super().run()
        except Exception as error:  # no compiler, a compiler that fails: the package works without the kernel
            self.warn(f"the dynamic tables' C kernel was not built at install time ({error}); "
                      "it is built on first use where a C compiler is, else lookups use torch")

    def build_extension(self, extension):
        try:
            super().build_extension(extension)
        except Exception as error:
            self.warn(f"{extension.name} was not built ({error}); the other builds go on")


setup(cmdclass={"build_py": BuildPyWithStubs, "build_ext": OptionalBuildExt}, ext_modules=kernel_extensions())
