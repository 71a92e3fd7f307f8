"""Earlier runs: listing them with filters and pages, and learning from them for plans."""

from __future__ import annotations

import calendar
import time
from collections.abc import Sequence
from typing import Final

import msgspec

from m27.common import proto
from m27.common.errors import NotFoundError
from m27.common.ids import is_valid_run_id
from m27.common.model import RunRecord, RunState
from m27.orchestrator.caching import Cache
from m27.orchestrator.store import RunStore
from m27.pipeline import PipelineSpec
from m27.v1 import pipeline_pb2 as pb

DEFAULT_PAGE: Final = 50
MAX_PAGE: Final = 1000
HISTORY_RUNS: Final = 200


class Query(msgspec.Struct, frozen=True, kw_only=True):
    limit: int = DEFAULT_PAGE
    states: frozenset[RunState] = frozenset()
    user: str = ""
    since: float = 0.0
    after: str = ""  # page token: the last run id of the previous page

    @classmethod
    def from_request(cls, request: pb.ListRunsRequest) -> Query:
        limit = request.limit or DEFAULT_PAGE
        if not 0 < limit <= MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}")
        if request.page_token and not is_valid_run_id(request.page_token):
            raise ValueError("page_token is not one this server gave out")
        states = frozenset(proto.run_state_from_proto(s) for s in request.states)
        return cls(limit=limit, states=states, user=request.user, since=request.since,
                   after=request.page_token)

    def matches(self, run: RunRecord) -> bool:
        return ((not self.states or run.state in self.states)
                and (not self.user or run.user == self.user) and run.created_at >= self.since)


def created_at(run_id: str) -> float:
    """The submission second a run id carries (`r-YYYYMMDD-HHMMSS-…`, UTC)."""
    return float(calendar.timegm(time.strptime(run_id[2:17], "%Y%m%d-%H%M%S")))


async def list_runs(store: RunStore, query: Query) -> tuple[list[RunRecord], str]:
    """One page of matching runs, newest first, and the token of the next page ('' if none).

    Run ids sort by submission time, so `since` stops the scan early."""
    ids = sorted(await store.run_ids(), reverse=True)
    if query.after:
        ids = [i for i in ids if i < query.after]
    page: list[RunRecord] = []
    for run_id in ids:
        if query.since and created_at(run_id) < query.since - 1:
            break
        try:
            stored, _ = await store.get(run_id)
        except NotFoundError:
            continue
        if query.matches(stored.run):
            if len(page) == query.limit:
                return page, page[-1].run_id
            page.append(stored.run)
    return page, ""


async def durations(store: RunStore, pipeline: str) -> dict[str, list[float]]:
    """How long each step (and sweep) of earlier runs of this pipeline took, by name."""
    found: dict[str, list[float]] = {}
    for run_id in sorted(await store.run_ids(), reverse=True)[:HISTORY_RUNS]:
        try:
            stored, _ = await store.get(run_id)
        except NotFoundError:
            continue
        if stored.run.name != pipeline:
            continue
        for step in stored.run.steps:
            if step.state == "succeeded" and step.started_at and step.ended_at \
                    and not step.cached_from:
                took = step.ended_at - step.started_at
                found.setdefault(step.name, []).append(took)
                if step.group:
                    found.setdefault(step.group, []).append(took)
    return found


async def predicted_reuse(cache: Cache, spec: PipelineSpec, workdir: str,
                          use_cache: bool) -> dict[str, str]:
    """For each step: the earlier step whose results it would reuse, or why it would run.

    A step can only be reused if everything it depends on is (otherwise its inputs are yet
    to be made)."""
    run = RunRecord(run_id="r-00000000-000000-000000", name=spec.name, user="", state="queued",
                    urgency=spec.urgency, created_at=0.0, steps=spec.steps, workdir=workdir,
                    use_cache=use_cache)
    reuse: dict[str, str] = {}
    for step in spec.steps:
        blocked = [d for d in step.depends_on if not reuse.get(d, "").startswith("r-")]
        if blocked:
            reuse[step.name] = f"runs: {blocked[0]} runs first"
            continue
        key, hit = await cache.lookup(run, step)
        reuse[step.name] = hit.task_id if hit else ("runs: no identical earlier step"
                                                    if key else "runs: not reusable")
    return reuse


def summaries(runs: Sequence[RunRecord]) -> list[pb.RunSummary]:
    return [proto.summary_to_proto(r) for r in runs]
