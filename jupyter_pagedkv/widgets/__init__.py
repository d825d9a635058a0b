"""Notebook widgets of jupyter-pagedkv (anywidget: no Node build, any Jupyter front end)."""
from .block_pool_monitor import BlockPoolMonitor
from .pool_figure import pool_figure
from .pool_recorder import PoolPoint, PoolRecorder

__all__ = ["BlockPoolMonitor", "PoolPoint", "PoolRecorder", "pool_figure"]
