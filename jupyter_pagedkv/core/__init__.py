"""The memory manager and scheduler: blocks, block tables, sequences, the scheduler and the gauges.

Pure Python over plain data: nothing here imports torch, a model or anything above this package,
so the simulator can drive the very same scheduler with a cost model instead of a model."""
