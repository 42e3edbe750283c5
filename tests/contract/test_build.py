"""What a build (a wheel, or an in-place build) contains and needs: the
extension loads without the CUDA runtime or torch, and `cuda_available()`
means a device that runs the kernels, not only kernels compiled in."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import ROOT
from idempotent_moe import _C

# What the extension may link dynamically: the C and C++ runtimes, and the
# OpenMP runtime (a wheel bundles it under a hashed name). Never libcudart
# (linked statically), the driver (loaded at run time), torch or libpython.
ALLOWED_NEEDED = ("libc.so", "libm.so", "libdl.so", "libpthread.so", "librt.so", "ld-linux",
                  "libgcc_s.so", "libstdc++.so", "libgomp")


def _driver_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _needed(path: str) -> list:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


@pytest.mark.skipif("IMOE_EXPECT_INSTALLED_IN" not in os.environ,
                    reason="set by .ci/run, which tests an installed wheel")
def test_the_installed_package_is_under_test():
    prefix = os.path.realpath(os.environ["IMOE_EXPECT_INSTALLED_IN"]) + os.sep
    assert os.path.realpath(imoe.__file__).startswith(prefix), imoe.__file__
    assert os.path.realpath(_C.__file__).startswith(prefix), _C.__file__


@pytest.mark.skipif(os.environ.get("IMOE_EXPECT_CUDA_COMPILED") != "1",
                    reason="set by .ci/run, whose wheel must carry the CUDA kernels")
def test_the_build_has_its_cuda_kernels():
    assert imoe.cuda_compiled()


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_extension_links_no_cuda_runtime_torch_or_python():
    needed = _needed(_C.__file__)
    assert needed, "readelf found no NEEDED entries"
    for lib in needed:
        assert lib.startswith(ALLOWED_NEEDED), f"{_C.__file__} needs {lib}"


@pytest.mark.skipif(_driver_loadable(), reason="a CUDA driver is installed here")
def test_no_driver_means_no_cuda_device():
    assert _C.cuda_device_count() == 0
    assert imoe.cuda_available() is False
    assert imoe.cuda_compiled() == bool(_C.cuda_compiled())  # what the build holds is unchanged
    # Asking left nothing behind: CPU work runs as before.
    x = np.arange(12, dtype=np.float32).reshape(1, 6, 2)
    scores = np.array([[0.0, 5.0, 1.0, 4.0, 2.0, 3.0]], dtype=np.float32)
    kept, idx = imoe.compact_(x, scores, 3)
    np.testing.assert_array_equal(idx, [[3, 1, 5]])
    np.testing.assert_array_equal(kept[0, :, 0], [6.0, 2.0, 10.0])


@pytest.mark.gpu
def test_cuda_available_with_a_device():
    import torch

    assert imoe.cuda_compiled() and imoe.cuda_available()
    assert 1 <= _C.cuda_device_count() <= torch.cuda.device_count()


# --------------------------------------------------------------------------- tools/glibc_compat.py

def _glibc_compat():
    import importlib.util

    path = os.path.join(ROOT, "tools", "glibc_compat.py")
    spec = importlib.util.spec_from_file_location("glibc_compat", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _glibc_versions(path: str) -> set:
    out = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        for field in line.split():
            name = field.strip("()")
            if name.startswith("GLIBC_2"):
                found.add(tuple(int(p) for p in name[6:].split(".")))
    return found


needs_toolchain = pytest.mark.skipif(
    shutil.which("objdump") is None or shutil.which("gcc") is None, reason="needs gcc and objdump")


@needs_toolchain
def test_glibc_compat_lowers_the_moved_symbols(tmp_path):
    lib = subprocess.run(["gcc", "-print-file-name=libgomp.so.1"], capture_output=True, text=True,
                         check=True).stdout.strip()
    if not os.path.isabs(lib) or max(_glibc_versions(lib)) <= (2, 17):
        pytest.skip("this machine's libgomp asks for no glibc newer than 2.17")
    copy = str(tmp_path / "libgomp.so.1")
    shutil.copy(lib, copy)
    result = _glibc_compat().lower(copy, (2, 17))
    assert result["blocked"] == [] and result["lowered"]
    assert max(_glibc_versions(copy)) <= (2, 17)
    lowered = {name: old for name, _, old in result["lowered"]}
    if "pthread_create" in lowered:
        assert lowered["pthread_create"] == "GLIBC_2.2.5"
    ctypes.CDLL(copy)  # still loads here: the old versions are compatibility symbols


@needs_toolchain
def test_glibc_compat_refuses_functions_older_glibcs_lack(tmp_path):
    src = tmp_path / "new.c"
    src.write_text("#include <stdlib.h>\nunsigned f(void) { return arc4random(); }\n")
    so = str(tmp_path / "libnew.so")
    build = subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", so], capture_output=True)
    if build.returncode or (2, 36) not in _glibc_versions(so):
        pytest.skip("this glibc has no arc4random (2.36)")
    before = open(so, "rb").read()
    result = _glibc_compat().lower(so, (2, 17))
    assert ("arc4random", "GLIBC_2.36") in result["blocked"]
    assert open(so, "rb").read() == before


def test_an_in_place_build_relinks_when_any_source_changes():
    """setuptools relinks only when a source or a `depends` entry is newer than
    the module: the CUDA kernels are linked in as prebuilt objects, so a kernel
    left out of `depends` would keep a stale module after its source changed."""
    import glob
    import runpy
    from unittest import mock

    import setuptools

    captured = {}
    with mock.patch.object(setuptools, "setup", lambda **kw: captured.update(kw)):
        cwd = os.getcwd()
        try:
            os.chdir(ROOT)
            runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="setup")
        finally:
            os.chdir(cwd)
    (ext,) = captured["ext_modules"]
    watched = {os.path.normpath(p) for p in [*ext.sources, *ext.depends]}
    for pattern in ("csrc/*.c", "csrc/*.h", "cuda/*.cu", "cuda/*.cuh", "python/idempotent_moe/_binding/*"):
        for path in glob.glob(pattern, root_dir=ROOT):
            assert os.path.normpath(path) in watched, f"a change to {path} would not relink the module"
