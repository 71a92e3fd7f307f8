"""The scheduler: decides where each ready step runs, what is preempted, paused or resumed.

Pure core: `policy` (`decide(state, queue, now, settings) -> decisions with reasons`, over
the types in `model`) and `_state` (stored records -> the policy's input).
Shell: `service` (task table in KV, node view from heartbeats, maintenance), `_apply`
(decisions -> node commands, idempotent), `_api` (`m27.v1.SchedulerService`).
"""
