"""Placeholder until its issue lands."""

from .errors import MoegraphError


def profile_command(spec, **kwargs):
    raise MoegraphError("profile is not built yet: profiling (issue: planner and profile)")
