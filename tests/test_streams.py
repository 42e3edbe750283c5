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
