"""Placeholder until its issue lands."""

from ..errors import MoegraphError


def plan_command(spec, **kwargs):
    raise MoegraphError("plan is not built yet: planner (issue: planner and profile)")
