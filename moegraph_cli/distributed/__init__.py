"""Running one moegraph command on several local GPUs.

`launch.py` starts the ranks through torch's own elastic launcher (what `torchrun` runs) and
turns the first rank's failure into one line and its exit code; the ranks themselves use its
`worker_env` / `report_error`. `watchdog.py` ends a rank whose collective never completes,
because captured NCCL work has no timeout of its own.
"""
