"""The report service: when a run ends, a self-contained HTML report of it, announced by event.

Pure parts (importable without NATS or gRPC): `render_run_report`, the decisions in
`m27.report.decide` and `write_atomic`. The shell is `m27.report.service`; run it with
`python -m m27.report`.
"""

from m27.report.decide import ReportDecision, decide, pick_orchestrator, report_file
from m27.report.files import write_atomic
from m27.report.render import render_run_report, summary_line

__all__ = [
    "ReportDecision",
    "decide",
    "pick_orchestrator",
    "render_run_report",
    "report_file",
    "summary_line",
    "write_atomic",
]
