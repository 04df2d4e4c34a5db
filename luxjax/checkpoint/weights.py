"""A name -> weight getter over loaded tensors that casts float tensors to the compute dtype on the way to
the device and passes packed quantized tensors through untouched."""
from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
import numpy as np

from luxjax.errors import ModelFormatError


class WeightSource:
    def __init__(self, tensors: Mapping[str, object], dtype, *, origin: str = "checkpoint"):
        self._tensors = tensors
        self._dtype = jnp.dtype(dtype)
        self._origin = origin

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str):
        return self(name) if name in self._tensors else None

    def __call__(self, name: str):
        try:
            value = self._tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self._origin} is missing tensor {name!r}") from None
        if isinstance(value, (np.ndarray, jnp.ndarray)) or hasattr(value, "__array__"):
            if np.issubdtype(np.dtype(value.dtype), np.floating) or value.dtype == jnp.bfloat16:
                return jnp.asarray(value, dtype=self._dtype)
            return jnp.asarray(value)
        return value  # packed QuantizedTensor

    def names(self):
        return list(self._tensors)

    def storage_signature(self, prefix: str) -> tuple:
        """How the tensors under `prefix` are stored (name, packed format, shape): layers whose signatures agree
        can be stacked into one array per parameter."""
        return tuple(
            (name[len(prefix):], str(getattr(value, "ggml_type", "dense")), tuple(value.shape))
            for name, value in sorted(self._tensors.items())
            if name.startswith(prefix)
        )
