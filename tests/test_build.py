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
