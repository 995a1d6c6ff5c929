"""Kernels and per-step tensor ops: the batch a forward step sees (`context`), paged
attention, recurrent-state scans, K/V storage and its fp8 form, work buffers, the
opt-in compiled paths."""
