"""The stream argument of the binding, and check_errors on host memory."""

import idempotent_moe as imoe
import numpy as np
import pytest
from idempotent_moe import _C


def _compact(x, scores, out, stream):
    return _C.compact([x], (1,), (1,), scores=scores, out_indices=out, capacity=2, num_threads=1,
                      stream=stream)


@pytest.mark.parametrize("stream,exc", [(0, ValueError), (-2, ValueError), (True, TypeError),
                                        ("1", TypeError), (1.0, TypeError)])
def test_bad_stream_values_raise_before_anything_moves(stream, exc):
    x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    scores = np.array([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=np.float32)
    out = np.full((2, 2), -7, dtype=np.int64)
    x0, out0 = x.copy(), out.copy()
    with pytest.raises(exc, match="stream"):
        _compact(x, scores, out, stream)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(out, out0)


@pytest.mark.parametrize("stream", [None, -1, 1, 2, 12345])
def test_host_memory_ignores_valid_streams(stream):
    x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    scores = np.array([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=np.float32)
    out = np.empty((2, 2), dtype=np.int64)
    _compact(x, scores, out, stream)
    np.testing.assert_array_equal(out, [[2, 3], [0, 1]])


def test_check_errors_on_host_memory_is_a_no_op():
    x = np.zeros((2, 3), dtype=np.float32)
    assert imoe.check_errors(x) is None
    assert imoe.check_errors() is None


def test_status_messages_name_the_code():
    assert "NaN" in _C.status_message(3)
    assert _C.status_message(0).startswith("IMOE_OK")
    assert "UNKNOWN" in _C.status_message(12345)


# --------------------------------------------------------------------------- stream "current"


def test_host_memory_takes_the_current_stream():
    x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    scores = np.array([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=np.float32)
    out = np.empty((2, 2), dtype=np.int64)
    _compact(x, scores, out, "current")
    np.testing.assert_array_equal(out, [[2, 3], [0, 1]])


@pytest.mark.parametrize("stream", ["Current", "current ", "default"])
def test_other_stream_names_raise_before_anything_moves(stream):
    x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    scores = np.array([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=np.float32)
    out = np.full((2, 2), -7, dtype=np.int64)
    x0 = x.copy()
    with pytest.raises(TypeError, match="stream must be None, 'current' or an int"):
        _compact(x, scores, out, stream)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(out, np.full((2, 2), -7))


def test_take_device_status_wants_the_stream_value():
    with pytest.raises(ValueError, match="not 'current'"):
        _C.take_device_status(0, "current")


def test_exchanges_says_which_types_name_their_stream():
    torch = pytest.importorskip("torch")
    assert _C.exchanges(torch.Tensor) == hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    assert _C.exchanges(np.ndarray) is False
    with pytest.raises(TypeError, match="takes a type"):
        _C.exchanges(torch.zeros(1))


def test_the_python_api_passes_current_for_torch_tensors_only():
    """torch tensors whose stream the binding reads: "current" (no lookup in
    Python); host NumPy arrays: None; a CUDA stream value only elsewhere."""
    torch = pytest.importorskip("torch")
    from idempotent_moe import _arrays

    want = "current" if _C.exchanges(torch.Tensor) else None
    assert _arrays.dlpack_stream(torch.zeros(2)) == want
    assert _arrays.stream_value(torch.zeros(2)) is None
    assert _arrays.dlpack_stream(np.zeros(2)) is None


class _ForeignCuda:
    """A producer on CUDA with __dlpack__ and no DLPack exchange table: the
    binding cannot read its current stream."""

    def __init__(self):
        self.calls = 0

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, *args, **kwargs):
        self.calls += 1
        raise AssertionError("not exported: the stream is refused first")


def test_current_refuses_a_cuda_array_of_a_framework_that_cannot_name_its_stream():
    x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    scores = np.array([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=np.float32)
    foreign = _ForeignCuda()
    x0 = x.copy()
    with pytest.raises(ValueError, match="out_indices: stream 'current' is read from DLPack's C "
                                         "exchange table, which _ForeignCuda does not publish"):
        _compact(x, scores, foreign, "current")
    assert foreign.calls == 0
    np.testing.assert_array_equal(x, x0)


@pytest.mark.gpu
def test_current_refuses_a_call_whose_cuda_arrays_are_all_capsules():
    """A capsule cannot name its framework's stream: with no other CUDA array
    to name it, "current" is refused (not run on the legacy default stream)."""
    torch = pytest.importorskip("torch")
    if not (torch.cuda.is_available() and _C.cuda_compiled()):
        pytest.skip("needs torch.cuda and a CUDA build of idempotent_moe")
    from torch.utils.dlpack import to_dlpack

    x = torch.randn(2, 4, 3, device="cuda")
    scores = torch.rand(2, 4, device="cuda")
    out = torch.full((2, 2), -1, dtype=torch.int64, device="cuda")
    x0 = x.clone()
    with pytest.raises(ValueError, match="no array of this call did"):
        _C.compact((to_dlpack(x),), (1,), (1,), scores=to_dlpack(scores), capacity=2, num_threads=1,
                   out_indices=to_dlpack(out), stream="current")
    torch.cuda.synchronize()
    assert torch.equal(x, x0) and bool((out == -1).all())


def test_current_with_a_tensor_that_requires_grad_is_refused_as_before():
    """Such a tensor is refused before any export (TypeError), with stream
    "current" as with stream None."""
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 4, 3).requires_grad_()
    before = x.detach().clone()
    for stream in (None, "current"):
        with pytest.raises(TypeError, match="requires grad"):
            _C.compact([x], (1,), (1,), scores=torch.rand(2, 4), capacity=2, num_threads=1,
                       out_indices=torch.empty(2, 2, dtype=torch.int64), stream=stream)
    assert torch.equal(x.detach(), before)
