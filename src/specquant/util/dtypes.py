"""The one table of dtype names specquant accepts (flags, config.json torch_dtype) and its parser."""

from __future__ import annotations

import torch

from specquant.errors import SpecquantError

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype or its name in DTYPES; raises SpecquantError naming the choices."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SpecquantError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]
