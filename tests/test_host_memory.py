"""Host arrays placed on the device: a loader's own buffers adopted as they are, anyone
else's copied (its owner may still change it), every result in C order."""

import jax
import numpy as np
import pytest

from purejax import host_memory


def test_a_buffer_from_empty_is_aligned_and_becomes_the_device_array():
  buffer = host_memory.empty((300, 70), np.float32)
  assert buffer.ctypes.data % host_memory.ALIGNMENT == 0 and buffer.flags.c_contiguous
  buffer[...] = np.arange(300 * 70, dtype=np.float32).reshape(300, 70)
  placed = host_memory.to_device(buffer)
  np.testing.assert_array_equal(np.asarray(placed), buffer)
  if jax.default_backend() == "cpu":  # adopted: the same memory, no second copy
    assert placed.unsafe_buffer_pointer() == buffer.ctypes.data


def test_any_other_array_is_copied_into_c_order_and_later_changes_do_not_reach_it():
  theirs = np.arange(12, dtype=np.float32).reshape(3, 4)
  transposed = theirs.T  # a transpose's strides, as a [out, in] file read as [in, out]
  placed = host_memory.to_device(transposed)
  assert placed.shape == (4, 3)
  theirs[...] = -1.0
  np.testing.assert_array_equal(np.asarray(placed), np.arange(12).reshape(3, 4).T)
  assert placed.unsafe_buffer_pointer() != theirs.ctypes.data


def test_a_buffer_is_adopted_once_and_device_arrays_pass_through():
  buffer = host_memory.empty((8,), np.int8)
  buffer[...] = 3
  first = host_memory.to_device(buffer)
  assert host_memory.to_device(first) is first
  second = host_memory.to_device(buffer)  # handed over already: copied this time
  if jax.default_backend() == "cpu":
    assert second.unsafe_buffer_pointer() != first.unsafe_buffer_pointer()


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0, 2)])
def test_empty_shapes_place(shape):
  assert host_memory.to_device(host_memory.empty(shape, np.float16)).shape == shape
