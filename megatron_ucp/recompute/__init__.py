"""Overlapped activation recomputation (Lynx, arXiv 2406.08756) for megatron-core pipelines.

Data flows one way: `profiler` measures a model (or `hardware.published_profile` states one from
published hardware figures) -> `profile.Profile` JSON -> `simulator` predicts step time, memory
and idle windows of a schedule -> `planner` searches per-layer recompute choices and the stage
partition -> `plan.Plan` JSON -> `runtime` executes it inside megatron-core's 1F1B schedule.
`activations` counts the bytes autograd keeps for backward (the memory every part talks about).

Nothing here imports the checkpoint package's modules, and the checkpoint package does not import
this one.
"""
