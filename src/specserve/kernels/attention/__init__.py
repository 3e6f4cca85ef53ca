"""The paged-attention kernels: decode (one wave of programs, split keys and their merge),
prefill tiles, the fused K/V write."""
