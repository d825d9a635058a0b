"""What runs the model: the KV cache tensors, paged attention, the model runner, sampling, loading.

Imports `core` (and the kernels in `kernels/`), nothing above."""
