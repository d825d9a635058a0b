"""Notebook widgets of jupyter-pagedkv (anywidget: no Node build, any Jupyter front end)."""
from .block_pool_monitor import BlockPoolMonitor

__all__ = ["BlockPoolMonitor"]
