"""Shared by the Ascend MoE kernels that stage rows of ``topk_idx`` ``[T, K]`` in UB."""

from __future__ import annotations


class TopkIndexRows:
    """Mixin of a kernel spec with ``slots`` (K) and ``index_dtype`` (int32 / int64) whose
    kernels move rows of ``topk_idx`` as int32 words (an int64 index is two words)."""

    slots: int
    index_dtype: str

    @property
    def words(self) -> int:
        """int32 words of one row of ``topk_idx``."""
        return self.slots * (2 if self.index_dtype == "int64" else 1)
