"""`python -m m27.report --nats URL [--api HOST:PORT] [--out DIR]`: the report service."""

from __future__ import annotations

from m27.common.service import run_service
from m27.report.service import NAME, build_parser, overrides, serve


def main() -> None:
    args = build_parser().parse_args()
    run_service(NAME, args, overrides(args), serve)


if __name__ == "__main__":
    main()
