"""The scheduler: decides where each ready step runs.

Pure core: `policy` (`schedule(nodes, placements, queue) -> decisions with reasons`).
Shell: `service` (task table in KV, node view from heartbeats, commands to node-agents).
"""
