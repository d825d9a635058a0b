"""The GPU check (`python -m jupyter_pagedkv.bench gpu`, `make gpu-check`): a driver that runs each
part in its own process under its own time slice (`driver`), the parts themselves (`parts`,
`graphs`, `throughput`, `architectures`), the events file they append to (`report`) and the pytest
plugin that records one row per test (`pytest_plugin`). The architecture sweep is also a CPU
command (`bench architectures`): the same code checks the same models on both machines."""
