"""What the controller's dispatcher (fleet/controller.py) keeps of the work in flight, and the two things it does
to an attempt's Ray ref: an `Attempt` per attempt started (its ref and the deadline past which it is cancelled),
a `GroupState` per admitted group (the slots it holds, its running attempts, its infrastructure failures per
attempt, the rollout ids it returned), `describe_failure` for the one line an attempt's failure is counted with,
and `cancel` for an attempt that timed out or whose group is withdrawn."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray

from codefleet.fleet.staleness import Ticket

log = logging.getLogger("codefleet.fleet.controller")  # the controller's logger: cancelling is one of its steps


@dataclass
class Attempt:
    token: int  # unique per start, across runs
    group_id: int
    attempt: int
    ref: ray.ObjectRef
    deadline_s: float  # time.monotonic() past which it is cancelled


@dataclass
class GroupState:
    ticket: Ticket
    item: Any
    held_slots: int  # slots this group holds (attempts started or about to start)
    running: dict[int, int] = field(default_factory=dict)  # attempt -> token
    failures: Counter[int] = field(default_factory=Counter)  # attempt -> infrastructure failures
    rollout_ids: set[str] = field(default_factory=set)


def describe_failure(e: BaseException) -> str:
    """One line for an attempt's failure: the remote cause's message, not Ray's wrapper header."""
    cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
    if isinstance(cause, BaseException):
        text = str(cause).strip()
        return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"


def cancel(ref: ray.ObjectRef) -> None:
    """Stop an attempt that is still running; one that ended, or whose worker is gone, is left as it is."""
    try:
        ray.cancel(ref)
    except Exception as e:  # already finished, or its worker is gone: nothing left to stop
        log.debug("ray.cancel: %r", e)
