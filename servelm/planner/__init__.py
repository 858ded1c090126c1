"""Sizing math for `servelm plan`: model shapes, GPU catalog, and the memory plan.

shapes.py   ModelShape: parameter counts, weight and KV bytes per TP rank, config.json
catalog.py  known model shapes and GPU datasheet numbers
plan.py     plan(): KV capacity, concurrency, fit / smallest TP, cold start
command.py  the `servelm plan` sub-command
"""

from servelm.planner.catalog import GPUS, MODELS, GpuSpec, get_gpu, get_model, resolve_model
from servelm.planner.plan import Plan, PlanError, plan
from servelm.planner.shapes import ModelShape, ShapeError, shape_from_config, shape_from_folder

__all__ = [
    "GPUS",
    "MODELS",
    "GpuSpec",
    "ModelShape",
    "Plan",
    "PlanError",
    "ShapeError",
    "get_gpu",
    "get_model",
    "plan",
    "resolve_model",
    "shape_from_config",
    "shape_from_folder",
]
