"""Build hooks: generate the control plane's gRPC stubs from ``protos/``; build the package's C kernels.

The ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` modules are never
committed: they are made here, by grpcio-tools, every time the package is
built or installed (editable installs too), so they always match the
protobuf runtime installed next to them.  ``protoc`` runs with ``-Iprotos``
and the proto tree mirrors the package path, so the generated imports are
absolute (``from paramserver.control.v1 import coordinator_pb2``).

The C kernels (``KERNELS``: the dynamic tables' ``kernel.c``, the row-wise
optimizers' ``row_kernel.c``, the row store's ``row_log.c``) are compiled here
too, where a C compiler is: a baseline build and, on x86-64, an AVX2 build of
each that has one, as extension files
beside its source (in the source tree for an editable install), which
``paramserver.native`` loads with ctypes.  They are optional: where the
compiler is missing or fails, the install goes on without them, and
``paramserver.native`` builds them on first use instead (or their callers use
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
#: Each kernel's source, relative to this file (setuptools wants relative paths), the module names of its
#: builds by variant (the variants it has), its compiler flags besides the variant's, its flags for some
#: variants and its linker flags: as its ``KernelSource`` says (``paramserver/shards/server/dynamic/native.py``,
#: ``paramserver/optim/row_kernel.py``, ``paramserver/shards/server/row_store/row_log.py``, whose one build
#: runs threads).
KERNELS = (
    ("paramserver/shards/server/dynamic/kernel.c", {"baseline": "_kernel_baseline", "avx2": "_kernel_avx2"},
     ["-O2"], {}, []),
    ("paramserver/optim/row_kernel.c", {"baseline": "_row_kernel_baseline", "avx2": "_row_kernel_avx2"},
     ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"], {"avx2": ["-mfma", "-mf16c"]}, []),
    ("paramserver/shards/server/row_store/row_log.c", {"baseline": "_row_log"}, ["-O2", "-pthread"], {},
     ["-pthread"]),
)
#: The variants' flags (``paramserver.native.BUILD_FLAGS``).
BUILD_FLAGS = {"baseline": [], "avx2": ["-mavx2"]}


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
    """Every kernel's builds, each carrying the digest of its source (``paramserver.native.source_digest``), so
    that a build of an older source is never loaded."""
    extensions = []
    for source, modules, flags, variant_flags, link_flags in KERNELS:
        digest = hashlib.sha256((ROOT / source).read_bytes()).hexdigest()[:16]
        package = source.rsplit("/", 1)[0].replace("/", ".")
        variants = ["baseline"] + (["avx2"] if platform.machine().lower() in ("x86_64", "amd64") else [])
        extensions += [Extension(f"{package}.{modules[variant]}", [source],
                                 extra_compile_args=[*flags, *BUILD_FLAGS[variant], *variant_flags.get(variant, [])],
                                 extra_link_args=link_flags, libraries=["m"],
                                 define_macros=[("PARAMSERVER_KERNEL_DIGEST", f'"{digest}"')], optional=True)
                       for variant in variants if variant in modules]
    return extensions


class OptionalBuildExt(build_ext):
    """``build_ext`` that never fails the install: a kernel that cannot be built here is left out (with a
    warning), and is built on first use instead where a compiler turns up."""

    def run(self):
        try:
            super().run()
        except Exception as error:  # no compiler, a compiler that fails: the package works without the kernel
            self.warn(f"the C kernels were not built at install time ({error}); "
                      "they are built on first use where a C compiler is, else their callers use torch")

    def build_extension(self, extension):
        try:
            super().build_extension(extension)
        except Exception as error:
            self.warn(f"{extension.name} was not built ({error}); the other builds go on")


setup(cmdclass={"build_py": BuildPyWithStubs, "build_ext": OptionalBuildExt}, ext_modules=kernel_extensions())
