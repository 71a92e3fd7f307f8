"""The node-agent: one per machine. Registers the node and its GPUs (NVML, or explicitly
simulated ones), heartbeats, and runs each step the scheduler places here as a real
subprocess in its own process group, reporting how it ended.

Run it with `python -m m27.node_agent --nats URL --node-id ID --gpus auto|none|sim:N`.
"""

from m27.common.model import per_gpu_share
from m27.node_agent._gpus import GpuSpec, parse_gpu_spec
from m27.node_agent._tasks import exit_status
from m27.node_agent.service import NodeAgent, serve

__all__ = ["GpuSpec", "NodeAgent", "exit_status", "parse_gpu_spec", "per_gpu_share", "serve"]
