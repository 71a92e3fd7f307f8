"""`python -m m27.node_agent`: parse flags, load config, run the agent until SIGTERM."""

from m27.common.service import run_service
from m27.node_agent._agent import serve
from m27.node_agent._cli import build_parser, overrides


def main() -> None:
    args = build_parser().parse_args()
    run_service("node-agent", args, overrides(args), serve)


if __name__ == "__main__":
    main()
