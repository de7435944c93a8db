"""Overlapped activation recomputation (Lynx, arXiv 2406.08756) for megatron-core pipelines.

Data flows one way: `profiler` measures a model (its layer hooks in `probe`, link costs in `links`,
clocks in `timing`; or `hardware.published_profile` states one from published hardware figures)
-> `profile.Profile` JSON -> `simulator` predicts step time, memory and idle windows of a schedule
(`schedule`: megatron-core's op orders) -> `planner` searches per-layer recompute choices and the
stage partition (`stages`, `search`, and `baseline`: Megatron-LM's own best setting) -> `plan.Plan`
JSON -> `runtime` executes it inside megatron-core's 1F1B schedule. `activations` counts the bytes
autograd keeps for backward (the memory every part talks about).

Nothing here imports the checkpoint package's modules, and the checkpoint package does not import
this one; both reach megatron-core's private names and release differences only through
`megatron_ucp.mcore_compat` (`schedules`).
"""
