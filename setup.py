"""Build: cythonize csrc/*.pyx into prefix_sidecar._core_c, generate the gRPC modules from proto/.

SIDECAR_NO_EXTENSIONS=1 skips the extension (the pure-Python twin is used). The proto modules
are generated into the source tree (git-ignored) before build_py, so that both wheels and
editable installs carry them. The wheel holds the runtime only: the tooling is its own
distribution (tools/, prefix-sidecar-tools), which the `tools` extra installs.
"""

import os
from pathlib import Path
from typing import ClassVar

from setuptools import Command, Distribution, Extension, find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOT = Path(__file__).parent.resolve()


class GenerateProto(Command):
    description = "generate prefix_sidecar/v1/*_pb2*.py(i) from proto/ with grpcio-tools"
    user_options: ClassVar[list[tuple[str, str, str]]] = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        from grpc_tools import protoc

        protos = sorted(
            str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto")
        )
        if not protos:
            return
        include = str(Path(protoc.__file__).parent / "_proto")
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"-I{include}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed on " + " ".join(protos))
        for package in {(ROOT / p).parent for p in protos}:
            (package / "__init__.py").touch()


class BuildPy(build_py):
    def run(self) -> None:
        self.run_command("generate_proto")
        super().run()


class EditableWheel(editable_wheel):
    def run(self) -> None:
        self.run_command("generate_proto")
        super().run()


def extensions() -> list:
    if os.environ.get("SIDECAR_NO_EXTENSIONS"):
        return []
    from Cython.Build import cythonize

    core = Extension(
        "prefix_sidecar._core_c",
        ["csrc/_core_c.pyx"],
        include_dirs=["csrc"],
        extra_compile_args=["-O3"],
    )
    return cythonize([core], language_level=3, build_dir="build/cython")


# Package discovery runs inside setup(), before build_py: prefix_sidecar/v1 must exist by then,
# or a wheel built from a clean tree (Docker, sdist) ships without the gRPC modules.
GenerateProto(Distribution()).run()


setup(
    packages=find_packages(include=["prefix_sidecar", "prefix_sidecar.*"]),
    ext_modules=extensions(),
    cmdclass={
        "generate_proto": GenerateProto,
        "build_py": BuildPy,
        "editable_wheel": EditableWheel,
    },
)
