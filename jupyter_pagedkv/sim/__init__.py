"""A production-scale serving simulator built on the engine's own Scheduler and BlockPool."""
from .cost_model import CostModel, ModelCost, StepWork
from .simulator import SimConfig, SimResult, Simulator
from .summary import RequestTiming, RunSummary
from .workload import PROFILES, SimRequest, synthetic

__all__ = ["CostModel", "ModelCost", "StepWork", "SimConfig", "SimResult", "Simulator", "RequestTiming",
           "RunSummary", "PROFILES", "SimRequest", "synthetic"]
