"""The simulator: replays a trace under a scheduling policy in virtual time (no NATS) and
measures allocation, utilization, goodput, completion times and night jobs by morning.
The same `Policy` callables run here as in the scheduler service. docs/simulator.md.
"""

from m27.sim._baselines import best_fit
from m27.sim._engine import MaintenanceSim, SimConfig, simulate
from m27.sim._errors import SimError, TraceError
from m27.sim._generator import LabParams, generate_lab
from m27.sim._metrics import (
    JobOutcome,
    Metrics,
    RawRun,
    Sample,
    format_preemptions,
    format_table,
    summarize,
)
from m27.sim._nights import Nights, night_check, night_demand
from m27.sim._plots import jct_cdf_svg, utilization_svg
from m27.sim._policies import POLICY_HELP, POLICY_NAMES, m27_policy, make_policy, policy_version
from m27.sim._traces import (
    is_philly,
    read_jsonl,
    read_openb,
    read_philly,
    read_trace,
    write_jsonl,
)
from m27.sim._workload import SimJob, Trace, demand_bound, make_nodes

__all__ = [
    "POLICY_HELP",
    "POLICY_NAMES",
    "JobOutcome",
    "LabParams",
    "MaintenanceSim",
    "Metrics",
    "Nights",
    "RawRun",
    "Sample",
    "SimConfig",
    "SimError",
    "SimJob",
    "Trace",
    "TraceError",
    "best_fit",
    "demand_bound",
    "format_preemptions",
    "format_table",
    "generate_lab",
    "is_philly",
    "jct_cdf_svg",
    "m27_policy",
    "make_nodes",
    "make_policy",
    "night_check",
    "night_demand",
    "policy_version",
    "read_jsonl",
    "read_openb",
    "read_philly",
    "read_trace",
    "simulate",
    "summarize",
    "utilization_svg",
    "write_jsonl",
]
