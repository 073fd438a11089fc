"""Array (de)serialisation for artefacts kept in the store: .npy bytes, never pickle."""

from __future__ import annotations

import io

import numpy as np
import numpy.typing as npt


def array_to_bytes(array: npt.NDArray[np.generic]) -> bytes:
    """Serialise an array as .npy bytes."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def array_from_bytes(data: bytes) -> npt.NDArray[np.generic]:
    """Load an array from .npy bytes, refusing pickled objects."""
    array: npt.NDArray[np.generic] = np.load(io.BytesIO(data), allow_pickle=False)
    return array
