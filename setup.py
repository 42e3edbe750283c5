"""Build of idempotent_moe._C: the C core (csrc/), the CPython binding, and,
where nvcc is present, the CUDA launchers (cuda/)."""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob(os.path.join(ROOT, pattern)))


def _compiler_accepts(compiler, flag):
    """True when the C compiler builds and links a tiny program with `flag`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("int main(void) { return 0; }\n")
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=[flag])
            compiler.link_executable(objs, os.path.join(tmp, "probe"), extra_postargs=[flag])
        except Exception:
            return False
    return True


def _find_nvcc():
    if os.environ.get("IMOE_NO_CUDA", "0") not in ("", "0"):
        return None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    candidates.append(shutil.which("nvcc"))
    for nvcc in candidates:
        if nvcc and os.path.exists(nvcc):
            return nvcc
    return None


def _cuda_home(nvcc):
    """The toolkit root, as nvcc itself reports it (nvcc may be a wrapper script)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        for line in (out.stdout + out.stderr).splitlines():
            if "TOP=" in line:
                return os.path.normpath(line.split("TOP=", 1)[1].strip().strip('"'))
    except (OSError, subprocess.SubprocessError):
        pass
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


class BuildExt(build_ext):
    """Adds OpenMP where the compiler has it, and compiles cuda/*.cu with nvcc
    (statically linked cudart) where nvcc is present."""

    def build_extensions(self):
        openmp = _compiler_accepts(self.compiler, "-fopenmp")
        nvcc = _find_nvcc()
        cu_sources = _rel("cuda/*.cu")
        for ext in self.extensions:
            if openmp:
                ext.extra_compile_args.append("-fopenmp")
                ext.extra_link_args.append("-fopenmp")
            if nvcc and cu_sources:
                self._add_cuda(ext, nvcc, cu_sources)
                ext.sources.remove(NO_CUDA_BACKEND)
        super().build_extensions()

    def _add_cuda(self, ext, nvcc, cu_sources):
        cuda_home = _cuda_home(nvcc)
        archs = [a for a in os.environ.get("IMOE_CUDA_ARCHS", DEFAULT_CUDA_ARCHS).split(";") if a]
        # Machine code for every arch, PTX of the last for later GPUs (the
        # device check in cuda/imoe_launch.cu counts on this layout).
        gencode = [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        # No sized operator delete: it would need libstdc++'s CXXABI_1.3.9
        # (GCC 5), which manylinux2014 systems lack.
        flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden,-fno-sized-deallocation",
                 "--expt-relaxed-constexpr", "--threads", "0", "-Icsrc", *gencode]
        # The objects hold no Python: one set serves every interpreter, and
        # is rebuilt when a source, a header, nvcc or the flags change.
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256(" ".join([version, *flags]).encode()).hexdigest()[:12]
        obj_dir = os.path.join(ROOT, "build", f"cuda-{key}")
        os.makedirs(obj_dir, exist_ok=True)
        headers = _rel("cuda/*.cuh") + _rel("csrc/*.h")
        for src in cu_sources:
            obj = os.path.join(obj_dir, os.path.basename(src) + ".o")
            if not _up_to_date(obj, [src, *headers]):
                cmd = [nvcc, "-c", src, "-o", obj + ".tmp", *flags]
                print(" ".join(cmd), flush=True)
                subprocess.check_call(cmd, cwd=ROOT)
                os.replace(obj + ".tmp", obj)
            ext.extra_objects.append(obj)
        lib_dirs = [os.path.join(cuda_home, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
        ext.library_dirs.extend(d for d in lib_dirs if os.path.isdir(d))
        ext.libraries.extend(["cudart_static", "rt", "dl", "pthread", "stdc++"])


def _up_to_date(target, sources):
    if not os.path.exists(target):
        return False
    built = os.path.getmtime(target)
    return all(os.path.getmtime(os.path.join(ROOT, s)) < built for s in sources)


def _numpy_include():
    import numpy

    return numpy.get_include()


# GPU architectures of the CUDA kernels (IMOE_CUDA_ARCHS overrides): Ampere,
# Hopper and Blackwell machine code, plus PTX that later GPUs compile.
DEFAULT_CUDA_ARCHS = "80;90;100"
# The device backend of a build without nvcc; the CUDA launchers replace it.
NO_CUDA_BACKEND = os.path.join("csrc", "backend_none.c")
_debug = os.environ.get("IMOE_DEBUG", "0") not in ("", "0")
ext = Extension(
    "idempotent_moe._C",
    sources=_rel("csrc/*.c") + _rel("python/idempotent_moe/_binding/*.c"),
    include_dirs=["csrc", "python/idempotent_moe/_binding", _numpy_include()],
    # Built against NumPy 2 headers, the module loads on NumPy >= 1.25 (the
    # dependency's floor): NumPy's C API is forward-compatible from the target.
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_22_API_VERSION"),
                   ("NPY_TARGET_VERSION", "NPY_1_25_API_VERSION")],
    extra_compile_args=["-std=c11", "-O0" if _debug else "-O3", "-g" if _debug else "-g0",
                        "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers",
                        # products rounded before they are summed (csrc/moe_combine.c)
                        "-ffp-contract=off"],
    # The CUDA sources too: their objects are linked in, so a changed kernel
    # must relink the module even when no C source changed.
    depends=(_rel("csrc/*.h") + _rel("python/idempotent_moe/_binding/*.h")
             + _rel("cuda/*.cuh") + _rel("cuda/*.cu")),
)

if sys.platform == "win32":
    ext.extra_compile_args = ["/O2"]

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
