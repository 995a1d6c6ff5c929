"""Identity types and small integer helpers shared by every layer of the package."""

from __future__ import annotations

from typing import NewType

BlockId = NewType("BlockId", int)
RequestId = NewType("RequestId", str)
GroupId = NewType("GroupId", int)
PoolId = NewType("PoolId", int)


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``a``."""
    return cdiv(a, multiple) * multiple


GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10
