"""Trace readers on small traces written by the tests: JSONL, openb, Philly; malformed rows
raise `TraceError` naming file:line and what is wrong."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m27.scheduler.model import Job
from m27.sim import (
    LabParams,
    SimJob,
    Trace,
    TraceError,
    demand_bound,
    generate_lab,
    make_nodes,
    read_jsonl,
    read_philly,
    read_trace,
    write_jsonl,
)
from m27.sim._workload import is_night, next_morning


def write(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_generated_lab_trace_round_trips_through_jsonl(tmp_path: Path) -> None:
    trace = generate_lab(LabParams(nodes=1, gpus_per_node=2, seed=4))
    write_jsonl(trace, tmp_path / "lab.jsonl")
    again = read_jsonl(tmp_path / "lab.jsonl")
    assert again.jobs == trace.jobs
    assert [len(n.gpus) for n in again.nodes] == [2]


def test_jsonl_defaults_cluster_lines_and_comments(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl",
                 "# a comment", "",
                 json.dumps({"type": "cluster", "clock0_s": 3600,
                             "nodes": [{"id": "gpu", "gpus": 4, "count": 2}]}),
                 json.dumps({"type": "job", "id": "b", "submit_s": 5, "duration_s": 60,
                             "gpu_milli": 300, "io_every_s": 10, "io_s": 2}),
                 json.dumps({"type": "job", "id": "a", "submit_s": 1, "duration_s": 30}))
    trace = read_jsonl(path)
    assert [n.node_id for n in trace.nodes] == ["gpu-0", "gpu-1"]
    assert trace.clock0_s == 3600
    assert [j.job.task_id for j in trace.jobs] == ["a", "b"]  # by submit time
    assert trace.jobs[1].job.gpu_milli == 300
    assert trace.jobs[1].io_s == 2
    assert trace.jobs[0].job.gpu_milli == 0
    assert trace.jobs[0].job.cpu_milli == 1000


@pytest.mark.parametrize(("line", "message"), [
    ('{"type": "job", "id": "x", "submit_s": 0', "not valid JSON"),
    ('{"type": "job", "id": "x", "submit_s": 0}', "duration_s"),
    ('{"type": "job", "id": "x", "submit_s": -1, "duration_s": 5}', "submit_s"),
    ('{"type": "job", "id": "x", "submit_s": 0, "duration_s": 5, "gpus": 1}', "gpus"),
    ('{"type": "job", "id": "x", "submit_s": 0, "duration_s": 5, "gpu_milli": 1500}',
     "neither a share"),
    ('{"type": "job", "id": "x", "submit_s": 0, "duration_s": 5, "urgency": "asap"}',
     "urgency"),
    ('{"type": "task", "id": "x"}', "type"),
    ('{"type": "job", "id": "a", "submit_s": 0, "duration_s": 5}', "already used on line 1"),
])
def test_malformed_jsonl_lines_name_file_line_and_problem(
        tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path / "bad.jsonl",
                 '{"type": "job", "id": "a", "submit_s": 0, "duration_s": 5}', line)
    with pytest.raises(TraceError) as info:
        read_jsonl(path)
    assert "bad.jsonl:2:" in str(info.value)
    assert message in str(info.value)


def test_missing_file_and_unknown_csv_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(write(tmp_path / "x.csv", "a,b,c", "1,2,3"))


def philly(tmp_path: Path, *rows: str) -> Path:
    return write(tmp_path / "philly.csv", "timestamp,duration,num_gpus,gpu_time,cluster", *rows)


def test_philly_window_gangs_and_oversized_jobs(tmp_path: Path) -> None:
    path = philly(tmp_path,
                  "2017-10-09 07:00:00,600.0,1,600.0,vc1",
                  "2017-10-09 06:00:00,60.0,4,240.0,vc2",
                  "2017-10-10 06:00:00,60.0,16,960.0,vc2",
                  "2017-10-20 06:00:00,60.0,1,60.0,vc2", "")
    trace = read_philly(path, nodes=make_nodes(2, 8), start="2017-10-09", days=7)
    assert [(j.submit_s, j.job.gpu_milli, j.duration_s) for j in trace.jobs] == [
        (6 * 3600.0, 4000, 60.0), (7 * 3600.0, 1000, 600.0)]
    assert len(trace.skipped) == 1
    assert "16 GPUs" in trace.skipped[0]
    assert trace.clock0_s == 0.0
    assert trace.jobs[0].job.user == "vc2"


def test_philly_bad_rows_name_the_line(tmp_path: Path) -> None:
    bad_time = philly(tmp_path, "2017-10-09 07:00:00,600.0,1,600.0,vc1", "yesterday,1,1,1,v")
    with pytest.raises(TraceError, match=r"philly.csv:3: timestamp 'yesterday'"):
        read_philly(bad_time, nodes=make_nodes(1, 8))
    bad_gpus = philly(tmp_path, "2017-10-09 07:00:00,600.0,1.5,600.0,vc1")
    with pytest.raises(TraceError, match=r"philly.csv:2: num_gpus"):
        read_philly(bad_gpus, nodes=make_nodes(1, 8))
    short = philly(tmp_path, "2017-10-09 07:00:00,600.0")
    with pytest.raises(TraceError, match=r"philly.csv:2: 2 columns"):
        read_philly(short, nodes=make_nodes(1, 8))


POD_HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
              "creation_time,deletion_time,scheduled_time")


def test_openb_pods_durations_qos_and_node_list(tmp_path: Path) -> None:
    write(tmp_path / "openb_node_list_gpu_node.csv", "sn,cpu_milli,memory_mib,gpu,model",
          "node-a,64000,262144,2,V100M32", "node-b,32000,131072,8,T4")
    pods = write(tmp_path / "openb_pod_list_tiny.csv", POD_HEADER,
                 "p0,4000,8192,1,470,,LS,Running,10,110,30",
                 "p1,2000,4096,1,1000,V100M16|V100M32,BE,Succeeded,20,220,",
                 "p2,2000,4096,2,1000,,LS,Running,30,300,40",
                 "p3,1000,1024,0,0,,LS,Pending,40,,")
    trace = read_trace(pods)
    jobs = {j.job.task_id: j for j in trace.jobs}
    assert set(jobs) == {"p0", "p1", "p2"}
    assert trace.skipped == ("p3: no creation/deletion time",)
    assert (jobs["p0"].submit_s, jobs["p0"].duration_s, jobs["p0"].job.gpu_milli) == (10, 80, 470)
    assert jobs["p1"].duration_s == 200  # never scheduled: from creation
    assert jobs["p1"].job.tier == "background"
    assert jobs["p1"].job.preemptible
    assert jobs["p1"].job.gpu_model == "V100M16|V100M32"
    assert jobs["p2"].job.gpu_milli == 2000
    assert [len(n.gpus) for n in trace.nodes] == [2, 8]
    assert trace.nodes[0].gpus[0].memory_mb == 32768


def test_openb_without_times_cannot_be_replayed(tmp_path: Path) -> None:
    write(tmp_path / "openb_node_list_gpu_node.csv", "sn,cpu_milli,memory_mib,gpu,model",
          "node-a,64000,262144,2,P100")
    pods = write(tmp_path / "openb_pod_list_multigpu20.csv",
                 "name,cpu_milli,memory_mib,num_gpu,gpu_milli", "p0,4000,8192,1,470")
    with pytest.raises(TraceError, match="no pod has both a creation and a deletion time"):
        read_trace(pods)
    bad = write(tmp_path / "openb_pod_list_bad.csv", POD_HEADER,
                "p0,4000,8192,1,470,,Gold,Running,10,110,30")
    with pytest.raises(TraceError, match=r"openb_pod_list_bad.csv:2: qos 'Gold'"):
        read_trace(bad)


@pytest.mark.parametrize(("hour", "night", "morning_h"), [
    (17.9, False, None), (18.0, True, 33.0), (23.5, True, 33.0), (3.0, True, 9.0),
    (8.5, False, None)])
def test_night_window_and_next_morning(hour: float, night: bool, morning_h: float | None
                                       ) -> None:
    assert is_night(hour * 3600, 0.0) is night
    if morning_h is not None:
        assert next_morning(hour * 3600, 0.0) == morning_h * 3600


def test_lab_generator_is_deterministic_and_has_its_mix() -> None:
    p = LabParams(nodes=2, gpus_per_node=8, seed=9)
    a, b = generate_lab(p), generate_lab(p)
    assert a == b
    kinds = {j.kind for j in a.jobs}
    assert kinds == {"md", "train", "analysis", "cpu", "background"}
    assert all(j.submit_s < 72 * 3600 for j in a.jobs)
    md = [j for j in a.jobs if j.kind == "md"]
    wall_io = [j.io_s / (j.io_s + j.io_every_s) for j in md]
    assert all(abs(x - p.io_share) < 1e-9 for x in wall_io)
    assert any(j.by_script for j in a.jobs)
    assert not any(
        j.by_script and not is_night(j.submit_s, 0.0) for j in a.jobs)
    backlog = sum(j.duration_s * j.job.gpu_milli / 1000 for j in a.jobs if j.kind == "background")
    assert backlog >= p.backlog_gpu_h_per_gpu * 16 * 3600


def test_the_demand_bound_is_the_submitted_work_over_the_gpu_time() -> None:
    node = make_nodes(1, 2)
    jobs = (SimJob(job=Job(task_id="a", gpu_milli=500), submit_s=0.0, duration_s=3600.0),
            SimJob(job=Job(task_id="b", gpu_milli=2000), submit_s=10.0, duration_s=1800.0),
            SimJob(job=Job(task_id="c", cpu_milli=4000), submit_s=0.0, duration_s=9e9),
            SimJob(job=Job(task_id="late", gpu_milli=1000), submit_s=7200.0, duration_s=1e9))
    trace = Trace(name="t", nodes=node, jobs=jobs)
    # 0.5 GPU-h + 2 × 0.5 GPU-h of work in 2 GPUs × 2 h; CPU work and late jobs do not count
    assert demand_bound(trace, 7200.0) == pytest.approx(1.5 / 4)
    assert demand_bound(trace, 7200.5) == 1.0  # capped
    assert demand_bound(trace, 0.0) == 0.0


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=200))
def test_any_text_is_a_trace_or_a_trace_error(text: str) -> None:
    """Malformed input never crashes the reader with anything but a `TraceError`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.jsonl"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        message = ""
        try:
            trace = read_jsonl(path)
        except TraceError as exc:
            message = str(exc)
        if message:
            assert message.startswith(f"{path}")
        else:
            assert all(j.duration_s > 0 for j in trace.jobs)
