"""Build moe_rt: pure Python, five Cython extensions and the C library libmoe_rt.so (the C ABI,
include/moe_rt/moe_rt.h), all needing gcc alone; and, where jaxlib's XLA FFI headers are importable at build
time, libmoe_rt_xla.so (moe_rt.jax's XLA FFI handlers; without it moe_rt.jax builds it on first use).

No CUDA header, library or compiler is used at build time: CUDA kernels are compiled at run time
by NVRTC (through CuPy), and the CUDA driver and NCCL are dlopen'ed when first used.
"""
import importlib.util
import os
import re

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
    with open(os.path.join(HERE, "moe_rt", "_version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def _libbuild():
    spec = importlib.util.spec_from_file_location("moe_rt_libbuild", os.path.join(HERE, "csrc", "libbuild.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildExt(build_ext):
    """The Cython extensions, then libmoe_rt.so into moe_rt/lib/ (of the build, or of the tree with --inplace)."""

    def _lib_target(self, name="libmoe_rt.so"):
        base = HERE if self.inplace else self.build_lib
        return os.path.join(base, "moe_rt", "lib", name)

    def run(self):
        super().run()
        lib = _libbuild()
        target = self._lib_target()
        self.announce(f"building {target}", level=2)
        try:
            lib.build(target)
        except Exception as e:  # the compiler's own output says why
            out = getattr(e, "stdout", "") + getattr(e, "stderr", "")
            raise RuntimeError(f"building libmoe_rt.so failed: {e}\n{out}") from e
        xla_target = self._lib_target(lib.XLA_LIB)
        include = lib.xla_include_dir()
        if include is None:
            # pip builds in an isolated environment without jax: moe_rt.jax then builds the library into the
            # kernel cache folder on first use (or: pip install --no-build-isolation with jax installed)
            print(f"moe_rt: not building {lib.XLA_LIB} (moe_rt.jax's XLA FFI handlers): jaxlib's XLA FFI headers "
                  "are not importable here; moe_rt.jax builds it on first use")
            self._xla_built = False
            return
        self.announce(f"building {xla_target}", level=2)
        try:
            lib.build_xla(xla_target, target, include)
        except Exception as e:
            out = getattr(e, "stdout", "") + getattr(e, "stderr", "")
            raise RuntimeError(f"building {lib.XLA_LIB} failed: {e}\n{out}") from e
        self._xla_built = True

    def get_outputs(self):
        extra = [self._lib_target()]
        if getattr(self, "_xla_built", False):
            extra.append(self._lib_target(_libbuild().XLA_LIB))
        return super().get_outputs() + extra


extensions = [
    Extension("moe_rt._dlpack", ["moe_rt/_dlpack.pyx"]),
    Extension("moe_rt._comm", ["moe_rt/_comm.pyx"], include_dirs=["include"], libraries=["dl"]),
    Extension("moe_rt._handle", ["moe_rt/_handle.pyx"]),
    Extension("moe_rt._launch", ["moe_rt/_launch.pyx"], libraries=["dl"]),
    Extension("moe_rt._light", ["moe_rt/_light.pyx"]),
    Extension("moe_rt._core", ["moe_rt/_core.pyx"], include_dirs=["include"], libraries=["dl"]),
]

setup(
    name="moe_rt",
    version=_version(),
    description="Framework-agnostic Mixture-of-Experts runtime: router, dispatch/combine and expert "
    "parallelism with run-time compiled CUDA kernels",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    author="moe_rt developers",
    license="Apache-2.0",
    license_files=["LICENSE"],
    url="https://github.com/moe-rt/moe_rt",
    project_urls={
        "Homepage": "https://github.com/moe-rt/moe_rt",
        "Source": "https://github.com/moe-rt/moe_rt",
        "Issues": "https://github.com/moe-rt/moe_rt/issues",
        "Documentation": "https://github.com/moe-rt/moe_rt/tree/main/docs",
    },
    keywords=["mixture-of-experts", "moe", "expert-parallelism", "cuda", "nccl", "pytorch", "jax", "cupy",
              "dlpack", "router", "token-dispatch"],
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Environment :: GPU :: NVIDIA CUDA",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Programming Language :: Cython",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: Software Development :: Libraries :: Python Modules",
    ],
    python_requires=">=3.10",
    packages=["moe_rt", "moe_rt.bench", "moe_rt.reference", "moe_rt.kernels", "moe_rt.include"],
    package_dir={"moe_rt.kernels": "kernels", "moe_rt.include": "include"},
    package_data={
        "moe_rt": ["*.pxd", "*.pyx", "py.typed"],
        "moe_rt.kernels": ["*.cu"],
        "moe_rt.include": ["moe_rt/*.cuh", "moe_rt/*.h"],
    },
    cmdclass={"build_ext": BuildExt},
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": 3, "embedsignature": True, "binding": True},
    ),
    install_requires=["numpy>=2.0", "ml_dtypes>=0.4"],
    extras_require={
        "cu12": ["cupy-cuda12x[ctk]>=14", "nvidia-nccl-cu12"],
        "cu13": ["cupy-cuda13x[ctk]>=14", "nvidia-nccl-cu13"],
        # on a CPU-only machine pip picks torch's CPU build; the tests skip what is missing.
        "test": ["pytest>=7", "torch>=2.4", "jax"],
        # python -m moe_rt bench: the plot
        "bench": ["matplotlib>=3.5"],
    },
    entry_points={"console_scripts": ["moe_rt=moe_rt.__main__:main"]},
    zip_safe=False,
)
