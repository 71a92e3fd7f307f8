"""`python -m m27.scheduler --nats URL`: places queued steps on nodes with room."""

from m27.common.service import run_service, service_parser
from m27.scheduler.service import serve


def main() -> None:
    parser = service_parser("scheduler", "Takes steps whose dependencies succeeded and "
                            "starts each on a node with room: a whole GPU for `gpu`, a "
                            "share of one for `gpu_light`, a CPU slot for `cpu`.")
    run_service("scheduler", parser.parse_args(), {}, serve)


if __name__ == "__main__":
    main()
