"""Reading encoded Arrow columns as numpy arrays in place (shared by the encoding and the task kinds' collation)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def numpy_of(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An integer Arrow column as a numpy array, read in place. (pyarrow's `to_numpy` and `pa.array` import
    pandas, half a second of a start that otherwise never needs it.)"""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.null_count or not pa.types.is_integer(array.type):
        return array.to_numpy(zero_copy_only=False)  # not a column that encode() writes
    sign = "u" if pa.types.is_unsigned_integer(array.type) else ""
    dtype = np.dtype(f"{sign}int{array.type.bit_width}")
    if len(array) == 0:
        return np.empty(0, dtype=dtype)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)
